"""Plain-jnp products on row-compacted TwELL lists (the reference for every kernel).

All three loop over the list position k up to the batch's largest ``row_nnz`` and touch
one gathered [M, D] slab per step, so memory stays O(M * D) whatever K is. Entries
``k >= row_nnz[m]`` are masked: whatever they hold never reaches the result.
fp32 accumulation throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _valid(row_nnz: jax.Array, k) -> jax.Array:
    return k < row_nnz


def sampled_dot(a: jax.Array, w: jax.Array, columns: jax.Array, row_nnz: jax.Array) -> jax.Array:
    """out[m, k] = a[m] . w[columns[m, k]] for k < row_nnz[m], else 0.

    a: [M, D]; w: [F, D]; columns: [M, K] int32; row_nnz: [M] int32. Returns [M, K] float32.
    """
    m, k_slots = columns.shape
    a32 = a.astype(_F32)

    def body(k, out):
        ok = _valid(row_nnz, k)
        rows = jnp.take(w, jnp.where(ok, columns[:, k], 0), axis=0).astype(_F32)
        dot = jnp.sum(a32 * rows, axis=1)
        return out.at[:, k].set(jnp.where(ok, dot, 0.0))

    return jax.lax.fori_loop(0, jnp.max(row_nnz), body, jnp.zeros((m, k_slots), _F32))


def sparse_dot(values: jax.Array, columns: jax.Array, row_nnz: jax.Array, w: jax.Array) -> jax.Array:
    """out[m] = sum_{k < row_nnz[m]} values[m, k] * w[columns[m, k]].

    values: [M, K]; columns: [M, K] int32; row_nnz: [M]; w: [F, D]. Returns [M, D] float32.
    """
    m = values.shape[0]

    def body(k, out):
        ok = _valid(row_nnz, k)
        rows = jnp.take(w, jnp.where(ok, columns[:, k], 0), axis=0).astype(_F32)
        scale = jnp.where(ok, values[:, k].astype(_F32), 0.0)
        # where(), not a product, so a masked row never turns an Inf weight into NaN.
        return out + jnp.where(ok[:, None], scale[:, None] * rows, 0.0)

    return jax.lax.fori_loop(0, jnp.max(row_nnz), body, jnp.zeros((m, w.shape[1]), _F32))


def sparse_outer(values: jax.Array, columns: jax.Array, row_nnz: jax.Array, b: jax.Array,
                 d_ff: int) -> jax.Array:
    """The transposed product: out[j] = sum over (m, k) with columns[m, k] = j of values[m, k] * b[m].

    values: [M, K]; columns: [M, K]; row_nnz: [M]; b: [M, D]. Returns [d_ff, D] float32
    (e.g. dW_down = h^T @ dy with h packed).
    """
    b32 = b.astype(_F32)

    def body(k, out):
        ok = _valid(row_nnz, k)
        dest = jnp.where(ok, columns[:, k], d_ff)  # d_ff = dropped
        return out.at[dest].add(values[:, k].astype(_F32)[:, None] * b32, mode="drop")

    return jax.lax.fori_loop(0, jnp.max(row_nnz), body, jnp.zeros((d_ff, b.shape[1]), _F32))
