"""Shared test helpers: one tolerance table, one assert_close, input patterns, float64 references."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import ffn

_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

# The one tolerance table: the relative error ||actual - expected|| / ||expected|| allowed, by
# what is compared and the compute dtype.
TOLERANCES = {
    # An op against a float64 reference computed from the same rounded inputs. bf16: the dense
    # bf16 path's own error is ~3e-3; the sparse paths accumulate in fp32
    # and land at or below it.
    "ffn": {_F32: 2e-5, _BF16: 1e-2},
    # Gradients pass through more roundings (bf16 h, dh, cotangent products).
    "grad": {_F32: 5e-5, _BF16: 2e-2},
    # A kernel against its jnp reference. bf16: output rounding, 2^-8 per element, against an
    # fp32 reference; fp32: summation order over contraction lengths <= 384.
    "kernel": {_F32: 1e-5, _BF16: 2e-2},
    # Two implementations of one layer. bf16: both round h and y to bf16 (eps 2^-8 = 3.9e-3) at
    # different points; f32: only accumulation order differs.
    "layer": {_F32: 2e-5, _BF16: 1.5e-2},
    # A model's logits computed two ways (cached decoding vs a full forward, two FFN paths).
    "logits": {_F32: 1e-5, _BF16: 2e-2},
}

PATTERNS = ("uniform", "heavy_tailed", "zero_rows", "dense_rows")


def slow(*values, **kwargs):
    """One parametrization case marked slow: left out of the default (fast) run, which keeps
    a representative case of the same parametrization; ``pytest tests -m slow`` runs it.
    Same test id as the bare value(s)."""
    return pytest.param(*values, marks=pytest.mark.slow, **kwargs)


def slow_unless(keep, values):
    """``values`` for a parametrization, those not in ``keep`` marked slow."""
    return [v if v in keep else slow(v) for v in values]


def one_backup_size(config, m: int):
    """``config`` with its dense backup fixed at the largest of the default sizes for ``m``
    rows: calls route as with the whole ladder of sizes (lists, backup, or dense past the
    largest; only ``FFNStats.backup_overflow`` then marks a batch sent dense), but the program
    holds one backup branch instead of one per size, each with the kernels, so the interpreter
    compiles it several times faster. Tests of the sizes themselves keep ``backup_rows=None``."""
    sizes = ffn._backup_sizes(m, dataclasses.replace(config, backup_rows=None))
    return dataclasses.replace(config, backup_rows=sizes[-1])


def seed_of(*parts) -> int:
    """A deterministic seed per test case (Python's str hash is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64; fails on a shape mismatch or NaN/Inf in
    ``actual``."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def assert_close(actual, expected, dtype=None, *, kind="ffn", tol=None, what="",
                 zero_reference_ok=False):
    """Fails on NaN/Inf and on a relative error above the tolerance: ``tol`` when given, else
    ``TOLERANCES[kind][dtype]``. An all-zero reference fails too (the test would prove
    nothing) unless ``zero_reference_ok``: then ``actual`` must be zero as well."""
    tol = TOLERANCES[kind][jnp.dtype(dtype)] if tol is None else tol
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values in result"
    assert np.all(np.isfinite(expected)), f"{what}: non-finite values in the reference"
    diff = actual - expected
    norm = np.linalg.norm(expected)
    rel = np.linalg.norm(diff) / max(norm, 1e-30)
    max_abs = np.max(np.abs(diff)) if diff.size else 0.0
    assert norm > 0 or zero_reference_ok, (
        f"{what}: reference is all zeros; the test would prove nothing")
    assert rel <= tol, (
        f"{what}: relative error {rel:.3e} > {tol:.1e} ({kind}, {dtype}); "
        f"max abs error {max_abs:.3e}"
    )
    return rel


def make_ffn_inputs(seed: int, m: int, d: int, f: int, pattern: str, dtype, *, gated=True,
                    density: float = 0.05):
    """Random x [m, d] and weights whose ReLU gate has the requested sparsity pattern.

    The last feature of x is a bias input (1 for ordinary rows) and the last row of the gate
    weight is minus a threshold, so the gate is relu(x' @ w' - threshold) without a bias term.
    Patterns: "uniform" (~density active per token), "heavy_tailed" (per-token lognormal scale:
    most tokens very sparse, a few nearly dense), "zero_rows" (a quarter of the rows have no
    active unit), "dense_rows" (a quarter of the rows have every unit active).
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d))
    w_gate = rng.standard_normal((d, f)) / np.sqrt(d - 1)
    w_up = rng.standard_normal((d, f)) / np.sqrt(d)
    w_down = rng.standard_normal((f, d)) / np.sqrt(f * density)
    # Threshold with P(N(0, 1) > t) = density.
    threshold = {0.02: 2.054, 0.05: 1.645, 0.1: 1.282, 0.2: 0.842}.get(density, 1.645)
    if pattern == "heavy_tailed":
        x[:, :-1] *= rng.lognormal(0.0, 0.6, size=(m, 1))
    x[:, -1] = 1.0
    w_gate[-1] = -threshold
    if pattern == "zero_rows":
        x[: m // 4 + 1, :-1] = 0.0  # pre-activation = -threshold everywhere
    elif pattern == "dense_rows":
        x[: m // 4 + 1, :-1] *= 0.01
        x[: m // 4 + 1, -1] = -20.0  # pre-activation ~ +20 * threshold everywhere
    elif pattern not in ("uniform", "heavy_tailed"):
        raise ValueError(f"unknown pattern {pattern!r}")
    arrays = [jnp.asarray(a, dtype) for a in (x, w_gate, w_up, w_down)]
    if not gated:
        return arrays[0], arrays[1], arrays[3]
    return tuple(arrays)


def ffn_float64(x, *weights, bias=None):
    """The dense FFN in float64 numpy on the given (already rounded) inputs; ``bias`` [F] is
    the gate's (gated) or the up projection's."""
    x, *weights = [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, *weights)]
    b = 0.0 if bias is None else np.asarray(jnp.asarray(bias, jnp.float32), np.float64)
    if len(weights) == 3:
        w_gate, w_up, w_down = weights
        h = np.maximum(x @ w_gate + b, 0.0) * (x @ w_up)
    else:
        w_up, w_down = weights
        h = np.maximum(x @ w_up + b, 0.0)
    return h @ w_down, np.abs(h).sum(axis=-1).mean()


def dense_ffn_f32(x, *weights, bias=None):
    """The dense FFN in float32 jnp at highest precision (for jax.vjp references); ``bias``
    [F] is added to the gating pre-activation."""
    dot = lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    pre = dot(x, weights[0]) + (0.0 if bias is None else bias)
    if len(weights) == 3:
        _, w_up, w_down = weights
        h = jax.nn.relu(pre) * dot(x, w_up)
    else:
        _, w_down = weights
        h = jax.nn.relu(pre)
    return dot(h, w_down), jnp.mean(jnp.sum(jnp.abs(h), axis=-1))


@contextlib.contextmanager
def load_experiment(name: str):
    """Imports ``experiments/<name>.py`` (or ``tools/<name>.py``) as module ``name`` for the
    duration of the block (registered in sys.modules: dataclasses look their module up by
    name)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    path = root / "experiments" / f"{name}.py"
    if not path.exists():
        path = root / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def subprocess_env(**overrides: str) -> dict[str, str]:
    """The environment for a test's Python subprocess: this one's, with the checkout under
    test first on ``PYTHONPATH`` (installed or not), then ``overrides``."""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **overrides}


def nested_eqns(jaxpr, skip: tuple[str, ...] = ()):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters
    (jits, switch branches, loops), in order; not inside the primitives named in ``skip``."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in skip:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from nested_eqns(sub.jaxpr, skip)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from nested_eqns(sub, skip)
