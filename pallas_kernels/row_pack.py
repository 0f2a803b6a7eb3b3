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
cancels most of x @ w), so there is none here.

One program per row loops over chunks of a few tiles. A chunk's positive lanes become bit masks,
one word per 32 columns (``word_bits``); popcounts give each word's first list slot, and each
round of a short loop lists the lowest set bit of every word (its column, its value read back
from ``pre``) until no word has bits left that fit the list. So a chunk stores one lane per
word, not one per column: storing a lane per column (16 predicated stores a thread a chunk,
with ~2.5 positive columns in 512) took half the kernel's time (0.186 ms against 0.089 ms on
the H100). A row at ~0.5% density takes one or two rounds a chunk; a dense one at
most ``word_bits`` a chunk, and only until its list is full. Disabled lanes are sent to index K
(out of range) so they never alias a real write (interpret mode applies masked scatters to
every lane).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_config, check_dense_tiles, resolve_interpret


def _row_pack_kernel(*refs, tiles_per_chunk: int, num_chunks: int, word_bits: int,
                     num_slots: int, has_exclude: bool):
    """One program: row ``program_id``, all its tiles in ``num_chunks`` steps; nothing at all
    when ``skip_ref[0]`` is set (the outputs are then unspecified).

    Refs: skip [1] int32; with ``has_exclude``, exclude [n_tiles, words_per_tile] int32, the
    bit masks of the columns never listed; pre [M, n_tiles, words_per_tile, word_bits] (the
    [M, F] pre-activation, reshaped); outputs values [M, K], columns [M, K] int32, counts
    [M, n_tiles] int32, row_total [M] int32.
    """
    if has_exclude:
        skip_ref, exclude_ref, pre_ref, values_ref, columns_ref, counts_ref, total_ref = refs
    else:
        skip_ref, pre_ref, values_ref, columns_ref, counts_ref, total_ref = refs
        exclude_ref = None
    row = pl.program_id(0)  # read outside the condition (the interpreter needs it so)

    @pl.when(skip_ref[0] == 0)
    def _():
        _pack_row(row, exclude_ref, pre_ref, values_ref, columns_ref, counts_ref, total_ref,
                  tiles_per_chunk=tiles_per_chunk, num_chunks=num_chunks, word_bits=word_bits,
                  num_slots=num_slots)


def _pack_row(row, exclude_ref, pre_ref, values_ref, columns_ref, counts_ref, total_ref, *,
              tiles_per_chunk, num_chunks, word_bits, num_slots):
    words_per_tile = pre_ref.shape[2]
    tile_width = words_per_tile * word_bits
    words_shape = (tiles_per_chunk, words_per_tile)
    bit = jax.lax.broadcasted_iota(jnp.int32, (*words_shape, word_bits), 2)
    tile_in_chunk = jax.lax.broadcasted_iota(jnp.int32, words_shape, 0)
    word = jax.lax.broadcasted_iota(jnp.int32, words_shape, 1)
    row_index = jnp.full(words_shape, row, jnp.int32)

    def chunk_step(c, length):
        tile0 = c * tiles_per_chunk
        gate = pre_ref[row, pl.ds(tile0, tiles_per_chunk), :, :].astype(jnp.float32)
        positive = jnp.logical_not(gate <= 0.0)  # > 0 or NaN
        # Distinct powers of two: their sum is their bitwise or (bit 31 wraps to the sign).
        masks = jnp.sum(jnp.where(positive, jnp.left_shift(1, bit), 0), axis=2)
        if exclude_ref is not None:
            masks = masks & ~exclude_ref[pl.ds(tile0, tiles_per_chunk), :]
        word_counts = jax.lax.population_count(masks)
        tile_counts = jnp.sum(word_counts, axis=1)
        counts_ref[row, pl.ds(tile0, tiles_per_chunk)] = tile_counts
        # Each word's first slot: the entries of the row before it (exclusive prefix sums).
        tile_start = jnp.cumsum(tile_counts) - tile_counts
        slot = length + tile_start[:, None] + jnp.cumsum(word_counts, axis=1) - word_counts
        tile = tile0 + tile_in_chunk

        def more(state):
            masks, slot = state
            listable = ((masks != 0) & (slot < num_slots)).astype(jnp.int32)
            # One axis at a time: Pallas' Triton lowering of a 2-D -> scalar max fails
            # under an explicit abstract mesh (jax 0.11.2; tests/test_lowering.py).
            return jnp.max(jnp.max(listable, axis=1)) > 0

        def list_lowest_bits(state):
            masks, slot = state
            lowest = masks & (-masks)
            keep = (masks != 0) & (slot < num_slots)
            position = jnp.where(keep, 31 - jax.lax.clz(lowest), 0)
            value = plgpu.load(pre_ref.at[row_index, tile, word, position], mask=keep)
            dest = jnp.where(keep, slot, num_slots)
            plgpu.store(values_ref.at[row_index, dest], value.astype(values_ref.dtype),
                        mask=keep)
            plgpu.store(columns_ref.at[row_index, dest],
                        tile * tile_width + word * word_bits + position, mask=keep)
            return masks ^ lowest, slot + (masks != 0).astype(jnp.int32)

        jax.lax.while_loop(more, list_lowest_bits, (masks, slot))
        return length + jnp.sum(tile_counts)

    total_ref[row] = jax.lax.fori_loop(0, num_chunks, chunk_step, jnp.int32(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPackConfig:
    """Knobs of :func:`row_pack`.

    Attributes:
      tiles_per_chunk: tiles per step (power of two dividing the number of tiles).
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the chunk loop.
    """

    tiles_per_chunk: int = 4
    num_warps: int = 1
    num_stages: int = 2

    def __post_init__(self):
        check_config(self, ("tiles_per_chunk", "num_warps"))


def default_row_pack_config(m: int, f: int, tile_width: int) -> RowPackConfig:
    """One warp, chunks of up to 512 columns (the most tiles, a power of two, dividing F / T).

    H100, M = 16384, F = 5632 (184 MB of bf16 pre-activations): 4 tiles of 128, 1 warp
    0.089 ms (2.1 TB/s; reading alone 0.065 ms); 3 stages 0.088; 2 tiles 0.103; 2 warps
    0.165; 4 warps 0.250."""
    del m
    n_tiles = f // tile_width
    tiles = 1
    while 2 * tiles * tile_width <= 512 and n_tiles % (2 * tiles) == 0:
        tiles *= 2
    return RowPackConfig(tiles_per_chunk=tiles, num_warps=1)


def row_pack(pre: jax.Array, *, tile_width: int, num_slots: int,
             config: RowPackConfig | None = None, interpret: bool | None = None,
             skip: jax.Array | None = None, exclude: jax.Array | None = None):
    """Row lists of the positive entries of ``pre``, leaving out the ``exclude`` columns.

    Args:
      pre: [M, F] gate pre-activation (bf16 or f32); F % tile_width == 0 (the caller pads).
      tile_width: T, the TwELL tile width (counts are per T columns).
      num_slots: K, list entries kept per row.
      config: ``default_row_pack_config`` when None; tiles_per_chunk must divide F / T.
      skip: optional [] bool on the device: when true every program returns at once and
        all four outputs are unspecified (a batch the caller already sends to the dense
        path: no pass over ``pre``).
      exclude: optional [F] bool: columns never listed nor counted (the hot units, which a
        dense GEMM computes: ``twell_jax.hot_units``).
    Returns:
      values [M, K] pre.dtype, columns [M, K] int32 (valid for k < min(row_total, K), column
      order), counts [M, F / T] int32, row_total [M] int32.
    """
    m, f = check_dense_tiles(pre, tile_width, 1)
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
    config = default_row_pack_config(m, f, tile_width) if config is None else config
    n_tiles = f // tile_width
    if n_tiles % config.tiles_per_chunk:
        raise ValueError(f"tiles_per_chunk={config.tiles_per_chunk} must divide the "
                         f"{n_tiles} tiles of F={f}")
    word_bits = min(32, tile_width)
    words_per_tile = tile_width // word_bits
    # No exclusion, no operand: XLA would build even a constant mask of zeros in a launch of
    # its own (a broadcast) on every call.
    exclusion = ()
    if exclude is not None:
        if exclude.shape != (f,):
            raise ValueError(f"exclude has shape {exclude.shape}, expected ({f},)")
        bit = jnp.arange(word_bits, dtype=jnp.int32)
        # Distinct powers of two: their sum is their bitwise or (bit 31 wraps to the sign).
        exclusion = (jnp.sum(
            jnp.where(exclude.reshape(n_tiles, words_per_tile, word_bits),
                      jnp.left_shift(1, bit), 0), axis=2, dtype=jnp.int32),)
    kernel = functools.partial(
        _row_pack_kernel, tiles_per_chunk=config.tiles_per_chunk,
        num_chunks=n_tiles // config.tiles_per_chunk, word_bits=word_bits, num_slots=num_slots,
        has_exclude=exclude is not None)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, num_slots), pre.dtype),
            jax.ShapeDtypeStruct((m, num_slots), jnp.int32),
            jax.ShapeDtypeStruct((m, n_tiles), jnp.int32),
            jax.ShapeDtypeStruct((m,), jnp.int32),
        ),
        grid=(m,),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_row_pack",
    )(jnp.reshape(jnp.asarray(False if skip is None else skip, jnp.int32), (1,)),
      *exclusion,
      pre.reshape(m, n_tiles, words_per_tile, word_bits))  # free: a view


def row_pack_reference(pre: jax.Array, *, tile_width: int, num_slots: int,
                       exclude: jax.Array | None = None):
    """Plain-jnp :func:`row_pack` (entries past a row's list are zero here)."""
    m, f = check_dense_tiles(pre, tile_width, 1)
    gate = pre.astype(jnp.float32)
    positive = jnp.logical_not(gate <= 0.0)
    if exclude is not None:
        positive = positive & ~exclude[None, :]
    rank = jnp.cumsum(positive, axis=1, dtype=jnp.int32) - 1
    dest = jnp.where(positive & (rank < num_slots), rank, num_slots)  # num_slots = dropped
    rows = jnp.broadcast_to(jnp.arange(m)[:, None], (m, f))
    cols = jnp.broadcast_to(jnp.arange(f, dtype=jnp.int32)[None, :], (m, f))
    values = jnp.zeros((m, num_slots), pre.dtype).at[rows, dest].set(
        gate.astype(pre.dtype), mode="drop")
    columns = jnp.zeros((m, num_slots), jnp.int32).at[rows, dest].set(cols, mode="drop")
    counts = positive.reshape(m, f // tile_width, tile_width).sum(axis=2, dtype=jnp.int32)
    return values, columns, counts, positive.sum(axis=1, dtype=jnp.int32)
