"""The ``"reference"`` backend: the TwELL building blocks in plain jnp (the yardstick of the
kernels).

The list products loop over the list position k up to the batch's largest ``row_nnz`` and touch
one gathered [M, D] slab per step, so memory stays O(M * D) whatever K is. Entries
``k >= row_nnz[m]`` are masked: whatever they hold never reaches the result. fp32 accumulation
throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.add_product import add_product_reference
from pallas_kernels.row_up_down import row_up_down_reference
from pallas_kernels.scan_up_down import scan_up_down_reference
from pallas_kernels.sparse_outer import sparse_outer_reference
from twell_jax import hot_units
from twell_jax.backends.base import Backend, RowLists
from twell_jax.config import TwELLConfig
from twell_jax.dense import dot_rows
from twell_jax.format import pack_tiles, row_compact, sampled_active, valid_entries

_F32 = jnp.float32


def sampled_dot(a: jax.Array, w: jax.Array, columns: jax.Array, row_nnz: jax.Array) -> jax.Array:
    """out[m, k] = a[m] . w[columns[m, k]] for k < row_nnz[m], else 0.

    a: [M, D]; w: [F, D]; columns: [M, K] int32; row_nnz: [M] int32. Returns [M, K] float32.
    """
    m, k = columns.shape
    nnz = jnp.clip(row_nnz, 0, k)
    a32 = a.astype(_F32)

    def step(kk, out):
        valid = kk < nnz
        rows = w[jnp.where(valid, columns[:, kk], 0)].astype(_F32)
        return out.at[:, kk].set(jnp.where(valid, jnp.sum(a32 * rows, axis=1), 0.0))

    return jax.lax.fori_loop(0, jnp.max(nnz, initial=0), step, jnp.zeros((m, k), _F32))


def sparse_dot(values: jax.Array, columns: jax.Array, row_nnz: jax.Array,
               w: jax.Array) -> jax.Array:
    """out[m] = sum_{k < row_nnz[m]} values[m, k] * w[columns[m, k]].

    values: [M, K]; columns: [M, K] int32; row_nnz: [M]; w: [F, D]. Returns [M, D] float32.
    (The reference of ``row_up_down``'s non-gated form.)
    """
    return row_up_down_reference(None, None, w, values, columns, row_nnz, out_dtype=_F32)[0]


def sparse_outer(values: tuple[jax.Array, ...], columns: jax.Array, row_nnz: jax.Array,
                 b: jax.Array, d_ff: int, skip: jax.Array | None = None
                 ) -> tuple[jax.Array, ...]:
    """Transposed products: out_i[j] = sum over (m, k) with columns[m, k] = j of
    values_i[m, k] * b[m].

    values: a tuple of [M, K] arrays sharing the pattern; columns: [M, K]; row_nnz: [M];
    b: [M, D]. Returns a tuple of [d_ff, D] float32, one per values array (e.g. dW_down =
    h^T @ dy with h packed). (The ``sparse_outer`` kernel's reference.) ``skip`` is ignored:
    the products are always computed.
    """
    del skip
    return sparse_outer_reference(values, columns, row_nnz, b, d_ff)


def _pack(x: jax.Array, w: jax.Array, bias: jax.Array | None, config: TwELLConfig,
          differentiated: bool = True):
    del differentiated  # no cost model: hot units whenever some unit passes the rate
    (m, d), f = x.shape, w.shape[0]
    pre = dot_rows(x, w, jnp.float32)
    if bias is not None:
        pre = pre + bias.astype(jnp.float32)
    hot = hot_units.select(sampled_active(pre), m, d, f, jnp.dtype(x.dtype).itemsize, config,
                           cost_decides=False)
    gate = jax.nn.relu(pre)
    if hot is not None:  # the hot units are left out of the lists
        gate = jnp.where(hot.mask[None, :], 0.0, gate)
    values, columns, counts = pack_tiles(gate, config.tile_width, config.slots_per_tile)
    values, columns, _ = row_compact(values.astype(x.dtype), columns, counts,
                                     config.slots_per_tile)
    lists = RowLists(values, columns, counts.sum(axis=1, dtype=jnp.int32))
    return lists, counts, None, None, hot


def _up_down(x, w_up, w_down, gate: RowLists):
    gate_values, columns, row_nnz = gate
    valid = valid_entries(row_nnz, columns.shape[1])
    l1_rows = lambda hidden: jnp.sum(jnp.where(valid, jnp.abs(hidden), 0.0), axis=1)
    if x is None:
        y = sparse_dot(gate_values, columns, row_nnz, w_down)
        return y.astype(w_down.dtype), None, l1_rows(gate_values.astype(jnp.float32))
    up_values = sampled_dot(x, w_up, columns, row_nnz)
    hidden = gate_values.astype(jnp.float32) * up_values
    y = sparse_dot(hidden, columns, row_nnz, w_down)
    return y.astype(x.dtype), up_values, l1_rows(hidden)


def _row_grads(dy, w_down, gate: RowLists, up_values, l1):
    """The backward's per-entry gradients from the generic list products: (du, dg) gated,
    (dh, None) non-gated."""
    gate_values, columns, row_nnz = gate
    g = gate_values.astype(jnp.float32)
    h = g if up_values is None else g * up_values
    dh = sampled_dot(dy, w_down, columns, row_nnz)
    dh = dh + l1 * jnp.sign(h)  # entries past row_nnz: h = 0, sign 0
    return (dh, None) if up_values is None else (dh * g, dh * up_values)


def _row_dx(w_up, w_gate, gate: RowLists, d1, d2, dx_dtype):
    _, columns, row_nnz = gate
    dx = sparse_dot(d1, columns, row_nnz, w_up)
    if w_gate is not None:
        dx = dx + sparse_dot(d2, columns, row_nnz, w_gate)
    return dx.astype(dx_dtype)


def _decode(x, w_in, bias, w_up, w_down, partial_sums=False, dense_above=None):
    """The decode path in float32: the gate as ``_pack`` computes it, then the active units'
    products (inactive units' hidden values exactly zero), the same function in either mode
    of the dense switch. y is always finished."""
    del partial_sums, dense_above
    pre = dot_rows(x, w_in, jnp.float32)
    if bias is not None:
        pre = pre + bias.astype(jnp.float32)
    active = jnp.logical_not(pre <= 0)  # > 0 or NaN
    y, l1 = scan_up_down_reference(pre, None if w_up is None else x, w_up, w_down,
                                   out_dtype=x.dtype)
    return y, l1, active


BACKEND = Backend(sparse=True, pack=_pack, up_down=_up_down, row_grads=_row_grads,
                  row_dx=_row_dx, sparse_outer=sparse_outer, decode=_decode,
                  add_product=add_product_reference)
