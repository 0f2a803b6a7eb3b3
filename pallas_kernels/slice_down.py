"""The decode FFN's dense down projection, one partial sum per slice of F, behind a flag.

``scan_up_down``'s dense mode (a decode-sized call whose gate is too busy for walking each
row's active units) writes the hidden values h [M, F] of every unit; this kernel then
multiplies them by ``w_down`` slice by slice:

    y_parts[s] = h[:, s * block_f : (s + 1) * block_f] @ w_down[s * block_f : (s + 1) * block_f]

into the same [S, M, D] float32 partial sums the sparse walk writes, so one finishing sum (or
the consumer that adds the slices itself) serves both modes. The flag is the sum of the gate's
per-block counts (``gemv_with_counts``) against a threshold, read by every program from one
small load: a sparse call's programs return at once and leave ``y_parts`` as the scan wrote
it (the output aliases that input), so the sparse call pays one near-empty launch and no host
round trip.

Why slices: with at most 64 rows the down product is bound by reading w_down once (D = 2048,
F = 5632: 23 MB). A grid of (slice, D block) programs puts every SM on it, each reading
[block_u, block_n] tiles of contiguous row pieces in a loop that Triton pipelines; reducing
over the whole of F in one program would leave most SMs idle (D / block_n programs).

Numerics: h is float32; for 16-bit weights it is split into a high and a low 16-bit part,
two tensor-core dots with float32 accumulation (h kept to ~2^-16 of itself, like the sparse
walk's float32 h); float32 weights use the float32 dot at highest precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (block_range, check_config, largest_pow2_divisor, next_pow2,
                                   resolve_interpret)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceDownConfig:
    """Knobs of :func:`slice_down`.

    Attributes:
      block_n: output columns of D per program (power of two >= 16, dividing D).
      block_u: units of F per loop step (power of two >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the loop over the slice's units.
    """

    block_n: int = 128
    block_u: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_config(self, ("block_n", "block_u", "num_warps"))
        if min(self.block_n, self.block_u) < 16:
            raise ValueError(f"the dot needs block_n and block_u >= 16, got block_n="
                             f"{self.block_n}, block_u={self.block_u}")


def default_slice_down_config(m: int, d: int, block_f: int) -> SliceDownConfig:
    """128-column D blocks (256-byte row pieces of bf16 w_down), 64-unit steps (the slice's
    width at most)."""
    del m
    return SliceDownConfig(block_n=largest_pow2_divisor(d, 128),
                           block_u=max(16, min(64, block_f)), num_warps=4, num_stages=3)


def _counts_total(counts_ref, n_counts: int):
    lanes = block_range(0, next_pow2(n_counts))
    return jnp.sum(plgpu.load(counts_ref.at[lanes], mask=lanes < n_counts, other=0))


def _slice_down_kernel(h_ref, w_ref, counts_ref, _parts_in, out_ref, *, m: int, m_pad: int,
                       f: int, block_f: int, block_n: int, block_u: int, n_counts: int,
                       dense_above: int, split_h: bool, precision):
    """Program (s, b): slice s of F, D columns [b * block_n, +block_n). Refs: h [M, F]
    float32, w_down [F, D], counts [n_counts] int32, y_parts [S, M, D] float32 (aliased to
    the output: untouched unless the call is dense)."""
    s = pl.program_id(0)
    b = pl.program_id(1)

    @pl.when(_counts_total(counts_ref, n_counts) > dense_above)
    def _():
        rows = block_range(0, m_pad)[:, None]
        row_ok = rows < m
        cols = (b * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n,), 0))[None, :]
        lane = jax.lax.broadcasted_iota(jnp.int32, (block_u,), 0)

        def step(i, acc):
            units = s * block_f + i * block_u + lane
            ok = units < f
            hk = plgpu.load(h_ref.at[rows, units[None, :]], mask=row_ok & ok[None, :], other=0.0)
            wk = plgpu.load(w_ref.at[units[:, None], cols],
                            mask=jnp.broadcast_to(ok[:, None], (block_u, block_n)), other=0)
            if split_h:
                high = hk.astype(wk.dtype)
                low = (hk - high.astype(jnp.float32)).astype(wk.dtype)
                return (acc + jnp.dot(high, wk, preferred_element_type=jnp.float32)
                        + jnp.dot(low, wk, preferred_element_type=jnp.float32))
            return acc + jnp.dot(hk, wk, preferred_element_type=jnp.float32,
                                 precision=precision)

        steps = -(-min(block_f, f) // block_u)
        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((m_pad, block_n), jnp.float32))
        plgpu.store(out_ref.at[s, rows, cols], acc,
                    mask=jnp.broadcast_to(row_ok, (m_pad, block_n)))


def _check_args(h, w_down, counts, y_parts, block_f: int) -> tuple[int, int, int]:
    if h.ndim != 2 or h.dtype != jnp.float32:
        raise ValueError(f"h must be float32 [M, F], got {h.dtype} {h.shape}")
    m, f = h.shape
    if w_down.ndim != 2 or w_down.shape[0] != f:
        raise ValueError(f"w_down has shape {w_down.shape}, expected ({f}, D)")
    d = w_down.shape[1]
    slices = -(-f // block_f)
    if y_parts.shape != (slices, m, d) or y_parts.dtype != jnp.float32:
        raise ValueError(f"y_parts must be float32 {(slices, m, d)}, got {y_parts.dtype} "
                         f"{y_parts.shape}")
    if counts.ndim != 1 or counts.dtype != jnp.int32:
        raise ValueError(f"counts must be int32 [B], got {counts.dtype} {counts.shape}")
    return m, d, f


def slice_down(
    h: jax.Array,
    w_down: jax.Array,
    counts: jax.Array,
    y_parts: jax.Array,
    *,
    dense_above: int,
    block_f: int,
    config: SliceDownConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Where ``sum(counts) > dense_above``: the per-slice products of h and w_down; else
    ``y_parts`` unchanged.

    Args:
      h: [M, F] float32 hidden values (read only in the dense case).
      w_down: [F, D] (bf16, f16 or f32); D a multiple of ``config.block_n``.
      counts: [B] int32, the gate's active entries per block (``gemv_with_counts``).
      y_parts: [S, M, D] float32, S = ceil(F / block_f): the sparse walk's partial sums.
      dense_above: the threshold on ``sum(counts)``.
      block_f: columns of F per slice (the scan's).
      config: ``default_slice_down_config`` when None.
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      [S, M, D] float32: ``slice_down_reference``'s products when dense, else ``y_parts``.
    """
    m, d, f = _check_args(h, w_down, counts, y_parts, block_f)
    config = default_slice_down_config(m, d, block_f) if config is None else config
    if d % config.block_n:
        raise ValueError(f"D={d} is not a multiple of block_n={config.block_n}")
    wide = jnp.dtype(w_down.dtype) == jnp.float32
    kernel = functools.partial(
        _slice_down_kernel, m=m, m_pad=max(16, next_pow2(m)), f=f, block_f=block_f,
        block_n=config.block_n, block_u=config.block_u, n_counts=counts.shape[0],
        dense_above=int(dense_above), split_h=not wide,
        precision=jax.lax.Precision.HIGHEST if wide else None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y_parts.shape, jnp.float32),
        grid=(y_parts.shape[0], d // config.block_n),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_slice_down",
    )(h, w_down, counts, y_parts)


def slice_down_reference(h: jax.Array, w_down: jax.Array, block_f: int) -> jax.Array:
    """Plain-jnp dense case of :func:`slice_down`: [S, M, D] float32, slice s being
    ``h[:, slice] @ w_down[slice]`` at highest precision (the last slice may be partial)."""
    m, f = h.shape
    slices = -(-f // block_f)
    pad = slices * block_f - f
    hs = jnp.pad(h, ((0, 0), (0, pad))).reshape(m, slices, block_f)
    ws = jnp.pad(w_down.astype(jnp.float32), ((0, pad), (0, 0))).reshape(slices, block_f, -1)
    return jnp.einsum("msu,sud->smd", hs, ws, precision=jax.lax.Precision.HIGHEST)
