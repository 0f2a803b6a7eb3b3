"""Hot units: the few units that fire for a large share of a batch's tokens, on a dense GEMM.

A unit active on most tokens is the lists' worst case. Each of its entries costs two gathered
weight rows in the forward and a share of the column-sorted pass in the backward, and it
pushes rows past the row cap into the dense backup; as a column of a dense GEMM it costs
next to nothing per token. So up to ``slots`` units that fire on many of a batch's tokens,
counted on a sample of rows of the gate pre-activation, can leave the lists (``row_pack``'s ``exclude``) and run as
a small dense FFN of K units on the tensor cores:

    y_hot = (relu(x @ w_gate[hot].T + b[hot]) * (x @ w_up[hot].T)) @ w_down[hot]

added to the lists' output on the light rows. The dense backup's rows and a batch that goes
dense compute every unit themselves, so there the hot GEMMs add nothing. Which units are hot
decides only the speed: every unit of every row is computed once either way, in float32
accumulation. Whether a batch uses them at all is decided on the device
(``select``); a batch that does not runs exactly as without them, but pays for the choice
(a sample's column counts and two device-side branches: 2-3% of the FFN at the design point
on the H100, ~4% of a 0.5b prefill under the layer scan), so it is opt-in
(``TwELLConfig.hot_units``, 0 by default).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from twell_jax.config import TwELLConfig
from twell_jax.dense import dot_rows

_F32 = jnp.float32


class HotUnits(NamedTuple):
    """A batch's hot units.

    index: [K] int32, the slots' units (distinct where ``on``; the spare slots hold unit 0).
    on: [K] bool, the slot's unit is hot: left out of the lists, computed by the hot GEMMs.
    mask: [F'] bool (F' >= F, the packing's padded width): the hot units, for ``row_pack``.
    used: [] bool, any slot on: the hot GEMMs run for this batch.
    """

    index: jax.Array
    on: jax.Array
    mask: jax.Array
    used: jax.Array


def slots(m: int, d_ff: int, config: TwELLConfig) -> int:
    """K, the hot units a call of ``m`` token rows may take off the lists (static): 0 below
    ``config.hot_min_rows`` rows, where the hot GEMMs' launches cost more than the entries
    they save, and at most an eighth of the units."""
    if m < config.hot_min_rows:
        return 0
    return min(config.hot_units, d_ff // 8)


def select(active_sample: jax.Array, m: int, d_model: int, d_ff: int, itemsize: int,
           config: TwELLConfig, cost_decides: bool, differentiated: bool = True
           ) -> HotUnits | None:
    """The hot units of a batch of ``m`` rows from ``active_sample`` [R, F'] bool, the active
    units of a sample of its rows (F' >= ``d_ff``; padded columns never active). None when
    ``slots`` is 0.

    A unit is hot when it fired on at least ``config.hot_unit_rate`` of the sample (and on
    two rows, so that one stray hit in a small sample is not taken for a rate); the first
    ``slots`` such units (by index) take the slots. With ``cost_decides`` the batch uses
    them only where the cost model says the entries they take off the lists cost more than
    the hot GEMMs (``CostModel.hot_units_pay``; ``differentiated``: the backward will run
    too, where an entry costs more); otherwise (interpret mode) whenever one is
    hot, so the tests exercise the path. (A threshold and ``nonzero`` rather than a top-k:
    no sort on the device.)"""
    k = slots(m, d_ff, config)
    if k == 0:
        return None
    rows, width = active_sample.shape
    counts = jnp.sum(active_sample, axis=0, dtype=jnp.int32)
    threshold = max(2.0, config.hot_unit_rate * rows)

    def choose():
        hot = counts >= threshold
        # The slots' units, the spare ones padded with unit 0 (``on`` False: nothing moves).
        (index,) = jnp.nonzero(hot, size=k, fill_value=0)
        on = jnp.arange(k) < jnp.sum(hot, dtype=jnp.int32)
        used = jnp.any(on)
        if cost_decides:
            moved = jnp.sum(jnp.where(on, counts[index], 0).astype(_F32)) * (m / rows)
            used = used & config.cost_model.hot_units_pay(m, d_model, k, moved, itemsize,
                                                          differentiated)
        on = on & used
        mask = jnp.zeros((width,), jnp.bool_).at[index].max(on)
        return HotUnits(index.astype(jnp.int32), on, mask, used)

    def none():
        return HotUnits(jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.bool_),
                        jnp.zeros((width,), jnp.bool_), jnp.asarray(False))

    # Most batches have no unit past the rate: for them one reduction and a branch that only
    # writes zeros instead of the choice's scan and scatters (~10 us of small launches on the
    # H100, below the spread of a whole call's time).
    return jax.lax.cond(jnp.max(counts) >= threshold, choose, none)


class _HotActivations(NamedTuple):
    gate: jax.Array  # [M, K] float32 pre-activation (with the bias)
    up: jax.Array | None  # [M, K] float32 (gated), else None
    active: jax.Array  # [M, K] bool: gate > 0 (or NaN) on a hot slot, every row
    kept: jax.Array  # [M, K] bool: ``active`` on ``rows`` (the entries the output has)
    hidden: jax.Array  # [M, K] float32, zero where not ``kept``


def _input_rows(weights: tuple[jax.Array, ...], hot: HotUnits) -> jax.Array:
    """[w_gate; w_up][hot] (gated) or w_up[hot]: [K or 2K, D], the hot GEMM's weight rows."""
    return jnp.concatenate([w[hot.index] for w in weights[:-1]], axis=0)


def _activations(x, w_in, bias, gated: bool, hot: HotUnits, rows) -> _HotActivations:
    """The hot units' activations on x [M, D'] (D' = w_in's width, zero past D for a widened
    x): one GEMM x @ w_in.T (``_input_rows``), float32 output. ``rows`` [M] bool: the rows
    whose hidden values count (the light rows)."""
    k = hot.index.shape[0]
    products = dot_rows(x, w_in, _F32)
    gate = products[:, :k]
    if bias is not None:
        gate = gate + bias[hot.index].astype(_F32)
    up = products[:, k:] if gated else None
    active = jnp.logical_not(gate <= 0) & hot.on[None, :]  # > 0 or NaN, as packed
    kept = active & rows[:, None]
    hidden = jnp.where(kept, gate, 0.0)
    if gated:
        hidden = hidden * up
    return _HotActivations(gate, up, active, kept, hidden)


def add_forward(y: jax.Array, x: jax.Array, weights: tuple[jax.Array, ...], bias, gated: bool,
                hot: HotUnits, rows: jax.Array, add_product: Callable):
    """``y`` [M, D] plus the hot units' output on the ``rows`` [M] bool, where ``hot.used``.

    Returns (y [M, D] y.dtype, l1 sum [] float32 over the rows, hot active units per row [M]
    int32 over every row, for the statistics). ``weights`` are [F, D] in x.dtype.
    ``add_product(y, h, w, run)``: the backend's ``y + h @ w`` where ``run``, written over y
    (``pallas_kernels.add_product``), so a batch without hot units copies nothing.

    x may be wider than D (a widened input: the folded gate bias's column and padding, which
    the pack and the up/down read in its place): its columns past D meet zero weight columns,
    so the call reads the array the others read and x itself need not be kept alive."""
    m, k = x.shape[0], hot.index.shape[0]

    def run():
        w_in = _input_rows(weights, hot)
        w_in = jnp.pad(w_in, ((0, 0), (0, x.shape[1] - w_in.shape[1])))
        acts = _activations(x, w_in, bias, gated, hot, rows)
        return (acts.hidden.astype(x.dtype), jnp.sum(jnp.abs(acts.hidden)),
                jnp.sum(acts.active, axis=1, dtype=jnp.int32))

    def skip():
        return (jnp.zeros((m, k), x.dtype), jnp.zeros((), _F32), jnp.zeros((m,), jnp.int32))

    hidden, l1, nnz = jax.lax.cond(hot.used, run, skip)
    return add_product(y, hidden, weights[-1][hot.index], hot.used), l1, nnz


class HotGrads(NamedTuple):
    """The hot units' gradients: ``d_weights`` [K, D] float32 per weight (in the weights'
    order, for the rows ``index``), ``d_bias`` [K] float32 or None."""

    d_weights: tuple[jax.Array, ...]
    d_bias: jax.Array | None


def add_backward(dx: jax.Array, x, weights, bias, gated: bool, hot: HotUnits, rows, dy,
                 l1_ct, add_product: Callable) -> tuple[jax.Array, HotGrads]:
    """The backward of ``add_forward``: (dx [M, D] plus the hot units' input gradient,
    ``HotGrads``), zeros where not ``hot.used``. ``dy`` [M, D] and ``l1_ct`` [] float32 (the
    cotangent of each row's sum |h|) are the cotangents of y and the l1 sum's rows."""
    m, d = x.shape
    k = hot.index.shape[0]
    n_in = len(weights) - 1
    # [n_in K, D], gathered outside the branch: ``add_product`` takes an operand of this shape
    # whether or not it runs, so a batch without hot units would otherwise write as many zeros.
    w_in = _input_rows(weights, hot)

    def run():
        acts = _activations(x, w_in, bias, gated, hot, rows)
        hidden, keep = acts.hidden, acts.kept
        d_hidden = dot_rows(dy, weights[-1][hot.index], _F32) + l1_ct * jnp.sign(hidden)
        if gated:
            d_gate = jnp.where(keep, d_hidden * acts.up, 0.0)
            d_up = jnp.where(keep, d_hidden * acts.gate, 0.0)
            d_in = jnp.concatenate([d_gate, d_up], axis=1)
        else:
            d_gate = d_in = jnp.where(keep, d_hidden, 0.0)
        d_in = d_in.astype(x.dtype)
        contract_rows = (((0,), (0,)), ((), ()))
        d_w_in = jax.lax.dot_general(d_in, x, contract_rows, preferred_element_type=_F32)
        d_w_down = jax.lax.dot_general(hidden.astype(x.dtype), dy.astype(x.dtype),
                                       contract_rows, preferred_element_type=_F32)
        d_weights = tuple(d_w_in[i * k:(i + 1) * k] for i in range(n_in)) + (d_w_down,)
        d_bias = None if bias is None else jnp.sum(d_gate, axis=0)
        return d_in, HotGrads(d_weights, d_bias)

    def skip():
        zeros = jnp.zeros((k, d), _F32)
        return (jnp.zeros((m, n_in * k), x.dtype),
                HotGrads((zeros,) * (n_in + 1), None if bias is None else jnp.zeros((k,), _F32)))

    d_in, grads = jax.lax.cond(hot.used, run, skip)
    return add_product(dx, d_in, w_in, hot.used), grads


def scatter_grads(d_weights: tuple[jax.Array, ...], d_bias, hot: HotUnits, grads: HotGrads):
    """``d_weights`` ([F, D] each) and ``d_bias`` ([F] or None) plus ``grads`` at the hot
    units' rows, in their own dtypes (each hot unit appears once: a scatter-add)."""
    d_weights = tuple(dw.at[hot.index].add(g.astype(dw.dtype))
                      for dw, g in zip(d_weights, grads.d_weights))
    if d_bias is not None:
        d_bias = d_bias.at[hot.index].add(grads.d_bias.astype(d_bias.dtype))
    return d_weights, d_bias
