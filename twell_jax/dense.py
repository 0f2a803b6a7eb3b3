"""Dense building blocks shared by the ops and the backends."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gemv import gemv

_K_MULTIPLE = 64  # the GEMM's contraction length is padded to this (tensor-core friendly)


def gate_pre_activation(x: jax.Array, w: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``x @ w + bias`` [M, F] in x.dtype, float32 accumulation inside the GEMM.

    The GEMM emits x.dtype directly, as a plain Flax layer does (half the bytes of a float32
    output). A bias is folded into the GEMM as one more contraction row (``[x, 1] @ [w; b]``,
    zero-padded to a multiple of 64), so the sum is rounded once: a threshold bias cancels
    most of ``x @ w`` for the active units, and adding it after rounding ``x @ w`` to bf16
    would lose the gate's low bits (5-10% gradient errors on small test problems), while a
    float32 GEMM output plus a separate add pass costs ~0.5 ms per call at M = 16384.

    With few rows (2 M < D: decode) the concatenation would copy the whole weight matrix on
    every call, more than a float32 output [M, F] costs: there the GEMM emits float32 and the
    bias is added before the one rounding."""
    if bias is None:
        return jnp.dot(x, w)
    m, d = x.shape
    if 2 * m < d:
        pre = jnp.dot(x, w, preferred_element_type=jnp.float32) + bias.astype(jnp.float32)
        return pre.astype(x.dtype)
    pad = _K_MULTIPLE - d % _K_MULTIPLE
    ones = jnp.zeros((m, pad), x.dtype).at[:, 0].set(1)
    rows = jnp.zeros((pad, w.shape[1]), w.dtype).at[0].set(bias.astype(w.dtype))
    return jnp.dot(jnp.concatenate([x, ones], axis=1), jnp.concatenate([w, rows], axis=0))


@jax.custom_vjp
def few_rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` for x [M, K] with M <= 64 rows (``pallas_kernels.gemv``), w [K, N] of x's
    dtype: [M, N] in x.dtype, float32 accumulation. Differentiable: the backward is XLA's
    (dx = dy @ w^T, dw = x^T @ dy), so a small training batch can take this path too."""
    return gemv(x, w, None)


def _few_rows_fwd(x, w):
    return gemv(x, w, None), (x, w)


def _few_rows_bwd(residuals, dy):
    x, w = residuals
    dx = jnp.dot(dy, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(x.T, dy, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


few_rows_matmul.defvjp(_few_rows_fwd, _few_rows_bwd)


@jax.custom_vjp
def f32_output_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` with a float32 output (x [..., K], w [K, N] of x's dtype: the logits), whose
    backward runs in x's dtype: the cotangent is rounded to x.dtype before the two backward
    GEMMs, as mixed-precision training does. Plain autodiff would take the float32 cotangent
    into float32 (TF32) GEMMs: on the H100 the 0.5b model's output layer's backward took 21 ms
    of a 164 ms training step that way. With a float32 x nothing is rounded."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _f32_output_fwd(x, w):
    return f32_output_matmul(x, w), (x, w)


def _f32_output_bwd(residuals, dy):
    x, w = residuals
    dy = dy.astype(x.dtype)
    dx = jnp.dot(dy, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    k = x.shape[-1]
    dw = jnp.dot(x.reshape(-1, k).T, dy.reshape(-1, dy.shape[-1]),
                 preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


f32_output_matmul.defvjp(_f32_output_fwd, _f32_output_bwd)
