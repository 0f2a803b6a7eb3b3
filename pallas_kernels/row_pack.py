"""Packs a dense gate pre-activation [M, F] into per-row lists of its positive entries.

For each row, in column order, the entries of ``relu(pre)`` that are positive (NaN counts as
positive, so it propagates) are listed as ``values`` [M, K] and ``columns`` [M, K] int32 (the
first ``min(row_total, K)`` entries of a row are valid; the rest are unspecified), together with
the true per-tile counts ``counts`` [M, F / T] int32 and per-row totals ``row_total`` [M] int32.
A row whose total exceeds K, or whose count in some tile exceeds the TwELL slot limit, is
*heavy*: the caller computes it densely, so its list never needs more than K entries.

It reads XLA's bf16 GEMM output directly (the ReLU is applied here), so the gate stage is one
GEMM plus one read of its output. A gate bias belongs in that GEMM (``dense.
gate_pre_activation`` folds it in before rounding, which keeps the low bits of gates whose bias
cancels most of x @ w), so there is none here. One program per ``block_m`` rows loops
over column chunks of ``chunk`` columns (several tiles at once: fewer dependent steps per
program than one tile at a time), ranking the positive lanes with a prefix count and writing
them with one masked scatter per chunk. Disabled lanes are sent to index K (out of range) so
they never alias a real write (interpret mode applies masked scatters to every lane).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_config, check_dense_tiles, resolve_interpret


def _row_pack_kernel(pre_ref, values_ref, columns_ref, counts_ref, total_ref, *, block_m: int,
                     chunk: int, num_chunks: int, tile_width: int, num_slots: int):
    """One program: rows [i * block_m, +block_m), all columns in ``num_chunks`` steps.

    Refs: pre [M, F]; outputs values [M, K], columns [M, K] int32, counts [M, F / T] int32,
    row_total [M] int32.
    """
    row0 = pl.multiple_of(pl.program_id(0) * block_m, block_m)
    rows = pl.ds(row0, block_m)
    shape = (block_m, chunk)
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    row_index = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    tiles_per_chunk = chunk // tile_width

    def chunk_step(c, length):
        col0 = pl.multiple_of(c * chunk, chunk)
        gate = pre_ref[rows, pl.ds(col0, chunk)].astype(jnp.float32)
        positive = jnp.logical_not(gate <= 0.0)  # > 0 or NaN
        p = positive.astype(jnp.int32)
        rank = length[:, None] + jnp.cumsum(p, axis=1) - p
        keep = positive & (rank < num_slots)
        dest = jnp.where(keep, rank, num_slots)
        plgpu.store(values_ref.at[row_index, dest], gate.astype(values_ref.dtype), mask=keep)
        plgpu.store(columns_ref.at[row_index, dest], col0 + lane, mask=keep)
        tile_counts = p.reshape(block_m, tiles_per_chunk, tile_width).sum(axis=2)
        counts_ref[rows, pl.ds(c * tiles_per_chunk, tiles_per_chunk)] = tile_counts
        return length + p.sum(axis=1)

    total_ref[rows] = jax.lax.fori_loop(0, num_chunks, chunk_step,
                                        jnp.zeros((block_m,), jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPackConfig:
    """Knobs of :func:`row_pack`.

    Attributes:
      block_m: rows per program (power of two).
      chunk: columns per step (a power-of-two multiple of the tile width dividing F).
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the chunk loop.
    """

    block_m: int = 1
    chunk: int = 512
    num_warps: int = 1
    num_stages: int = 2

    def __post_init__(self):
        check_config(self, ("block_m", "chunk", "num_warps"))


def default_row_pack_config(m: int, f: int, tile_width: int) -> RowPackConfig:
    """One row per program and one warp, the widest chunk (<= 512 columns) dividing F.

    H100, M = 16384, F = 5632 (184 MB of bf16 pre-activations): 1 row / 512 columns / 1 warp
    0.224 ms; 1 row 2 warps 0.295; 2 rows 2 warps 0.296; 4 rows 4 warps 0.302; 8 rows 0.287;
    16 rows x 128 columns 0.432 (BENCHMARKS.md compares it with the kernel it replaced).
    D = 4096, F = 14336: 0.577 against 0.67-1.0 for the others."""
    del m
    chunk = tile_width
    while chunk < 512 and f % (2 * chunk) == 0:
        chunk *= 2
    return RowPackConfig(block_m=1, chunk=chunk, num_warps=1)


def row_pack(pre: jax.Array, *, tile_width: int, num_slots: int,
             config: RowPackConfig | None = None, interpret: bool | None = None):
    """Row lists of the positive entries of ``pre``.

    Args:
      pre: [M, F] gate pre-activation (bf16 or f32); F % tile_width == 0 (the caller pads).
      tile_width: T, the TwELL tile width (counts are per T columns).
      num_slots: K, list entries kept per row.
      config: ``default_row_pack_config`` when None; chunk must divide F, block_m must divide M.
    Returns:
      values [M, K] pre.dtype, columns [M, K] int32 (valid for k < min(row_total, K), column
      order), counts [M, F / T] int32, row_total [M] int32.
    """
    m, f = check_dense_tiles(pre, tile_width, 1)
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
    config = default_row_pack_config(m, f, tile_width) if config is None else config
    if config.chunk % tile_width or f % config.chunk:
        raise ValueError(f"chunk={config.chunk} must be a multiple of tile_width={tile_width} "
                         f"dividing F={f}")
    if m % config.block_m:
        raise ValueError(f"M={m} is not a multiple of block_m={config.block_m}")
    kernel = functools.partial(
        _row_pack_kernel, block_m=config.block_m, chunk=config.chunk,
        num_chunks=f // config.chunk, tile_width=tile_width, num_slots=num_slots)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, num_slots), pre.dtype),
            jax.ShapeDtypeStruct((m, num_slots), jnp.int32),
            jax.ShapeDtypeStruct((m, f // tile_width), jnp.int32),
            jax.ShapeDtypeStruct((m,), jnp.int32),
        ),
        grid=(m // config.block_m,),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_row_pack",
    )(pre)


def row_pack_reference(pre: jax.Array, *, tile_width: int, num_slots: int):
    """Plain-jnp :func:`row_pack` (entries past a row's list are zero here)."""
    m, f = check_dense_tiles(pre, tile_width, 1)
    gate = pre.astype(jnp.float32)
    positive = jnp.logical_not(gate <= 0.0)
    rank = jnp.cumsum(positive, axis=1, dtype=jnp.int32) - 1
    dest = jnp.where(positive & (rank < num_slots), rank, num_slots)  # num_slots = dropped
    rows = jnp.broadcast_to(jnp.arange(m)[:, None], (m, f))
    cols = jnp.broadcast_to(jnp.arange(f, dtype=jnp.int32)[None, :], (m, f))
    values = jnp.zeros((m, num_slots), pre.dtype).at[rows, dest].set(
        gate.astype(pre.dtype), mode="drop")
    columns = jnp.zeros((m, num_slots), jnp.int32).at[rows, dest].set(cols, mode="drop")
    counts = positive.reshape(m, f // tile_width, tile_width).sum(axis=2, dtype=jnp.int32)
    return values, columns, counts, positive.sum(axis=1, dtype=jnp.int32)
