"""Inputs with a chosen sparsity, for examples, tests and benchmarks (the bias trick).

Rows x [M, D] are Gaussian with their last feature set to 1, so the last row of a gate weight
w [D, F] acts as a per-unit bias: setting it to minus a threshold makes unit j fire
(pre-activation > 0) for the chosen fraction of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gaussian_rows(key: jax.Array, tokens: int, d_model: int) -> jax.Array:
    """[tokens, d_model] float32 standard Gaussian rows whose last feature is 1 (the bias input)."""
    x = jax.random.normal(key, (tokens, d_model), jnp.float32)
    return x.at[:, -1].set(1.0)


def with_threshold_row(w: jax.Array, density: float) -> jax.Array:
    """``w`` [D, F] with its last row set so that about ``density`` of the units are active on
    ``gaussian_rows``.

    Unit j's pre-activation is ``sum_{i<D-1} x_i w_ij + w_{D-1,j}``, Gaussian with standard
    deviation ``||w_{:D-1,j}||``; the last row becomes minus that times the (1 - density)
    quantile of a standard normal.
    """
    z = float(jax.scipy.special.ndtri(1.0 - density))
    threshold = z * jnp.linalg.norm(w[:-1].astype(jnp.float32), axis=0)
    return w.at[-1].set(-threshold.astype(w.dtype))
