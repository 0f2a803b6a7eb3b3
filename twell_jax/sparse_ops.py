"""Plain-jnp products on row-compacted TwELL lists (the reference for every kernel).

All three loop over the list position k up to the batch's largest ``row_nnz`` and touch
one gathered [M, D] slab per step, so memory stays O(M * D) whatever K is. Entries
``k >= row_nnz[m]`` are masked: whatever they hold never reaches the result.
fp32 accumulation throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sampled_dot import sampled_dot_reference
from pallas_kernels.sparse_down import sparse_down_reference
from pallas_kernels.sparse_outer import sparse_outer_reference

_F32 = jnp.float32


def sampled_dot(a: jax.Array, w: jax.Array, columns: jax.Array, row_nnz: jax.Array) -> jax.Array:
    """out[m, k] = a[m] . w[columns[m, k]] for k < row_nnz[m], else 0.

    a: [M, D]; w: [F, D]; columns: [M, K] int32; row_nnz: [M] int32. Returns [M, K] float32.
    (The ``sampled_dot`` kernel's reference.)
    """
    return sampled_dot_reference(a, w, columns, row_nnz)


def sparse_dot(values: jax.Array, columns: jax.Array, row_nnz: jax.Array, w: jax.Array) -> jax.Array:
    """out[m] = sum_{k < row_nnz[m]} values[m, k] * w[columns[m, k]].

    values: [M, K]; columns: [M, K] int32; row_nnz: [M]; w: [F, D]. Returns [M, D] float32.
    (The ``sparse_down`` kernel's reference.)
    """
    return sparse_down_reference(values, columns, row_nnz, w, out_dtype=_F32)


def sparse_outer(values: tuple[jax.Array, ...], columns: jax.Array, row_nnz: jax.Array,
                 b: jax.Array, d_ff: int) -> tuple[jax.Array, ...]:
    """Transposed products: out_i[j] = sum over (m, k) with columns[m, k] = j of values_i[m, k] * b[m].

    values: a tuple of [M, K] arrays sharing the pattern; columns: [M, K]; row_nnz: [M];
    b: [M, D]. Returns a tuple of [d_ff, D] float32, one per values array (e.g. dW_down =
    h^T @ dy with h packed). (The ``sparse_outer`` kernel's reference.)
    """
    return sparse_outer_reference(values, columns, row_nnz, b, d_ff)
