"""Plain-jnp products on row-compacted TwELL lists (the reference for every kernel).

All three loop over the list position k up to the batch's largest ``row_nnz`` and touch
one gathered [M, D] slab per step, so memory stays O(M * D) whatever K is. Entries
``k >= row_nnz[m]`` are masked: whatever they hold never reaches the result.
fp32 accumulation throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.row_up_down import row_up_down_reference
from pallas_kernels.sparse_outer import sparse_outer_reference

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


def sparse_dot(values: jax.Array, columns: jax.Array, row_nnz: jax.Array, w: jax.Array) -> jax.Array:
    """out[m] = sum_{k < row_nnz[m]} values[m, k] * w[columns[m, k]].

    values: [M, K]; columns: [M, K] int32; row_nnz: [M]; w: [F, D]. Returns [M, D] float32.
    (The reference of ``row_up_down``'s non-gated form.)
    """
    return row_up_down_reference(None, None, w, values, columns, row_nnz, out_dtype=_F32)[0]


def sparse_outer(values: tuple[jax.Array, ...], columns: jax.Array, row_nnz: jax.Array,
                 b: jax.Array, d_ff: int) -> tuple[jax.Array, ...]:
    """Transposed products: out_i[j] = sum over (m, k) with columns[m, k] = j of values_i[m, k] * b[m].

    values: a tuple of [M, K] arrays sharing the pattern; columns: [M, K]; row_nnz: [M];
    b: [M, D]. Returns a tuple of [d_ff, D] float32, one per values array (e.g. dW_down =
    h^T @ dy with h packed). (The ``sparse_outer`` kernel's reference.)
    """
    return sparse_outer_reference(values, columns, row_nnz, b, d_ff)
