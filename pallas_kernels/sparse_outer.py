"""Transposed sparse products (the backward's dW): ``out_i[f] = sum_{(m, k): columns[m, k] = f} values_i[m, k] * b[m]``.

The left operand is the row-compacted TwELL list (entries k < row_nnz[m] of
row m are valid; the rest are ignored whatever they hold), transposed: dW_down = h^T @ dy,
dW_gate = dg^T @ x and dW_up = du^T @ x. Several values arrays that share the pattern and b
(dg and du against x) are summed in one pass, so each gathered row of b serves all of them.

A column-major view is built on the device first (``column_view``): the valid entries sorted by
column with XLA's sort (invalid ones keyed F, so they sort last), per-column start offsets and
counts (a binary search on the sorted keys). Each unit's column is then cut into pieces of at
most ``max(min_piece, 2 E / F)`` entries (``column_pieces``; E the valid entries), so a unit
active on half the tokens, as the busiest units of trained models are, is shared by many
programs instead of serialising one: with one program per unit it took 6-8 ms on the H100
where the whole dense FFN forward + backward takes 4.4. The kernel
gathers rows with the roles of rows and units swapped: grid (pieces / block_f, D / block_d);
each program owns block_f pieces x block_d features, loops over its longest piece, and at
each step gathers, for each piece, the rows of b named by its next ``unroll`` entries
(block_d contiguous elements each: coalesced) times those entries' values, in fp32. The
first F pieces are the units' first pieces, stored as their output rows; the later pieces of
busy units store partial sums, which a second small kernel adds to their units' rows in
piece order. Deterministic (no atomics). (An fp32-atomic variant without the sort took
14.9 ms against 4.4 ms for the whole FFN forward + backward on the H100, and a dense GEMM on
the scattered values 4.8 ms.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_config, largest_pow2_divisor, resolve_interpret


def _sparse_outer_kernel(skip_ref, start_ref, size_ref, rows_ref, *refs, block_f: int,
                         block_d: int, n_values: int, unit_blocks: int, unroll: int):
    """One program: pieces [i * block_f, +block_f) x features [j * block_d, +block_d).

    Pieces [0, F) are the units' first pieces: programs i < ``unit_blocks`` store their tiles
    as those units' output rows. Later pieces are the rest of the busy units' columns: those
    programs store partial sums, one row per piece (``_add_pieces_kernel`` adds them).

    Refs (whole arrays): skip [1] int32 (non-zero: store nothing); per piece its first
    sorted entry and size [P] int32; rows [E] int32 (entry rows sorted by unit); n_values
    sorted values [E]; b [M, D]; then n_values outputs [F, D] float32 and n_values partial
    sums [P - F, D] float32.
    Each loop step takes ``unroll`` entries of every piece, their loads issued together: more
    gathers in flight per program (faster on the H100).
    """
    values_refs = refs[:n_values]
    b_ref = refs[n_values]
    out_refs = refs[n_values + 1:2 * n_values + 1]
    partial_refs = refs[2 * n_values + 1:]
    i = pl.program_id(0)
    piece0 = pl.multiple_of(i * block_f, block_f)
    col0 = pl.multiple_of(pl.program_id(1) * block_d, block_d)
    pieces = pl.ds(piece0, block_f)
    starts = start_ref[pieces]
    sizes = size_ref[pieces]
    dcols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)

    def step(s, accs):
        ks = [s * unroll + u for u in range(unroll)]
        valids = [k < sizes for k in ks]
        entries = [jnp.where(valid, starts + k, 0) for valid, k in zip(valids, ks)]
        rows = [plgpu.load(rows_ref.at[e], mask=valid, other=0)
                for e, valid in zip(entries, valids)]
        b_tiles = [plgpu.load(b_ref.at[row[:, None], dcols],
                              mask=jnp.broadcast_to(valid[:, None], (block_f, block_d)),
                              other=0)
                   for row, valid in zip(rows, valids)]
        out = list(accs)
        for entry, valid, b_tile in zip(entries, valids, b_tiles):
            b_tile = b_tile.astype(jnp.float32)
            for n, v_ref in enumerate(values_refs):
                v = plgpu.load(v_ref.at[entry], mask=valid, other=0).astype(jnp.float32)
                out[n] = out[n] + v[:, None] * b_tile
        return tuple(out)

    zeros = tuple(jnp.zeros((block_f, block_d), jnp.float32) for _ in range(n_values))
    skip = skip_ref[0] != 0
    longest = jnp.where(skip, 0, jnp.max(sizes))
    accs = jax.lax.fori_loop(0, (longest + unroll - 1) // unroll, step, zeros)
    features = pl.ds(col0, block_d)

    @pl.when((i < unit_blocks) & jnp.logical_not(skip))
    def _():
        for acc, o_ref in zip(accs, out_refs):
            o_ref[pieces, features] = acc

    # Later pieces: partial sums, stored only by a block that holds some (most blocks are
    # padding: the rows are allocated for F / 2 later pieces; the piece-adding kernel reads
    # only real pieces' rows, so the padding's rows are never written nor read).
    @pl.when((i >= unit_blocks) & (longest > 0))
    def _():
        rows = pl.ds(pl.multiple_of(piece0 - unit_blocks * block_f, block_f), block_f)
        for acc, p_ref in zip(accs, partial_refs):
            p_ref[rows, features] = acc


def _add_pieces_kernel(busy_ref, first_ref, count_ref, *refs, block_h: int, block_d: int,
                       n_values: int, d_ff: int):
    """One program: busy units [i * block_h, +block_h) x features [j * block_d, +block_d):
    each unit's output row += its later pieces' partial sums, in piece order.

    Refs: busy units [H] int32 (``d_ff`` past the real ones); each unit's first later piece
    (a partial-sum row) and their count [F] int32; n_values partial sums [P - F, D]; the
    n_values outputs as inputs, then as outputs (aliased).
    """
    partial_refs = refs[:n_values]
    in_refs = refs[n_values:2 * n_values]
    out_refs = refs[2 * n_values:]
    col0 = pl.multiple_of(pl.program_id(1) * block_d, block_d)
    units = busy_ref[pl.ds(pl.multiple_of(pl.program_id(0) * block_h, block_h), block_h)]
    ok = units < d_ff
    safe = jnp.where(ok, units, 0)
    first = plgpu.load(first_ref.at[safe], mask=ok, other=0)
    count = plgpu.load(count_ref.at[safe], mask=ok, other=0)
    dcols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
    mask = jnp.broadcast_to(ok[:, None], (block_h, block_d))
    # Masked lanes aim out of range too: the interpreter applies masked scatters everywhere.
    rows = jnp.where(ok, units, d_ff)
    at = lambda ref: ref.at[rows[:, None], dcols]
    accs = tuple(plgpu.load(at(r), mask=mask, other=0.0) for r in in_refs)

    def step(k, accs):
        valid = k < count
        piece = jnp.where(valid, first + k, 0)
        pmask = jnp.broadcast_to(valid[:, None], (block_h, block_d))
        return tuple(acc + plgpu.load(p_ref.at[piece[:, None], dcols], mask=pmask, other=0.0)
                     for acc, p_ref in zip(accs, partial_refs))

    accs = jax.lax.fori_loop(0, jnp.max(count), step, accs)
    for acc, o_ref in zip(accs, out_refs):
        plgpu.store(at(o_ref), acc, mask=mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseOuterConfig:
    """Block sizes and Triton knobs of :func:`sparse_outer`.

    Attributes:
      block_f: units (output rows) per program (power of two).
      block_d: output features per program (power of two): the gathered segment of each b row.
      num_warps: Triton warps per program.
      min_piece: the shortest piece a unit's column is cut into (entries; the length is
        ``max(min_piece, 2 * entries / F)``, so a column no busier than twice the mean is one
        piece).
      unroll: entries of each piece per loop step (their row and b loads issued together).
    """

    block_f: int = 8
    block_d: int = 512
    num_warps: int = 8
    min_piece: int = 64
    unroll: int = 2

    def __post_init__(self):
        check_config(self, ("block_f", "block_d", "num_warps"))
        for name in ("min_piece", "unroll"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def default_sparse_outer_config(f: int, d: int, n_values: int = 1) -> SparseOuterConfig:
    """8 units x 512 features, 8 warps, 2 entries of each unit a step, for one values array;
    256 features for two or more (one float32 accumulator tile per array). Measured on the
    H100 (M = 16384, D = 2048, F = 5632, 28 entries per row, each call with its column
    sort; the two-array outputs then stored [D, F]): two arrays 0.53 ms against 0.72 for 16 x
    256, 4-warp, one-entry blocks (0.57-0.60 with 8 units or 8 warps or two entries alone),
    one array 0.45 against 0.51; smaller gains on the trained model's counts.
    Blocks shrink to the largest power of two dividing f / d."""
    return SparseOuterConfig(block_f=largest_pow2_divisor(f, 8),
                             block_d=largest_pow2_divisor(d, 512 if n_values == 1 else 256))


def _check_args(values, columns, row_nnz, b, d_ff):
    if not isinstance(values, tuple) or not values:
        raise ValueError("values must be a non-empty tuple of [M, K] arrays")
    if columns.ndim != 2 or any(v.shape != columns.shape for v in values):
        raise ValueError(f"values and columns must be 2-D of one shape, got "
                         f"{[v.shape for v in values]} and {columns.shape}")
    m, k = columns.shape
    if row_nnz.shape != (m,):
        raise ValueError(f"row_nnz has shape {row_nnz.shape}, expected ({m},)")
    if columns.dtype != jnp.int32 or row_nnz.dtype != jnp.int32:
        raise ValueError(f"columns and row_nnz must be int32, got {columns.dtype} and "
                         f"{row_nnz.dtype}")
    if b.ndim != 2 or b.shape[0] != m:
        raise ValueError(f"b must be [M={m}, D], got shape {b.shape}")
    if not isinstance(d_ff, int) or d_ff <= 0:
        raise ValueError(f"d_ff must be a positive int, got {d_ff!r}")
    return m, k, b.shape[1]


def column_view(columns: jax.Array, row_nnz: jax.Array, d_ff: int):
    """The pattern sorted by column: ``(order [M * K], starts [d_ff], counts [d_ff])``.

    ``order`` lists flat entry indices (m * K + k) grouped by column, valid entries first in
    column order (stable: rows ascending within a column), invalid ones last; column f's
    entries are ``order[starts[f] : starts[f] + counts[f]]``. Columns outside [0, d_ff) of
    valid entries are dropped (they are invalid input).
    """
    m, k = columns.shape
    valid = jnp.arange(k, dtype=jnp.int32)[None, :] < row_nnz[:, None]
    # 16-bit keys where F allows (F < 2^16 - 1, every FFN here): a radix sort then takes half
    # the passes of a 32-bit one.
    key_dtype = jnp.uint16 if d_ff < jnp.iinfo(jnp.uint16).max else jnp.int32
    keys = jnp.where(valid & (columns >= 0) & (columns < d_ff), columns, d_ff)
    keys = keys.reshape(-1).astype(key_dtype)
    # The stable sort of (key, entry) pairs returns the sorted keys too: no gather for them.
    sorted_keys, order = jax.lax.sort((keys, jnp.arange(m * k, dtype=jnp.int32)), num_keys=1,
                                      is_stable=True)
    # Each column's extent in the sorted keys: a binary search (no scatter-add: a hot column
    # would serialise the atomic adds), unrolled (the default search is a while loop, which on
    # a GPU waits on the host at each of its ~21 steps).
    edges = jnp.searchsorted(sorted_keys, jnp.arange(d_ff + 1, dtype=key_dtype),
                             side="left", method="scan_unrolled").astype(jnp.int32)
    return order, edges[:-1], edges[1:] - edges[:-1]


class ColumnPieces(NamedTuple):
    """Each unit's column of sorted entries cut into pieces of at most ``length`` entries: the
    kernel's work items.

    Per piece [P] int32: ``start`` (first sorted entry) and ``size`` (entries). Pieces [0, F)
    are the units' first pieces (empty for an idle unit); the later ones, from F on, hold the
    rest of the busy units' columns, unit by unit (size 0 past the real ones). Per unit [F]
    int32: ``later_first``, its first later piece counted from F, and ``later_count``. ``busy``
    [H] int32: the units with later pieces, ascending, F past them. ``length``: a scalar.
    """

    start: jax.Array
    size: jax.Array
    later_first: jax.Array
    later_count: jax.Array
    busy: jax.Array
    length: jax.Array


def max_later_pieces(d_ff: int) -> int:
    """Static bound on the later pieces (and busy units) of ``column_pieces``: pieces of at
    least 2 E / F entries leave at most E / (2 E / F) = F / 2 of them."""
    return max(1, d_ff // 2)


def column_pieces(starts: jax.Array, counts: jax.Array, min_piece: int,
                  padded: int | None = None) -> ColumnPieces:
    """Cuts the column view (``column_view``'s starts and counts [F]) into pieces of
    ``max(min_piece, ceil(2 E / F))`` entries, E the valid entries: a busy unit (one active on
    many tokens, common in trained models) is then shared by several programs instead of
    serialising one. ``padded``: the number of later pieces and busy units to allocate, at
    least ``max_later_pieces(F)``."""
    d_ff = counts.shape[0]
    n_later = padded or max_later_pieces(d_ff)
    entries = jnp.sum(counts)
    length = jnp.maximum(min_piece, (2 * entries + d_ff - 1) // d_ff).astype(jnp.int32)
    later_count = jnp.maximum(0, (counts + length - 1) // length - 1).astype(jnp.int32)
    end = jnp.cumsum(later_count)
    later_first = (end - later_count).astype(jnp.int32)
    later = jnp.arange(n_later, dtype=jnp.int32)
    unit = jnp.searchsorted(end, later, side="right",  # F past the last
                            method="scan_unrolled").astype(jnp.int32)
    safe = jnp.minimum(unit, d_ff - 1)
    offset = (later - later_first[safe] + 1) * length
    size = jnp.where(unit < d_ff, jnp.clip(counts[safe] - offset, 0, length), 0)
    busy = jnp.nonzero(later_count > 0, size=n_later, fill_value=d_ff)[0].astype(jnp.int32)
    return ColumnPieces(
        start=jnp.concatenate([starts, starts[safe] + offset]).astype(jnp.int32),
        size=jnp.concatenate([jnp.minimum(counts, length), size]).astype(jnp.int32),
        later_first=later_first, later_count=later_count, busy=busy, length=length)


def sparse_outer(
    values: tuple[jax.Array, ...],
    columns: jax.Array,
    row_nnz: jax.Array,
    b: jax.Array,
    d_ff: int,
    *,
    config: SparseOuterConfig | None = None,
    skip: jax.Array | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, ...]:
    """Transposed products of a row-compacted pattern with a dense b.

    Args:
      values: tuple of [M, K] arrays (bf16 or f32) sharing the pattern.
      columns: [M, K] int32 (valid entries in [0, d_ff)).
      row_nnz: [M] int32; entries k < min(row_nnz[m], K) of row m are used.
      b: [M, D] (bf16 or f32).
      d_ff: F, the number of output rows.
      config: block sizes; ``default_sparse_outer_config`` when None. Requires
        d_ff % block_f == 0 and D % block_d == 0 (the caller pads).
      skip: optional [] bool, read on the device: when true the kernels store nothing and
        the outputs are unspecified, for a caller that will discard them (the FFN's backward
        of a batch that went dense). Writing zeros there would cost a pass over every
        output: 3 x 235 MB at F = 14336, D = 4096.
      interpret: run the Pallas interpreter (None: iff no GPU).

    Returns:
      A tuple of [d_ff, D] float32, one per values array (the gradient of a weight stored
      [F, D], one row per unit, as every FFN weight is: ``twell_jax.layout``).
    """
    m, k, d = _check_args(values, columns, row_nnz, b, d_ff)
    if config is None:
        config = default_sparse_outer_config(d_ff, d, len(values))
    if d_ff % config.block_f:
        raise ValueError(f"d_ff={d_ff} is not a multiple of block_f={config.block_f}")
    if d % config.block_d:
        raise ValueError(f"D={d} is not a multiple of block_d={config.block_d}")
    block_f, block_d, n = config.block_f, config.block_d, len(values)
    order, starts, counts = column_view(columns, jnp.minimum(row_nnz, k), d_ff)
    n_later = -(-max_later_pieces(d_ff) // block_f) * block_f
    pieces = column_pieces(starts, counts, config.min_piece, n_later)
    rows = order // k
    sorted_values = [v.reshape(-1)[order] for v in values]
    shape = (d_ff, d)
    # One stage: Triton's pipelining of the k loop gained nothing (2 stages: the same times
    # on the H100); the loop's loads are data-dependent gathers.
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)
    interpret = resolve_interpret(interpret)
    out = pl.pallas_call(
        functools.partial(_sparse_outer_kernel, block_f=block_f, block_d=block_d, n_values=n,
                          unit_blocks=d_ff // block_f,
                          unroll=config.unroll),
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for _ in values]
        + [jax.ShapeDtypeStruct((n_later, d), jnp.float32) for _ in values],
        grid=((d_ff + n_later) // block_f, d // block_d),
        compiler_params=params,
        interpret=interpret,
        name="twell_sparse_outer",
    )(jnp.reshape(jnp.asarray(False if skip is None else skip, jnp.int32), (1,)),
      pieces.start, pieces.size, rows, *sorted_values, b)
    results, partials = out[:n], out[n:]
    # The busy units' rows: their first piece's sum plus their later pieces' partial sums.
    return tuple(pl.pallas_call(
        functools.partial(_add_pieces_kernel, block_h=block_f, block_d=block_d, n_values=n,
                          d_ff=d_ff),
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for _ in values],
        grid=(n_later // block_f, d // block_d),
        input_output_aliases={3 + n + i: i for i in range(n)},
        compiler_params=params,
        interpret=interpret,
        name="twell_sparse_outer_add_pieces",
    )(pieces.busy, pieces.later_first, pieces.later_count, *partials, *results))


def sparse_outer_reference(
    values: tuple[jax.Array, ...],
    columns: jax.Array,
    row_nnz: jax.Array,
    b: jax.Array,
    d_ff: int,
) -> tuple[jax.Array, ...]:
    """Plain-jnp :func:`sparse_outer`: a loop over k scatter-adding [M, D] slabs (fp32)."""
    _, k, d = _check_args(values, columns, row_nnz, b, d_ff)
    b32 = b.astype(jnp.float32)
    nnz = jnp.clip(row_nnz, 0, k)

    def body(kk, outs):
        ok = kk < nnz
        dest = jnp.where(ok, columns[:, kk], d_ff)  # d_ff = dropped
        return tuple(
            out.at[dest].add(jnp.where(ok, v[:, kk].astype(jnp.float32), 0.0)[:, None] * b32,
                             mode="drop")
            for out, v in zip(outs, values))

    init = tuple(jnp.zeros((d_ff, d), jnp.float32) for _ in values)
    return jax.lax.fori_loop(0, jnp.max(nnz, initial=0), body, init)
