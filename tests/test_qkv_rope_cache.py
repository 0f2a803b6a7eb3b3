"""``qkv_rope_cache`` (a decode step's q, k, v finished from their GEMV partial sums, rotated,
and k, v written into the KV cache, in one launch) against its jnp reference, the model's
unfused step and numpy float64, in interpret mode on the CPU (``tests/test_lowering.py``
checks the Triton lowering)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qkv_rope_cache import qkv_rope_cache, qkv_rope_cache_reference
from tests.utils import assert_close, seed_of, slow
from twell_jax.model import apply_rope_at, rope_tables

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def make_inputs(b, n, n_kv, h, length, splits, dtype, rng):
    parts = jnp.asarray(rng.standard_normal((splits, b, (n + 2 * n_kv) * h)), jnp.float32)
    cos, sin = (jnp.asarray(t) for t in rope_tables(length + 4, h, 10000.0))
    caches = [jnp.asarray(rng.standard_normal((b, length, n_kv, h)), dtype) for _ in range(2)]
    return parts, cos, sin, caches


@pytest.mark.parametrize("b, n, n_kv, h, splits", [
    slow(1, 4, 4, 64, 8),   # the 0.5b model's shape, scaled down in heads
    (3, 6, 2, 16, 3),   # grouped-query attention, 3 sequences
    slow(2, 2, 1, 32, 1),   # one split, one kv head
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_cache_matches_reference_and_model(b, n, n_kv, h, splits, dtype):
    rng = np.random.default_rng(seed_of("qkv_rope_cache", b, n, n_kv, h, splits, str(dtype)))
    length = 9
    parts, cos, sin, (cache_k, cache_v) = make_inputs(b, n, n_kv, h, length, splits, dtype, rng)
    positions = jnp.asarray(rng.integers(0, length, b), jnp.int32).at[-1].set(length - 1)
    q, new_k, new_v = qkv_rope_cache(parts, cos, sin, positions, cache_k, cache_v, n_heads=n,
                                     dtype=dtype)
    assert q.shape == (b, n, h) and q.dtype == dtype
    assert new_k.shape == cache_k.shape and new_k.dtype == cache_k.dtype
    want = qkv_rope_cache_reference(parts, cos, sin, positions, cache_k, cache_v, n_heads=n,
                                    dtype=dtype)
    for name, got, ref in zip(("q", "cache_k", "cache_v"), (q, new_k, new_v), want):
        assert_close(got, np.asarray(ref, np.float64), dtype, kind="kernel", what=name)
    # Only each sequence's row of the caches changed.
    changed = np.zeros((b, length), bool)
    changed[np.arange(b), np.asarray(positions)] = True
    for new, old in ((new_k, cache_k), (new_v, cache_v)):
        np.testing.assert_array_equal(np.asarray(new, np.float32)[~changed],
                                      np.asarray(old, np.float32)[~changed])
    # The model's unfused step: finish, split, rotate at the positions (float64 check of q).
    total = np.asarray(jnp.asarray(parts.sum(0), jnp.float32).astype(dtype), np.float64)
    q_rows = jnp.asarray(total[:, :n * h].reshape(b, 1, n, h), dtype)
    q_model = apply_rope_at(q_rows, cos, sin, positions[:, None])[:, 0]
    assert_close(q, np.asarray(q_model, np.float64), dtype, kind="kernel", what="q vs model")


def test_qkv_rope_cache_position_past_the_cache_writes_nothing():
    rng = np.random.default_rng(seed_of("qkv_rope_cache_oob"))
    parts, cos, sin, (cache_k, cache_v) = make_inputs(2, 2, 2, 16, 5, 2, jnp.float32, rng)
    positions = jnp.asarray([1, 5], jnp.int32)  # the second is past the 5-entry cache
    q, new_k, new_v = qkv_rope_cache(parts, cos, sin, positions, cache_k, cache_v, n_heads=2,
                                     dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(new_k)[1], np.asarray(cache_k)[1])
    np.testing.assert_array_equal(np.asarray(new_v)[1], np.asarray(cache_v)[1])
    assert not np.array_equal(np.asarray(new_k)[0, 1], np.asarray(cache_k)[0, 1])
    assert np.isfinite(np.asarray(q)).all()


def test_qkv_rope_cache_nan_propagates():
    rng = np.random.default_rng(seed_of("qkv_rope_cache_nan"))
    parts, cos, sin, (cache_k, cache_v) = make_inputs(1, 2, 1, 16, 4, 2, jnp.float32, rng)
    parts = parts.at[1, 0, 2 * 16 + 1].set(jnp.nan)  # one value of k
    q, new_k, _ = qkv_rope_cache(parts, cos, sin, jnp.asarray([2]), cache_k, cache_v,
                                 n_heads=2, dtype=jnp.float32)
    assert np.isnan(np.asarray(new_k)[0, 2, 0]).any() and np.isfinite(np.asarray(q)).all()


def test_qkv_rope_cache_bad_inputs():
    rng = np.random.default_rng(seed_of("qkv_rope_cache_bad"))
    parts, cos, sin, (ck, cv) = make_inputs(2, 2, 2, 16, 4, 2, jnp.float32, rng)
    pos = jnp.asarray([0, 1])
    with pytest.raises(ValueError, match="float32"):
        qkv_rope_cache(parts.astype(jnp.bfloat16), cos, sin, pos, ck, cv, n_heads=2,
                       dtype=jnp.float32)
    with pytest.raises(ValueError, match="do not hold q, k, v"):
        qkv_rope_cache(parts, cos, sin, pos, ck, cv, n_heads=3, dtype=jnp.float32)
    with pytest.raises(ValueError, match="a power of two"):  # H = 12: H / 2 = 6
        p12, c12, s12, (k12, v12) = make_inputs(2, 2, 2, 12, 4, 2, jnp.float32, rng)
        qkv_rope_cache(p12, c12, s12, pos, k12, v12, n_heads=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="caches must be"):
        qkv_rope_cache(parts, cos, sin, pos, ck, cv[:, :3], n_heads=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="cos, sin"):
        qkv_rope_cache(parts, cos[:, :2], sin[:, :2], pos, ck, cv, n_heads=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="positions"):
        qkv_rope_cache(parts, cos, sin, pos[:1], ck, cv, n_heads=2, dtype=jnp.float32)
