"""What a TwELL backend supplies: the packed products the shared algorithm in ``ffn.py`` needs.

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
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of the four building blocks above."""

    pack: Callable
    up_down: Callable
    row_backward: Callable
    sparse_outer: Callable
