"""Sparse FFN ops: ``gated_mlp`` and ``mlp``, with a sparse ``custom_vjp`` backward.

Every implementation computes the same function (up to bf16 rounding):

    gated_mlp: y = (relu(x @ w_gate + b_gate) * (x @ w_up)) @ w_down
    mlp:       y = relu(x @ w_up + b_up) @ w_down

(the biases are optional: a per-unit threshold that sets each unit's firing rate).

The implementations are the backends of ``twell_jax.backends``, looked up by name:

- ``"xla"``: the dense computation as a plain Flax MLP writes it (GEMMs with x.dtype outputs,
  float32 accumulation inside; the baseline every speed ratio is taken against); plain autodiff.
- ``"reference"``: the TwELL algorithm in plain jnp: pack the gate per column tile, compute
  the up projection only at packed positions, down-project from the packed hidden, heavy rows
  through the dense backup. Its backward is sparse too and keeps only packed residuals.
- ``"pallas"``: the same algorithm on Pallas kernels (interpret mode without a GPU): the gate
  GEMM in XLA, then one program per token row for the packing, the up/down projections and
  the backward's per-row products.

Calls of at most ``TwELLConfig.decode_rows`` token rows that are not differentiated (decode
steps) skip the lists: the backend's ``decode`` runs the gate product and one kernel that walks
each row's active units (``pallas_kernels.scan_up_down``), exact for every row whatever its
count. Differentiated, such calls run the dense function with plain autodiff where the cost
model says the sparse path's fixed cost exceeds the dense FFN (``path_for``).

The L1 statistic (``stats.l1``) is differentiable on every path: its gradient is folded into
the sparse backward, so ``loss + coeff * stats.l1`` trains the L1 penalty at no dense cost.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.common import default_interpret
from twell_jax import backends, hot_units
from twell_jax.backends import DEFAULT_IMPLEMENTATION, Backend, Implementation, RowLists
from twell_jax.config import DEFAULT_CONFIG, TwELLConfig
from twell_jax.dense import dot_down, dot_rows, gate_pre_activation
from twell_jax.format import (column_sums, heavy_row_index, heavy_rows, mask_lists, set_rows,
                              take_rows)
from twell_jax.layout import FFNWeights, prepare_weights

RESIDUALS_NAME = "twell_residuals"
"""The ``checkpoint_name`` of the sparse FFN's saved lists (for remat policies)."""

_F32 = jnp.float32


class FFNStats(NamedTuple):
    """Statistics of one FFN call (scalars).

    nnz_mean: mean active units (gate > 0) per token. nnz_p99: the 99th percentile over tokens
    (nearest rank). nnz_max: the most in one token.
    l1: mean over tokens of sum_j |h_j| (differentiable). heavy_rows: tokens the format sends
    to the dense backup (more than S non-zeros in some tile, or more than the row cap; the
    backup's spare rows also take the densest light rows, not counted here); the dense and
    decode paths, which run no backup, report the same count. backup_overflow: more
    heavy rows than ``config.backup_rows``, so the whole batch took the exact dense path.
    dense_fallback: the whole batch took the dense path (overflow, more than half the rows
    heavy, or density above the cost of the sparse up/down for ``"pallas"``, see
    ``TwELLConfig.dense_fallback_density``).
    hot_units: units a dense GEMM computed on the light rows instead of the lists (hot units,
    ``TwELLConfig.hot_units``; 0 when none). The other counts include them, except
    ``heavy_rows``, which the format decides without them.
    """

    nnz_mean: jax.Array
    nnz_p99: jax.Array
    nnz_max: jax.Array
    l1: jax.Array
    heavy_rows: jax.Array
    backup_overflow: jax.Array
    dense_fallback: jax.Array
    hot_units: jax.Array


class PartialSums(NamedTuple):
    """An FFN output left unfinished: ``sums`` [S, M, D] float32, whose slices added in order
    and rounded to the compute dtype are y [M, D] (``pallas_kernels.common.
    finish_partial_sums``). ``gated_mlp(..., partial_sums=True)`` returns it from the
    ``"pallas"`` decode path, for a consumer that adds the slices itself (the model's decode
    step adds them into the residual inside ``add_rms_norm``: one launch less)."""

    sums: jax.Array


# ----------------------------------------------------------------------------------------
# The dense function, used by "xla", by the dense backup and by the all-dense fallback.


def _p99(row_nnz: jax.Array, d_ff: int) -> jax.Array:
    """Nearest-rank 99th percentile of the per-token counts [M] (int32, in [0, d_ff]).

    From a histogram of the counts and its running sum, not a sort: exact, and no sort
    launch (on the H100 the change did not show in a call's time)."""
    m = row_nnz.shape[0]
    histogram = jnp.zeros((d_ff + 1,), jnp.int32).at[jnp.clip(row_nnz, 0, d_ff)].add(1)
    rank = max(1, -(-99 * m // 100))
    return jnp.argmax(jnp.cumsum(histogram) >= rank).astype(row_nnz.dtype)


def _dense_rows(x: jax.Array, weights: tuple[jax.Array, ...], bias, gated: bool):
    """Dense FFN on rows x [R, D] (weights [F, D] each), written as a plain Flax MLP computes
    it: every GEMM emits x.dtype (float32 accumulation inside), the gating product in x.dtype.
    Its autodiff backward runs x.dtype GEMMs too. Returns (y [R, D] x.dtype, l1 [R] f32,
    active [R, F] bool)."""
    pre = gate_pre_activation(x, weights[0], bias)
    y, l1_rows = _dense_from_pre(x, pre, weights, gated)
    return y, l1_rows, pre > 0


def _dense_from_pre(x, pre, weights, gated):
    """Dense FFN given the gate pre-activation ``pre = x @ w_gate.T + bias`` [R, F] (x.dtype):
    (y [R, D] x.dtype, l1 [R] f32)."""
    gate = jax.nn.relu(pre)
    h = gate * dot_rows(x, weights[1]) if gated else gate
    return dot_down(h, weights[-1]), jnp.sum(jnp.abs(h.astype(_F32)), axis=1)


def _active_counts(active: jax.Array, config: TwELLConfig) -> tuple[jax.Array, jax.Array]:
    """(row totals [M] int32, heavy rows [] int32) of an active mask [M, F] bool.

    The per-tile counts are the mask's one reduction and the row totals are summed from
    them; a last tile cut short is summed on its own rather than padded to a copy. (It timed
    as the two-reduction version it replaced on the 2% uniform forward on the H100.)"""
    m, f = active.shape
    width = config.tile_width
    full = f // width
    counts = active[:, :full * width].reshape(m, full, width).sum(-1, dtype=jnp.int32)
    if f % width:  # the last tile's columns, not padded to a copy
        rest = active[:, full * width:].sum(axis=1, keepdims=True, dtype=jnp.int32)
        counts = jnp.concatenate([counts, rest], axis=1)
    return counts.sum(axis=1), heavy_rows(counts, config, f).sum(dtype=jnp.int32)


def _stats_from_active(active: jax.Array, l1_rows: jax.Array, config: TwELLConfig) -> FFNStats:
    """Statistics of a call that computed every row without lists (dense, or the decode path):
    ``active`` [M, F] bool, ``l1_rows`` [M] float32. ``heavy_rows`` counts the rows the format
    would send to the dense backup."""
    f = active.shape[1]
    nnz, num_heavy = _active_counts(active, config)
    return FFNStats(
        nnz_mean=jnp.mean(nnz.astype(_F32)),
        nnz_p99=_p99(nnz, f),
        nnz_max=jnp.max(nnz),
        l1=jnp.mean(l1_rows),
        heavy_rows=num_heavy,
        backup_overflow=jnp.asarray(False),
        dense_fallback=jnp.asarray(False),
        hot_units=jnp.zeros((), jnp.int32),
    )


def _dense_with_stats(x, weights, bias, gated, config):
    y, l1_rows, active = _dense_rows(x, weights, bias, gated)
    return y, _stats_from_active(active, l1_rows, config)


# ----------------------------------------------------------------------------------------
# The dense backup: heavy rows gathered, computed densely, scattered back.


def _backup_sizes(m: int, config: TwELLConfig) -> tuple[int, ...]:
    """Static row counts the backup can run at; the smallest that holds the heavy rows is used."""
    if config.backup_rows is not None:
        capacity = min(config.backup_rows, m)
        return (capacity,) if capacity > 0 else ()
    # M/64 to M/2 in factor-2 steps, plus 3M/16 and 5M/16: the backup computes at most twice
    # the heavy rows, and at most 4/3 and 5/4 of them around a sixth and a quarter of the
    # batch heavy, where trained models' tails put it (M = 16384, the row cap at 58 units:
    # 3,959 heavy rows on bench_ffn's trained case, 4,101 on the heavy-tailed one, which
    # without 5M/16 spilled into the M/2 backup: +13% forward on the H100); its
    # spare rows take the densest light rows (``_backup_rows``). Past M/2 the whole batch
    # goes dense, which reuses the gate GEMM and costs no more than a backup of M rows would.
    return tuple(sorted({max(1, -(-m * n // 64)) for n in (1, 2, 4, 8, 12, 16, 20, 32)}))


def _route(dense: jax.Array, num_heavy: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """The index of the one ``lax.switch`` that runs a call (forward, and again backward):
    0 the lists alone (no heavy row), 1 + i the lists plus the dense backup at ``sizes[i]``,
    the smallest that holds the heavy rows, ``1 + len(sizes)`` the whole batch dense.

    Why the lists alone come first: XLA gives a conditional's output the buffer of its first
    branch's result. With the lists-only branch first, the arrays that branch passes through
    (the backward's float32 dW, computed before the switch) need no copy in one FFN; with the
    dense branch first every other branch copied the backward's dx, then passed through too
    (a 67 MB copy per call at M = 16384, D = 2048: ~46 us on the H100).
    In a model of identical layers XLA copied the passed-through dx anyway, so
    dx is now made in each branch (``_twell_backward``).

    Why one switch: on a GPU each data-dependent branch copies its index to the host and
    waits for it, so the device idles while the host launches the branch; one switch per
    direction instead of a dense/sparse ``cond`` around a backup ``switch`` halves those waits.
    Each wait still costs ~110 us of GPU idle on the H100, unless XLA
    runs the switch on the device (``twell_jax.xla_flags``: the experiment scripts do)."""
    bigger = sum((num_heavy > s).astype(jnp.int32) for s in sizes[:-1]) if sizes else 0
    sparse = jnp.where(num_heavy > 0, 1 + bigger, 0)
    return jnp.where(dense, 1 + len(sizes), jnp.minimum(sparse, len(sizes)))


def _backup_branches(run, backup: jax.Array, sizes: tuple[int, ...]) -> list:
    """The switch's sparse branches: ``run(None)`` (no heavy row), then ``run(index [size])``
    (the indices of the ``backup`` [M] bool rows, padded with M) for each backup size."""
    return [lambda: run(None)] + [
        functools.partial(lambda size: run(heavy_row_index(backup, size)), size)
        for size in sizes]


def _backup_rows(heavy: jax.Array, row_nnz_all: jax.Array, route: jax.Array,
                 sizes: tuple[int, ...], max_light: int) -> jax.Array:
    """[M] bool: the rows the dense backup computes. The heavy rows, plus, where the chosen
    size leaves room, the light rows with the most active units (every light row with at
    least some count t, t >= 1 the smallest that fits): the backup computes ``size`` rows
    whatever it is given, so a dense row there costs nothing, and each takes its units off the
    lists' kernels, forward and backward. ``route`` is ``_route``'s switch index;
    ``max_light`` the most units a light row holds (``config.max_row_nnz``): the counts to
    try are 1 .. max_light, so one comparison per row and count finds t (no histogram of all
    F + 1 counts and its running sum: a scatter and two launches more)."""
    if not sizes:
        return heavy
    size = jnp.asarray((0,) + sizes + (0,), jnp.int32)[route]  # 0: lists alone, or dense
    room = size - heavy.sum(dtype=jnp.int32)
    light = jnp.where(heavy, -1, jnp.minimum(row_nnz_all, max_light))  # heavy: below any t
    counts = jnp.arange(1, max_light + 2, dtype=light.dtype)  # t = 1 .. max_light + 1
    # at_least[i]: light rows with at least counts[i] units (0 for the last count).
    at_least = jnp.sum(light[:, None] >= counts[None, :], axis=0, dtype=jnp.int32)
    threshold = counts[jnp.argmax(at_least <= room)]
    return heavy | (light >= threshold) & (room > 0)


# ----------------------------------------------------------------------------------------
# The TwELL forward and its sparse backward.


def _cost_model_decides(config: TwELLConfig) -> bool:
    """``TwELLConfig.cost_model_decides`` for the kernels as this process runs them."""
    return config.cost_model_decides(default_interpret())


def _cheaper_dense(row_nnz_all: jax.Array, heavy: jax.Array, x: jax.Array, f: int,
                   config: TwELLConfig) -> jax.Array:
    """[] bool: would dense up/down GEMMs beat the sparse path (gathers for the light rows,
    the dense backup for the heavy ones) on this batch? ``row_nnz_all`` [M] true counts,
    ``heavy`` [M] bool."""
    if config.dense_fallback_density is not None:
        return jnp.mean(row_nnz_all.astype(_F32)) > config.dense_fallback_density * f
    if not _cost_model_decides(config):
        return jnp.asarray(False)
    m, d = x.shape
    # Integer sums, converted after: exact, where a float32 sum of counts loses units past
    # 2^24 (a light row holds at most ``config.max_row_nnz(f)`` units, so M times that fits
    # in int32).
    light_nnz = jnp.sum(jnp.where(heavy, 0, row_nnz_all), dtype=jnp.int32)
    num_heavy = jnp.sum(heavy, dtype=jnp.int32)
    return config.cost_model.sparse_costs_more(m, d, f, light_nnz.astype(_F32),
                                               num_heavy.astype(_F32),
                                               jnp.dtype(x.dtype).itemsize)


def _sparse_never_pays(m: int, d: int, f: int, dtype, config: TwELLConfig) -> bool:
    """Static (shape-only) check: even with no active unit, the sparse path's fixed cost
    (extra launches, the packing pass, device-side decisions) exceeds the whole dense FFN.
    True at small M on the H100; such calls run the dense function directly (those of at most
    ``config.decode_rows`` rows run the list-free decode path instead when not differentiated)."""
    if not _cost_model_decides(config):
        return False
    cost = config.cost_model
    itemsize = jnp.dtype(dtype).itemsize
    return cost.sparse_fixed_seconds > cost.dense_ffn_seconds(m, d, f, itemsize)



class _Residuals(NamedTuple):
    x: jax.Array
    params: tuple[jax.Array, ...]  # the weights as passed: their dtypes are the gradients'
    weights: tuple[jax.Array, ...]  # cast to x.dtype (the compute weights)
    bias: jax.Array | None  # [F] of the gating projection
    gate_values: jax.Array  # [M, K] packed gate (gated) or hidden (non-gated) values
    up_values: jax.Array  # [M, K] f32 up projection at the packed entries ([M, 0] if non-gated)
    columns: jax.Array  # [M, K] int32
    row_nnz: jax.Array  # [M] int32, 0 for the backup's rows
    backup: jax.Array  # [M] bool: the rows the dense backup computed (``_backup_rows``)
    num_heavy: jax.Array
    dense: jax.Array  # [] bool: the whole batch took the dense path
    hot: hot_units.HotUnits | None  # the batch's hot units (left out of the lists)

    @property
    def gate(self) -> RowLists:
        return RowLists(self.gate_values, self.columns, self.row_nnz)


def _light_lists(lists: RowLists, skip: jax.Array, f: int, config: TwELLConfig,
                 masked: bool = True) -> RowLists:
    """The lists of the rows not in ``skip`` [M] bool, with ``masked`` the entries past each
    row's count zeroed.

    Skipped rows (the backup's rows, or every row of a batch that goes dense) get row_nnz 0:
    the sparse products pass over them. A light row holds at most max_row_nnz entries, so the
    lists (and the residuals) keep only that many slots. The backends leave entries past a
    row's count unspecified: the lists saved for the backward need them zeroed, but the
    forward's ``up_down`` never reads them, so a call that is not differentiated skips the
    mask (one [M, K] pass a call)."""
    light_slots = min(lists.values.shape[1], config.max_row_nnz(f))
    row_nnz = jnp.where(skip, 0, jnp.minimum(lists.row_nnz, light_slots))
    values, columns = lists.values[:, :light_slots], lists.columns[:, :light_slots]
    if masked:
        values, columns = mask_lists(values, columns, row_nnz)
    return RowLists(values, columns, row_nnz)


def _sparse_forward(backend: Backend, x, weights, bias, gated, gate: RowLists, pre, counted,
                    index):
    """Light rows on the lists, the backup's rows ``index`` [size] (None: no heavy row; see
    ``_backup_rows``) through the dense backup: (y [M, D] x.dtype, l1 sum [] f32, up_values
    [M, K] f32 or [M, 0], ``counted`` as given: the statistics' row totals and heavy rows).
    x [M, D']: ``Backend.widen_input``'s (its first D columns are x).
    ``pre`` [M, F]: the backend's gate pre-activation, or None. The backup takes its rows of ``pre``
    rather than redo their gate GEMM, as the all-dense branch does (with the sizes of
    ``_backup_sizes``: heavy-tailed forward 1.60 -> 1.43 ms on the H100)."""
    m, d = x.shape[0], weights[-1].shape[1]
    if gated:
        y, up_values, l1_rows = backend.up_down(x, weights[1], weights[-1], gate)
    else:
        y, _, l1_rows = backend.up_down(None, None, weights[-1], gate)
        up_values = jnp.zeros((m, 0), _F32)
    l1_sum = jnp.sum(l1_rows)  # the backup's rows have no entries: 0
    y = y.astype(x.dtype)
    if index is None:
        return y, l1_sum, up_values, counted
    rows = take_rows(x, index)[:, :d]
    if pre is None:
        y_rows, l1_rows, _ = _dense_rows(rows, weights, bias, gated)
    else:
        pre_rows = take_rows(pre, index)
        y_rows, l1_rows = _dense_from_pre(rows, pre_rows, weights, gated)
    return (set_rows(y, index, y_rows),
            l1_sum + jnp.sum(jnp.where(index < m, l1_rows, 0.0)), up_values, counted)


def _dense_forward(x, weights, bias, gated, pre, up_slots: int, counted, config=None):
    """The whole batch dense: (y [M, D] x.dtype, l1 sum [] f32, zero up_values [M, up_slots],
    (row totals [M], heavy rows [])): the ``counted`` ones, or with ``config`` (a batch the
    backend did not list: ``skipped``) counted here from ``pre``. x [M, D']: its first D
    columns are x (``Backend.widen_input``)."""
    x = x[:, :weights[-1].shape[1]]
    if pre is None:
        y, l1_rows, _ = _dense_rows(x, weights, bias, gated)
    else:  # the backend already paid for the gate GEMM: reuse its output
        y, l1_rows = _dense_from_pre(x, pre, weights, gated)
    if config is not None:
        counted = _active_counts(jnp.logical_not(pre <= 0), config)  # > 0 or NaN, as packed
    return y, jnp.sum(l1_rows), jnp.zeros((x.shape[0], up_slots), _F32), counted


class _DenseVJP(NamedTuple):
    """The residuals of a differentiated call that runs the dense function: autodiff's own
    (``jax.vjp``'s pullback, a pytree of the saved arrays), so the backward recomputes nothing."""
    pullback: Callable


def _dense_forward_for_grad(x, params, bias, gated, config):
    """The dense function with autodiff's residuals: ((y [M, D], FFNStats), ``_DenseVJP``)."""
    def fn(xx, pp, bb):
        y, l1_rows, active = _dense_rows(xx, _compute_weights(xx, pp), bb, gated)
        return (y, l1_rows), active

    (y, l1_rows), pullback, active = jax.vjp(fn, x, params, bias, has_aux=True)
    stats = _stats_from_active(active, l1_rows, config)._replace(dense_fallback=jnp.asarray(True))
    return (y, stats), _DenseVJP(pullback)


def _twell_forward(x, params, bias, gated, implementation, config, differentiated=True):
    backend = backends.get(implementation)
    m = x.shape[0]
    f = params[0].shape[0]
    # A differentiated decode-sized call (the primal took the decode path): where the sparse
    # path's fixed cost exceeds the dense FFN, the dense function and its plain autodiff.
    if _static_dense(backend, m, x.shape[1], f, x.dtype, config, differentiated=True):
        return _dense_forward_for_grad(x, params, bias, gated, config)
    weights = _compute_weights(x, params)
    # What the pack, the up/down and the hot units' GEMM read in place of x: one array, which
    # x's producer can write in one pass (``Backend.widen_input``). The branches below take
    # x's columns back.
    # Differentiated, x itself is saved for the backward, so a wider copy would save nothing.
    widen = backend.widen_input is not None and not differentiated
    x_in = backend.widen_input(x, bias) if widen else x
    # ``differentiated``: the backward runs too (the custom_vjp's forward), which changes
    # what hot units save (``CostModel.hot_units_pay``).
    lists, counts, pre, skipped, hot = backend.pack(x_in, weights[0], bias, config,
                                                    differentiated=differentiated)
    if skipped is not None:  # nothing listed: the counts are unspecified
        counts = jnp.where(skipped, 0, counts)
    heavy = heavy_rows(counts, config, f)
    num_heavy = heavy.sum(dtype=jnp.int32)
    row_nnz_all = counts.sum(axis=1, dtype=jnp.int32)
    sizes = _backup_sizes(m, config)
    capacity = sizes[-1] if sizes else 0
    dense = num_heavy > capacity  # past the largest bucket the batch goes dense
    if skipped is not None:
        dense = dense | skipped
    if backend.cost_model_routes:
        dense = dense | _cheaper_dense(row_nnz_all, heavy, x, f, config)
    route = _route(dense, num_heavy, sizes)
    backup = _backup_rows(heavy, row_nnz_all, route, sizes, config.max_row_nnz(f))
    # A batch that goes dense keeps empty lists: the backward runs the lists' kernels whatever
    # the route (``_twell_backward``), and they then have nothing to loop over.
    gate = _light_lists(lists, backup | dense, f, config, masked=differentiated)

    counted = (row_nnz_all, num_heavy)
    sparse = functools.partial(_sparse_forward, backend, x_in, weights, bias, gated, gate, pre,
                               counted)
    dense_branch = functools.partial(_dense_forward, x_in, weights, bias, gated, pre,
                                     gate.values.shape[1] if gated else 0, counted)
    branches = [*_backup_branches(sparse, backup, sizes), dense_branch]
    if skipped is not None:
        # A batch the backend did not list has its statistics' counts only from a pass over
        # ``pre``, which only this last branch makes (the dense branch above reuses the
        # pack's counts): one switch still, no condition inside a branch.
        branches.append(functools.partial(dense_branch, config=config))
        route = jnp.where(skipped, len(branches) - 1, route)
    y, l1_sum, up_values, (nnz, num_heavy_out) = jax.lax.switch(route, branches)
    num_hot = jnp.zeros((), jnp.int32)
    if hot is not None:
        # The hot units' output on the light rows (the backup's rows and a dense batch have
        # theirs). Its per-row counts complete the statistics, so a listed batch that went
        # dense still runs the hot GEMMs (its rows add nothing); a batch that was not listed
        # has its counts from ``pre`` whole and skips them.
        if skipped is not None:
            hot = hot._replace(used=hot.used & ~skipped)
        y, l1_hot, hot_nnz = hot_units.add_forward(y, x_in, weights, bias, gated, hot,
                                                   ~(backup | dense), backend.add_product)
        l1_sum, nnz = l1_sum + l1_hot, nnz + hot_nnz
        num_hot = jnp.where(hot.used & ~dense, jnp.sum(hot.on, dtype=jnp.int32), 0)
    # An overflow is a fixed capacity exceeded.
    overflow = ((num_heavy_out > capacity) if config.backup_rows is not None
                else jnp.asarray(False))
    stats = FFNStats(
        nnz_mean=jnp.mean(nnz.astype(_F32)),
        nnz_p99=_p99(nnz, f),
        nnz_max=jnp.max(nnz),
        l1=l1_sum / m,
        heavy_rows=num_heavy_out,
        backup_overflow=overflow,
        dense_fallback=dense,
        hot_units=num_hot,
    )
    # Named so a remat policy can keep the packed lists (~1% of the dense residuals) instead of
    # recomputing the FFN forward in the backward (``RESIDUALS_NAME``).
    packed = jax.tree.map(lambda a: checkpoint_name(a, RESIDUALS_NAME),
                          (gate.values, up_values, gate.columns, gate.row_nnz, backup,
                           num_heavy, dense, hot))
    residuals = _Residuals(x, params, weights, bias, *packed)
    return (y, stats), residuals


def _dense_vjp(gated: bool, x, weights, bias, dy, l1_ct_rows):
    """(dx, d_weights, d_bias or None) of the dense function on rows x [R, D], given the
    cotangents dy [R, D] and l1_ct_rows [R] of its outputs."""
    def fn(xx, ww, bb):
        y, l1_rows, _ = _dense_rows(xx, ww, bb, gated)
        return y, l1_rows

    _, vjp = jax.vjp(fn, x, weights, bias)
    return vjp((dy, l1_ct_rows))


class _ListGrads(NamedTuple):
    """The lists' gradients computed before the backward's route switch."""
    entries: tuple[jax.Array, jax.Array | None]  # (du, dg) gated, (dh, None): [M, K] float32
    d_weights: tuple[jax.Array, ...]  # float32, in the weights' order
    d_bias: jax.Array | None  # [F] float32


def _list_grads(backend: Backend, gated: bool, r: _Residuals, dy, l1_ct) -> _ListGrads:
    """The light rows' per-entry gradients, dW and d bias from the lists (their dx: the
    backend's ``row_dx`` in the backward's switch, ``_twell_backward``)."""
    x, weights, gate = r.x, r.weights, r.gate
    f = weights[0].shape[0]
    g = gate.values.astype(_F32)
    # The transposed products, one per values array: [F, D], every weight's layout. A batch
    # that went dense discards them (``_dense_backward``), so its kernels store nothing:
    # zeros there would cost a pass over every dW (3 x 235 MB of float32 at D 4096, F 14336).
    outer = lambda values, b: backend.sparse_outer(values, gate.columns, gate.row_nnz, b, f,
                                                   skip=r.dense)
    d1, d2 = backend.row_grads(dy, weights[-1], gate, r.up_values if gated else None, l1_ct)
    if gated:
        du, dg = d1, d2
        (d_w_down,) = outer((g * r.up_values,), dy)
        d_w_gate, d_w_up = outer((dg, du), x)  # one pass over x serves both
        d_weights, d_pre = (d_w_gate, d_w_up, d_w_down), dg
    else:
        (d_w_down,) = outer((g,), dy)
        (d_w_up,) = outer((d1,), x)
        d_weights, d_pre = (d_w_up, d_w_down), d1
    # d bias: the pre-activation gradients summed per column.
    d_bias = None if r.bias is None else column_sums(d_pre, gate.columns, gate.row_nnz, f)
    return _ListGrads((d1, d2), d_weights, d_bias)


def _add_backup_grads(gated: bool, r: _Residuals, dy, l1_ct, grads, index):
    """``grads`` (dx in x.dtype, the rest float32) plus the dense gradients of the backup's
    rows ``index`` [size] (padded with M), in the output dtypes (``_output_grads``). The
    backup's rows of dx are written in place: the lists skip the backup's rows, so the
    kernel left them zero and writing equals adding (a write with unique indices needs no
    atomics: ``set_rows``)."""
    dx, d_weights, d_bias = grads
    valid = index < r.x.shape[0]
    rows_x = take_rows(r.x, index)
    rows_dy = take_rows(dy, index)
    rows_dx, rows_dw, rows_db = _dense_vjp(gated, rows_x, r.weights, r.bias, rows_dy,
                                           jnp.where(valid, l1_ct, 0.0))
    d_weights = tuple(a + b.astype(_F32) for a, b in zip(d_weights, rows_dw))
    d_bias = None if r.bias is None else d_bias + rows_db.astype(_F32)
    dx, d_weights, d_bias = _output_grads(r, (dx, d_weights, d_bias))
    return set_rows(dx, index, rows_dx), d_weights, d_bias


def _output_grads(r: _Residuals, grads):
    """Gradients (dx, d_weights, d_bias or None) cast to the dtypes of x, the weights as
    passed (``r.params``: float32 master weights get ``sparse_outer``'s float32 dW as is), the
    bias."""
    dx, d_weights, d_bias = grads
    return (dx.astype(r.x.dtype), tuple(d.astype(w.dtype) for d, w in zip(d_weights, r.params)),
            None if r.bias is None else d_bias.astype(r.bias.dtype))


def _dense_backward(gated: bool, r: _Residuals, dy, l1_ct):
    """Gradients of the all-dense forward, in the output dtypes."""
    return _output_grads(r, _dense_vjp(gated, r.x, r.weights, r.bias, dy,
                                       jnp.full((r.x.shape[0],), l1_ct)))


def _twell_backward(gated, implementation, config, residuals: _Residuals, cotangents):
    dy, stats_ct = cotangents
    if isinstance(residuals, _DenseVJP):
        m = dy.shape[0]
        return residuals.pullback((dy, jnp.full((m,), stats_ct.l1.astype(_F32) / m)))
    r = residuals
    backend = backends.get(implementation)
    l1_ct = stats_ct.l1.astype(_F32) / r.x.shape[0]  # d(l1)/dh = sign(h) / M
    sizes = _backup_sizes(r.x.shape[0], config)
    # The lists' products run once, before the switch, not in each of its sparse branches:
    # XLA compiles every Triton call on its own, so each branch's copy of the kernels would
    # cost compile time. When the batch went dense the lists are empty
    # (``_twell_forward``) and these cost a few launches. Every branch ends in the cast of the
    # float32 dW to the output dtypes.
    lists = _list_grads(backend, gated, r, dy, l1_ct)
    # dx's kernel runs in each sparse branch instead, as the forward's up/down does: a dx
    # passed into the switch and through it is copied at the end of every branch in the
    # models, whose layers' switches call clones of one set of branches (67 MB a layer at
    # M = 16384, D = 2048). The kernel rounds dx to x.dtype itself, so no float32 dx is
    # written and then read again by a cast.
    def with_backup(index):
        dx = backend.row_dx(r.weights[-2],  # (w_gate, w_up, w_down) or (w_up, w_down)
                            r.weights[0] if gated else None, r.gate, *lists.entries, dy.dtype)
        grads = (dx, lists.d_weights, lists.d_bias)
        if index is None:
            return _output_grads(r, grads)
        return _add_backup_grads(gated, r, dy, l1_ct, grads, index)

    branches = [*_backup_branches(with_backup, r.backup, sizes),
                functools.partial(_dense_backward, gated, r, dy, l1_ct)]
    dx, d_weights, d_bias = jax.lax.switch(_route(r.dense, r.num_heavy, sizes), branches)
    if r.hot is None:
        return dx, d_weights, d_bias
    # The hot units' gradients on the light rows (a dense batch's are in its branch).
    hot = r.hot._replace(used=r.hot.used & ~r.dense)
    dx, hot_grads = hot_units.add_backward(dx, r.x, r.weights, r.bias, gated, hot,
                                           ~(r.backup | r.dense), dy, l1_ct,
                                           backend.add_product)
    d_weights, d_bias = hot_units.scatter_grads(d_weights, d_bias, hot, hot_grads)
    return dx, d_weights, d_bias


def _decode_dense_above(backend: Backend, x: jax.Array, f: int, config: TwELLConfig,
                        partial_sums: bool) -> int | None:
    """The decode path's dense switch: the active (row, unit) entries past which a call
    multiplies every unit instead of walking each row's, or None for no switch.

    ``dense_fallback_density`` (a float) sets it as a share of the call's M * F entries
    (``1.0``: no switch); else the cost model (``CostModel.decode_dense_above``), compiled
    kernels only. The model's decode steps (``partial_sums``) have none: their loop decides
    once, from the prefill's activity (``decode_runs_dense``), and so skips the switch's
    launch."""
    if partial_sums or not backend.cost_model_routes:
        return None
    m = x.shape[0]
    if config.dense_fallback_density is not None:
        if config.dense_fallback_density >= 1.0:
            return None
        return int(config.dense_fallback_density * m * f)
    if not _cost_model_decides(config):
        return None
    return config.cost_model.decode_dense_above(m, f)


def _decode_forward(backend: Backend, x, params, bias, gated, config, partial_sums=False):
    """The backend's list-free decode path: (y [M, D], FFNStats). Every row exact, no backup.
    ``partial_sums``: y may come back as the backend's float32 partial sums [S, M, D]."""
    weights = _compute_weights(x, params)
    dense_above = _decode_dense_above(backend, x, weights[-1].shape[0], config, partial_sums)
    y, l1_rows, active = backend.decode(x, weights[0], bias, weights[1] if gated else None,
                                        weights[-1], partial_sums=partial_sums,
                                        dense_above=dense_above)
    return y, _stats_from_active(active, l1_rows, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _decode_partial_sums(x, params, bias, gated, implementation, config):
    """``_decode_forward`` with partial sums, for inference only: differentiating it raises."""
    return _decode_forward(backends.get(implementation), x, params, bias, gated, config,
                           partial_sums=True)


def _partial_sums_not_differentiable(*args):
    raise ValueError("partial_sums=True is for decode steps (inference): it cannot be "
                     "differentiated; call the FFN without it under jax.grad")


_decode_partial_sums.defvjp(_partial_sums_not_differentiable, _partial_sums_not_differentiable)


def _uses_decode(backend: Backend, m: int, config: TwELLConfig) -> bool:
    return backend.decode is not None and m <= config.decode_rows


def _static_dense(backend: Backend, m: int, d: int, f: int, dtype, config: TwELLConfig,
                  differentiated: bool = False) -> bool:
    """The shape-only switch: a sparse backend whose cost model says even an empty sparse call
    costs more than the dense FFN runs the dense function. Decode-sized calls that are not
    differentiated take the list-free decode path instead; differentiated ones need the lists
    for the sparse backward, whose fixed cost is what the dense function saves."""
    return (backend.cost_model_routes
            and (differentiated or not _uses_decode(backend, m, config))
            and _sparse_never_pays(m, d, f, dtype, config))


def _compute_weights(x: jax.Array, params: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The weights in x.dtype, the dtype every kernel and GEMM computes in."""
    return tuple(w.astype(x.dtype) for w in params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _twell_ffn(x, params, bias, gated, implementation, config):
    """The sparse FFN on x [M, D]; ``params`` the weights in their own dtype (float32 master
    weights, say): cast to x.dtype inside, so the backward returns ``sparse_outer``'s float32
    dW without a round trip through x.dtype (two passes over each [F, D] matrix a call)."""
    # Not differentiated (the primal): few rows take the list-free decode path. Differentiated
    # calls run ``_twell_forward``, whose lists the sparse backward needs.
    backend = backends.get(implementation)
    if _uses_decode(backend, x.shape[0], config):
        return _decode_forward(backend, x, params, bias, gated, config)
    return _twell_forward(x, params, bias, gated, implementation, config,
                          differentiated=False)[0]


_twell_ffn.defvjp(_twell_forward, _twell_backward)


# ----------------------------------------------------------------------------------------
# Public entry points.


def _check_common(x, implementation, config):
    backends.check(implementation)
    if config is not None and not isinstance(config, TwELLConfig):
        raise TypeError(f"config must be a TwELLConfig or None, got {type(config).__name__}")
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must have shape [..., d_model], got shape {x.shape}")


def _check_float(name, a):
    if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype "
                        f"{getattr(a, 'dtype', type(a).__name__)}")


def _check_bias(bias, bias_name, d_ff):
    if bias is not None:
        _check_float(bias_name, bias)
        if bias.shape != (d_ff,):
            raise ValueError(f"{bias_name} has shape {bias.shape}, expected ({d_ff},)")


def _check_flax_layout(x, weights, names):
    """The shapes of weights in the Flax layout (the inputs [D, F], w_down [F, D])."""
    for name, a in zip(names, weights):
        _check_float(name, a)
    d_model = x.shape[-1]
    *in_weights, w_down = weights
    in_names = names[:-1]
    for name, w in zip(in_names, in_weights):
        if w.ndim != 2 or w.shape[0] != d_model:
            raise ValueError(f"{name} has shape {w.shape}, expected ({d_model}, d_ff) to match "
                             f"x of shape {x.shape}")
    d_ff = in_weights[0].shape[1]
    for name, w in zip(in_names, in_weights):
        if w.shape != (d_model, d_ff):
            raise ValueError(f"{name} has shape {w.shape}, expected ({d_model}, {d_ff})")
    if w_down.shape != (d_ff, d_model):
        raise ValueError(f"{names[-1]} has shape {w_down.shape}, expected ({d_ff}, {d_model})")
    if d_ff == 0 or d_model == 0:
        raise ValueError(f"d_model and d_ff must be positive, got {d_model} and {d_ff}")


def _check_unit_rows(x, weights: FFNWeights):
    """The shapes of ``FFNWeights``: every matrix [F, D] (one F and D), D matching x's."""
    if not isinstance(weights, FFNWeights):
        raise TypeError(f"weights must be an FFNWeights (twell_jax.prepare_weights makes one "
                        f"from the Flax layout), got {type(weights).__name__}")
    names = ("gate", "up", "down") if weights.gated else ("up", "down")
    for name, a in zip(names, weights.matrices):
        _check_float(f"weights.{name}", a)
    shape = weights.matrices[0].shape
    for name, w in zip(names, weights.matrices):
        if w.ndim != 2 or w.shape != shape:
            raise ValueError(f"weights.{name} has shape {w.shape}: every FFN weight is "
                             f"[d_ff, d_model], one row per unit, and weights."
                             f"{names[0]} has shape {shape}")
    d_ff, d_model = shape
    if d_ff == 0 or d_model == 0:
        raise ValueError(f"d_model and d_ff must be positive, got {d_model} and {d_ff}")
    if x.shape[-1] != d_model:
        raise ValueError(f"x has shape {x.shape}, but the weights [d_ff, d_model] = {shape} "
                         f"want its last axis to be d_model = {d_model}")


def _ffn(x, weights: FFNWeights, bias, implementation, config, return_stats,
         partial_sums=False):
    """The op on checked inputs, weights one row per unit."""
    backend = backends.get(implementation)
    config = DEFAULT_CONFIG if config is None else config
    gated = weights.gated
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # One compute dtype: weights are cast to x.dtype. The sparse op casts them itself and
    # returns dW in their own dtype; the dense paths' gradients flow back through the cast.
    params = weights.matrices
    weights = _compute_weights(x, params)
    bias = None if bias is None else bias.astype(x.dtype)
    if x2.shape[0] == 0:
        y = jnp.zeros(x.shape, x.dtype)
        zero = jnp.zeros((), _F32)
        zero_int = jnp.zeros((), jnp.int32)
        stats = FFNStats(zero, zero_int, zero_int, zero, zero_int, jnp.asarray(False),
                         jnp.asarray(False), zero_int)
    elif not backend.sparse:
        y, stats = _dense_with_stats(x2, weights, bias, gated, config)
    elif _static_dense(backend, x2.shape[0], x2.shape[1], weights[0].shape[0], x.dtype, config):
        y, stats = _dense_with_stats(x2, weights, bias, gated, config)
        stats = stats._replace(dense_fallback=jnp.asarray(True))
    elif partial_sums and _uses_decode(backend, x2.shape[0], config):
        y, stats = _decode_partial_sums(x2, params, bias, gated, implementation, config)
    else:
        y, stats = _twell_ffn(x2, params, bias, gated, implementation, config)
    y = PartialSums(y) if y.ndim == 3 else y.reshape(*lead, x.shape[-1])
    return (y, stats) if return_stats else y


def decode_runs_dense(implementation: Implementation, nnz_mean: jax.Array, rows: int,
                      d_model: int, d_ff: int, dtype, config: TwELLConfig | None = None,
                      nnz_p99: jax.Array | None = None):
    """Whether a decode loop should run its FFN layers dense, from their measured activity:
    ``nnz_mean`` [L] (the layers' mean active units per token, e.g. a prefill's) and, if
    given, ``nnz_p99`` [L] (their 99th percentiles) for decode steps of ``rows`` token rows.
    Returns a [] bool array, or False where the answer is always no, known from the shapes (a
    dense implementation or a sparse one without a dense route, a decode-sized call that does
    not take the decode path, ``dense_fallback_density=1.0``, or the cost model in interpret
    mode, where the kernels always run).

    The decode path cannot switch per call at no cost: a device-side conditional inside the
    decode loop cost 14-23 us a call on the H100, more than the whole FFN at the design
    point. A loop decides once, before it starts. With ``dense_fallback_density`` set, dense
    when a layer's mean density exceeds it; with the cost model, dense when a layer passes
    ``CostModel.decode_density_limit(rows)`` or the layers' decode up/downs
    (``decode_up_down_seconds`` on ``decode_row_units`` per row: the mean, or a share of the
    p99 for heavy-tailed layers) add up to more than their dense GEMMs."""
    backend = backends.get(implementation)
    config = DEFAULT_CONFIG if config is None else config
    threshold = config.dense_fallback_density
    if (not backend.cost_model_routes or not _uses_decode(backend, rows, config)
            or threshold == 1.0 or (threshold is None and not _cost_model_decides(config))):
        return False
    nnz_mean = jnp.asarray(nnz_mean, _F32)
    density = nnz_mean / d_ff
    if threshold is not None:
        return jnp.any(density > threshold)
    cost = config.cost_model
    itemsize = jnp.dtype(dtype).itemsize
    units = cost.decode_row_units(nnz_mean, nnz_p99)
    sparse = jnp.sum(cost.decode_up_down_seconds(d_model, rows * units, itemsize))
    dense = density.shape[0] * cost.dense_up_down_seconds(rows, d_model, d_ff, itemsize)
    return jnp.any(density > cost.decode_density_limit(rows)) | (sparse > dense)


def path_for(implementation: Implementation, m: int, d_model: int, d_ff: int, dtype,
             config: TwELLConfig | None = None, *,
             differentiated: bool = False) -> Literal["dense", "decode", "lists"]:
    """Which path a call of ``m`` token rows takes, from the shapes alone: ``"dense"`` (the dense
    function), ``"decode"`` (the list-free decode path) or ``"lists"`` (the TwELL lists with the
    dense backup, which may still switch the batch to dense on the device: ``stats.
    dense_fallback`` says). ``differentiated``: the call is under ``jax.grad``/``vjp``."""
    backend = backends.get(implementation)  # raises for an unknown name
    config = DEFAULT_CONFIG if config is None else config
    if not backend.sparse:
        return "dense"
    if not differentiated and _uses_decode(backend, m, config):
        return "decode"
    dense = _static_dense(backend, m, d_model, d_ff, dtype, config, differentiated)
    return "dense" if dense else "lists"


def feed_forward(x: jax.Array, weights: FFNWeights, *, bias: jax.Array | None = None,
                 implementation: Implementation = DEFAULT_IMPLEMENTATION,
                 config: TwELLConfig | None = None, return_stats: bool = False,
                 partial_sums: bool = False):
    """The FFN on weights stored one row per unit: gated
    ``(relu(x @ gate.T + bias) * (x @ up.T)) @ down``, or non-gated
    ``relu(x @ up.T + bias) @ down`` when ``weights.gate`` is None. No weight is transposed
    (``twell_jax.layout``): the entry point for repeated calls, and the layers'.

    Args:
      x: [..., D] activations (bf16 or float32; the compute and output dtype).
      weights: ``FFNWeights``, every matrix [F, D] (``prepare_weights`` makes them from the
        Flax layout once). Cast to x.dtype.
      bias: optional [F] bias of the ReLU's input (cast to x.dtype, added in float32): a
        negative bias is a per-unit threshold that makes the unit fire less often.
      implementation: "pallas" (Pallas kernels; interpret mode without a GPU), "reference"
        (the TwELL algorithm in plain jnp) or "xla" (dense).
      config: the TwELL format's knobs (``TwELLConfig()`` when None).
      return_stats: also return an ``FFNStats``.
      partial_sums: where the call takes the decode path (``path_for``: "decode") of a backend
        that leaves its output unfinished ("pallas"), return y as ``PartialSums`` [S, M, D]
        (M = the rows of x) instead, for a consumer that adds them itself; other calls return
        y as usual. Inference only: such a call cannot be differentiated.
    Returns:
      y [..., D] in x.dtype (or ``PartialSums``), or ``(y, stats)``. Differentiable in x, the
      weights (gradients [F, D], in each weight's dtype) and the bias (without
      ``partial_sums``).
    """
    _check_common(x, implementation, config)
    _check_unit_rows(x, weights)
    _check_bias(bias, "bias", weights.up.shape[0])
    return _ffn(x, weights, bias, implementation, config, return_stats, partial_sums)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
              b_gate: jax.Array | None = None,
              implementation: Implementation = DEFAULT_IMPLEMENTATION,
              config: TwELLConfig | None = None, return_stats: bool = False,
              partial_sums: bool = False):
    """ReLU-gated FFN ``(relu(x @ w_gate + b_gate) * (x @ w_up)) @ w_down`` with TwELL
    sparsity, on weights in the Flax layout.

    Each call transposes w_gate and w_up into the layout the kernels read (XLA folds the
    transposes into the dense paths' GEMMs, not into the sparse kernels'): for repeated calls
    make ``prepare_weights(w_gate, w_up, w_down)`` once and call ``feed_forward``.

    Args:
      x: [..., D] activations (bf16 or float32; the compute and output dtype).
      w_gate, w_up: [D, F]. w_down: [F, D]. Cast to x.dtype.
      b_gate: optional [F] gate bias (``feed_forward``'s ``bias``).
      implementation, config, return_stats, partial_sums: as ``feed_forward``'s.
    Returns:
      As ``feed_forward``; the weights' gradients in their own layout.
    """
    _check_common(x, implementation, config)
    _check_flax_layout(x, (w_gate, w_up, w_down), ("w_gate", "w_up", "w_down"))
    _check_bias(b_gate, "b_gate", w_gate.shape[1])
    return _ffn(x, prepare_weights(w_gate, w_up, w_down), b_gate, implementation, config,
                return_stats, partial_sums)


def mlp(x: jax.Array, w_up: jax.Array, w_down: jax.Array, *, b_up: jax.Array | None = None,
        implementation: Implementation = DEFAULT_IMPLEMENTATION, config: TwELLConfig | None = None,
        return_stats: bool = False, partial_sums: bool = False):
    """Non-gated ReLU FFN ``relu(x @ w_up + b_up) @ w_down`` with TwELL sparsity, on weights
    in the Flax layout (w_up transposed per call: see ``gated_mlp``).

    Args and returns as ``gated_mlp``: x [..., D], w_up [D, F], w_down [F, D], optional
    b_up [F].
    """
    _check_common(x, implementation, config)
    _check_flax_layout(x, (w_up, w_down), ("w_up", "w_down"))
    _check_bias(b_up, "b_up", w_up.shape[1])
    return _ffn(x, prepare_weights(None, w_up, w_down), b_up, implementation, config,
                return_stats, partial_sums)
