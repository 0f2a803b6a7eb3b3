"""Products with few token rows: ``x @ w + bias`` for M <= 64 (decode steps).

With M rows and a [D, F] weight matrix the product is a matrix-vector product in disguise:
2 M D F flops against 2 D F bytes of bf16 weights, so at M <= 64 it is bound by reading the
weights once (D = 2048, F = 5632: 23 MB, 6.9 us at an H100's 3.35 TB/s). XLA does poorly there
(H100, batch 1): the FFN gate's dot takes 12.5-22 us, and the attention
projections' [1, 2048] x [2048, 2048] dots become column-reduction fusions at 300-770 GB/s.
The sparse FFN's decode path runs its gate product here, and the model's attention projections
at decode. This kernel is built around the weight read:

* The grid is (column blocks of F, K splits). Program (j, s) reads the [block_k, block_f]
  tiles of ``w`` (row-major [D, F]: each tile row is ``block_f`` contiguous values, so loads
  are coalesced) for its columns and its share of D, ``block_k`` rows per step of a loop that
  Triton pipelines (``num_stages``). Every weight value is read by exactly one program. A
  weight stored one row per output unit ([F, D], the sparse FFN's layout: ``unit_rows``) is
  read as [block_f, block_k] tiles of ``block_k`` contiguous values, transposed in registers.
* Few column blocks (F / block_f ~ 44) would leave most of the 132 SMs idle, so D can be split
  over a second grid axis (``k_splits``): each split writes float32 partial sums
  [splits, M, F] that the wrapper adds in a fixed order (deterministic) before the bias. The
  partials cost 2 * splits * M * F * 4 bytes of traffic, small next to the weights when
  splits * M is small; the default keeps them under ~1/8 of the weight bytes.
* With one split the kernel adds the bias in float32 and rounds once to x.dtype itself: one
  launch, no epilogue pass (at ~7 us a second launch is not free). For the same reason a
  consumer can take the partial sums unsummed (``gemv_partial_sums``: the decode FFN's
  ``scan_up_down`` adds them), and several weights that multiply one x share a launch
  (``gemv_many``: a decode step's q, k and v, each program reading a tile of one weight).
* The x rows are loaded per step as one [M_pad, block_k] tile (tiny, stays in L1/L2), padded
  to at least 16 rows for a tensor-core dot: the padding's flops are free in a memory-bound
  kernel. (A broadcast multiply-and-sum on the CUDA cores was slower at every measured size,
  up to 2.4x at M = 8 on the H100.)

Ragged shapes are masked, not padded: padding w would copy it on every call. Blocks that
divide D and F skip the masks (they are static).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (block_range, check_config, finish_partial_sums,
                                   next_pow2, resolve_interpret)

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_ROWS = 64  # the x rows are one tile; more rows want a GEMM, not this kernel
# The model's attention projections use the kernel below this many rows: at 8 rows XLA's dot
# is as fast (H100: 12.4 us against 12.7 for F = 5632, 5.6 against 5.9 for F = 2048); at 1
# row it is 2-5x slower. (The FFN's decode gate uses it up to MAX_ROWS: its partial sums go
# straight into ``scan_up_down``, which saves a launch and the [M, F] write.)
FEW_ROWS = 8


def _load(ref, mask):
    """A tile load, zeros where ``mask`` (broadcast to the tile) is False; unmasked for None."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def _gemv_kernel(*refs, m: int, d: int, m_pad: int, block_k: int, block_f: int, steps: int,
                 weights: tuple[tuple[int, int, int, int], ...], has_bias: bool, fused: bool,
                 mask_k: bool, unit_rows: bool, precision, counts: bool = False):
    """One program: columns [b * block_f, +block_f) of one weight, where ``program_id(0)``
    is that weight's first block plus b, and D rows [s * steps * block_k, +steps * block_k)
    for s = ``program_id(1)``.

    ``weights`` holds, per weight matrix, (its first block, its block count, its F, its first
    output column): several products of one x share a launch, each program reading one
    weight's tile (a branch per weight). Refs (whole arrays): x [M, D], the weights [D, F_i]
    ([F_i, D] with ``unit_rows``), [bias [F_0], one weight only]; output: [M, sum F_i] in
    x.dtype (``fused``: the only split, bias added) or partial sums [S, M, sum F_i] float32;
    with ``counts`` (fused, one weight) also [blocks] int32: the active outputs (> 0 or NaN,
    as rounded) of each program's block.
    """
    n_w = len(weights)
    x_ref, w_refs = refs[0], refs[1:1 + n_w]
    b_ref = refs[1 + n_w] if has_bias else None
    o_ref = refs[-2] if counts else refs[-1]
    j = pl.program_id(0)
    s = pl.program_id(1)
    # The rows [0, m_pad) of x and of the output as index vectors, not ``pl.ds(0, m_pad)``:
    # past row M (masked) the static slice is rejected at trace time by jax >= 0.12
    # (``common.block_range``). The interpreter takes index vectors only if every axis is one.
    rows = block_range(0, m_pad)[:, None]  # [m_pad, 1]
    row_ok = rows < m
    k_lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    k_first = s * (steps * block_k)

    def product(w_ref, first_block, f, out_col0):
        col0 = (j - first_block) * block_f
        cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (block_f,), 0)
        mask_f = f % block_f != 0
        col_ok = cols < f

        def step(i, acc):
            k0 = k_first + i * block_k
            x_mask = row_ok
            w_mask = None
            if mask_k:
                k_ok = (k0 + k_lane) < d
                x_mask = x_mask & k_ok[None, :]
                w_mask = k_ok[:, None]
            if mask_f:
                w_mask = col_ok[None, :] if w_mask is None else w_mask & col_ok[None, :]
            if m_pad == m and not mask_k:
                x_mask = None
            xk = _load(x_ref.at[rows, (k0 + k_lane)[None, :]], x_mask)
            if unit_rows:  # a [block_f, block_k] tile: each unit's row is contiguous
                wk = _load(w_ref.at[pl.ds(col0, block_f), pl.ds(k0, block_k)],
                           None if w_mask is None else w_mask.T).T
            else:
                wk = _load(w_ref.at[pl.ds(k0, block_k), pl.ds(col0, block_f)], w_mask)
            return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32,
                                 precision=precision)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((m_pad, block_f), jnp.float32))
        out_mask = row_ok & col_ok[None, :] if (m_pad != m or mask_f) else None
        out_cols = (out_col0 + cols)[None, :]
        if fused:
            if has_bias:
                bias = _load(b_ref.at[pl.ds(col0, block_f)], col_ok if mask_f else None)
                acc = acc + bias.astype(jnp.float32)[None, :]
            out = acc.astype(o_ref.dtype)
            plgpu.store(o_ref.at[rows, out_cols], out, mask=out_mask)
            if counts:
                active = (jnp.logical_not(out.astype(jnp.float32) <= 0.0) & row_ok
                          & col_ok[None, :])
                # Row sums first: Triton's lowering reduces one axis at a time.
                refs[-1][j] = jnp.sum(jnp.sum(active.astype(jnp.int32), axis=1))
        else:
            plgpu.store(o_ref.at[s, rows, out_cols], acc, mask=out_mask)

    if n_w == 1:
        first_block, _, f, out_col0 = weights[0]
        product(w_refs[0], first_block, f, out_col0)
        return
    for w_ref, (first_block, n_blocks, f, out_col0) in zip(w_refs, weights):
        pl.when((j >= first_block) & (j < first_block + n_blocks))(
            functools.partial(product, w_ref, first_block, f, out_col0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemvConfig:
    """Knobs of :func:`gemv`.

    Attributes:
      block_f: columns of F per program (power of two); the grid's first axis is
        ceil(F / block_f).
      block_k: rows of D (and of w) per loop step (power of two >= 16, as block_f: the dot's
        minimum).
      k_splits: D is split over this many programs per column block (an int >= 1; fewer are
        used when D has fewer ``block_k`` steps); > 1 writes float32 partial sums that the
        wrapper adds.
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages of the loop over D.
    """

    block_f: int = 128
    block_k: int = 64
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_config(self, ("block_f", "block_k", "num_warps"))
        if not isinstance(self.k_splits, int) or self.k_splits < 1:
            raise ValueError(f"k_splits must be an int >= 1, got {self.k_splits!r}")
        if min(self.block_k, self.block_f) < 16:
            raise ValueError(f"the dot needs block_k and block_f >= 16, got block_k="
                             f"{self.block_k}, block_f={self.block_f}")


def default_gemv_config(m: int, d: int, f: int) -> GemvConfig:
    """The fastest configs of ``tools/probe_gemv.py`` on the H100, D = 2048, bf16, per call:

    * M < 8: the dot on x padded to 16 rows, 128-column blocks, 64-row steps, D split 8 ways:
      M = 1, F = 5632: 8.1 us of kernel (XLA's dot 15.8); F = 2048: ~2 us (XLA ~11.7, a column
      reduction). The broadcast product was slower at every M (30 us at M = 8).
    * 8 <= M < 16: 64-column blocks, D split 4 ways: twice the programs with half the partial
      sums of the M < 8 config, whose [8, M, F] float32 partials grow with M (the decode FFN
      at M = 8 ~0.5 us faster, on both weight layouts). Only the FFN gate runs here at these
      sizes: the attention projections use XLA's dot from ``FEW_ROWS`` rows.
    * M >= 16: 64-column blocks, 128-row steps, D split 2 ways: M = 64, F = 5632 ~11 us (XLA's
      12.3).

    Blocks shrink to the operands' sizes; the splits never exceed D's steps."""
    if m >= 16:
        block_f, block_k, k_splits = 64, 128, 2
    elif m >= FEW_ROWS:
        block_f, block_k, k_splits = 64, 64, 4
    else:
        block_f, block_k, k_splits = 128, 64, 8
    block_f = min(block_f, max(16, next_pow2(f)))
    block_k = min(block_k, max(16, next_pow2(d)))
    return GemvConfig(block_f=block_f, block_k=block_k,
                      k_splits=max(1, min(k_splits, -(-d // block_k))), num_warps=4,
                      num_stages=3)


def _check_args(x, w, bias, unit_rows: bool = False) -> tuple[int, int, int]:
    """Shapes and dtypes of :func:`gemv`'s inputs (w [D, F], or [F, D] with ``unit_rows``);
    returns (M, D, F)."""
    layout = "[F, D]" if unit_rows else "[D, F]"
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, D], got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D {layout}, got shape {w.shape}")
    m, d = x.shape
    w_d, f = (w.shape[1], w.shape[0]) if unit_rows else w.shape
    if w_d != d:
        expected = f"(F, {d})" if unit_rows else f"({d}, F)"
        raise ValueError(f"w has shape {w.shape}, expected {expected} for x of shape {x.shape}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got M={m}")
    if d < 1 or f < 1:
        raise ValueError(f"empty operands: x {x.shape}, w {w.shape}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
        raise ValueError(f"w's dtype {w.dtype} differs from x's {x.dtype}")
    if bias is not None:
        if bias.shape != (f,):
            raise ValueError(f"bias has shape {bias.shape}, expected ({f},)")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError(f"bias must be floating point, got {bias.dtype}")
    return m, d, f


def _gemv_call(x: jax.Array, ws: tuple[jax.Array, ...], bias: jax.Array | None,
               config: GemvConfig | None, interpret: bool | None, allow_fused: bool,
               unit_rows: bool = False, counts: bool = False):
    """The kernel on ``x`` [M, D] and weights ``ws`` ([D, F_i], or [F_i, D] with
    ``unit_rows``; one dtype): ``[M, sum F_i]`` in x.dtype (one D split and ``allow_fused``;
    bias added) or float32 partial sums ``[S, M, sum F_i]`` (bias not added). With
    ``counts`` (one weight; the config must not split D): ``(out, [blocks] int32)``."""
    m, d, _ = _check_args(x, ws[0], bias, unit_rows)
    for w in ws[1:]:
        _check_args(x, w, None, unit_rows)
    widths = [w.shape[0] if unit_rows else w.shape[1] for w in ws]
    config = default_gemv_config(m, d, max(widths)) if config is None else config
    m_pad = max(16, next_pow2(m))
    total_steps = -(-d // config.block_k)
    steps = -(-total_steps // min(config.k_splits, total_steps))
    splits = -(-total_steps // steps)  # no empty split
    fused = splits == 1 and allow_fused
    if counts and (not fused or len(ws) != 1):
        raise ValueError(f"counts need one weight and an unsplit D (k_splits=1), got "
                         f"{len(ws)} weights and {splits} splits")
    weights, first_block, out_col0 = [], 0, 0
    for f in widths:
        n_blocks = -(-f // config.block_f)
        weights.append((first_block, n_blocks, f, out_col0))
        first_block += n_blocks
        out_col0 += f
    has_bias = bias is not None and fused
    precision = (jax.lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None)
    kernel = functools.partial(
        _gemv_kernel, m=m, d=d, m_pad=m_pad, block_k=config.block_k, block_f=config.block_f,
        steps=steps, weights=tuple(weights), has_bias=has_bias, fused=fused,
        mask_k=splits * steps * config.block_k != d, unit_rows=unit_rows, precision=precision,
        counts=counts)
    out_shape = (jax.ShapeDtypeStruct((m, out_col0), x.dtype) if fused
                 else jax.ShapeDtypeStruct((splits, m, out_col0), jnp.float32))
    if counts:
        out_shape = (out_shape, jax.ShapeDtypeStruct((first_block,), jnp.int32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(first_block, splits),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_gemv",
    )(x, *ws, *((bias,) if has_bias else ()))


def gemv(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None,
    *,
    unit_rows: bool = False,
    config: GemvConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x @ w + bias`` for few rows, float32 accumulation, rounded once to x.dtype.

    Args:
      x: [M, D] with 1 <= M <= 64; bfloat16, float16 or float32.
      w: [D, F] row-major, x's dtype; with ``unit_rows``, [F, D] (one row per output unit, the
        sparse FFN's layout) and the product is ``x @ w.T``.
      bias: [F] (any float dtype, added in float32 before the rounding) or None.
      config: ``default_gemv_config(M, D, F)`` when None. D and F need not be multiples
        of the blocks.
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      pre [M, F] in x.dtype: ``(x @ w (float32) + bias (float32)).astype(x.dtype)``, as
      ``twell_jax.dense.gate_pre_activation`` computes it for decode-sized M.
    """
    out = _gemv_call(x, (w,), bias, config, interpret, allow_fused=True, unit_rows=unit_rows)
    return out if out.ndim == 2 else finish_partial_sums(out, bias, x.dtype)


def default_gemv_counts_config(m: int, d: int, f: int) -> GemvConfig:
    """The unsplit config of :func:`gemv_with_counts`: 32-column blocks (176 programs at
    F = 5632, enough to keep every SM streaming weights without a D split), 128-row steps,
    4 stages. On an H200 at M = 64, D = 2048, F = 5632 it matched the split default (13.7 us
    a call in an on-device loop, ``tools/probe_gemv.py --unit-rows``)."""
    return GemvConfig(block_f=min(32, max(16, next_pow2(f))),
                      block_k=min(128, max(16, next_pow2(d))), k_splits=1, num_warps=4,
                      num_stages=4)


def gemv_with_counts(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None,
    *,
    unit_rows: bool = False,
    config: GemvConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`gemv` plus each program's count of active outputs, in the same launch.

    The counts let a later kernel see how busy the whole product is with one small load
    (the decode FFN's ``scan_up_down`` chooses its dense mode so, with no launch or host
    round trip in between). D is not split, so every program holds finished outputs.

    Args: as :func:`gemv`; ``config`` must have ``k_splits=1`` (default
      ``default_gemv_counts_config``).
    Returns:
      ``(pre [M, F] x.dtype, counts [ceil(F / block_f)] int32)``: counts[b] is the number of
      entries of pre's columns [b * block_f, +block_f) that are > 0 or NaN.
    """
    if config is None:
        m, d, f = _check_args(x, w, bias, unit_rows)
        config = default_gemv_counts_config(m, d, f)
    return _gemv_call(x, (w,), bias, config, interpret, allow_fused=True, unit_rows=unit_rows,
                      counts=True)


def gemv_partial_sums(
    x: jax.Array,
    w: jax.Array,
    *,
    unit_rows: bool = False,
    config: GemvConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x @ w`` for few rows as float32 partial sums over the D splits, unsummed: [S, M, F]
    (S = 1 when D is not split). For a consumer that adds them itself (``scan_up_down`` reads
    the FFN gate so, saving the launch that would add them): ``finish_partial_sums(out, bias,
    x.dtype)`` equals ``gemv(x, w, bias, unit_rows=unit_rows)`` up to the order of the float32
    sum."""
    return _gemv_call(x, (w,), None, config, interpret, allow_fused=False, unit_rows=unit_rows)


def gemv_many_partial_sums(
    x: jax.Array,
    ws: tuple[jax.Array, ...],
    *,
    config: GemvConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``gemv_many``'s products unfinished: float32 partial sums [S, M, sum F_i] over the D
    splits, the weights' columns side by side, for a consumer that adds them itself (a decode
    step's q, k and v: ``qkv_rope_cache``)."""
    if not isinstance(ws, tuple) or not ws:
        raise ValueError("ws must be a non-empty tuple of [D, F] weights")
    return _gemv_call(x, ws, None, config, interpret, allow_fused=False)


def gemv_many(
    x: jax.Array,
    ws: tuple[jax.Array, ...],
    *,
    config: GemvConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, ...]:
    """``x @ w`` for each w of ``ws`` (each [D, F_i], x's dtype) in one launch (and one pass
    adding the D splits): a decode step's q, k and v projections. Each program reads a tile
    of one weight, so no weight is copied or concatenated. Returns [M, F_i] in x.dtype each,
    equal to ``gemv(x, w, None)`` up to the order of the float32 sum."""
    if not isinstance(ws, tuple) or not ws:
        raise ValueError("ws must be a non-empty tuple of [D, F] weights")
    out = _gemv_call(x, ws, None, config, interpret, allow_fused=True)
    if out.ndim == 3:
        out = finish_partial_sums(out, None, x.dtype)
    edges = [0]
    for w in ws:
        edges.append(edges[-1] + w.shape[1])
    return tuple(out[:, a:b] for a, b in zip(edges[:-1], edges[1:]))


def gemv_reference(x: jax.Array, w: jax.Array, bias: jax.Array | None, *,
                   unit_rows: bool = False) -> jax.Array:
    """Plain-jnp :func:`gemv` (same arguments and output): a float32 dot at highest
    precision plus the float32 bias, rounded once to x.dtype."""
    _check_args(x, w, bias, unit_rows)
    pre = jnp.dot(x, w.T if unit_rows else w, preferred_element_type=jnp.float32,
                  precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        pre = pre + bias.astype(jnp.float32)
    return pre.astype(x.dtype)
