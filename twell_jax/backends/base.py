"""What a backend supplies: the packed products the shared TwELL algorithm in ``ffn.py`` needs.

A sparse backend (``sparse=True``) fills the building blocks below. Every weight is [F, D], one
row per unit (``twell_jax.layout``).

- ``widen_input(x [M, D], bias [F] or None)`` (optional) -> ``x_in`` [M, D'], D' >= D, whose
  first D columns are x: what ``pack`` and ``up_down`` are given in place of x in a call that
  is not differentiated (``ffn.py`` takes x's columns back for its own dense products; a
  differentiated call saves x for its backward, so it hands x over as it is). The
  ``"pallas"`` backend appends the folded gate bias's column (``dense.with_bias_column``),
  which its gate GEMM contracts and its up/down kernel skips: one array both read, so x's
  producer (a model's RMSNorm) writes it in one pass instead of x and then a copy of it.
- ``pack(x [M, D], w [F, D], bias [F] or None, config, differentiated=True)`` -> ``(lists:
  RowLists, counts [M, n_tiles] int32, pre, skipped, hot)``: the positive entries of
  ``relu(x @ w.T + bias)`` listed per row in column order (``lists.values`` [M, K] x.dtype, ``lists.columns`` [M, K] int32,
  ``lists.row_nnz`` [M] int32 the true row totals) and the true per-tile counts. Only light
  rows' lists (``format.heavy_rows`` false; K >= ``config.max_row_nnz(F)`` or every tile's S
  slots) must be valid, and only their first ``row_nnz`` entries; ``pre`` is the dense [M, F]
  pre-activation ``x @ w.T`` in x.dtype when the backend computed it anyway (the dense fallback
  then reuses it), else None. ``skipped``: None, or (a backend that returns ``pre``) a [] bool
  that, when true, says the batch is mostly heavy rows (``format.mostly_heavy``) and nothing
  was listed: lists and counts are then unspecified and the batch goes dense. ``hot``: the
  batch's hot units (``hot_units.select``, None when the call takes none), which the lists
  and counts leave out; ``differentiated`` (the backward will run too) only changes whether
  hot units pay.
- ``up_down(x, w_up [F, D], w_down [F, D], gate: RowLists)`` -> ``(y [M, D] x.dtype,
  up_values [M, K] float32, l1 [M] float32)``: the gated up/down projection on the lists and
  each row's ``sum |h|`` over its first ``row_nnz`` entries (h = g * u); with x and w_up None
  the non-gated down projection ``(y [M, D] w_down.dtype, None, l1)`` (h = g).
- ``row_grads(dy [M, D], w_down [F, D], gate: RowLists, up_values or None, l1)`` -> ``(du or
  dh [M, K] float32, dg or None)``: the per-entry gradients of the backward
  (``pallas_kernels.row_backward`` says what they are; gated when up_values is given).
- ``row_dx(w_up [F, D], w_gate [F, D] or None, gate: RowLists, d1, d2 or None, dx_dtype)`` ->
  dx [M, D] dx_dtype: the input gradient from ``row_grads``' outputs, accumulated in float32
  and rounded once.
- ``sparse_outer(values: tuple of [M, K], columns, row_nnz, b [M, D], d_ff, skip=None)``
  -> tuple of [d_ff, D] float32, one per values array (all
  share the pattern and b): the transposed products of the backward (dW). ``skip``: a [] bool
  that, when true, allows outputs left unspecified (the caller discards them: the backward of
  a batch that went dense); a backend may compute them anyway.
- ``decode(x [M, D], w_in [F, D], bias [F] or None, w_up [F, D] or None, w_down [F, D],
  partial_sums=False, dense_above=None)`` -> ``(y [M, D] x.dtype, l1 [M] float32, active
  [M, F] bool)``
  (optional; with ``partial_sums`` a backend may return y as float32 partial sums [S, M, D]
  instead, which ``finish_partial_sums(y, None, x.dtype)`` turns into y): the whole sparse FFN
  of a few rows without lists (``w_in`` is the gate, or the up projection when ``w_up`` is
  None; l1 = sum_j |h_j|; active: the units with a positive gate). ``ffn.py`` runs it for
  calls of at most ``TwELLConfig.decode_rows`` rows that are not differentiated (decode
  steps); every row is exact whatever its count, so there is no dense backup. ``dense_above``
  (an int): a call with more active (row, unit) entries than that may multiply every unit
  instead, chosen on the device (``"pallas"``: inside its kernels, no host round trip).
- ``add_product(y [M, D], h [M, K], w [K, D], run [] bool)`` -> ``y + h @ w`` (float32
  accumulation, rounded once to y.dtype) where ``run``, else y; ideally in y's buffer: the hot
  units' output and input gradient (``twell_jax.hot_units``).

The dense backend (``sparse=False``) supplies none: ``ffn.py`` runs the dense function.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax


class RowLists(NamedTuple):
    """Per-row lists of a sparse [M, F] matrix: row m holds ``values[m, :row_nnz[m]]`` at
    columns ``columns[m, :row_nnz[m]]``; entries past ``row_nnz`` are unspecified unless
    a caller masks them (``format.mask_lists``)."""

    values: jax.Array  # [M, K]
    columns: jax.Array  # [M, K] int32
    row_nnz: jax.Array  # [M] int32


@dataclasses.dataclass(frozen=True)
class Backend:
    """One FFN implementation.

    sparse: runs the TwELL algorithm on the building blocks below; False: the dense function.
    cost_model_routes: the cost model (``TwELLConfig.cost_model``, ``dense_fallback_density``)
      may send a call or a batch to the dense function when that is cheaper.
    """

    sparse: bool
    cost_model_routes: bool = False
    widen_input: Callable | None = None
    pack: Callable | None = None
    up_down: Callable | None = None
    row_grads: Callable | None = None
    row_dx: Callable | None = None
    sparse_outer: Callable | None = None
    decode: Callable | None = None
    add_product: Callable | None = None
