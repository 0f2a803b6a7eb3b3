"""``decode_attention`` (flash-decoding over a KV cache) against numpy float64 and its jnp
reference (the model's XLA path), in interpret mode on the CPU (compiled on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.decode_attention import (DecodeAttentionConfig, combine_partials,
                                             combine_partials_kernel,
                                             decode_attention, decode_attention_reference,
                                             default_decode_attention_config)
from tests.utils import assert_close, seed_of, slow

F32, BF16 = jnp.float32, jnp.bfloat16
SMALL = DecodeAttentionConfig(block_s=16, block_k=16, num_warps=1, num_stages=1)


def numpy_decode_attention(q, k, v, positions):
    """Float64 loop over sequences and query heads on the given (rounded) inputs; q rounded to
    k's dtype first, as both implementations do."""
    q = np.asarray(jnp.asarray(q).astype(k.dtype).astype(F32), np.float64)
    k, v = (np.asarray(jnp.asarray(a, F32), np.float64) for a in (k, v))
    b, n, h = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, n, h))
    for i in range(b):
        valid = slice(0, int(positions[i]) + 1)
        for j in range(n):
            scores = k[i, valid, j // g] @ q[i, j] / np.sqrt(h)
            p = np.exp(scores - scores.max())
            out[i, j] = (p / p.sum()) @ v[i, valid, j // g]
    return out


def make_inputs(seed, b, s, n, n_kv, h, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(2.0 * rng.standard_normal((b, n, h)), dtype)  # peaked softmax too
    k = jnp.asarray(rng.standard_normal((b, s, n_kv, h)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, n_kv, h)), dtype)
    return q, k, v


@pytest.mark.parametrize("b,s,n,n_kv,h,positions,config,dtype", [
    # N == Nkv, one sequence at the cache's end; S not a multiple of block_s.
    (1, 37, 4, 4, 16, [36], SMALL, F32),
    slow(1, 37, 4, 4, 64, [0], SMALL, BF16),  # position 0: also in the GQA case
    # GQA (G = 4), mixed positions: the first entry, the last one, inside a chunk.
    (3, 50, 8, 2, 64, [0, 49, 20], DecodeAttentionConfig(block_s=32, block_k=16,
                                                          num_warps=2), BF16),
    slow(3, 50, 8, 2, 16, [17, 0, 49], SMALL, F32),
    # G = 3 and H = 24 (both padded to powers of two in the kernel), default config.
    slow(2, 33, 6, 2, 24, [32, 5], None, F32),
    # G = 16: the dot path.
    (2, 40, 16, 1, 16, [39, 16], SMALL, BF16),
    slow(2, 40, 16, 1, 16, [3, 31], SMALL, F32),
], ids=["mha-f32", "mha-pos0-bf16", "gqa-bf16", "gqa-h16-f32", "g3-h24-f32", "dot-bf16",
        "dot-f32"])
def test_decode_attention_matches_numpy_and_reference(b, s, n, n_kv, h, positions, config,
                                                      dtype):
    q, k, v = make_inputs(seed_of("decode_attention", b, s, n, n_kv, h, str(dtype)), b, s, n,
                          n_kv, h, dtype)
    pos = jnp.asarray(positions, jnp.int32)
    want = numpy_decode_attention(q, k, v, positions)
    got = decode_attention(q, k, v, pos, config=config)
    ref = decode_attention_reference(q, k, v, pos)
    assert got.shape == (b, n, h) and got.dtype == dtype
    assert_close(got, want, dtype, kind="kernel", what="kernel vs float64")
    assert_close(ref, want, dtype, kind="kernel", what="reference vs float64")
    assert_close(got, ref, dtype, kind="kernel", what="kernel vs reference")


@pytest.mark.parametrize("n,n_kv", [(8, 2), slow(16, 1)], ids=["gqa", "dot"])
def test_entries_after_the_position_do_not_matter(n, n_kv):
    """Huge values, inf and NaN after each sequence's position: the same output, bit for bit
    (whole chunks after the position are skipped, the partial chunk is masked)."""
    b, s, h = 3, 50, 16
    q, k, v = make_inputs(seed_of("decode_attention_garbage", n), b, s, n, n_kv, h, F32)
    positions = [0, 21, 49]
    pos = jnp.asarray(positions, jnp.int32)
    clean = np.asarray(decode_attention(q, k, v, pos, config=SMALL))
    after = np.arange(s)[None, :, None, None] > np.asarray(positions)[:, None, None, None]
    garbage = np.resize(np.array([1e30, -1e30, np.inf, np.nan], np.float32), k.shape)
    k_bad = jnp.asarray(np.where(after, garbage, np.asarray(k)))
    v_bad = jnp.asarray(np.where(after, garbage[:, ::-1], np.asarray(v)))
    dirty = np.asarray(decode_attention(q, k_bad, v_bad, pos, config=SMALL))
    np.testing.assert_array_equal(dirty, clean)
    assert_close(dirty, numpy_decode_attention(q, k, v, positions), F32, kind="kernel")


def test_nan_in_a_valid_entry_propagates():
    b, s, n, n_kv, h = 2, 40, 4, 2, 16
    q, k, v = make_inputs(seed_of("decode_attention_nan"), b, s, n, n_kv, h, F32)
    pos = jnp.asarray([30, 30], jnp.int32)
    k = k.at[0, 25, 1, 3].set(jnp.nan)  # sequence 0, kv head 1: its query heads 2, 3
    v = v.at[1, 7, 0, 5].set(jnp.nan)  # sequence 1, kv head 0, column 5: heads 0, 1
    got = np.asarray(decode_attention(q, k, v, pos, config=SMALL))
    ref = np.asarray(decode_attention_reference(q, k, v, pos))
    expected_nan = np.zeros((b, n, h), bool)
    expected_nan[0, 2:] = True
    expected_nan[1, :2, 5] = True
    np.testing.assert_array_equal(np.isnan(ref), expected_nan)
    np.testing.assert_array_equal(np.isnan(got), expected_nan)


def test_combine_ignores_neutral_partials():
    """Neutral partials (a chunk after the position) add nothing; all-neutral gives NaN (a
    softmax over no entries, as the reference) and never raises."""
    rng = np.random.default_rng(seed_of("combine"))
    m = jnp.asarray(rng.standard_normal((1, 1, 3, 2)), F32)
    l = jnp.asarray(rng.uniform(1.0, 2.0, (1, 1, 3, 2)), F32)
    acc = jnp.asarray(rng.standard_normal((1, 1, 3, 2, 4)), F32)
    want = combine_partials(m, l, acc)
    neutral = lambda x, value: jnp.concatenate([x, jnp.full_like(x[:, :, :2], value)], axis=2)
    got = combine_partials(neutral(m, -jnp.inf), neutral(l, 0.0), neutral(acc, 0.0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    empty = combine_partials(jnp.full_like(m, -jnp.inf), jnp.zeros_like(l), jnp.zeros_like(acc))
    assert np.all(np.isnan(np.asarray(empty)))


@pytest.mark.parametrize("g, g_pad, h, h_pad, chunks", [(1, 1, 64, 64, 16), (3, 4, 24, 32, 5)])
def test_combine_kernel_matches_combine_partials(g, g_pad, h, h_pad, chunks):
    """The combine's kernel (one launch) against ``combine_partials`` (its jnp reference), with
    padded heads and columns, a chunk count that is not a power of two, neutral partials, and
    a sequence whose partials are all neutral (NaN, as the reference)."""
    rng = np.random.default_rng(seed_of("combine_kernel", g, h, chunks))
    b, n_kv = 3, 2
    m = rng.standard_normal((b, n_kv, chunks, g_pad)).astype(np.float32)
    l = rng.uniform(1.0, 2.0, (b, n_kv, chunks, g_pad)).astype(np.float32)
    acc = rng.standard_normal((b, n_kv, chunks, g_pad, h_pad)).astype(np.float32)
    m[1, :, chunks // 2:] = -np.inf  # chunks after the position
    l[1, :, chunks // 2:] = 0.0
    acc[1, :, chunks // 2:] = 0.0
    m[2], l[2], acc[2] = -np.inf, 0.0, 0.0  # nothing to attend to
    m, l, acc = (jnp.asarray(a) for a in (m, l, acc))
    got = np.asarray(combine_partials_kernel(m, l, acc, g=g, h=h, dtype=F32))
    want = np.asarray(combine_partials(m[..., :g], l[..., :g], acc[..., :g, :h])).reshape(
        b, n_kv * g, h)
    assert got.shape == (b, n_kv * g, h)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-6, atol=1e-6)
    assert np.isnan(got[2]).all() and np.isnan(want[2]).all()


def test_default_config_fills_the_gpu():
    for b, s, n_kv, chunks in [(1, 2048, 32, 16), (8, 2048, 32, 2), (64, 2048, 32, 2),
                               (1, 100, 8, 2)]:
        config = default_decode_attention_config(b, s, n_kv, 64)
        assert -(-s // config.block_s) == chunks, (b, s, n_kv, config)
        assert config.rows_per_tile(64) <= config.block_s


def test_decode_attention_rejects_bad_input():
    q, kv, pos = jnp.zeros((2, 8, 16)), jnp.zeros((2, 20, 2, 16)), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of Nkv"):
        decode_attention(q[:, :7], kv, kv, pos)
    with pytest.raises(ValueError, match="batch"):
        decode_attention(q[:1], kv, kv, pos[:1])
    with pytest.raises(ValueError, match="head dim"):
        decode_attention(q[..., :8], kv, kv, pos)
    with pytest.raises(ValueError, match="positions has shape"):
        decode_attention(q, kv, kv, pos[:, None])
    with pytest.raises(ValueError, match="positions must be integers"):
        decode_attention(q, kv, kv, pos.astype(F32))
    with pytest.raises(ValueError, match="v has shape"):
        decode_attention(q, kv, kv[:, :10], pos)
    with pytest.raises(ValueError, match="q must be 3-D"):
        decode_attention(q[:, None], kv, kv, pos)
    with pytest.raises(ValueError, match="k must be 4-D"):
        decode_attention_reference(q, kv[0], kv[0], pos)
    with pytest.raises(ValueError, match="power of two"):
        DecodeAttentionConfig(block_s=96)
    with pytest.raises(ValueError, match="block_k"):
        DecodeAttentionConfig(block_s=32, block_k=64)
    with pytest.raises(ValueError, match="num_stages"):
        DecodeAttentionConfig(num_stages=0)
