"""The FFN's up/down projections on row lists, one program per token row.

For each row m and each valid entry k < row_nnz[m] (j = columns[m, k], g = gate_values[m, k]):

    gated:      u[m, k] = x[m] . w_up_t[j]   (fp32);   y[m] += (g * u[m, k]) * w_down[j]
    non-gated:                                           y[m] += g * w_down[j]

and the row's L1 statistic l1[m] = sum_k |h| (h = g * u[m, k], or g), from the same loop.

``w_up_t`` is stored feature-major ([F, D]: row j holds unit j's up weights), so each entry reads
one contiguous D-row of each weight; the dense hidden h is never formed. Entries k >= row_nnz[m]
are never read.

Why one program per row (grid M): each program's work is proportional to its own row's count (no
block-level maximum, no masked lanes), the x row and the fp32 output row stay in registers for
the whole loop, and the up dot is one reduction per entry instead of one per row block and D
chunk. On the H100 this reads the gathered weight rows at ~6 TB/s (L2 hits), against ~4 TB/s for
row-block kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (check_config, check_up_inputs, largest_pow2_divisor,
                                   next_pow2, resolve_interpret)


def _row_up_down_kernel(*refs, block_d: int, num_chunks: int, num_slots: int, up_width: int,
                        gated: bool):
    """One program: row ``program_id(0)``, all D columns.

    Refs (whole arrays): [x [M, D'], w_up_t [F, D]] (gated only; x's columns past D are not
    read), w_down [F, D],
    gate_values [M, K], columns [M, K] int32, row_nnz [M] int32; outputs y [M, D], l1 [M]
    float32 and, gated only, up [M, up_width] float32.
    """
    if gated:
        x_ref, w_up_ref, w_down_ref, g_ref, columns_ref, nnz_ref, y_ref, l1_ref, up_ref = refs
    else:
        w_down_ref, g_ref, columns_ref, nnz_ref, y_ref, l1_ref = refs
    row = pl.program_id(0)
    nnz = jnp.clip(nnz_ref[row], 0, num_slots)
    chunks = [pl.ds(c * block_d, block_d) for c in range(num_chunks)]
    slot = jax.lax.broadcasted_iota(jnp.int32, (up_width,), 0)
    if gated:
        x_chunks = [x_ref[row, ch].astype(jnp.float32) for ch in chunks]

    def step(k, carry):
        accs, ups, l1 = carry
        j = columns_ref[row, k]
        h = g_ref[row, k].astype(jnp.float32)
        # The w_down row is loaded before the up product's reduction (which synchronises the
        # warps), so its read overlaps the w_up row's: one memory latency per entry, not two
        # (it saved ~5% of the kernel's time on the H100 at M = 16384).
        w_down_row = [w_down_ref[j, ch] for ch in chunks]
        if gated:
            # Sum the chunks' products first: one cross-thread reduction per entry.
            prod = x_chunks[0] * w_up_ref[j, chunks[0]].astype(jnp.float32)
            for c in range(1, num_chunks):
                prod = prod + x_chunks[c] * w_up_ref[j, chunks[c]].astype(jnp.float32)
            u = jnp.sum(prod)
            ups = jnp.where(slot == k, u, ups)
            h = h * u
        accs = tuple(acc + h * w.astype(jnp.float32) for acc, w in zip(accs, w_down_row))
        return accs, ups, l1 + jnp.abs(h)

    zeros = tuple(jnp.zeros((block_d,), jnp.float32) for _ in chunks)
    accs, ups, l1 = jax.lax.fori_loop(
        0, nnz, step, (zeros, jnp.zeros((up_width,), jnp.float32), jnp.float32(0.0)))
    for acc, ch in zip(accs, chunks):
        y_ref[row, ch] = acc.astype(y_ref.dtype)
    l1_ref[row] = l1
    if gated:
        up_ref[row, :] = ups  # 0 past row_nnz


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowUpDownConfig:
    """Knobs of :func:`row_up_down`.

    Attributes:
      block_d: D chunk width (power of two); the wrapper's caller pads D to a multiple of it.
        The whole row lives in registers as D / block_d chunks.
      num_warps: Triton warps per program (one row).
      num_stages: Triton pipelining stages of the entry loop.
    """

    block_d: int = 2048
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_config(self, ("block_d", "num_warps"))


def default_row_up_down_config(d: int) -> RowUpDownConfig:
    """Knobs for rows of ``d`` features: the widest power-of-two chunk (<= 2048) dividing D,
    and one warp per 512 features (16 fp32 values of x and of the accumulator per thread).

    H100, M = 16384, 28 entries per row: D = 2048: 4 warps 0.73
    ms, 8 warps 0.83, 2 warps 1.03, 1 warp 0.83; 1024-wide chunks 0.76. D = 4096: 8 warps
    6.49 ms, 4 warps 6.67 (71 entries per row). Prefetching the next entry's rows into
    registers (software pipelining by hand) was slower: 0.72 ms at D = 2048."""
    return RowUpDownConfig(block_d=largest_pow2_divisor(d, 2048),
                           num_warps=max(1, min(8, d // 512)))


def _check_args(x, w_up_t, w_down, gate_values, columns, row_nnz, gated: bool):
    if w_down.ndim != 2:
        raise ValueError(f"w_down must be 2-D [F, D], got shape {w_down.shape}")
    f, d = w_down.shape
    if gate_values.ndim != 2 or columns.shape != gate_values.shape:
        raise ValueError(f"gate_values {gate_values.shape} and columns {columns.shape} must "
                         f"both be (M, K)")
    m, k = gate_values.shape
    if row_nnz.shape != (m,):
        raise ValueError(f"row_nnz has shape {row_nnz.shape}, expected ({m},)")
    if columns.dtype != jnp.int32 or row_nnz.dtype != jnp.int32:
        raise ValueError(f"columns and row_nnz must be int32, got {columns.dtype} and "
                         f"{row_nnz.dtype}")
    check_up_inputs(x, w_up_t, m, f, d, gated, wide_x=True)
    return m, k, d


def row_up_down(
    x: jax.Array | None,
    w_up_t: jax.Array | None,
    w_down: jax.Array,
    gate_values: jax.Array,
    columns: jax.Array,
    row_nnz: jax.Array,
    *,
    out_dtype=None,
    config: RowUpDownConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Gated (x and w_up_t given) or non-gated (both None) up/down projection on row lists.

    Args:
      x: [M, D'] (D' >= D: the columns past D are not read, so x may be the gate GEMM's
        operand with the folded bias's column, ``twell_jax.dense.with_bias_column``) or None.
        w_up_t: [F, D] or None. w_down: [F, D].
      gate_values: [M, K] (any float dtype): g, or the hidden values h when non-gated.
      columns: [M, K] int32 in [0, F) for valid entries.
      row_nnz: [M] int32; entries k < min(row_nnz[m], K) are used, the rest never read.
      out_dtype: dtype of y (default: x's, or w_down's when non-gated).
      config: ``default_row_up_down_config(D)`` when None; D % block_d == 0 (the caller pads).
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      ``(y [M, D], up [M, K] float32 or None, l1 [M] float32)``: up holds u at valid entries
      and 0 elsewhere (gated only; the training backward uses it); l1 is each row's
      ``sum_k |h|`` over its valid entries, h = g * u (gated) or g: the L1 statistic.
    """
    gated = x is not None
    m, k, d = _check_args(x, w_up_t, w_down, gate_values, columns, row_nnz, gated)
    config = default_row_up_down_config(d) if config is None else config
    block_d = config.block_d
    if d % block_d:
        raise ValueError(f"D={d} is not a multiple of block_d={block_d}")
    out_dtype = jnp.dtype(out_dtype or (x.dtype if gated else w_down.dtype))
    up_width = next_pow2(max(k, 1))  # a register vector needs a power-of-two length
    kernel = functools.partial(_row_up_down_kernel, block_d=block_d, num_chunks=d // block_d,
                               num_slots=k, up_width=up_width,
                               gated=gated)
    out_shape = [jax.ShapeDtypeStruct((m, d), out_dtype),
                 jax.ShapeDtypeStruct((m,), jnp.float32)]
    inputs = (x, w_up_t) if gated else ()
    if gated:
        out_shape.append(jax.ShapeDtypeStruct((m, up_width), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(m,),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_row_up_down",
    )(*inputs, w_down, gate_values, columns, row_nnz)
    if gated:
        return outs[0], outs[2][:, :k], outs[1]
    return outs[0], None, outs[1]


def row_up_down_reference(
    x: jax.Array | None,
    w_up_t: jax.Array | None,
    w_down: jax.Array,
    gate_values: jax.Array,
    columns: jax.Array,
    row_nnz: jax.Array,
    *,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Plain-jnp :func:`row_up_down` (same arguments and outputs), one slot at a time."""
    gated = x is not None
    m, k, d = _check_args(x, w_up_t, w_down, gate_values, columns, row_nnz, gated)
    out_dtype = jnp.dtype(out_dtype or (x.dtype if gated else w_down.dtype))
    nnz = jnp.clip(row_nnz, 0, k)
    if gated:
        x = x[:, :d]

    def step(kk, carry):
        y, up, l1 = carry
        valid = kk < nnz
        j = jnp.where(valid, columns[:, kk], 0)
        h = jnp.where(valid, gate_values[:, kk].astype(jnp.float32), 0.0)
        if gated:
            u = jnp.sum(x.astype(jnp.float32) * w_up_t[j].astype(jnp.float32), axis=1)
            u = jnp.where(valid, u, 0.0)
            up = up.at[:, kk].set(u)
            h = h * u
        return y + h[:, None] * w_down[j].astype(jnp.float32), up, l1 + jnp.abs(h)

    init = (jnp.zeros((m, d), jnp.float32), jnp.zeros((m, k), jnp.float32),
            jnp.zeros((m,), jnp.float32))
    y, up, l1 = jax.lax.fori_loop(0, jnp.max(nnz, initial=0), step, init)
    return y.astype(out_dtype), (up if gated else None), l1
