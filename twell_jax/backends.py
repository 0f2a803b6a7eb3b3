"""The building blocks each TwELL implementation provides, looked up by name.

A backend supplies the packed products the shared algorithm in ``ffn.py`` needs:

- ``pack(x [M, D], w [D, F], bias [F] or None, config)`` -> ``(values [M, K] x.dtype, columns
  [M, K] int32, counts [M, n_tiles] int32, row_total [M] int32, pre)``: the positive entries
  of ``relu(x @ w + bias)`` listed per row in column order, the true per-tile counts and row
  totals. Only light rows' lists (``format.heavy_rows`` false; K >= ``config.max_row_nnz(F)``
  or every tile's S slots) must be valid, and only their first ``row_total`` entries;
  ``pre`` is the dense [M, F] pre-activation ``x @ w`` in x.dtype when the backend computed it
  anyway (the dense fallback then reuses it), else None.
- ``up_down(x, w_up_t [F, D], w_down [F, D], gate_values [M, K], columns, row_nnz)`` -> ``(y
  [M, D] x.dtype, up_values [M, K] float32)``: the gated up/down projection on the lists; with
  x and w_up_t None the non-gated down projection ``(y [M, D] w_down.dtype, None)``.
- ``row_backward(dy [M, D], w_down, w_up_t, w_gate_t or None, gate_values, up_values or None,
  columns, row_nnz, l1)`` -> ``(dx [M, D] float32, du or dh [M, K] float32, dg or None)``: the
  per-row products of the backward (``pallas_kernels.row_backward`` says what they are).
- ``sparse_outer(values: tuple of [M, K], columns, row_nnz, b [M, D], d_ff)`` -> tuple of
  [d_ff, D] float32, one per values array (all share the pattern and b): the transposed
  products of the backward (dW).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable

import jax
import jax.numpy as jnp

from twell_jax import sparse_ops
from twell_jax.config import TwELLConfig
from twell_jax.format import pack_tiles, row_compact


@dataclasses.dataclass(frozen=True)
class Backend:
    pack: Callable
    up_down: Callable
    row_backward: Callable
    sparse_outer: Callable


def _reference_pack(x: jax.Array, w: jax.Array, bias: jax.Array | None, config: TwELLConfig):
    pre = jnp.dot(x, w, preferred_element_type=jnp.float32)
    gate = jax.nn.relu(pre if bias is None else pre + bias.astype(jnp.float32))
    values, columns, counts = pack_tiles(gate, config.tile_width, config.slots_per_tile)
    values, columns, _ = row_compact(values.astype(x.dtype), columns, counts,
                                     config.slots_per_tile)
    return values, columns, counts, counts.sum(axis=1, dtype=jnp.int32), None


def _reference_up_down(x, w_up_t, w_down, gate_values, columns, row_nnz):
    if x is None:
        y = sparse_ops.sparse_dot(gate_values, columns, row_nnz, w_down)
        return y.astype(w_down.dtype), None
    up_values = sparse_ops.sampled_dot(x, w_up_t, columns, row_nnz)
    hidden = gate_values.astype(jnp.float32) * up_values
    y = sparse_ops.sparse_dot(hidden, columns, row_nnz, w_down)
    return y.astype(x.dtype), up_values


def _reference_row_backward(dy, w_down, w_up_t, w_gate_t, gate_values, up_values, columns,
                            row_nnz, l1):
    """The backward's per-row products composed from the generic list products."""
    g = gate_values.astype(jnp.float32)
    h = g if up_values is None else g * up_values
    dh = sparse_ops.sampled_dot(dy, w_down, columns, row_nnz)
    dh = dh + l1 * jnp.sign(h)  # entries past row_nnz: h = 0, sign 0
    if w_gate_t is None:
        return sparse_ops.sparse_dot(dh, columns, row_nnz, w_up_t), dh, None
    du, dg = dh * g, dh * up_values
    dx = (sparse_ops.sparse_dot(du, columns, row_nnz, w_up_t)
          + sparse_ops.sparse_dot(dg, columns, row_nnz, w_gate_t))
    return dx, du, dg


REFERENCE = Backend(
    pack=_reference_pack,
    up_down=_reference_up_down,
    row_backward=_reference_row_backward,
    sparse_outer=sparse_ops.sparse_outer,
)


@functools.cache
def _pallas_backend() -> Backend:
    from twell_jax import pallas_backend  # imports the kernels only when asked for

    return pallas_backend.BACKEND


_BACKENDS = types.MappingProxyType({
    "reference": lambda: REFERENCE,
    "pallas": _pallas_backend,
})


def get(name: str) -> Backend:
    """The backend called ``name`` ("reference" or "pallas"); raises for any other name."""
    if name not in _BACKENDS:
        raise ValueError(f"no TwELL backend named {name!r}; have {tuple(_BACKENDS)}")
    return _BACKENDS[name]()
