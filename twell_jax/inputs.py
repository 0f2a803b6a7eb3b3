"""Inputs with a chosen sparsity, for examples, tests and benchmarks (the bias trick).

Rows x [M, D] are Gaussian with their last feature set to 1, so the last row of a gate weight
w [D, F] acts as a per-unit bias: setting it to minus a threshold makes unit j fire
(pre-activation > 0) for the chosen fraction of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def gaussian_rows(key: jax.Array, tokens: int, d_model: int) -> jax.Array:
    """[tokens, d_model] float32 standard Gaussian rows whose last feature is 1 (the bias input)."""
    x = jax.random.normal(key, (tokens, d_model), jnp.float32)
    return x.at[:, -1].set(1.0)


def with_threshold_row(w: jax.Array, density) -> jax.Array:
    """``w`` [D, F] with its last row set so that unit j is active on about ``density`` (a
    float, or [F] per-unit rates in (0, 1)) of ``gaussian_rows``.

    Unit j's pre-activation is ``sum_{i<D-1} x_i w_ij + w_{D-1,j}``, Gaussian with standard
    deviation ``||w_{:D-1,j}||``; the last row becomes minus that times the (1 - density_j)
    quantile of a standard normal.
    """
    z = jax.scipy.special.ndtri(1.0 - jnp.asarray(density, jnp.float32))
    threshold = z * jnp.linalg.norm(w[:-1].astype(jnp.float32), axis=0)
    return w.at[-1].set(-threshold.astype(w.dtype))


def firing_rates(d_ff: int, mean_nnz: float, pattern: str) -> np.ndarray:
    """[F] per-unit firing probabilities p_j with sum p_j = mean_nnz (active units per token).

    ``uniform``: every unit alike. ``heavy``: Zipf-like, as in trained models where a few units
    fire on a large share of tokens (the busiest ~1000x as often as the median unit), capped
    at 0.5, the excess handed to the others so the mean stays. ``hot64``: 64 units (chosen at
    random) active on 85% of the tokens, every other unit alike.
    """
    if pattern == "uniform":
        return np.full(d_ff, mean_nnz / d_ff)
    if pattern == "hot64":
        num_hot, hot_rate = 64, 0.85
        if num_hot >= d_ff or not 0 < mean_nnz - num_hot * hot_rate < d_ff - num_hot:
            raise ValueError(f"hot64 needs d_ff > 64 and mean_nnz in (54.4, ...), got "
                             f"d_ff={d_ff}, mean_nnz={mean_nnz}")
        p = np.full(d_ff, (mean_nnz - num_hot * hot_rate) / (d_ff - num_hot))
        p[np.random.default_rng(2).permutation(d_ff)[:num_hot]] = hot_rate
        return p
    if pattern != "heavy":
        raise ValueError(f"pattern must be uniform, heavy or hot64, got {pattern!r}")
    rank = np.random.default_rng(1).permutation(d_ff) + 1.0
    p = rank ** -0.8
    p = p / p.sum() * mean_nnz
    for _ in range(50):  # cap at 0.5 and hand the excess to the others, keeping the sum
        over = p > 0.5
        if not over.any():
            break
        excess = (p[over] - 0.5).sum()
        p[over] = 0.5
        p[~over] += excess * p[~over] / p[~over].sum()
    return p
