"""The FFN benchmark's cases (shapes and activity patterns, calibrated to a target), the
float64 check, the timer and the plain dense FFN baseline."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from twell_jax import cli

import twell_jax as tj
from twell_jax import inputs
from twell_jax.format import heavy_rows


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    d: int
    f: int
    # uniform | heavy_tailed (row skew) | hot_units (column skew, Zipf-like) | hot64 (64 units
    # on 85% of the tokens, the rest uniform) | trained (rows' counts drawn from TRAINED_NNZ,
    # scaled to F)
    pattern: str
    nnz_target: float  # mean active units per token
    p99_target: float | None = None  # heavy-tailed only


# The per-token active-unit histograms of our trained 100m model (L1 3e-4, 2200 steps, held-out
# tokens, every layer; docs/performance.md), F = 2560: the "trained" pattern's rows.
TRAINED_NNZ = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results", "lm_100m_2200steps", "100m-xla-l1_3e-4",
    "nnz_distribution.json")


@functools.cache
def trained_histogram(path: str = TRAINED_NNZ) -> tuple[np.ndarray, int]:
    """(tokens per active-unit count [n + 1], pooled over the layers; the model's F). Read once
    (the case table asks for it at import), so the array is read-only."""
    with open(path) as file:
        dist = json.load(file)
    hists = [np.asarray(layer["histogram"], np.float64) for layer in dist["layers"]]
    pooled = np.zeros(max(len(h) for h in hists))
    for h in hists:
        pooled[: len(h)] += h
    pooled.flags.writeable = False
    return pooled, int(dist["d_ff"])


def trained_mean(f: int) -> float:
    """The trained model's mean active units per token, scaled to F = ``f``."""
    hist, d_ff = trained_histogram()
    return float((hist * np.arange(len(hist))).sum() / hist.sum() * f / d_ff)


CASES = {
    c.name: c
    for c in [
        Case("smoke_uniform", 256, 256, 1024, "uniform", 8.0),
        Case("smoke_heavy", 256, 256, 1024, "heavy_tailed", 12.0, 100.0),
        Case("smoke_trained", 256, 256, 1024, "trained", trained_mean(1024)),
        Case("m16k_uniform28", 16384, 2048, 5632, "uniform", 28.0),
        Case("m16k_uniform2pct", 16384, 2048, 5632, "uniform", 0.02 * 5632),
        Case("m16k_heavy", 16384, 2048, 5632, "heavy_tailed", 60.0, 580.0),
        # Zipf-like per-unit rates (inputs.firing_rates "heavy"): the busiest units fire on
        # half the tokens, as in trained models; row counts stay near the mean.
        Case("m16k_hot_units", 16384, 2048, 5632, "hot_units", 28.0),
        # A few units firing for most tokens: 64 on 85%, 0.4% of the others (76 per token).
        Case("m16k_hot64", 16384, 2048, 5632, "hot64", 54.4 + 0.004 * (5632 - 64)),
        Case("smoke_hot64", 2048, 256, 1024, "hot64", 54.4 + 0.01 * (1024 - 64)),
        # Trained counts: rows drawn from our trained 100m model's counts, x 5632 / 2560.
        Case("m16k_trained", 16384, 2048, 5632, "trained", trained_mean(5632)),
        Case("m128k_uniform28", 131072, 2048, 5632, "uniform", 28.0),
        Case("wide_m16k_uniform", 16384, 4096, 14336, "uniform", 14336 * 28 / 5632),
        Case("wide_m16k_uniform28", 16384, 4096, 14336, "uniform", 28.0),
        Case("decode_m1", 1, 2048, 5632, "uniform", 28.0),
        Case("decode_m8", 8, 2048, 5632, "uniform", 28.0),
        Case("decode_m64", 64, 2048, 5632, "uniform", 28.0),
        Case("decode_m8_heavy", 8, 2048, 5632, "heavy_tailed", 60.0, 580.0),
        Case("decode_m64_heavy", 64, 2048, 5632, "heavy_tailed", 60.0, 580.0),
        Case("decode_m1_half_dense", 1, 2048, 5632, "uniform", 2816.0),
    ]
}


SUITES = {
    "smoke": ["smoke_uniform", "smoke_heavy"],
    "paper": ["m16k_uniform28", "m16k_heavy", "m16k_uniform2pct", "m16k_trained", "decode_m1",
              "decode_m8", "decode_m64", "wide_m16k_uniform28", "m128k_uniform28"],
    "training": ["m16k_uniform28", "m16k_heavy", "m16k_hot_units", "m16k_hot64"],
    "decode": ["decode_m1", "decode_m8", "decode_m64", "decode_m8_heavy", "decode_m64_heavy",
               "decode_m1_half_dense"],
}


def _tail(z: np.ndarray) -> np.ndarray:
    """P(N(0, 1) > z), vectorised, without scipy."""
    return 0.5 * np.vectorize(math.erfc)(np.asarray(z, np.float64) / math.sqrt(2.0))


def _calibrate(case: Case, rng: np.random.Generator):
    """(threshold, lognormal sigma) giving the target mean (and p99) active units per token."""
    f = case.f
    if case.pattern == "uniform":
        zs = np.linspace(0.0, 5.0, 5001)
        threshold = zs[np.argmin(np.abs(_tail(zs) * f - case.nnz_target))]
        return float(threshold), 0.0
    scales = rng.standard_normal(20000)
    best = None
    for sigma in np.linspace(0.1, 1.5, 57):
        s = np.exp(sigma * scales)
        for t in np.linspace(1.5, 6.0, 91):
            nnz = _tail(t / s) * f
            err = abs(np.log(nnz.mean() / case.nnz_target)) + abs(
                np.log(np.percentile(nnz, 99) / case.p99_target))
            if best is None or err < best[0]:
                best = (err, float(t), float(sigma))
    return best[1], best[2]


TRAINED_THRESHOLD = 3.0  # the "trained" pattern's gate threshold, in pre-activation sigmas


def trained_row_scales(m: int, f: int, rng: np.random.Generator) -> np.ndarray:
    """[M] row scales s for the "trained" pattern: each row's count n is drawn from the trained
    model's histogram and scaled by F / its F; a row of x scaled by s activates each unit with
    probability P(N(0, 1) > TRAINED_THRESHOLD / s) = n / F, so its count is ~Binomial(F, n / F)."""
    hist, d_ff = trained_histogram()
    counts = rng.choice(len(hist), size=m, p=hist / hist.sum()) * (f / d_ff)
    rate = np.clip(counts / f, 0.1 / f, 0.5)  # a row with no active unit: ~0.1 expected
    z = np.asarray(jax.scipy.special.ndtri(jnp.asarray(1.0 - rate, jnp.float32)), np.float64)
    return TRAINED_THRESHOLD / np.maximum(z, 1e-3)


def make_case_inputs(case: Case, seed: int = 0):
    """bf16 x [M, D] and weights with the case's sparsity; pre-activations ~ N(0, scale^2)."""
    rng = np.random.default_rng(seed)
    if case.pattern in ("hot_units", "hot64"):
        threshold, sigma = 0.0, 0.0
    elif case.pattern == "trained":
        threshold, sigma = TRAINED_THRESHOLD, 0.0
    else:
        threshold, sigma = _calibrate(case, rng)
    key = jax.random.PRNGKey(seed)
    kx, kg, ku, kd, ks = jax.random.split(key, 5)
    m, d, f = case.m, case.d, case.f
    x = jax.random.normal(kx, (m, d), jnp.float32)
    if sigma > 0:
        x = x * jnp.exp(sigma * jax.random.normal(ks, (m, 1)))
    if case.pattern == "trained":
        x = x * jnp.asarray(trained_row_scales(m, f, rng), jnp.float32)[:, None]
    x = x.at[:, -1].set(1.0)
    w_gate = jax.random.normal(kg, (d, f), jnp.float32) / math.sqrt(d - 1)
    if case.pattern in ("hot_units", "hot64"):
        rates = "heavy" if case.pattern == "hot_units" else "hot64"
        w_gate = inputs.with_threshold_row(w_gate, inputs.firing_rates(f, case.nnz_target, rates))
    else:
        w_gate = w_gate.at[-1].set(-threshold)
    w_up = jax.random.normal(ku, (d, f), jnp.float32) / math.sqrt(d)
    density = case.nnz_target / f
    w_down = jax.random.normal(kd, (f, d), jnp.float32) / math.sqrt(f * density)
    bf = lambda a: a.astype(jnp.bfloat16)
    return bf(x), bf(w_gate), bf(w_up), bf(w_down)


def sparsity_stats(x, w_gate, config: tj.TwELLConfig) -> tuple[dict, np.ndarray]:
    """Active units per token (mean / p99 / max), (row, tile) pairs over S, heavy rows.

    Returns the statistics and the [M] bool mask of heavy rows.
    """
    f = w_gate.shape[1]
    t = config.tile_width

    @jax.jit
    def counts_of(x, w):
        active = jnp.dot(x, w, preferred_element_type=jnp.float32) > 0
        n_tiles = config.num_tiles(f)
        active = jnp.pad(active, ((0, 0), (0, n_tiles * t - f)))
        return active.reshape(x.shape[0], n_tiles, t).sum(-1, dtype=jnp.int32)

    counts = counts_of(x, w_gate)
    nnz = np.asarray(counts.sum(1))
    over = np.asarray(counts > config.slots_per_tile)
    heavy = np.asarray(heavy_rows(counts, config, f))
    return {
        "nnz_mean": float(nnz.mean()),
        "nnz_p99": float(np.percentile(nnz, 99)),
        "nnz_max": int(nnz.max()),
        "tiles_over_S": float(over.mean()),
        "heavy_rows": int(heavy.sum()),
    }, heavy


def rel_error_float64(y, x, w_gate, w_up, w_down, rows: np.ndarray) -> float:
    """||y - ref|| / ||ref|| on the given rows, ref in float64 numpy from the same bf16 inputs."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    xs = f64(x[rows])
    ref = (np.maximum(xs @ f64(w_gate), 0.0) * (xs @ f64(w_up))) @ f64(w_down)
    got = f64(y[rows])
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def decode_loop(fn: Callable, steps: int) -> Callable:
    """Jitted ``run(x, layers)``: ``steps`` steps, each calling ``fn(x, *weights)`` on every
    weight set of ``layers`` in turn, as a model's decode loop runs its layers (four sets of
    the 69 MB FFN at D = 2048 leave no layer's weights in the 50 MB L2 between its calls).
    Each call's x is the original x plus 0 * the running sum of outputs (not folded for
    floats), so no call is hoisted or dropped. At decode sizes timing calls one by one from
    Python measures the host's dispatch (~40 us), not the GPU."""
    def run(x, layers):
        def step(_, acc):
            for weights in layers:
                xi = (x.astype(jnp.float32) + 0.0 * acc).astype(x.dtype)
                acc = acc + fn(xi, *weights).astype(jnp.float32)
            return acc
        return jax.lax.fori_loop(0, steps, step, jnp.zeros(x.shape, jnp.float32))
    return jax.jit(run)


def unrolled_calls(fn: Callable) -> Callable:
    """Jitted ``run(x, sets)``: one call of ``fn(x, *weights)`` on each weight set, unrolled
    (a public op's calls as a user's program makes them: no loop out of which XLA could hoist
    a per-call transpose, no weight left in the L2 from the call before)."""
    def run(x, sets):
        return sum(fn(x, *weights).astype(jnp.float32) for weights in sets)
    return jax.jit(run)


def time_ms(fn: Callable, *args, runs: int, min_batch_ms: float) -> dict:
    """Per-call time in ms of back-to-back calls, and the latency of a lone call.

    ``median_ms`` (and p10 / p90): the median over ``runs`` batches, each ``calls`` calls
    queued back to back and synchronised once, of the batch's time / ``calls``. ``calls`` makes
    a batch last at least ``min_batch_ms``, so the host's dispatch of one call overlaps the
    GPU's work on the one before, as a layer in a model overlaps the previous layer's. With
    one or two calls a batch the time would also hold the host's dispatch: ~0.7 ms for the
    sparse FFN at M = 16384, whose route switch XLA re-records in its command buffer at every
    call. ``latency_ms``: the median time of
    single synchronised calls, dispatch included (what a lone call makes the caller wait)."""
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm up
    latencies = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        latencies.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()  # a short stream, to size the batches
    jax.block_until_ready([fn(*args) for _ in range(4)])
    per_call = (time.perf_counter() - t0) * 1e3 / 4
    calls = max(1, int(math.ceil(min_batch_ms / max(per_call, 1e-3))))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return {**cli.summarize_ms(samples), "calls_per_batch": calls,
            "latency_ms": float(np.median(latencies))}


def flax_dense_mlp(x, w_gate, w_up, w_down):
    """The dense FFN as a Flax user writes it: three bias-free bf16 ``nnx.Linear`` layers
    (bf16 GEMM outputs, fp32 accumulation inside), timed beside ``implementation="xla"``."""
    from flax import nnx

    (d, f), kw = w_gate.shape, dict(use_bias=False, dtype=x.dtype, param_dtype=w_gate.dtype,
                                    rngs=nnx.Rngs(0))
    gate, up, down = nnx.Linear(d, f, **kw), nnx.Linear(d, f, **kw), nnx.Linear(f, d, **kw)
    gate.kernel[...], up.kernel[...], down.kernel[...] = w_gate, w_up, w_down
    return down(jax.nn.relu(gate(x)) * up(x))
