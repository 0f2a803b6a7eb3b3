"""The FFN's up/down projections straight from the gate pre-activation: no lists.

For each row m and each unit j with ``pre[m, j] > 0`` (NaN counts as active, so it propagates):

    gated:      y[m] += (pre[m, j] * (x[m] . w_up_t[j])) * w_down[j]      (fp32 accumulation)
    non-gated:  y[m] += pre[m, j] * w_down[j]

One program per (token row, slice of ``block_f`` columns of F): it scans its slice of the
pre-activation ``scan_width`` columns at a time and, for each active unit, reads that unit's
contiguous D-row of ``w_up_t`` and of ``w_down``. Nothing is packed or written in between,
so a call is one launch after the gate GEMM, and every row is exact whatever its count (no
capacity, no dense backup). It can also read the gate straight from ``gemv_partial_sums``'
unsummed float32 partial sums (``GatePartials``: added in order, plus the bias, rounded as
``gemv`` rounds them), so nothing runs between the two kernels. Splitting F over programs is
what makes it fast at decode sizes (M <= 64 rows): one program per row would leave most of
the GPU idle and walk a row's ~28 units one dependent weight read after another. With
several slices, each program writes its partial sum and the wrapper adds the slices in order
(deterministic); or ``scan_up_down_partial_sums`` leaves them [S, M, D] for a consumer that
adds them itself (the model's decode step: ``add_rms_norm`` adds them into the residual).
A single row has too few (row, slice) programs for a busy call, so there two programs share
each, every one writing half of D (``ScanUpDownConfig.d_splits``; both read the units' whole
w_up rows, for the up product).

Within a chunk the active units are ranked (a prefix count) and taken ``group`` at a time: the
group's rows of ``w_up_t`` and ``w_down`` are gathered as [group, D] tiles, so their reads are
in flight together. (Walking the units one at a time paid a dependent pair of ~1 us row reads
per unit, and a decode-sized call waits for its busiest program.) Busy chunks (heavy rows, or
a dense call) take the same walk: on the H100 it matched multiplying a chunk's whole
[scan_width, D] weight slabs near the design point and was 2-6x faster at 20-50% active, as
that reads every row of the slabs, one tile after another.

A busy *call* is another matter: its rows together read the weight rows of their units many
times over, where dense products read each once. With a ``DenseSwitch`` (the counts of
``gemv_with_counts``, the gate GEMV that leaves D unsplit so each program can count its
finished outputs) every program sums the counts from one small load; above the threshold no
program walks, and the programs of each slice share its units instead, computing the hidden
values of every row on the tensor cores; ``slice_down`` then multiplies them by w_down into the
same per-slice partial sums. The same launches run either way, so the choice needs no
conditional and no host round trip.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (add_in_order, block_range, check_config, check_up_inputs,
                                   finish_partial_sums, largest_pow2_divisor, next_pow2,
                                   resolve_interpret)
from pallas_kernels.slice_down import slice_down


# Unit groups of at most this many gather their w_down rows early (``_scan_up_down_kernel``).
EARLY_DOWN_MAX_GROUP = 4
# Calls of at most this many rows split F into slices of NARROW_SLICE columns: with so few
# rows, a busy call's time is set by how many programs walk its units at once.
NARROW_SLICE_MAX_ROWS = 4
NARROW_SLICE = 128
# Calls with at most this many (row, slice) programs, fewer than an H100 or H200 has SMs,
# split D over two programs per (row, slice), each walking its units in groups of
# SPLIT_D_GROUP: a busy call has twice the programs walking at once. With more, the GPU is
# already full and the split only adds a second read of each w_up row.
SPLIT_D_MAX_PROGRAMS = 128
SPLIT_D_GROUP = 8
# Pipelining stages of the scan's loops. Only a call with the dense switch can use more than
# one (its dense mode's up product streams w_up tiles; 3 stages took it from 38.7 to 32.3 us
# at one row, 64.4 to 41.4 at 64, H200, D = 2048); without the switch the walk keeps 1.
DENSE_SWITCH_STAGES = 3
# The dense mode's tiles where F / 64 gives fewer than DENSE_MODE_MIN_PROGRAMS programs (F =
# 5632: 88, fewer than the SMs): 32 units a program, and for at most WIDE_DENSE_STEP_MAX_ROWS
# rows 256-row D steps, twice the bytes in flight per stage. With more programs (F = 14336:
# 224) 64 units and 128-row steps: every program re-reads all of x, and larger tiles cost the
# walk occupancy (shared memory per program).
DENSE_MODE_MIN_PROGRAMS = 128
WIDE_DENSE_STEP = 256
WIDE_DENSE_STEP_MAX_ROWS = 8


class GatePartials(NamedTuple):
    """The gate pre-activation still as ``gemv_partial_sums``' float32 partial sums:
    ``pre = finish_partial_sums(sums, bias, dtype)``. ``scan_up_down`` adds them itself, so
    no launch sits between the gate product and the up/down at decode."""

    sums: jax.Array  # [S, M, F] float32
    bias: jax.Array | None  # [F]
    dtype: jnp.dtype  # the dtype pre is rounded to (the compute dtype)

    def pre(self) -> jax.Array:
        """The pre-activation [M, F] in ``dtype``."""
        return finish_partial_sums(self.sums, self.bias, self.dtype)


def _gate_chunk(pre_ref, bias_ref, row, col0, ok, width: int, n_parts: int, pre_dtype):
    """The gate pre-activation of ``row``, columns [col0, +width) (``ok``: inside F), as
    float32 values of ``pre_dtype``: loaded, or (``n_parts`` > 0) the GEMV's partial sums
    added in order, plus the bias, rounded once to ``pre_dtype`` as ``gemv`` rounds them."""
    cols = pl.ds(col0, width)
    if not n_parts:
        return plgpu.load(pre_ref.at[row, cols], mask=ok, other=0.0).astype(jnp.float32)
    # (A traced split index: the interpreter's masked load rejects a Python int there.)
    pre = add_in_order(
        lambda s: plgpu.load(pre_ref.at[jnp.int32(s), row, cols], mask=ok, other=0.0), n_parts)
    if bias_ref is not None:
        pre = pre + plgpu.load(bias_ref.at[cols], mask=ok, other=0.0).astype(jnp.float32)
    return pre.astype(pre_dtype).astype(jnp.float32)


def _dense_hidden(pre_ref, x_ref, w_up_ref, h_ref, *, m: int, f: int, col0, width: int,
                  d: int, block_k: int, gated: bool, precision):
    """The dense mode's share of one program: h = relu(pre) * (x @ w_up_t.T) (gated) or
    relu(pre), float32, for every row and the units [col0, +width), stored in h [M, F]. The
    up product runs on the tensor cores, rows padded to 16."""
    m_pad = max(16, next_pow2(m))
    rows = block_range(0, m_pad)[:, None]
    row_ok = rows < m
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
    ok = row_ok & (cols < f)[None, :]
    gate = plgpu.load(pre_ref.at[rows, cols[None, :]], mask=ok, other=0.0).astype(jnp.float32)
    h = jnp.where(gate <= 0.0, 0.0, gate)  # NaN stays NaN
    if gated:
        k_lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        w_mask = jnp.broadcast_to((cols < f)[:, None], (width, block_k))
        x_mask = jnp.broadcast_to(row_ok, (m_pad, block_k))

        def step(i, acc):
            ks = (i * block_k + k_lane)[None, :]
            xk = plgpu.load(x_ref.at[rows, ks], mask=x_mask, other=0)
            wk = plgpu.load(w_up_ref.at[cols[:, None], ks], mask=w_mask, other=0)
            return acc + jnp.dot(xk, wk.T, preferred_element_type=jnp.float32,
                                 precision=precision)

        up = jax.lax.fori_loop(0, d // block_k, step, jnp.zeros((m_pad, width), jnp.float32))
        h = h * up
    plgpu.store(h_ref.at[rows, cols[None, :]], h, mask=ok)


def _scan_up_down_kernel(*refs, f: int, block_f: int, scan_width: int, block_d: int,
                         num_d_chunks: int, d_splits: int, group: int, gated: bool,
                         n_parts: int, has_bias: bool, pre_dtype, m: int = 0,
                         n_counts: int = 0, dense_above: int = 0, dense_width: int = 0,
                         dense_block_k: int = 0, precision=None):
    """One program: row ``program_id(0)``, columns [s * block_f, +block_f) for s =
    ``program_id(1)``, output columns [k * D / d_splits, +D / d_splits) for k =
    ``program_id(2)`` (the up product still reads whole rows of ``w_up_t``).

    Refs (whole arrays): pre [M, F] (``n_parts`` 0) or the gate's float32 partial sums
    [n_parts, M, F] and, with ``has_bias``, its bias [F]; [x [M, D], w_up_t [F, D]] (gated
    only), w_down [F, D]; outputs y [S, M, D] and l1 [M, S, d_splits] float32 (this program's
    partial sums at [s, row, its columns] and [row, s, k]).

    With ``n_counts`` (the dense switch; pre given as [M, F]): a counts [n_counts] int32 ref
    after the gate's, and an output h [M, F] float32 last. When the counts add up to more
    than ``dense_above`` the call is dense: no program walks; the programs of slice s instead
    share its hidden values (``_dense_hidden``: ``dense_width`` units each, every row) and
    write h for ``slice_down``, leaving y unwritten and l1 zero.
    """
    refs = list(refs)
    pre_ref = refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    counts_ref = refs.pop(0) if n_counts else None
    h_ref = refs.pop() if n_counts else None
    if gated:
        x_ref, w_up_ref, w_down_ref, y_ref, l1_ref = refs
    else:
        w_down_ref, y_ref, l1_ref = refs
        x_ref = w_up_ref = None
    row = pl.program_id(0)
    part = pl.program_id(1)
    split = pl.program_id(2)
    if not n_counts:
        _walk(pre_ref, bias_ref, x_ref, w_up_ref, w_down_ref, y_ref, l1_ref, row, part, split,
              f=f, block_f=block_f, scan_width=scan_width, block_d=block_d,
              num_d_chunks=num_d_chunks, d_splits=d_splits, group=group, gated=gated,
              n_parts=n_parts, pre_dtype=pre_dtype)
        return
    lanes = block_range(0, next_pow2(n_counts))
    dense = jnp.sum(plgpu.load(counts_ref.at[lanes], mask=lanes < n_counts,
                               other=0)) > dense_above

    @pl.when(jnp.logical_not(dense))
    def _():
        _walk(pre_ref, bias_ref, x_ref, w_up_ref, w_down_ref, y_ref, l1_ref, row, part, split,
              f=f, block_f=block_f, scan_width=scan_width, block_d=block_d,
              num_d_chunks=num_d_chunks, d_splits=d_splits, group=group, gated=gated,
              n_parts=n_parts, pre_dtype=pre_dtype)

    share = row * d_splits + split  # this program's share of its slice in the dense mode

    @pl.when(dense)
    def _():
        l1_ref[row, part, split] = jnp.float32(0.0)

    @pl.when(dense & (share < block_f // dense_width))
    def _():
        _dense_hidden(pre_ref, x_ref, w_up_ref, h_ref, m=m, f=f,
                      col0=part * block_f + share * dense_width, width=dense_width,
                      d=num_d_chunks * block_d, block_k=dense_block_k, gated=gated,
                      precision=precision)


def _walk(pre_ref, bias_ref, x_ref, w_up_ref, w_down_ref, y_ref, l1_ref, row, part, split, *,
          f: int, block_f: int, scan_width: int, block_d: int, num_d_chunks: int,
          d_splits: int, group: int, gated: bool, n_parts: int, pre_dtype):
    """The sparse walk of one program (``_scan_up_down_kernel``): its row's active units in
    its slice, their weight rows gathered in groups."""
    d_chunks = [pl.ds(c * block_d, block_d) for c in range(num_d_chunks)]
    d_iota = jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
    d_cols = [c * block_d + d_iota for c in range(num_d_chunks)]
    # The first columns of this program's output chunks (all of D without a D split).
    own_chunks = num_d_chunks // d_splits
    own_starts = [(split * own_chunks + c) * block_d for c in range(own_chunks)]
    own_cols = [start + d_iota for start in own_starts]
    lane = jax.lax.broadcasted_iota(jnp.int32, (scan_width,), 0)
    if gated:
        x_chunks = [x_ref[row, ch].astype(jnp.float32) for ch in d_chunks]
    # Groups whose w_down reads add up to at most EARLY_DOWN_MAX_GROUP whole rows (a D split
    # reads part of each) gather them before the up product's reduction, so those reads
    # overlap the w_up rows' (as in row_up_down); more would hold too many rows in registers
    # through it (slower on the H100).
    early_down = group <= EARLY_DOWN_MAX_GROUP * d_splits

    def unit_group(r, carry):
        """The chunk's active units of rank [r * group, +group): their rows of w_up_t and
        w_down gathered as [group, block_d] tiles, so the group's weight reads are in flight
        together instead of one dependent pair of row reads per unit."""
        col0, gate, active, rank, accs, l1 = carry
        slot = r * group + jax.lax.broadcasted_iota(jnp.int32, (group, scan_width), 0)
        pick = active[None, :] & (rank[None, :] == slot)  # [group, scan_width]
        valid = jnp.sum(pick.astype(jnp.int32), axis=1) > 0  # (no reduce_or in Triton)
        j = col0 + jnp.sum(jnp.where(pick, lane[None, :], 0), axis=1)  # in range when valid
        h = jnp.sum(jnp.where(pick, gate[None, :], 0.0), axis=1)  # 0 where not valid
        mask = jnp.broadcast_to(valid[:, None], (group, block_d))
        rows = lambda ref, cols: plgpu.load(ref.at[j[:, None], cols], mask=mask,
                                            other=0).astype(jnp.float32)
        down_rows = lambda: [rows(w_down_ref, cols) for cols in own_cols]
        if early_down:
            down = down_rows()
        if gated:
            # Sum the D chunks' products first: one cross-thread reduction per group.
            prod = rows(w_up_ref, d_cols[0]) * x_chunks[0][None, :]
            for c in range(1, num_d_chunks):
                prod = prod + rows(w_up_ref, d_cols[c]) * x_chunks[c][None, :]
            h = h * jnp.sum(prod, axis=1)
        if not early_down:
            down = down_rows()
        accs = tuple(acc + jnp.sum(h[:, None] * w, axis=0) for acc, w in zip(accs, down))
        return col0, gate, active, rank, accs, l1 + jnp.sum(jnp.abs(h))

    def chunk_step(c, carry):
        col0 = part * block_f + c * scan_width
        cols = col0 + lane
        gate = _gate_chunk(pre_ref, bias_ref, row, col0, cols < f, scan_width, n_parts,
                           pre_dtype)
        active = jnp.logical_not(gate <= 0.0) & (cols < f)  # > 0 or NaN
        p = active.astype(jnp.int32)
        rank = jnp.cumsum(p) - p  # active units before each lane
        groups = (jnp.sum(p) + group - 1) // group
        return jax.lax.fori_loop(0, groups, unit_group, (col0, gate, active, rank, *carry))[4:]

    zeros = tuple(jnp.zeros((block_d,), jnp.float32) for _ in own_cols)
    # Only the chunks that hold columns < F (all of them but in the last slice).
    num_chunks = -(-min(block_f, f) // scan_width)
    accs, l1 = jax.lax.fori_loop(0, num_chunks, chunk_step, (zeros, jnp.float32(0.0)))
    for start, acc in zip(own_starts, accs):
        y_ref[part, row, pl.ds(start, block_d)] = acc
    l1_ref[row, part, split] = l1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScanUpDownConfig:
    """Knobs of :func:`scan_up_down`.

    Attributes:
      block_f: columns of F per program (power of two); the grid is (M, ceil(F / block_f)).
      scan_width: columns scanned at once (power of two, <= block_f).
      block_d: D chunk width (power of two); D must be a multiple of it (the caller pads).
      num_warps: Triton warps per program.
      group: active units handled together (power of two): their weight rows are gathered
        as [group, block_d] tiles, one group after another.
      d_splits: programs sharing one (row, slice) (power of two), each writing D / d_splits
        output columns: more programs walk a busy call's units at once, each with a larger
        group in the same registers, at the cost of reading the units' w_up rows d_splits
        times (from the L2 after the first). D must be a multiple of block_d * d_splits.
      num_stages: Triton pipelining stages (of every loop: the walk's and the dense mode's),
        used only with the dense switch; without it the walk runs with one.
      dense_width: the dense mode's units per program (power of two >= 16), every row at
        once; the slice's M * d_splits programs share its block_f units, so at least
        block_f / (M * d_splits), rounded up to a power of two (raised to that where smaller).
      dense_block_k: the dense mode's D step of the up product (power of two >= 16).
    """

    block_f: int = 128
    scan_width: int = 128
    block_d: int = 2048
    num_warps: int = 4
    group: int = 4
    d_splits: int = 1
    num_stages: int = DENSE_SWITCH_STAGES
    dense_width: int = 64
    dense_block_k: int = 128

    def __post_init__(self):
        check_config(self, ("block_f", "scan_width", "block_d", "num_warps", "group",
                            "d_splits", "dense_width", "dense_block_k"))
        if self.scan_width > self.block_f:
            raise ValueError(f"scan_width={self.scan_width} must be <= block_f={self.block_f}")
        if min(self.dense_width, self.dense_block_k) < 16:
            raise ValueError(f"the dense mode's dot needs dense_width and dense_block_k >= 16, "
                             f"got {self.dense_width} and {self.dense_block_k}")


def default_scan_up_down_config(m: int, d: int, f: int) -> ScanUpDownConfig:
    """F split into power-of-two slices of at least 256 columns (128 for at most
    ``NARROW_SLICE_MAX_ROWS`` rows), fewer when ~700 programs (about 5 per SM of an H100) need
    no more; scans of up to 512 columns. D chunks as in ``row_up_down``: the widest power of
    two <= 2048. For at most ``SPLIT_D_MAX_PROGRAMS`` (row, slice) pairs and D a multiple of
    2048, two programs per pair, 1024-column D chunks and groups of ``SPLIT_D_GROUP`` (on 4
    warps for one row, 8 for more, as measured); otherwise groups of 4 on 4 warps.

    The D split, measured on an H200: one row 8-22% faster from 5% to 50% active at D = 2048
    (50%: 44.6-45.2 -> 35.1-35.6 us) and 4-10% at D = 4096, for 0.4-0.9 us (1-5%) more at
    0.5% in an on-device loop; two rows (88 pairs at F = 5632) 3-9% faster from 5% active,
    equal at 0.5%.
    Where the pairs already outnumber the SMs it lost: two rows at D = 4096, F = 14336 (224
    pairs) by 9-51%, 4 rows and more at D = 2048 (176 pairs and more) by up to 70%, as each
    split reads the units' w_up rows again; four splits lost everywhere (benchmarks/LOG.md).

    Slices for at most ``NARROW_SLICE_MAX_ROWS`` rows are narrower because a busy call of so
    few rows is bound by how many programs walk its units at once (one row at 50% active: 1.6x
    faster with 128 columns than with 256), while near the design point the two widths cost
    the same; from 8 rows on, the narrower slices' extra partial sums cost the design point
    (docs/performance.md, "Decode-sized calls").

    Groups of 4 on 4 warps for the unsplit programs: on an H200 they beat groups of 8 on 8
    warps at every measured case of 4-32 rows (0.5% active 6-15% faster, 2% 2-7%, 20% 8-15%,
    the trained model's counts 7-11%, heavy-tailed rows at 8 rows 6%): fewer threads wait on
    each cross-warp reduction, and more programs fit on an SM. At 64 rows 256-column slices
    and groups of 8 favour heavy-tailed rows but cost uniform ones more (H100).

    The dense switch's mode (H200, kernel times in us and calls in an on-device loop): at
    D = 2048, F = 5632 (88 programs of 64 units) 32 units a program took its up product from
    12.4 to 11.4 us at 8 rows, and the 64-row walk at 0.5% active from 16.0 to 13.5 (its
    programs need less shared memory, so more fit on an SM); 256-row D steps took the up from
    11.1 to 9.8 us at one row and 12.4 to 11.7 at 8, but cost the 64-row walk 7.8 us. At
    D = 4096, F = 14336 (224 programs of 64 units) the two together cost half-active calls
    9 us (8 rows 98.1 -> 107.5, 64 rows 115.8 -> 124.7): hence ``DENSE_MODE_MIN_PROGRAMS``.
    """
    min_width = NARROW_SLICE if m <= NARROW_SLICE_MAX_ROWS else 256
    slices = max(1, min(-(-704 // max(m, 1)), -(-f // min_width)))
    block_f = max(min_width, 1 << (-(-f // slices) - 1).bit_length())
    split_d = m * -(-f // block_f) <= SPLIT_D_MAX_PROGRAMS and d % 2048 == 0
    warps = 8 if split_d and m > 1 else 4
    few_dense_programs = -(-f // 64) < DENSE_MODE_MIN_PROGRAMS
    return ScanUpDownConfig(block_f=block_f, scan_width=min(block_f, 512),
                            block_d=1024 if split_d else largest_pow2_divisor(d, 2048),
                            num_warps=max(1, min(warps, d // 256)),
                            group=SPLIT_D_GROUP if split_d else 4,
                            d_splits=2 if split_d else 1,
                            dense_width=32 if few_dense_programs else 64,
                            dense_block_k=(WIDE_DENSE_STEP if few_dense_programs
                                           and m <= WIDE_DENSE_STEP_MAX_ROWS else 128))


def _check_args(pre, x, w_up_t, w_down, gated: bool) -> tuple[int, int, int]:
    if w_down.ndim != 2:
        raise ValueError(f"w_down must be 2-D [F, D], got shape {w_down.shape}")
    f, d = w_down.shape
    if isinstance(pre, GatePartials):
        sums, bias = pre.sums, pre.bias
        if sums.ndim != 3 or sums.shape[2] != f or sums.shape[0] < 1:
            raise ValueError(f"GatePartials.sums has shape {sums.shape}, expected (S, M, {f})")
        if sums.dtype != jnp.float32:
            raise ValueError(f"GatePartials.sums must be float32, got {sums.dtype}")
        if bias is not None and bias.shape != (f,):
            raise ValueError(f"GatePartials.bias has shape {bias.shape}, expected ({f},)")
        m = sums.shape[1]
    else:
        if pre.ndim != 2 or pre.shape[1] != f:
            raise ValueError(f"pre has shape {pre.shape}, expected (M, {f})")
        m = pre.shape[0]
    check_up_inputs(x, w_up_t, m, f, d, gated)
    return m, d, f


def scan_up_down(
    pre: jax.Array | GatePartials,
    x: jax.Array | None,
    w_up_t: jax.Array | None,
    w_down: jax.Array,
    *,
    out_dtype=None,
    config: ScanUpDownConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gated (x and w_up_t given) or non-gated (both None) sparse up/down from the gate.

    Args:
      pre: [M, F] gate pre-activation (any float dtype); units with pre > 0 (or NaN) are
        active. Or ``GatePartials``: the GEMV's partial sums, added here (``GatePartials.pre``
        gives the same pre-activation).
      x: [M, D] or None. w_up_t: [F, D] (unit j's up weights in row j) or None. w_down: [F, D].
      out_dtype: dtype of y (default: x's, or w_down's when non-gated).
      config: ``default_scan_up_down_config(M, D, F)`` when None; D % block_d == 0.
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      ``(y [M, D], l1 [M] float32)``: y = ``h @ w_down`` with the hidden ``h = relu(pre) *
      (x @ w_up_t.T)`` (gated) or ``relu(pre)``, accumulated in float32 over the active units
      only (the slices' partial sums added in order); l1 = sum_j |h[m, j]| (the L1 statistic).
    """
    gated = x is not None
    out_dtype = jnp.dtype(out_dtype or (x.dtype if gated else w_down.dtype))
    y_parts, l1 = scan_up_down_partial_sums(pre, x, w_up_t, w_down, config=config,
                                            interpret=interpret)
    return finish_partial_sums(y_parts, None, out_dtype), l1


class DenseSwitch(NamedTuple):
    """The decode path's dense mode, chosen on the device: when ``sum(counts) > above`` the
    call multiplies every unit (the up product of all rows on the tensor cores, then
    ``slice_down``) instead of walking each row's active units, whose reads grow with the
    rows times their units while the dense products read each weight once."""

    counts: jax.Array  # [B] int32: the gate's active entries per block (gemv_with_counts)
    above: int  # the threshold on their sum


def scan_up_down_partial_sums(
    pre: jax.Array | GatePartials,
    x: jax.Array | None,
    w_up_t: jax.Array | None,
    w_down: jax.Array,
    *,
    switch: DenseSwitch | None = None,
    config: ScanUpDownConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`scan_up_down` with y left as the programs' float32 partial sums, one per slice
    of ``config.block_f`` columns of F: ``finish_partial_sums(y_parts, None, dtype)`` (the
    slices added in order, rounded once) is ``scan_up_down``'s y. Arguments as there (no
    ``out_dtype``), and ``switch``: the dense mode's counts and threshold (pre must then be
    the finished [M, F] pre-activation the counts were taken of). A dense call's partial sums
    are ``slice_down``'s, over the same slices.

    Returns:
      ``(y_parts [S, M, D] float32, l1 [M] float32)``, S = ceil(F / block_f).
    """
    gated = x is not None
    m, d, f = _check_args(pre, x, w_up_t, w_down, gated)
    config = default_scan_up_down_config(m, d, f) if config is None else config
    if d % (config.block_d * config.d_splits):
        raise ValueError(f"D={d} is not a multiple of block_d={config.block_d} x "
                         f"d_splits={config.d_splits}")
    slices = -(-f // config.block_f)
    parts = isinstance(pre, GatePartials)
    if switch is not None and parts:
        raise ValueError("the dense switch needs the finished pre-activation [M, F], not "
                         "GatePartials")
    has_bias = parts and pre.bias is not None
    # A power of two (so the slice's shares tile it exactly) of at least block_f / programs.
    dense_width = min(config.block_f, max(config.dense_width,
                                          next_pow2(-(-config.block_f // (m * config.d_splits)))))
    dense_block_k = largest_pow2_divisor(d, config.dense_block_k)
    if switch is not None and dense_block_k < 16:
        raise ValueError(f"the dense switch needs D={d} to be a multiple of 16")
    kernel = functools.partial(_scan_up_down_kernel, f=f, block_f=config.block_f,
                               scan_width=config.scan_width, block_d=config.block_d,
                               num_d_chunks=d // config.block_d, d_splits=config.d_splits,
                               group=config.group, gated=gated,
                               n_parts=pre.sums.shape[0] if parts else 0,
                               has_bias=has_bias, pre_dtype=jnp.dtype(pre.dtype), m=m,
                               n_counts=0 if switch is None else switch.counts.shape[0],
                               dense_above=0 if switch is None else int(switch.above),
                               dense_width=dense_width, dense_block_k=dense_block_k,
                               precision=(jax.lax.Precision.HIGHEST
                                          if jnp.dtype(w_down.dtype) == jnp.float32 else None))
    gate = (pre.sums, *((pre.bias,) if has_bias else ())) if parts else (pre,)
    if switch is not None:
        gate = (*gate, switch.counts)
    inputs = (*gate, x, w_up_t, w_down) if gated else (*gate, w_down)
    out_shape = [jax.ShapeDtypeStruct((slices, m, d), jnp.float32),
                 jax.ShapeDtypeStruct((m, slices, config.d_splits), jnp.float32)]
    if switch is not None:
        out_shape.append(jax.ShapeDtypeStruct((m, f), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(m, slices, config.d_splits),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps,
            num_stages=config.num_stages if switch is not None else 1),
        interpret=resolve_interpret(interpret),
        name="twell_scan_up_down",
    )(*inputs)
    y_parts, l1 = outs[0], jnp.sum(outs[1][:, :, 0], axis=1)  # every split: the same l1
    if switch is None:
        return y_parts, l1
    h = outs[2]
    y_parts = slice_down(h, w_down, switch.counts, y_parts, dense_above=switch.above,
                         block_f=config.block_f, interpret=interpret)
    dense = jnp.sum(switch.counts) > switch.above
    # (h is unwritten in a sparse call: its sum is selected away.)
    return y_parts, jnp.where(dense, jnp.sum(jnp.abs(h), axis=1), l1)


def scan_up_down_reference(
    pre: jax.Array | GatePartials,
    x: jax.Array | None,
    w_up_t: jax.Array | None,
    w_down: jax.Array,
    *,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp :func:`scan_up_down` (same arguments and outputs): dense products in float32
    with the inactive units' hidden values exactly zero."""
    gated = x is not None
    _check_args(pre, x, w_up_t, w_down, gated)
    out_dtype = jnp.dtype(out_dtype or (x.dtype if gated else w_down.dtype))
    if isinstance(pre, GatePartials):
        pre = pre.pre()
    gate = pre.astype(jnp.float32)
    h = jnp.where(gate <= 0.0, 0.0, gate)  # NaN stays NaN
    if gated:
        up = jnp.dot(x.astype(jnp.float32), w_up_t.astype(jnp.float32).T,
                     precision=jax.lax.Precision.HIGHEST)
        h = h * up
    y = jnp.dot(h, w_down.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype), jnp.sum(jnp.abs(h), axis=1)
