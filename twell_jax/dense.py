"""Dense building blocks shared by the ops and the backends."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import default_interpret
from pallas_kernels.gemv import FEW_ROWS, gemv, gemv_many
from twell_jax import sharding

_K_MULTIPLE = 64  # the GEMM's contraction length is padded to this (tensor-core friendly)


def dot_rows(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``x @ w.T`` for x [..., D] and w [F, D] stored one row per unit (the FFN weights'
    layout, ``twell_jax.layout``): [..., F], float32 accumulation, in ``out_dtype`` (x.dtype
    when None). One ``dot_general`` contracting both operands' last axis: no transpose of w
    is asked for, and a GEMM reads either operand order."""
    return _dot_unit_rows(x, w, 1, jnp.dtype(out_dtype or x.dtype))


def dot_down(h: jax.Array, w: jax.Array) -> jax.Array:
    """``h @ w`` for h [..., F] and the down projection w [F, D]: [..., D] in h.dtype, float32
    accumulation."""
    return _dot_unit_rows(h, w, 0, jnp.dtype(h.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot_unit_rows(a, w, w_axis: int, out_dtype):
    """a [..., K] times w [F, D] contracted on its axis ``w_axis`` (K = D for 1, F for 0), in
    ``out_dtype``. Its backward writes dw [F, D] as w is stored; JAX's own rule makes it the
    other way round and transposes it, a weight-sized copy per call."""
    return jax.lax.dot_general(a, w, (((a.ndim - 1,), (w_axis,)), ((), ())),
                               preferred_element_type=out_dtype)


def _dot_unit_rows_fwd(a, w, w_axis, out_dtype):
    return _dot_unit_rows(a, w, w_axis, out_dtype), (a, w)


def _dot_unit_rows_bwd(w_axis, out_dtype, residuals, g):
    a, w = residuals
    lead = tuple(range(a.ndim - 1))
    da = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1 - w_axis,)), ((), ())),
                             preferred_element_type=a.dtype)
    # dw [F, D]: the leading axes summed, F (g's for w_axis 1, a's for 0) first.
    rows, cols = (g, a) if w_axis == 1 else (a, g)
    dw = jax.lax.dot_general(rows, cols, ((lead, lead), ((), ())),
                             preferred_element_type=w.dtype)
    return da, dw


_dot_unit_rows.defvjp(_dot_unit_rows_fwd, _dot_unit_rows_bwd)


def folds_bias(m: int, d: int, bias: jax.Array | None) -> bool:
    """Whether ``gate_pre_activation`` folds the bias into its GEMM as a contraction column
    (a bias, and at least D / 2 rows), so that its operand is ``with_bias_column(x)``."""
    return bias is not None and 2 * m >= d


def with_bias_column(x: jax.Array) -> jax.Array:
    """x [M, D] -> [M, D + P]: x, a column of ones, zeros up to a multiple of 64 columns
    (1 <= P <= 64): the GEMM operand of the folded gate bias (``gate_pre_activation``)."""
    m, d = x.shape
    return jnp.concatenate([x, _first_column(jnp.ones((m, 1), x.dtype), d)], axis=1)


def _first_column(column: jax.Array, d: int) -> jax.Array:
    """column [R, 1] followed by zeros: [R, P], P = 64 - D % 64. Padded, not scattered: on
    the GPU an ``.at[:, 0].set`` compiled to two small fusions of its own (an index check and
    a pad), where a pad folds into the concatenation."""
    return jnp.pad(column, ((0, 0), (0, _K_MULTIPLE - d % _K_MULTIPLE - 1)))


def gate_pre_activation(x: jax.Array, w: jax.Array, bias: jax.Array | None, *,
                        kernel: bool | None = None,
                        x_wide: jax.Array | None = None) -> jax.Array:
    """``x @ w.T + bias`` [M, F] in x.dtype (w [F, D], one row per unit), float32
    accumulation inside the GEMM. ``x_wide``: ``with_bias_column(x)`` when the caller made it
    (where ``folds_bias``), read in place of x; a caller that also hands it to another
    consumer lets x's producer write it in one pass (the sparse FFN's up/down reads it).

    The GEMM emits x.dtype directly, as a plain Flax layer does (half the bytes of a float32
    output). A bias is folded into the GEMM as one more contraction column (``[x, 1] @ [w,
    b].T``, zero-padded to a multiple of 64), so the sum is rounded once: a threshold bias
    cancels most of ``x @ w.T`` for the active units, and adding it after rounding to bf16
    would lose the gate's low bits (5-10% gradient errors on small test problems), while a
    float32 GEMM output plus a separate add pass costs ~0.5 ms per call at M = 16384.

    With few rows (2 M < D: decode) the concatenation would copy the whole weight matrix on
    every call, more than a float32 output [M, F] costs: there the GEMM emits float32 and the
    bias is added before the one rounding. XLA compiles that float32-output product to a slow
    GEMM (H100, D = 2048, F = 5632, one row: 19.9 us, where cuBLAS's bf16 product takes 12.9;
    the 0.5b dense model decoded 12% faster with a plain Flax gate),
    so below ``FEW_ROWS`` (8) rows it runs on the ``gemv`` kernel (the same sums, 12.2 us) on
    a GPU outside a multi-device mesh; ``kernel`` forces the choice (tests)."""
    if bias is None:
        return dot_rows(x, w)
    m, d = x.shape
    if not folds_bias(m, d, bias):
        if _few_rows_on_gemv(m) if kernel is None else kernel:
            return _biased_gemv(x, w, bias)
        pre = dot_rows(x, w, jnp.float32) + bias.astype(jnp.float32)
        return pre.astype(x.dtype)
    x_wide = with_bias_column(x) if x_wide is None else x_wide
    bias_columns = _first_column(bias.astype(w.dtype)[:, None], d)
    return dot_rows(x_wide, jnp.concatenate([w, bias_columns], axis=1))


def _few_rows_on_gemv(m: int) -> bool:
    """Whether ``gate_pre_activation`` runs an M-row biased product on ``gemv``: fewer than
    ``FEW_ROWS`` rows, compiled for a GPU (not interpreted), and not under a context mesh of
    several devices (``sharding.on_one_device``)."""
    return m < FEW_ROWS and not default_interpret() and sharding.on_one_device()


@jax.custom_vjp
def _biased_gemv(x: jax.Array, w: jax.Array, bias: jax.Array) -> jax.Array:
    """``(x @ w.T + bias)`` rounded once to x.dtype (x [M, D], w [F, D], bias [F]) on
    ``gemv``; its backward is autodiff's of the float32 form it replaces."""
    return gemv(x, w.astype(x.dtype), bias, unit_rows=True)


def _biased_gemv_fwd(x, w, bias):
    return _biased_gemv(x, w, bias), (x, w, bias)


def _biased_gemv_bwd(residuals, d_pre):
    x, w, bias = residuals
    d_pre = d_pre.astype(x.dtype)
    dx = jnp.dot(d_pre, w.astype(x.dtype), preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(d_pre, x, (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [F, D]
    return (dx.astype(x.dtype), dw.astype(w.dtype),
            jnp.sum(d_pre.astype(jnp.float32), axis=0).astype(bias.dtype))


_biased_gemv.defvjp(_biased_gemv_fwd, _biased_gemv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mixed_precision_matmul(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """``x @ w`` (x [..., K], w [K, N], both in the compute dtype) -> [..., N] in
    ``out_dtype``, float32 accumulation, rounded once (XLA's GEMM; ``few_row_matmuls`` runs
    the same products on the GEMV kernel).

    The backward GEMMs (XLA's) read the compute dtype too (the cotangent is rounded to
    x.dtype, as mixed-precision training does) and accumulate in float32, rounded after: so
    under data parallelism the weight gradient's sum over devices is taken in float32. Plain
    autodiff of a float32-output product would feed the float32 cotangent to float32 (TF32)
    GEMMs: on the H100 the 0.5b model's attention projections and output layer spent ~50 ms
    of a 164 ms training step that way. With float32 operands nothing
    is rounded."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_fwd(x, w, out_dtype):
    return mixed_precision_matmul(x, w, out_dtype), (x, w)


def _mixed_bwd(out_dtype, residuals, dy):
    x, w = residuals
    dy = dy.astype(x.dtype)
    dx = jnp.dot(dy, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    k = x.shape[-1]
    dw = jnp.dot(x.reshape(-1, k).T, dy.reshape(-1, dy.shape[-1]),
                 preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


mixed_precision_matmul.defvjp(_mixed_fwd, _mixed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def few_row_matmuls(x: jax.Array, ws: tuple[jax.Array, ...], out_dtype) -> tuple[jax.Array, ...]:
    """``mixed_precision_matmul(x, w, out_dtype)`` for each w of ``ws`` (x [..., K] with at
    most 64 rows, each w [K, N_i], all in the compute dtype) on one ``gemv_many`` launch: a
    decode step's products (XLA turns a one-row product into a slow column reduction), q, k
    and v in one call. The backward is ``mixed_precision_matmul``'s, per weight."""
    k = x.shape[-1]
    outs = gemv_many(x.reshape(-1, k), tuple(ws))
    return tuple(y.reshape(*x.shape[:-1], w.shape[1]).astype(out_dtype)
                 for y, w in zip(outs, ws))


def _few_rows_fwd(x, ws, out_dtype):
    return few_row_matmuls(x, ws, out_dtype), (x, ws)


def _few_rows_bwd(out_dtype, residuals, dys):
    x, ws = residuals
    grads = [_mixed_bwd(out_dtype, (x, w), dy) for w, dy in zip(ws, dys)]
    dx = functools.reduce(lambda a, b: a + b, (g[0].astype(jnp.float32) for g in grads))
    return dx.astype(x.dtype), tuple(g[1] for g in grads)


few_row_matmuls.defvjp(_few_rows_fwd, _few_rows_bwd)
