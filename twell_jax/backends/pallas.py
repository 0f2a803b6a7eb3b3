"""The ``"pallas"`` backend: the TwELL building blocks on Pallas kernels.

The forward: XLA's GEMM writes the gate pre-activation in x.dtype, ``row_pack`` lists each
row's positive entries (the ReLU applied there), and ``row_up_down`` runs the up and down
projections one program per token row. The backward's per-row products (dh, du, dg; dx) run
on ``row_backward``'s two kernels, one program per token row too, and the transposed products
(dW = h^T @ dy, (dg, du)^T @ x) on ``sparse_outer`` over a column-sorted view of the pattern.
Nothing dense is saved for the backward. A decode step (few rows, not differentiated) runs the
gate product on ``gemv`` (its partial sums read by the next kernel) and the up/down on
``scan_up_down``, with no lists.

The kernels want block-divisible shapes; this module pads (D with zero features, which change
no dot product; F with zero gate columns, which are never active) and slices the results back,
so callers can pass any M, D, F. Without a GPU the
kernels run in interpret mode (``pallas_kernels.common.resolve_interpret``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common as kernels_common
from pallas_kernels.add_product import add_product, add_product_reference
from pallas_kernels.add_product import fits as add_product_fits
from pallas_kernels.common import finish_partial_sums
from pallas_kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from pallas_kernels.gemv import gemv_partial_sums, gemv_with_counts
from pallas_kernels.row_backward import row_dx, row_entry_grads
from pallas_kernels.row_pack import row_pack
from pallas_kernels.row_up_down import row_up_down
from pallas_kernels.scan_up_down import DenseSwitch, GatePartials, scan_up_down_partial_sums
from pallas_kernels.sparse_outer import sparse_outer
from twell_jax.backends.base import Backend, RowLists
from twell_jax.config import TwELLConfig
from twell_jax.dense import folds_bias, gate_pre_activation, with_bias_column
from twell_jax import hot_units
from twell_jax.format import mostly_heavy, sampled_active, sampled_cost_says_dense

_D_BLOCK_MAX = 512  # sparse_outer: D padded so a power-of-two chunk <= 512 divides it
_D_MULTIPLE = 64  # the row kernels: D padded to a multiple of 64, split into power-of-two chunks


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_features(d: int) -> int:
    """D padded so a power-of-two chunk (<= 512, >= 16) divides it."""
    chunk = min(_D_BLOCK_MAX, max(16, 1 << (d - 1).bit_length()))
    return _round_up(d, chunk)


def _pad(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == shape:
        return a
    return jnp.pad(a, [(0, n - s) for s, n in zip(a.shape, shape)])


def _widen_input(x: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x [M, D] with the folded gate bias's column where the gate GEMM folds it
    (``dense.folds_bias``), else x. ``row_up_down`` reads the same array (its first D
    columns), so the RMSNorm in front of a model's FFN writes it directly: the fold's copy of
    x is gone (H100, M = 16384, D = 2048: norm + gate GEMM 0.647 -> 0.585 ms).

    The optimization barrier keeps XLA from rewriting a slice of the first D columns (the
    dense branch's) back into x itself, which would keep x alive beside this array."""
    if not folds_bias(*x.shape, bias):
        return x
    return jax.lax.optimization_barrier(with_bias_column(x))


def _pack(x: jax.Array, w: jax.Array, bias: jax.Array | None, config: TwELLConfig,
          differentiated: bool = True):
    m = x.shape[0]
    f, d = w.shape
    f_pad = config.num_tiles(f) * config.tile_width
    itemsize = jnp.dtype(x.dtype).itemsize
    cost_decides = config.cost_model_decides(kernels_common.default_interpret())
    # The GEMM emits x.dtype (fp32 accumulation inside): half the bytes for the pack to read.
    # Padded units have zero weights and bias: never active. x may be ``_widen_input``'s.
    pre = gate_pre_activation(x[:, :d], _pad(w, (f_pad, d)),
                              None if bias is None else _pad(bias, (f_pad,)),
                              x_wide=x if x.shape[1] > d else None)
    # The batch's hot units, from the same sample of rows as the decisions below; the lists
    # and those decisions leave them out.
    hot = hot_units.select(sampled_active(pre), m, d, f, itemsize, config, cost_decides,
                           differentiated)
    exclude = None if hot is None else hot.mask
    # A batch whose rows are mostly heavy goes dense whatever its lists say: row_pack then
    # returns at once instead of reading the 184 MB pre-activation (M = 16384, F = 5632) for
    # nothing, and the dense branch takes the statistics from ``pre`` (``ffn._twell_forward``).
    skipped = mostly_heavy(pre, config, f, exclude=exclude)
    if cost_decides:
        # Compiled, the cost model routes: a batch it clearly sends dense (a sample of rows
        # says so) skips the pack too. (M = 16384, 1% uniform: ~40% of the rows heavy, so not
        # mostly heavy, yet dense by the cost model: packing it would read ``pre`` for nothing.)
        skipped = skipped | sampled_cost_says_dense(pre, config, f, d, itemsize,
                                                    exclude=exclude)
    values, columns, counts, row_total = row_pack(
        pre, tile_width=config.tile_width, num_slots=config.max_row_nnz(f), skip=skipped,
        exclude=exclude)
    return RowLists(values, columns, row_total), counts, pre[:, :f], skipped, hot


def _pad_up_down(x, w_up, w_down):
    """x [M, D'], w_up [F, D] (None when non-gated) and w_down [F, D] with D padded to a
    multiple of 64 for the row kernels; x is padded only if narrower (``_widen_input``'s
    columns past D meet the weights' zero padding)."""
    f, d = w_down.shape
    d_pad = _round_up(d, _D_MULTIPLE)
    if x is not None and x.shape[1] < d_pad:
        x = _pad(x, (x.shape[0], d_pad))
    if w_up is not None:
        w_up = _pad(w_up, (f, d_pad))
    return x, w_up, _pad(w_down, (f, d_pad))


def _row_up_down(x, w_up, w_down, gate: RowLists):
    y, up, l1 = row_up_down(*_pad_up_down(x, w_up, w_down), *gate)
    return y[:, :w_down.shape[1]], up, l1


def _pad_rows(w: jax.Array | None) -> jax.Array | None:
    """A weight [F, D] with D padded to a multiple of 64 for the row kernels."""
    return None if w is None else _pad(w, (w.shape[0], _round_up(w.shape[1], _D_MULTIPLE)))


def _row_grads(dy, w_down, gate: RowLists, up_values, l1):
    d_pad = _round_up(dy.shape[1], _D_MULTIPLE)
    return row_entry_grads(_pad(dy, (dy.shape[0], d_pad)), _pad_rows(w_down), gate.values,
                           up_values, gate.columns, gate.row_nnz, l1)


def _row_dx(w_up, w_gate, gate: RowLists, d1, d2, dx_dtype):
    dx = row_dx(_pad_rows(w_up), _pad_rows(w_gate), d1, d2, gate.columns, gate.row_nnz,
                dx_dtype=dx_dtype)
    return dx[:, :w_up.shape[1]]


def _sparse_outer(values, columns, row_nnz, b, d_ff, skip=None):
    m, d = b.shape
    out = sparse_outer(tuple(values), columns, row_nnz, _pad(b, (m, _padded_features(d))), d_ff,
                       skip=skip)
    return tuple(o[:, :d] for o in out)


def _decode(x, w_in, bias, w_up, w_down, partial_sums=False, dense_above=None):
    # The gate on the GEMV kernel. Below 8 rows XLA's dot is ~2x slower than the weight read;
    # at 8 and 64 rows the whole decode FFN is 0.7 and 1.5 us faster this way than with XLA's
    # dot (H100). With the dense switch the GEMV is unsplit and counts its active outputs, so
    # the scan can choose the dense mode from one small load; without it, its D-split partial
    # sums go straight to the scan, which adds them itself: no launch or [M, F] write between.
    switch = None
    if x.shape[0] <= GEMV_MAX_ROWS and dense_above is not None:
        gate, counts = gemv_with_counts(x, w_in, bias, unit_rows=True)
        pre = gate
        switch = DenseSwitch(counts, dense_above)
    elif x.shape[0] <= GEMV_MAX_ROWS:
        gate = GatePartials(gemv_partial_sums(x, w_in, unit_rows=True), bias, x.dtype)
        pre = gate.pre()  # only for the statistics: dead code unless they are used
    else:
        gate = pre = gate_pre_activation(x, w_in, bias)
    gated = w_up is not None
    x_pad, w_up, w_down_pad = _pad_up_down(x if gated else None, w_up, w_down)
    y_parts, l1 = scan_up_down_partial_sums(gate, x_pad, w_up, w_down_pad, switch=switch)
    y_parts = y_parts[..., :w_down.shape[1]]
    # Unfinished for a consumer that adds the slices itself (the model's add_rms_norm: one
    # launch less a decode step).
    y = y_parts if partial_sums else finish_partial_sums(y_parts, None, x.dtype)
    return y, l1, jnp.logical_not(pre <= 0)  # active: > 0 or NaN


def _add_product(y, h, w, run):
    # In place on the kernel where the blocks divide the shapes (the models' do); elsewhere
    # XLA's product, which may copy y.
    if add_product_fits(*y.shape, h.shape[1]):
        return add_product(y, h, w, run)
    return add_product_reference(y, h, w, run)


# The cost model may route to dense: the kernels' rates are what it measures.
BACKEND = Backend(sparse=True, cost_model_routes=True,
                  widen_input=_widen_input,
                  pack=jax.jit(_pack, static_argnames=("config", "differentiated")),
                  up_down=jax.jit(_row_up_down),
                  row_grads=jax.jit(_row_grads),
                  row_dx=jax.jit(_row_dx, static_argnames="dx_dtype"),
                  sparse_outer=jax.jit(_sparse_outer, static_argnames="d_ff"),
                  decode=_decode,
                  add_product=_add_product)
