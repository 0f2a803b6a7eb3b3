"""The building blocks each TwELL implementation provides, looked up by name.

A backend supplies the packed products the shared algorithm in ``ffn.py`` needs:

- ``pack(x [M, D], w [D, F], bias [F] or None, config)`` -> ``(values [M, K] x.dtype, columns
  [M, K] int32, counts [M, n_tiles] int32, row_nnz [M] int32, dense_gate)``: ``relu(x @ w +
  bias)`` packed per tile
  and row-compacted (``format.row_compact``); ``dense_gate`` is the dense [M, F] gate in
  x.dtype when the backend computed it anyway (the dense fallback then reuses it), else None.
- ``gated_up_down(x, w_up_t [F, D], w_down [F, D], gate_values [M, K], columns, row_nnz)``
  -> ``(y [M, D] float32 or x.dtype, up_values [M, K] float32)``.
- ``sparse_dot(values [M, K], columns, row_nnz, w [F, D])`` -> [M, D].
- ``sampled_dot(a [M, D], w [F, D], columns, row_nnz)`` -> [M, K] float32.
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
    gated_up_down: Callable
    sparse_dot: Callable
    sampled_dot: Callable
    sparse_outer: Callable


def _reference_pack(x: jax.Array, w: jax.Array, bias: jax.Array | None, config: TwELLConfig):
    pre = jnp.dot(x, w, preferred_element_type=jnp.float32)
    gate = jax.nn.relu(pre if bias is None else pre + bias.astype(jnp.float32))
    values, columns, counts = pack_tiles(gate, config.tile_width, config.slots_per_tile)
    values, columns, row_nnz = row_compact(values.astype(x.dtype), columns, counts,
                                           config.slots_per_tile)
    return values, columns, counts, row_nnz, None


def _reference_gated_up_down(x, w_up_t, w_down, gate_values, columns, row_nnz):
    up_values = sparse_ops.sampled_dot(x, w_up_t, columns, row_nnz)
    hidden = gate_values.astype(jnp.float32) * up_values
    return sparse_ops.sparse_dot(hidden, columns, row_nnz, w_down), up_values


REFERENCE = Backend(
    pack=_reference_pack,
    gated_up_down=_reference_gated_up_down,
    sparse_dot=sparse_ops.sparse_dot,
    sampled_dot=sparse_ops.sampled_dot,
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
