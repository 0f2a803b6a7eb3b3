"""A residual add and the RMSNorm after it, for a decode step's few rows, in one launch.

In a decode step each norm of a pre-norm block follows a residual add: ``r = x + delta``,
``h = rmsnorm(r) * scale``. XLA compiles the pair on a few rows to three launches (the add,
with the preceding product's partial sums; the sum of squares; the scaling), ~1.3 us each
plus ~0.8 us of GPU idle between launches on the H100: two norms a layer, ~12 launches of a
0.5b step's 160. Here one program per row does all of it, reading
the row once:

* ``delta`` is the sublayer's output [M, D], or the float32 partial sums [S, M, D] of a
  ``gemv`` that was not finished (``gemv_partial_sums``): they are added in order 0..S-1 and
  rounded to x.dtype, as ``finish_partial_sums`` does, so the result equals the unfused
  ``x + gemv(...)`` bit for bit; then ``r = x + delta`` rounded to x.dtype, as the model adds.
* The norm: ``r`` in float32, ``r * rsqrt(mean(r^2) + eps) * scale``, rounded once, as
  ``twell_jax.model.RMSNorm`` computes it (only the order of the mean's sum differs).

D is padded to a power of two inside the program (masked), so any D works. Measured (H100,
0.5b): 1.8-2.0 us a call with the sublayer output, 3.7 us with 8
partial sums at 4 warps (one program reads their 64 KB; 2.65 us alone at 16 warps, now the
default); decode at batch 1 +3% tokens/s in both models (at 4 warps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (add_in_order, block_range, finish_partial_sums,
                                   next_pow2, resolve_interpret)

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_ROWS = 64  # one program per row: for decode steps, not for a prefill's thousands of rows


def _load_row(ref, mask):
    return plgpu.load(ref, mask=mask, other=0).astype(jnp.float32)


def _kernel(*refs, d: int, d_pad: int, parts: int | None, has_delta: bool, eps: float):
    """Program i: row i. Refs: x [M, D], [delta [M, D] or partial sums [S, M, D]], scale [D];
    outputs: [sum [M, D]], normed [M, D]."""
    if has_delta:
        x_ref, delta_ref, scale_ref, sum_ref, normed_ref = refs
    else:
        x_ref, scale_ref, normed_ref = refs
    i = pl.program_id(0)
    # Columns [0, d_pad) as an index vector, not ``pl.ds(0, d_pad)``: past D (masked) the
    # static slice is rejected at trace time by jax >= 0.12 (pallas_kernels/common.py,
    # ``block_range``).
    cols = block_range(0, d_pad)
    mask = cols < d
    dtype = x_ref.dtype
    row = _load_row(x_ref.at[i, cols], mask)
    if has_delta:
        if parts is None:
            delta = _load_row(delta_ref.at[i, cols], mask)
        else:
            delta = add_in_order(
                lambda s: _load_row(delta_ref.at[jnp.int32(s), i, cols], mask), parts)
        # The sublayer's output and the residual sum, each rounded to x.dtype as the model's
        # unfused step rounds them.
        delta = delta.astype(dtype).astype(jnp.float32)
        row = (row + delta).astype(dtype)
        plgpu.store(sum_ref.at[i, cols], row, mask=mask)
        row = row.astype(jnp.float32)
    mean_square = jnp.sum(row * row) / d  # padded columns are zero
    normed = row * jax.lax.rsqrt(mean_square + eps) * _load_row(scale_ref.at[cols], mask)
    plgpu.store(normed_ref.at[i, cols], normed.astype(dtype), mask=mask)


def default_num_warps(d_pad: int, parts: int | None) -> int:
    """Warps per program for a row of ``d_pad`` (power of two) columns. H100, D = 2048, one
    row, the call alone in an on-device loop: with 8 partial sums
    4 / 8 / 16 warps take 3.88 / 3.18 / 2.65 us (more loads in flight), with the sublayer
    output 2.29-2.37 us from 4 warps up."""
    if parts is not None and parts > 1:
        return max(1, min(16, d_pad // 128))
    return max(1, min(8, d_pad // 512))


def add_rms_norm(
    x: jax.Array,
    delta: jax.Array | None,
    scale: jax.Array,
    *,
    eps: float,
    num_warps: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``r = x + delta`` and ``rmsnorm(r) * scale`` for few rows, one launch.

    Args:
      x: [M, D] the residual stream, 1 <= M <= 64; bfloat16, float16 or float32.
      delta: the sublayer output to add: [M, D] (any float dtype; rounded to x.dtype first),
        float32 partial sums [S, M, D] (summed in order, then rounded to x.dtype), or None
        (no add: ``r = x``).
      scale: [D] the norm's scale (any float dtype, applied in float32).
      eps: added to the mean square.
      num_warps: Triton warps per program (None: ``default_num_warps``).
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      (r [M, D], normed [M, D]), both in x.dtype; r is x itself when delta is None.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, D], got shape {x.shape}")
    m, d = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"add_rms_norm takes 1 to {MAX_ROWS} rows, got {m}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if scale.shape != (d,):
        raise ValueError(f"scale has shape {scale.shape}, expected ({d},)")
    parts = None
    if delta is not None:
        if delta.ndim == 3:
            if delta.shape[1:] != (m, d) or jnp.dtype(delta.dtype) != jnp.dtype(jnp.float32):
                raise ValueError(f"partial sums must be float32 [S, {m}, {d}], got "
                                 f"{delta.dtype}{list(delta.shape)}")
            parts = delta.shape[0]
        elif delta.shape != (m, d):
            raise ValueError(f"delta has shape {delta.shape}, expected ({m}, {d}) or "
                             f"[S, {m}, {d}] partial sums")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    d_pad = next_pow2(d)
    kernel = functools.partial(_kernel, d=d, d_pad=d_pad, parts=parts,
                               has_delta=delta is not None, eps=float(eps))
    row = jax.ShapeDtypeStruct((m, d), x.dtype)
    out_shape = (row, row) if delta is not None else row
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(m,),
        compiler_params=plgpu.CompilerParams(
            num_warps=default_num_warps(d_pad, parts) if num_warps is None else num_warps,
            num_stages=1),
        interpret=resolve_interpret(interpret),
        name="twell_add_rms_norm",
    )(x, *((delta,) if delta is not None else ()), scale)
    return tuple(out) if delta is not None else (x, out)


def add_rms_norm_reference(x: jax.Array, delta: jax.Array | None, scale: jax.Array, *,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp :func:`add_rms_norm` (same arguments and outputs): the unfused model step."""
    if delta is not None:
        x = x + (finish_partial_sums(delta, None, x.dtype) if delta.ndim == 3
                 else delta.astype(x.dtype))
    r = x.astype(jnp.float32)
    r = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
    return x, (r * scale.astype(jnp.float32)).astype(x.dtype)
