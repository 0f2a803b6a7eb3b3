"""Fused gated up/down projection on row-compacted gate lists.

For each row m and each valid entry k < row_nnz[m] (j = columns[m, k], g = gate_values[m, k]):

    u[m, k] = x[m] . w_up_t[j]          (fp32)
    y[m]   += (g * u[m, k]) * w_down[j]  (fp32 accumulate)

``w_up_t`` is stored feature-major ([F, D], row j = unit j's up weights), so each non-zero reads
two contiguous D-rows (one of w_up_t, one of w_down); the dense hidden h is never formed. Entries
k >= row_nnz[m] are ignored whatever they hold (their loads are masked and never touch the
weights). Output y [M, D] in x.dtype and optionally ``up_values`` [M, K] float32 (u at valid
entries, 0 elsewhere), which the training backward needs.

One program per block of block_m rows (grid M / block_m), looping k up to the block's largest
row_nnz (a dynamic bound). D is split into static chunks of block_d (a Python loop, unrolled).
Two schedules (config knob ``schedule``):

* ``"fused"``: one k loop; per k, u = sum over chunks of x_chunk . w_up_chunk, then every chunk's
  accumulator gets (g * u) * w_down_chunk. The full-D accumulator lives in registers as D / block_d
  fp32 tiles [block_m, block_d]: block_m * D fp32 values per program (16 x 2048 = 256 registers
  per thread at 4 warps: it spills at large D).
* ``"two_pass"``: pass 1 loops k and stores u[:, k] (to the up_values output, also used as
  scratch); after a barrier (GPU only: interpret mode runs a program sequentially), pass 2 loops
  over D chunks and, inside, over k: acc_chunk += (g * u) * w_down_chunk. Only one [block_m,
  block_d] accumulator is live; the price is re-reading u, g and columns (4 + 4 + 4 bytes per
  entry per chunk, L1/L2 hits) against the 2 * block_d * 2 gathered weight bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_config, largest_pow2_divisor, resolve_interpret

Schedule = Literal["fused", "two_pass"]
_SCHEDULES = ("fused", "two_pass")


def _gated_up_down_kernel(
    x_ref,
    w_up_ref,
    w_down_ref,
    g_ref,
    columns_ref,
    nnz_ref,
    y_ref,
    up_ref,
    *,
    block_m: int,
    block_d: int,
    d_model: int,
    num_slots: int,
    schedule: Schedule,
    preload_x: bool,
    store_up: bool,
    barrier: bool,
):
    """One program: rows [i * block_m, +block_m), all D columns.

    Refs (whole arrays): x [M, D], w_up_t [F, D], w_down [F, D], gate_values [M, K],
    columns [M, K] int32, row_nnz [M] int32; outputs y [M, D], up [M, K] float32.
    ``store_up`` is False only for the fused schedule without return_up (up is then a dummy).
    """
    i = pl.program_id(0)
    row0 = pl.multiple_of(i * block_m, block_m)
    rows = pl.ds(row0, block_m)
    nnz = jnp.minimum(nnz_ref[rows], num_slots)  # [block_m]; entries past K do not exist
    k_end = jnp.max(nnz)
    num_chunks = d_model // block_d
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
    chunk_cols = [c * block_d + lane for c in range(num_chunks)]  # [1, block_d] each

    def x_chunk(c):
        return x_ref[rows, pl.ds(c * block_d, block_d)].astype(jnp.float32)

    x_chunks = [x_chunk(c) for c in range(num_chunks)] if preload_x else None

    def entry(k):
        """Masked (valid, safe columns, gate) of column k for the block's rows."""
        valid = k < nnz
        cols = plgpu.load(columns_ref.at[rows, k], mask=valid, other=0)
        cols = jnp.where(valid, cols, 0)
        g = plgpu.load(g_ref.at[rows, k], mask=valid, other=0).astype(jnp.float32)
        return valid, cols, g

    def gather(w_ref, cols, valid, c):
        mask = jnp.broadcast_to(valid[:, None], (block_m, block_d))
        wk = plgpu.load(w_ref.at[cols[:, None], chunk_cols[c]], mask=mask, other=0)
        return wk.astype(jnp.float32)

    def up_dot(valid, cols):
        u = jnp.zeros((block_m,), jnp.float32)
        for c in range(num_chunks):
            xc = x_chunks[c] if preload_x else x_chunk(c)
            u = u + jnp.sum(xc * gather(w_up_ref, cols, valid, c), axis=1)
        # 0 at invalid entries even if x holds inf/NaN (x * 0 would be NaN there).
        return jnp.where(valid, u, 0.0)

    if schedule == "fused":

        def step(k, accs):
            valid, cols, g = entry(k)
            u = up_dot(valid, cols)
            if store_up:
                up_ref[rows, k] = u
            h = (g * u)[:, None]
            return tuple(
                acc + h * gather(w_down_ref, cols, valid, c) for c, acc in enumerate(accs)
            )

        zeros = tuple(jnp.zeros((block_m, block_d), jnp.float32) for _ in range(num_chunks))
        accs = jax.lax.fori_loop(0, k_end, step, zeros)
        for c, acc in enumerate(accs):
            y_ref[rows, pl.ds(c * block_d, block_d)] = acc.astype(y_ref.dtype)
    else:

        def up_step(k, carry):
            valid, cols, _ = entry(k)
            up_ref[rows, k] = up_dot(valid, cols)
            return carry

        jax.lax.fori_loop(0, k_end, up_step, 0)
        if barrier:
            plgpu.debug_barrier()  # pass 2 reads u written by other threads of this program

        for c in range(num_chunks):

            def down_step(k, acc, c=c):
                valid, cols, g = entry(k)
                u = plgpu.load(up_ref.at[rows, k], mask=valid, other=0.0)
                h = (g * u)[:, None]
                return acc + h * gather(w_down_ref, cols, valid, c)

            acc = jax.lax.fori_loop(
                0, k_end, down_step, jnp.zeros((block_m, block_d), jnp.float32)
            )
            y_ref[rows, pl.ds(c * block_d, block_d)] = acc.astype(y_ref.dtype)

    if store_up:
        # Entries the k loop did not reach: exactly one write per address (no zero-init race).
        def zero_step(k, carry):
            up_ref[rows, k] = jnp.zeros((block_m,), jnp.float32)
            return carry

        jax.lax.fori_loop(jnp.maximum(k_end, 0), num_slots, zero_step, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedUpDownConfig:
    """Block sizes and Triton knobs of :func:`gated_up_down`.

    Attributes:
      block_m: rows per program (power of two).
      block_d: D chunk width (power of two): the contiguous segment of each gathered weight row.
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the k loops.
      schedule: "fused" (one k loop, full-D accumulators) or "two_pass" (u first, then per-chunk
        down accumulation); see the module docstring.
      preload_x: load the block's x rows once before the k loop (else reload chunks per k).
    """

    block_m: int = 16
    block_d: int = 512
    num_warps: int = 4
    num_stages: int = 1
    schedule: Schedule = "fused"
    preload_x: bool = True

    def __post_init__(self):
        check_config(self, ("block_m", "block_d", "num_warps"))
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.preload_x, bool):
            raise ValueError(f"preload_x must be a bool, got {self.preload_x!r}")


def default_gated_up_down_config(m: int, k: int, f: int, d: int, dtype) -> GatedUpDownConfig:
    """Default blocks for x [m, d], gate lists [m, k], weights [f, d].

    Measured on H100 (bf16, M=16384, D=2048, F=5632, K=32 with 28 valid entries per row):
    "fused" spills its full-D accumulator (16 x 2048 fp32): 4.5-5.7 ms at 4 warps, 1.6 ms at 8.
    "two_pass" with block_m 16, block_d 512, 8 warps, x reloaded per chunk: 1.03-1.11 ms (4 warps
    1.21-1.41; block_d 256 1.31; block_d 1024 1.34; block_m 32 1.42-1.72; num_stages 2 same).
    "fused" is kept while the accumulator is small (block_m * d <= 8192 fp32: <= 64 registers per
    thread at 4 warps; unmeasured there). Blocks shrink to powers of two dividing m / d.
    """
    del k, f, dtype
    block_m = largest_pow2_divisor(m, 16)
    block_d = largest_pow2_divisor(d, 512)
    if block_m * d <= 8192:
        return GatedUpDownConfig(block_m=block_m, block_d=block_d, schedule="fused")
    return GatedUpDownConfig(
        block_m=block_m, block_d=block_d, schedule="two_pass", num_warps=8, preload_x=False
    )


def _check_args(x, w_up_t, w_down, gate_values, columns, row_nnz):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, D], got shape {x.shape}")
    m, d = x.shape
    if w_up_t.ndim != 2 or w_up_t.shape[1] != d:
        raise ValueError(f"w_up_t has shape {w_up_t.shape}, expected (F, {d})")
    f = w_up_t.shape[0]
    if w_down.shape != (f, d):
        raise ValueError(f"w_down has shape {w_down.shape}, expected ({f}, {d})")
    if gate_values.ndim != 2 or gate_values.shape[0] != m or columns.shape != gate_values.shape:
        raise ValueError(
            f"gate_values {gate_values.shape} and columns {columns.shape} must both be ({m}, K)"
        )
    if row_nnz.shape != (m,):
        raise ValueError(f"row_nnz has shape {row_nnz.shape}, expected ({m},)")
    if columns.dtype != jnp.int32 or row_nnz.dtype != jnp.int32:
        raise ValueError(
            f"columns and row_nnz must be int32, got {columns.dtype} and {row_nnz.dtype}"
        )
    return m, gate_values.shape[1], f, d


def gated_up_down(
    x: jax.Array,
    w_up_t: jax.Array,
    w_down: jax.Array,
    gate_values: jax.Array,
    columns: jax.Array,
    row_nnz: jax.Array,
    *,
    return_up: bool = False,
    config: GatedUpDownConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``y[m] = sum_{k < row_nnz[m]} g[m, k] * (x[m] . w_up_t[j]) * w_down[j]``, j = columns[m, k].

    Args:
      x: [M, D] bf16 or f32.
      w_up_t: [F, D] (feature-major up weights).
      w_down: [F, D].
      gate_values: [M, K] (x.dtype or f32).
      columns: [M, K] int32, valid entries in [0, F).
      row_nnz: [M] int32; entries k < min(row_nnz[m], K) are used, the rest ignored.
      return_up: also return up_values.
      config: ``default_gated_up_down_config`` when None. Requires M % block_m == 0 and
        D % block_d == 0 (the caller pads).
      interpret: run the Pallas interpreter (None: iff no GPU).

    Returns:
      y [M, D] in x.dtype; with return_up, (y, up_values [M, K] float32, 0 at invalid entries).
    """
    m, k, f, d = _check_args(x, w_up_t, w_down, gate_values, columns, row_nnz)
    if config is None:
        config = default_gated_up_down_config(m, k, f, d, x.dtype)
    if m % config.block_m:
        raise ValueError(f"M={m} is not a multiple of block_m={config.block_m}")
    if d % config.block_d:
        raise ValueError(f"D={d} is not a multiple of block_d={config.block_d}")
    interpret = resolve_interpret(interpret)
    # The two-pass schedule keeps u in the up output; the fused one needs it only if returned.
    store_up = return_up or config.schedule == "two_pass"
    kernel = functools.partial(
        _gated_up_down_kernel,
        block_m=config.block_m,
        block_d=config.block_d,
        d_model=d,
        num_slots=k,
        schedule=config.schedule,
        preload_x=config.preload_x,
        store_up=store_up,
        barrier=not interpret,
    )
    up_shape = (m, k) if store_up else (1, 1)
    y, up = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, d), x.dtype),
            jax.ShapeDtypeStruct(up_shape, jnp.float32),
        ),
        grid=(m // config.block_m,),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="twell_gated_up_down",
    )(x, w_up_t, w_down, gate_values, columns, row_nnz)
    return (y, up) if return_up else y


def gated_up_down_reference(
    x: jax.Array,
    w_up_t: jax.Array,
    w_down: jax.Array,
    gate_values: jax.Array,
    columns: jax.Array,
    row_nnz: jax.Array,
    *,
    return_up: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain-jnp :func:`gated_up_down`: a loop over k gathering [M, D] rows (fp32, memory-light)."""
    m, k, _, d = _check_args(x, w_up_t, w_down, gate_values, columns, row_nnz)
    nnz = jnp.clip(row_nnz, 0, k)
    x32 = x.astype(jnp.float32)

    def step(kk, carry):
        y, up = carry
        valid = kk < nnz
        c = jnp.where(valid, columns[:, kk], 0)
        g = jnp.where(valid, gate_values[:, kk].astype(jnp.float32), 0.0)
        u = jnp.where(valid, jnp.sum(x32 * w_up_t[c].astype(jnp.float32), axis=1), 0.0)
        wd = jnp.where(valid[:, None], w_down[c].astype(jnp.float32), 0.0)
        return y + (g * u)[:, None] * wd, up.at[:, kk].set(u)

    init = (jnp.zeros((m, d), jnp.float32), jnp.zeros((m, k), jnp.float32))
    y, up = jax.lax.fori_loop(0, jnp.max(nnz, initial=0), step, init)
    y = y.astype(x.dtype)
    return (y, up) if return_up else y
