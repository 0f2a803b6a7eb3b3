"""Transposed sparse products (the backward's dW): ``out_i[f] = sum_{(m, k): columns[m, k] = f} values_i[m, k] * b[m]``.

The left operand is the row-compacted TwELL list (entries k < row_nnz[m] of
row m are valid; the rest are ignored whatever they hold), transposed: dW_down = h^T @ dy,
dW_gate = dg^T @ x and dW_up = du^T @ x. Several values arrays that share the pattern and b
(dg and du against x) are summed in one pass, so each gathered row of b serves all of them.

A column-major view is built on the device first (``column_view``): the valid entries sorted by
column with XLA's sort (invalid ones keyed F, so they sort last), per-column start offsets and
counts (a binary search on the sorted keys). The kernel then gathers rows with the roles of
rows and units swapped: grid (F / block_f,
D / block_d); each program owns block_f output rows (units) x block_d features, loops k up to
the largest count among its units, and at each step gathers, for each unit, the row of b named
by its k-th entry (block_d contiguous elements: coalesced) times that entry's values, in fp32.
Deterministic (no atomics). Units of one program with fewer entries idle (masked) for the
remaining steps: skew across units costs time, not correctness. (An fp32-atomic variant
without the sort took 14.9 ms against 4.4 ms for the whole FFN forward + backward on the H100,
and a dense GEMM on the scattered values 4.8 ms: BENCHMARKS.md.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_config, largest_pow2_divisor, resolve_interpret


def _sparse_outer_kernel(starts_ref, counts_ref, rows_ref, *refs, block_f: int, block_d: int,
                         n_values: int, transposed: bool):
    """One program: units [i * block_f, +block_f) x features [j * block_d, +block_d).

    Refs (whole arrays): starts [F], counts [F] int32; rows [E] int32 (entry rows sorted by
    unit); n_values sorted values [E]; b [M, D]; then n_values outputs [F, D] float32 ([D, F]
    when ``transposed``).
    """
    values_refs = refs[:n_values]
    b_ref = refs[n_values]
    out_refs = refs[n_values + 1:]
    i = pl.program_id(0)
    j = pl.program_id(1)
    unit0 = pl.multiple_of(i * block_f, block_f)
    col0 = pl.multiple_of(j * block_d, block_d)
    units = pl.ds(unit0, block_f)
    starts = starts_ref[units]
    counts = counts_ref[units]
    dcols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)

    def step(k, accs):
        valid = k < counts
        entry = jnp.where(valid, starts + k, 0)
        row = plgpu.load(rows_ref.at[entry], mask=valid, other=0)
        bmask = jnp.broadcast_to(valid[:, None], (block_f, block_d))
        b_rows = plgpu.load(b_ref.at[row[:, None], dcols], mask=bmask, other=0)
        b_rows = b_rows.astype(jnp.float32)
        out = []
        for acc, v_ref in zip(accs, values_refs):
            v = plgpu.load(v_ref.at[entry], mask=valid, other=0).astype(jnp.float32)
            out.append(acc + v[:, None] * b_rows)
        return tuple(out)

    zeros = tuple(jnp.zeros((block_f, block_d), jnp.float32) for _ in range(n_values))
    accs = jax.lax.fori_loop(0, jnp.max(counts), step, zeros)
    for acc, o_ref in zip(accs, out_refs):
        if transposed:  # block_f contiguous units per feature row: the store is still wide
            o_ref[pl.ds(col0, block_d), units] = acc.T
        else:
            o_ref[units, pl.ds(col0, block_d)] = acc


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseOuterConfig:
    """Block sizes and Triton knobs of :func:`sparse_outer`.

    Attributes:
      block_f: units (output rows) per program (power of two).
      block_d: output features per program (power of two): the gathered segment of each b row.
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the k loop.
    """

    block_f: int = 16
    block_d: int = 512
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_config(self, ("block_f", "block_d", "num_warps"))


def default_sparse_outer_config(f: int, d: int, n_values: int = 1) -> SparseOuterConfig:
    """16 units x 512 features, 4 warps, for one values array; 256 features for two or more
    (one float32 accumulator tile per array: the same registers per program). Measured on
    the H100 (BENCHMARKS.md, run 25; M = 16384, 28 entries per row, D = 2048, F = 5632): one
    array 0.93 ms (8 warps 1.01, 256 features 1.15), two arrays transposed 1.12 ms (512
    features 1.28). Blocks shrink to the largest power of two dividing f / d."""
    return SparseOuterConfig(block_f=largest_pow2_divisor(f, 16),
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
    keys = jnp.where(valid & (columns >= 0) & (columns < d_ff), columns, d_ff).reshape(-1)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    # Each column's extent in the sorted keys (a binary search, no scatter-add: a hot column
    # would serialise the atomic adds).
    edges = jnp.searchsorted(keys[order], jnp.arange(d_ff + 1, dtype=keys.dtype),
                             side="left").astype(jnp.int32)
    return order, edges[:-1], edges[1:] - edges[:-1]


def sparse_outer(
    values: tuple[jax.Array, ...],
    columns: jax.Array,
    row_nnz: jax.Array,
    b: jax.Array,
    d_ff: int,
    *,
    config: SparseOuterConfig | None = None,
    transposed: bool = False,
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
      transposed: write each output as [D, d_ff] (dW of a weight stored [D, F]: the
        kernel stores its tiles transposed instead of XLA transposing the result, a
        ~90 us copy per output at D = 2048, F = 5632 on the H100).
      interpret: run the Pallas interpreter (None: iff no GPU).

    Returns:
      A tuple of [d_ff, D] float32 ([D, d_ff] when ``transposed``), one per values array.
    """
    m, k, d = _check_args(values, columns, row_nnz, b, d_ff)
    if config is None:
        config = default_sparse_outer_config(d_ff, d, len(values))
    if d_ff % config.block_f:
        raise ValueError(f"d_ff={d_ff} is not a multiple of block_f={config.block_f}")
    if d % config.block_d:
        raise ValueError(f"D={d} is not a multiple of block_d={config.block_d}")
    order, starts, counts = column_view(columns, jnp.minimum(row_nnz, k), d_ff)
    rows = order // k
    sorted_values = [v.reshape(-1)[order] for v in values]
    kernel = functools.partial(_sparse_outer_kernel, block_f=config.block_f,
                               block_d=config.block_d, n_values=len(values),
                               transposed=transposed)
    shape = (d, d_ff) if transposed else (d_ff, d)
    out = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for _ in values],
        grid=(d_ff // config.block_f, d // config.block_d),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_sparse_outer",
    )(starts, counts, rows, *sorted_values, b)
    return tuple(out)


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
