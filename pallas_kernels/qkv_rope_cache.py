"""A decode step's q, k and v from their GEMV partial sums: rotated, and k, v written into the
KV cache, in one launch.

Between the q / k / v projection (``gemv_many``, float32 partial sums over its D splits) and
the attention over the cache, a decode step finishes the three products, applies the rotary
embedding to q and k at each sequence's position and writes k and v into the caches at that
position. XLA compiles this to five launches a layer (the rotations of k and q, each with the
partial sums' finish, v's finish, the two cache writes), ~1.2-1.6 us each plus ~0.8 us of GPU
idle between launches on the H100. Here one program per
(sequence, query head) does its head's share:

* the head's columns of q (and, for the first Nkv heads, of k and v) are summed over the
  splits in order 0..S-1 and rounded to the compute dtype, as ``finish_partial_sums`` does;
* q and k are rotated in float32 (Hugging Face's split-halves convention, as
  ``twell_jax.model.apply_rope_at``: features i and i + H/2 pair up) with the cos / sin
  table rows at the position, and rounded once;
* k and v are stored into the caches at [b, position] (the caches are aliased to the outputs:
  nothing else of them is read or written). A position past the cache writes nothing, as an
  out-of-bounds ``.at[].set`` drops its update; the tables' row is clamped, as a gather is.

So q, k and v are the unfused step's sums in the same order, rounded the same way; the
float32 rotation may differ from XLA's in the last bit (float32: ~2e-7). Head sizes with H / 2
a power of two >= 8 (``supports_head_dim``; the model falls back to XLA otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (add_in_order, finish_partial_sums, is_power_of_two,
                                   resolve_interpret)

_F32 = jnp.float32
MAX_ROWS = 64  # one query row per sequence: decode steps


def _kernel(pos_ref, parts_ref, cos_ref, sin_ref, k_in_ref, v_in_ref, q_ref, k_ref, v_ref, *,
            n_heads: int, n_kv: int, h: int, splits: int, seq_len: int, table_len: int, dtype):
    """Program (b, n): sequence b, query head n (and kv head n when n < Nkv). Refs: positions
    [B] int32, partial sums [S, B, (N + 2 Nkv) H] float32, cos, sin [T, H/2] float32, the
    caches [B, L, Nkv, H] (inputs aliased to the outputs k_ref, v_ref; unused here); q out
    [B, N, H]."""
    del k_in_ref, v_in_ref  # aliased to k_ref, v_ref
    b = pl.program_id(0)
    n = pl.program_id(1)
    half = h // 2  # a power of two: a block of its own, no mask
    pos = pos_ref[b]
    row = jnp.clip(pos, 0, table_len - 1)
    cos = cos_ref[row, pl.ds(0, half)].astype(_F32)
    sin = sin_ref[row, pl.ds(0, half)].astype(_F32)

    def finish(col0):
        """The product's columns [col0, col0 + half): splits summed in order, rounded."""
        cols = pl.ds(col0, half)
        acc = add_in_order(lambda s: parts_ref[jnp.int32(s), b, cols], splits)
        return acc.astype(dtype).astype(_F32)

    def rotated(col0):
        x1, x2 = finish(col0), finish(col0 + half)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def store(ref, index, mask, first, second):
        """Both halves of one head's row, rounded to dtype, then to the ref's dtype."""
        for col0, value in ((0, first), (half, second)):
            plgpu.store(ref.at[(*index, pl.ds(col0, half))],
                        value.astype(dtype).astype(ref.dtype), mask=mask)

    store(q_ref, (b, n), None, *rotated(n * h))

    @pl.when(n < n_kv)
    def _():
        # A position past the cache writes nothing, as .at[].set drops the update.
        in_cache = jnp.full((half,), (pos >= 0) & (pos < seq_len))
        index = (b, jnp.clip(pos, 0, seq_len - 1), n)
        store(k_ref, index, in_cache, *rotated((n_heads + n) * h))
        v_col = (n_heads + n_kv + n) * h
        store(v_ref, index, in_cache, finish(v_col), finish(v_col + half))


def supports_head_dim(h: int) -> bool:
    """Head sizes the kernel takes: H / 2 a power of two (each half one block: Triton's blocks
    are powers of two, and a static slice may not run past the cache's H), at least 8 (the
    smallest tested)."""
    return h % 2 == 0 and is_power_of_two(h // 2) and h // 2 >= 8


def qkv_rope_cache(
    partial_sums: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    positions: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    *,
    n_heads: int,
    dtype,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q rotated, and the caches with k (rotated) and v written at each sequence's position.

    Args:
      partial_sums: [S, B, (N + 2 Nkv) H] float32: ``gemv_many_partial_sums`` of x [B, D] with
        (w_q, w_k, w_v), in that order.
      cos, sin: [T, H / 2] float32 rotary tables (``twell_jax.model.rope_tables``).
      positions: [B] int, each sequence's new position.
      cache_k, cache_v: [B, L, Nkv, H] (any float dtype; ``supports_head_dim(H)``), updated
        in place where XLA can.
      n_heads: N, query heads (Nkv, H come from the caches).
      dtype: the compute dtype q, k and v are rounded to (then k, v to the caches' dtype).
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      (q [B, N, H] in dtype, cache_k, cache_v).
    """
    if partial_sums.ndim != 3 or jnp.dtype(partial_sums.dtype) != jnp.dtype(_F32):
        raise ValueError(f"partial_sums must be float32 [S, B, F], got "
                         f"{partial_sums.dtype}{list(partial_sums.shape)}")
    splits, b, width = partial_sums.shape
    if cache_k.ndim != 4 or cache_k.shape != cache_v.shape or cache_k.shape[0] != b:
        raise ValueError(f"caches must be [B={b}, L, Nkv, H] of one shape, got "
                         f"{cache_k.shape} and {cache_v.shape}")
    _, seq_len, n_kv, h = cache_k.shape
    if not supports_head_dim(h) or n_heads % n_kv or width != (n_heads + 2 * n_kv) * h:
        raise ValueError(f"partial sums of width {width} do not hold q, k, v for {n_heads} "
                         f"heads, {n_kv} kv heads of size {h} (H / 2 a power of two >= 8)")
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[1] != h // 2:
        raise ValueError(f"cos, sin must be [T, {h // 2}], got {cos.shape}, {sin.shape}")
    if positions.shape != (b,):
        raise ValueError(f"positions must be [{b}], got {positions.shape}")
    if not 1 <= b <= MAX_ROWS:
        raise ValueError(f"qkv_rope_cache takes 1 to {MAX_ROWS} sequences, got {b}")
    kernel = functools.partial(
        _kernel, n_heads=n_heads, n_kv=n_kv, h=h, splits=splits, seq_len=seq_len,
        table_len=cos.shape[0], dtype=jnp.dtype(dtype))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, n_heads, h), dtype),
                   jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                   jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)),
        grid=(b, n_heads),
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="twell_qkv_rope_cache",
    )(positions.astype(jnp.int32), partial_sums, cos.astype(_F32), sin.astype(_F32), cache_k,
      cache_v)


def qkv_rope_cache_reference(partial_sums, cos, sin, positions, cache_k, cache_v, *,
                             n_heads: int, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp :func:`qkv_rope_cache` (same arguments and outputs): the unfused step."""
    _, b, _ = partial_sums.shape
    n_kv, h = cache_k.shape[2:]
    total = finish_partial_sums(partial_sums, None, dtype)
    q, k, v = jnp.split(total, [n_heads * h, (n_heads + n_kv) * h], axis=1)

    def rotate(x, heads):
        x = x.reshape(b, heads, h).astype(_F32)
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        x1, x2 = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(dtype)

    rows = jnp.arange(b)
    cache_k = cache_k.at[rows, positions].set(rotate(k, n_kv).astype(cache_k.dtype))
    cache_v = cache_v.at[rows, positions].set(v.reshape(b, n_kv, h).astype(cache_v.dtype))
    return rotate(q, n_heads), cache_k, cache_v
