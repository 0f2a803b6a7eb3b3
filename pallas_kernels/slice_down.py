"""The decode FFN's busy blocks: their down product added to the walk's per-slice partial sums.

A decode-sized call walks each row's active units (``scan_up_down``), reading that row's own
weight rows; a block of F that many rows use is cheaper multiplied densely, reading each of
its weight rows once for all rows. The counting GEMV (``gemv_with_counts``) marks such blocks
(their count of active entries above a threshold) and writes their hidden values h; the walk
skips their units; this kernel adds, for every slice s of the walk,

    y_parts[s] += sum over the busy blocks b in slice s of h[:, b] @ w_down[b]

so one finishing sum (or the consumer that adds the slices itself) serves every block. Each
program reads the counts of its slice's blocks (one small load) and returns at once when
none is busy, leaving ``y_parts`` as the walk wrote it (the output aliases that input): a
call near the design point pays a near-empty launch and no host round trip.

Why slices: with at most 64 rows the down product is bound by reading w_down once (D = 2048,
F = 5632: 23 MB). A grid of (slice, D block) programs puts every SM on it, each reading
[block, block_n] tiles of contiguous row pieces in a loop that Triton pipelines; reducing over
the whole of F in one program would leave most SMs idle (D / block_n programs).

Numerics: h is float32; for 16-bit weights it is split into a high and a low 16-bit part,
two tensor-core dots with float32 accumulation (h kept to ~2^-16 of itself, like the walk's
float32 h); float32 weights use the float32 dot at highest precision. The busy blocks are
added after the walk's sum, in block order: deterministic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (block_range, check_config, largest_pow2_divisor, next_pow2,
                                   resolve_interpret)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceDownConfig:
    """Knobs of :func:`slice_down`.

    Attributes:
      block_n: output columns of D per program (power of two >= 16, dividing D).
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the loop over the slice's blocks.
    """

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_config(self, ("block_n", "num_warps"))
        if self.block_n < 16:
            raise ValueError(f"the dot needs block_n >= 16, got {self.block_n}")


def default_slice_down_config(m: int, d: int) -> SliceDownConfig:
    """128-column D blocks: 256-byte row pieces of bf16 w_down."""
    del m
    return SliceDownConfig(block_n=largest_pow2_divisor(d, 128), num_warps=4, num_stages=3)


def _slice_down_kernel(h_ref, w_ref, counts_ref, _parts_in, out_ref, *, m: int, m_pad: int,
                       f: int, block_f: int, count_block: int, block_n: int, n_counts: int,
                       dense_above: int, split_h: bool, precision):
    """Program (s, b): slice s of F (``block_f // count_block`` blocks), D columns
    [b * block_n, +block_n). Refs: h [M, F] float32, w_down [F, D], counts [n_counts] int32,
    y_parts [S, M, D] float32 (aliased to the output: untouched unless a block is busy)."""
    s = pl.program_id(0)
    b = pl.program_id(1)
    n_blocks = block_f // count_block
    block_lane = jax.lax.broadcasted_iota(jnp.int32, (n_blocks,), 0)
    block_ids = s * n_blocks + block_lane
    busy = plgpu.load(counts_ref.at[block_ids], mask=block_ids < n_counts,
                      other=0) > dense_above

    @pl.when(jnp.sum(busy.astype(jnp.int32)) > 0)
    def _():
        rows = block_range(0, m_pad)[:, None]
        row_ok = rows < m
        cols = (b * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n,), 0))[None, :]
        lane = jax.lax.broadcasted_iota(jnp.int32, (count_block,), 0)
        rows_mask = jnp.broadcast_to(row_ok, (m_pad, block_n))
        out = out_ref.at[s, rows, cols]

        def step(i, acc):
            units = (s * n_blocks + i) * count_block + lane
            take = jnp.sum(jnp.where(block_lane == i, busy, False).astype(jnp.int32)) > 0
            ok = (units < f) & take
            hk = plgpu.load(h_ref.at[rows, units[None, :]], mask=row_ok & ok[None, :],
                            other=0.0)
            wk = plgpu.load(w_ref.at[units[:, None], cols],
                            mask=jnp.broadcast_to(ok[:, None], (count_block, block_n)), other=0)
            if split_h:
                high = hk.astype(wk.dtype)
                low = (hk - high.astype(jnp.float32)).astype(wk.dtype)
                return (acc + jnp.dot(high, wk, preferred_element_type=jnp.float32)
                        + jnp.dot(low, wk, preferred_element_type=jnp.float32))
            return acc + jnp.dot(hk, wk, preferred_element_type=jnp.float32,
                                 precision=precision)

        steps = min(n_blocks, -(-f // count_block))
        dense = jax.lax.fori_loop(0, steps, step, jnp.zeros((m_pad, block_n), jnp.float32))
        walked = plgpu.load(out, mask=rows_mask, other=0.0)
        plgpu.store(out, walked + dense, mask=rows_mask)


def _check_args(h, w_down, counts, y_parts, block_f: int) -> tuple[int, int, int]:
    if h.ndim != 2 or h.dtype != jnp.float32:
        raise ValueError(f"h must be float32 [M, F], got {h.dtype} {h.shape}")
    m, f = h.shape
    if w_down.ndim != 2 or w_down.shape[0] != f:
        raise ValueError(f"w_down has shape {w_down.shape}, expected ({f}, D)")
    d = w_down.shape[1]
    slices = -(-f // block_f)
    if y_parts.shape != (slices, m, d) or y_parts.dtype != jnp.float32:
        raise ValueError(f"y_parts must be float32 {(slices, m, d)}, got {y_parts.dtype} "
                         f"{y_parts.shape}")
    if counts.ndim != 1 or counts.dtype != jnp.int32:
        raise ValueError(f"counts must be int32 [B], got {counts.dtype} {counts.shape}")
    return m, d, f


def slice_down(
    h: jax.Array,
    w_down: jax.Array,
    counts: jax.Array,
    y_parts: jax.Array,
    *,
    dense_above: int,
    count_block: int,
    block_f: int,
    config: SliceDownConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``y_parts`` plus, in each slice, the down product of its busy blocks.

    Args:
      h: [M, F] float32 hidden values (read only in busy blocks).
      w_down: [F, D] (bf16, f16 or f32); D a multiple of ``config.block_n``.
      counts: [B] int32, B = ceil(F / count_block): active entries per block
        (``gemv_with_counts``); a block is busy when its count exceeds ``dense_above``.
      y_parts: [S, M, D] float32, S = ceil(F / block_f): the walk's partial sums.
      count_block: units per counted block; block_f: units per slice, a multiple of it.
      config: ``default_slice_down_config`` when None.
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      [S, M, D] float32: ``y_parts[s] + sum over busy blocks b of slice s of h[:, b] @
      w_down[b]`` (``slice_down_reference``).
    """
    m, d, f = _check_args(h, w_down, counts, y_parts, block_f)
    if block_f % count_block or counts.shape[0] != -(-f // count_block):
        raise ValueError(f"block_f={block_f} must be a multiple of count_block={count_block}, "
                         f"and counts ({counts.shape[0]}) one per block of F={f}")
    if count_block < 16:
        raise ValueError(f"the dot needs count_block >= 16, got {count_block}")
    config = default_slice_down_config(m, d) if config is None else config
    if d % config.block_n:
        raise ValueError(f"D={d} is not a multiple of block_n={config.block_n}")
    wide = jnp.dtype(w_down.dtype) == jnp.float32
    kernel = functools.partial(
        _slice_down_kernel, m=m, m_pad=max(16, next_pow2(m)), f=f, block_f=block_f,
        count_block=count_block, block_n=config.block_n, n_counts=counts.shape[0],
        dense_above=int(dense_above), split_h=not wide,
        precision=jax.lax.Precision.HIGHEST if wide else None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y_parts.shape, jnp.float32),
        grid=(y_parts.shape[0], d // config.block_n),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_slice_down",
    )(h, w_down, counts, y_parts)


def slice_down_reference(h: jax.Array, w_down: jax.Array, counts: jax.Array, y_parts: jax.Array,
                         *, dense_above: int, count_block: int, block_f: int) -> jax.Array:
    """Plain-jnp :func:`slice_down` (same arguments and output), at highest precision."""
    m, f = h.shape
    slices = y_parts.shape[0]
    busy = jnp.repeat(counts > dense_above, count_block)[:f]
    h = jnp.where(busy[None, :], h, 0.0)
    pad = slices * block_f - f
    hs = jnp.pad(h, ((0, 0), (0, pad))).reshape(m, slices, block_f)
    ws = jnp.pad(w_down.astype(jnp.float32), ((0, pad), (0, 0))).reshape(slices, block_f, -1)
    return y_parts + jnp.einsum("msu,sud->smd", hs, ws, precision=jax.lax.Precision.HIGHEST)
