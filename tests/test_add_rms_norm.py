"""``add_rms_norm`` (a decode step's residual add and RMSNorm in one launch) against numpy
float64, its jnp reference and the model's unfused step, in interpret mode on the CPU
(``tests/test_lowering.py`` checks the Triton lowering)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference
from pallas_kernels.common import finish_partial_sums
from tests.utils import assert_close, seed_of, slow

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
EPS = 1e-6


def numpy_norm(r, scale) -> np.ndarray:
    r = np.asarray(jnp.asarray(r, jnp.float32), np.float64)
    s = np.asarray(jnp.asarray(scale, jnp.float32), np.float64)
    return r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + EPS) * s


def make_inputs(m, d, dtype, delta_kind, rng):
    """x [m, d] (the residual stream), scale [d] and delta: None, [m, d] in dtype, or float32
    partial sums [3, m, d]; rows of different scales (one ~100x) as a residual stream has."""
    rows = np.exp(rng.uniform(-1, 4.6, (m, 1)))
    x = jnp.asarray(rng.standard_normal((m, d)) * rows, dtype)
    scale = jnp.asarray(1 + 0.2 * rng.standard_normal(d), dtype)
    delta = {"none": None,
             "output": jnp.asarray(rng.standard_normal((m, d)), dtype),
             "partials": jnp.asarray(rng.standard_normal((3, m, d)), jnp.float32)}[delta_kind]
    return x, delta, scale


@pytest.mark.parametrize("delta_kind", ["none", "output", "partials"])
@pytest.mark.parametrize("m, d", [slow(1, 2048), (5, 200), slow(64, 64)])  # 200: a masked, ragged D
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_numpy_and_reference(m, d, dtype, delta_kind):
    rng = np.random.default_rng(seed_of("add_rms_norm", m, d, str(dtype), delta_kind))
    x, delta, scale = make_inputs(m, d, dtype, delta_kind, rng)
    r, normed = add_rms_norm(x, delta, scale, eps=EPS)
    assert r.shape == normed.shape == (m, d) and r.dtype == normed.dtype == dtype
    want_r, want_normed = add_rms_norm_reference(x, delta, scale, eps=EPS)
    # The residual sum rounds the same values in the same order: equal to the bit.
    np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(want_r, np.float32))
    if delta_kind == "partials":  # as gemv's finish then the model's add would give
        unfused = x + finish_partial_sums(delta, None, dtype)
        np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(unfused, np.float32))
    assert_close(normed, numpy_norm(r, scale), dtype, kind="kernel", what="normed vs float64")
    assert_close(normed, np.asarray(want_normed, np.float64), dtype, kind="kernel",
                 what="normed vs reference")


def test_add_rms_norm_nan_propagates():
    rng = np.random.default_rng(seed_of("add_rms_norm_nan"))
    x, delta, scale = make_inputs(3, 96, jnp.float32, "output", rng)
    delta = delta.at[1, 7].set(jnp.nan)
    r, normed = add_rms_norm(x, delta, scale, eps=EPS)
    assert np.isnan(np.asarray(r)[1, 7]) and np.isnan(np.asarray(normed)[1]).all()
    assert np.isfinite(np.asarray(normed)[[0, 2]]).all()


def test_add_rms_norm_jitted_zero_row():
    """A zero row normalises to zero (eps keeps it finite), under jit."""
    x = jnp.zeros((2, 64), jnp.bfloat16).at[1].set(1.0)
    scale = jnp.ones((64,), jnp.bfloat16)
    r, normed = jax.jit(lambda a, s: add_rms_norm(a, None, s, eps=EPS))(x, scale)
    np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(normed[0], np.float32), 0.0)
    np.testing.assert_allclose(np.asarray(normed[1], np.float32), 1.0, rtol=1e-2)


def test_add_rms_norm_bad_inputs():
    x = jnp.ones((2, 8), jnp.float32)
    scale = jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        add_rms_norm(jnp.ones((65, 8)), None, scale, eps=EPS)
    with pytest.raises(ValueError, match="2-D"):
        add_rms_norm(jnp.ones((8,)), None, scale, eps=EPS)
    with pytest.raises(ValueError, match="scale has shape"):
        add_rms_norm(x, None, jnp.ones((7,)), eps=EPS)
    with pytest.raises(ValueError, match="delta has shape"):
        add_rms_norm(x, jnp.ones((2, 7)), scale, eps=EPS)
    with pytest.raises(ValueError, match="partial sums must be float32"):
        add_rms_norm(x, jnp.ones((3, 2, 8), jnp.bfloat16), scale, eps=EPS)
    with pytest.raises(ValueError, match="eps must be positive"):
        add_rms_norm(x, None, scale, eps=0.0)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        add_rms_norm(x.astype(jnp.int32), None, scale, eps=EPS)
