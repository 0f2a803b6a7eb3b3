"""Flash-decoding: one query per sequence attends over its KV cache, split over the cache.

The contract of ``twell_jax.model.decode_attention``: q [B, N, H] (rotated), caches k, v
[B, S, Nkv, H] with Nkv dividing N (grouped-query attention, G = N // Nkv query heads per kv
head), positions [B]: cache entries 0..positions[b] are valid, later ones are masked out.
Scores and softmax in float32, scale 1/sqrt(H); the result in q's dtype.

Grid (B, Nkv, ceil(S / block_s)): one program per (sequence, kv head, chunk of ``block_s``
cache positions) takes that kv head's G queries. It walks its chunk ``block_k`` rows at a
time: loads the [block_k, H] tiles of K and V of its head (rows strided by Nkv * H, masked at
the position and at S, so nothing after the position is read and garbage there cannot leak in),
and keeps an online softmax per query head: running max m, sum of exponentials l and the
unnormalized output acc, all float32. G < 16: the scores of each head are a broadcast product
summed over H (the K and V tiles are loaded once for the G heads); G >= 16: two float32 dots
at HIGHEST precision (correct, not tuned: no bf16 tensor-core path yet). A
program whose chunk starts after the position reads nothing (a ``cond`` in the kernel) and
writes the neutral partial (m = -inf, l = 0, acc = 0). A second kernel (one program per
sequence and kv head) combines the chunks' partials with the log-sum-exp rule in a fixed order
(deterministic): one launch where XLA made three (``combine_partials`` is its jnp reference).
H100, 0.5b decode: +3.6% / +4.5% tokens/s at batch 1 (dense / sparse
model), +1.3% / +2.4% at batch 8, against XLA's combine in the same process.

Precision: the probabilities stay float32 in the weighted sum over V (V's values are converted
to float32), where the XLA version rounds them to V's dtype first: the kernel is the more exact
of the two; both are within the dtype's tolerance of a float64 reference. q is rounded to K's
dtype first, as in the XLA version.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import block_range, check_config, next_pow2, resolve_interpret

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
# G (query heads per kv head, padded to a power of two) from which the scores and the weighted
# sum are dots (tensor cores) instead of one broadcast product per head.
_DOT_MIN_HEADS = 16


def _decode_attention_kernel(pos_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *,
                             s: int, h: int, g: int, g_pad: int, h_pad: int, block_s: int,
                             block_k: int, use_dot: bool):
    """One program: sequence ``program_id(0)``, kv head ``program_id(1)``, cache rows
    [c * block_s, +block_s) for c = ``program_id(2)``.

    Refs (whole arrays): positions [B] int32, q [B, N, H] (any float dtype: rounded to the
    caches' dtype, then float32, here rather than in a launch of its own), k, v [B, S, Nkv, H];
    outputs m, l [B, Nkv, C, g_pad] and acc [B, Nkv, C, g_pad, h_pad] float32 (this program's
    partial at [b, kv, c]).
    """
    b = pl.program_id(0)
    kv = pl.program_id(1)
    chunk = pl.program_id(2)
    pos = pos_ref[b]
    start = chunk * block_s
    scale = 1.0 / math.sqrt(h)
    row_iota = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    # Columns [0, h_pad) as an index vector, not ``pl.ds(0, h_pad)``: past H (masked) the static
    # slice is rejected at trace time by jax >= 0.12 (``common.block_range``). The interpreter
    # takes index vectors only if every axis is one (or a scalar), hence the row vectors below.
    cols = block_range(0, h_pad)
    col_ok = (cols < h)[None, :]
    as_k = lambda a: a.astype(k_ref.dtype).astype(_F32)
    if use_dot:  # [g_pad, h_pad], rows past the group's G heads zero
        head_ok = (jax.lax.broadcasted_iota(jnp.int32, (g_pad,), 0) < g)[:, None]
        heads = block_range(kv * g, g_pad)[:, None]
        q = as_k(plgpu.load(q_ref.at[b, heads, cols[None, :]], mask=head_ok & col_ok,
                            other=0))
    else:  # one [h_pad] row per head (Triton cannot slice a loaded value)
        q_rows = [as_k(plgpu.load(q_ref.at[b, kv * g + gi, cols], mask=col_ok[0], other=0))
                  for gi in range(g)]

    def tile(ref, rows, ok):
        mask = ok[:, None] if h_pad == h else ok[:, None] & col_ok
        return plgpu.load(ref.at[b, rows[:, None], kv, cols[None, :]], mask=mask,
                          other=0).astype(_F32)

    def update(m, l, acc, scores, v):
        """One online-softmax step for one head ([block_k] scores, m, l [1], acc [h_pad])
        or for all heads at once (scores [g_pad, block_k], m, l [g_pad], acc [g_pad, h_pad])."""
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        # m_new is -inf only while every score so far is masked: keep exp() away from -inf - -inf.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        per_head = acc.ndim == 1
        p = jnp.exp(scores - (m_safe if per_head else m_safe[:, None]))
        l = alpha * l + jnp.sum(p, axis=-1)
        if use_dot:
            pv = jnp.dot(p, v, precision=_HIGHEST, preferred_element_type=_F32)
        else:
            pv = jnp.sum(p[:, None] * v, axis=0)
        return m_new, l, (alpha if per_head else alpha[:, None]) * acc + pv

    def compute(_):
        def step(j, carry):
            row0 = start + j * block_k
            rows_idx = row0 + row_iota
            ok = (rows_idx <= pos) & (rows_idx < s)
            k = tile(k_ref, rows_idx, ok)
            v = tile(v_ref, rows_idx, ok)
            if use_dot:
                m, l, acc = carry
                scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                             preferred_element_type=_F32)
                scores = jnp.where(ok[None, :], scores * scale, -jnp.inf)
                return update(m, l, acc, scores, v)
            out = []
            for gi, (m, l, acc) in enumerate(carry):
                scores = jnp.sum(k * q_rows[gi][None, :], axis=1)
                scores = jnp.where(ok, scores * scale, -jnp.inf)
                out.append(update(m, l, acc, scores, v))
            return tuple(out)

        return jax.lax.fori_loop(0, block_s // block_k, step, neutral(None))

    def neutral(_):
        if use_dot:
            return (jnp.full((g_pad,), -jnp.inf, _F32), jnp.zeros((g_pad,), _F32),
                    jnp.zeros((g_pad, h_pad), _F32))
        # Per head: m, l of shape [1] (a cond's branch cannot yield scalar literals in Triton).
        return tuple((jnp.full((1,), -jnp.inf, _F32), jnp.zeros((1,), _F32),
                      jnp.zeros((h_pad,), _F32)) for _ in range(g))

    # A chunk that starts after the position reads nothing.
    state = jax.lax.cond(start <= pos, compute, neutral, None)
    if use_dot:
        m, l, acc = state
        m_ref[b, kv, chunk, :] = m
        l_ref[b, kv, chunk, :] = l
        acc_ref[b, kv, chunk, :, :] = acc
    else:
        for gi, (m, l, acc) in enumerate(state):
            m_ref[b, kv, chunk, pl.ds(gi, 1)] = m
            l_ref[b, kv, chunk, pl.ds(gi, 1)] = l
            acc_ref[b, kv, chunk, gi, :] = acc


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeAttentionConfig:
    """Knobs of :func:`decode_attention`.

    Attributes:
      block_s: cache positions per program (power of two); the grid is
        (B, Nkv, ceil(S / block_s)).
      block_k: rows of K and V loaded at once within a program (power of two, 16 <= block_k
        <= block_s); None: ``min(block_s, max(16, 4096 // H_pad))`` (~4K values per tile: 64
        rows at H = 64, 32 values of K and of V per thread at 4 warps).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the loop over a chunk's row blocks.
    """

    block_s: int = 256
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_config(self, ("block_s", "num_warps"))
        if self.block_k is not None:
            check_config(self, ("block_k",))
            if not 16 <= self.block_k <= self.block_s:
                raise ValueError(f"block_k={self.block_k} must be in [16, block_s="
                                 f"{self.block_s}]")
        if self.block_s < 16:
            raise ValueError(f"block_s must be >= 16, got {self.block_s}")

    def rows_per_tile(self, h_pad: int) -> int:
        if self.block_k is not None:
            return self.block_k
        return min(self.block_s, max(16, 4096 // h_pad))


def default_decode_attention_config(b: int, s: int, n_kv: int, h: int) -> DecodeAttentionConfig:
    """~512 programs (about 4 per SM of an H100) when (B, Nkv) pairs are fewer: S is split into
    power-of-two chunks of 64 to 1024 positions; tiles of ~4K values (64 rows at H = 64).

    H100 (tools/probe_decode_attention.py; S = 2048, 32 heads of
    64, per call with 1.7-2.3 us of loop): B = 1, full cache 13.8 us (the best config 12.9:
    256-position chunks, 8 warps), position 512 9.1 (best 8.3: 64-position chunks, 2 warps);
    B = 8 55.2 (best). Inside the 0.5b model's decode loop: 8.1 us per layer."""
    chunks = max(1, -(-512 // max(b * n_kv, 1)))
    block_s = min(1024, max(64, next_pow2(-(-s // chunks))))
    return DecodeAttentionConfig(block_s=block_s, num_warps=4, num_stages=2)


def _check_args(q, k, v, positions) -> tuple[int, int, int, int, int]:
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D [B, N, H], got shape {q.shape}")
    if k.ndim != 4:
        raise ValueError(f"k must be 4-D [B, S, Nkv, H], got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}, expected k's {k.shape}")
    b, n, h = q.shape
    kb, s, n_kv, kh = k.shape
    if kb != b:
        raise ValueError(f"k has batch {kb}, q has {b}")
    if kh != h:
        raise ValueError(f"k has head dim {kh}, q has {h}")
    if s < 1 or n_kv < 1 or n % n_kv:
        raise ValueError(f"N={n} query heads must be a multiple of Nkv={n_kv} kv heads (and "
                         f"S={s} >= 1)")
    if positions.shape != (b,):
        raise ValueError(f"positions has shape {positions.shape}, expected ({b},)")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integers, got {positions.dtype}")
    return b, n, h, s, n_kv


def combine_partials(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:
    """Log-sum-exp combination over axis 2 of partials m, l [B, Nkv, C, G] and acc
    [B, Nkv, C, G, H] -> [B, Nkv, G, H] float32. Neutral partials (m = -inf, l = 0, acc = 0)
    add nothing, even when all are neutral (then 0 / 0: NaN, as a softmax over no entries)."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)  # 0 for neutral partials
    l_sum = jnp.sum(w * l, axis=2)
    acc_sum = jnp.sum(w[..., None] * acc, axis=2)
    return acc_sum / l_sum[..., None]


def _combine_kernel(m_ref, l_ref, acc_ref, out_ref, *, chunks: int, c_pad: int, g: int,
                    g_pad: int, h: int, h_pad: int):
    """``combine_partials`` for one (sequence ``program_id(0)``, kv head ``program_id(1)``):
    m, l [B, Nkv, C, g_pad], acc [B, Nkv, C, g_pad, h_pad] float32 -> out [B, N, H] (the
    group's G heads, rounded to out's dtype). One launch where XLA makes three (the max over
    the chunks, the weighted sums, the division)."""
    b = pl.program_id(0)
    kv = pl.program_id(1)
    # Index vectors, not ``pl.ds(0, c_pad)`` and ``pl.ds(0, h)``: past C and H (masked) the
    # static slices are rejected at trace time by jax >= 0.12 (``common.block_range``).
    chunk = block_range(0, c_pad)
    chunk_ok = chunk < chunks
    head = block_range(0, g_pad)
    cols = block_range(0, h_pad)
    col_ok = cols < h
    m = plgpu.load(m_ref.at[b, kv, chunk[:, None], head[None, :]],
                   mask=chunk_ok[:, None], other=-jnp.inf)
    l = plgpu.load(l_ref.at[b, kv, chunk[:, None], head[None, :]],
                   mask=chunk_ok[:, None], other=0.0)
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max[None, :])  # [c_pad, g_pad]; 0 for neutral and padded chunks
    l_sum = jnp.sum(w * l, axis=0)  # [g_pad]
    for gi in range(g):  # one [h_pad] row per head (Triton cannot slice a loaded value)
        acc = plgpu.load(acc_ref.at[b, kv, chunk[:, None], jnp.int32(gi), cols[None, :]],
                         mask=chunk_ok[:, None], other=0.0)  # [c_pad, h_pad]
        w_g = jnp.sum(jnp.where(head[None, :] == gi, w, 0.0), axis=1)  # column gi of w
        l_g = jnp.sum(jnp.where(head == gi, l_sum, 0.0))
        out = jnp.sum(w_g[:, None] * acc, axis=0) / l_g
        plgpu.store(out_ref.at[b, kv * g + gi, cols], out.astype(out_ref.dtype), mask=col_ok)


def combine_partials_kernel(m: jax.Array, l: jax.Array, acc: jax.Array, *, g: int, h: int,
                            dtype, interpret: bool | None = None) -> jax.Array:
    """The kernel's partials m, l [B, Nkv, C, g_pad], acc [B, Nkv, C, g_pad, h_pad] ->
    [B, Nkv * g, h] in ``dtype``: ``combine_partials`` of their first g heads and h columns,
    in one launch."""
    b, n_kv, chunks, g_pad = m.shape
    h_pad = acc.shape[-1]
    kernel = functools.partial(_combine_kernel, chunks=chunks, c_pad=next_pow2(chunks), g=g,
                               g_pad=g_pad, h=h, h_pad=h_pad)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, n_kv * g, h), dtype),
        grid=(b, n_kv),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="twell_decode_attention_combine",
    )(m, l, acc)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    config: DecodeAttentionConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of one query per sequence over a KV cache (flash-decoding).

    Args:
      q: [B, N, H] queries (rotated).
      k, v: [B, S, Nkv, H] caches (Nkv divides N: grouped-query attention).
      positions: [B] int, the query's position; cache entries after it are masked out (and not
        read).
      config: ``default_decode_attention_config(B, S, Nkv, H)`` when None.
      interpret: run the Pallas interpreter (None: iff no GPU).
    Returns:
      [B, N, H] in q's dtype. Scores, softmax and the weighted sum in float32 (the
      probabilities are not rounded to v's dtype; see the module docstring).
    """
    b, n, h, s, n_kv = _check_args(q, k, v, positions)
    config = default_decode_attention_config(b, s, n_kv, h) if config is None else config
    g = n // n_kv
    g_pad, h_pad = next_pow2(g), max(16, next_pow2(h))
    use_dot = g_pad >= _DOT_MIN_HEADS
    chunks = -(-s // config.block_s)
    kernel = functools.partial(_decode_attention_kernel, s=s, h=h, g=g, g_pad=g_pad,
                               h_pad=h_pad, block_s=config.block_s,
                               block_k=config.rows_per_tile(h_pad), use_dot=use_dot)
    m, l, acc = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, n_kv, chunks, g_pad), _F32),
                   jax.ShapeDtypeStruct((b, n_kv, chunks, g_pad), _F32),
                   jax.ShapeDtypeStruct((b, n_kv, chunks, g_pad, h_pad), _F32)),
        grid=(b, n_kv, chunks),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=resolve_interpret(interpret),
        name="twell_decode_attention",
    )(positions.astype(jnp.int32), q, k, v)
    return combine_partials_kernel(m, l, acc, g=g, h=h, dtype=q.dtype, interpret=interpret)


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                               positions: jax.Array) -> jax.Array:
    """Plain-jnp :func:`decode_attention` (``twell_jax.model.decode_attention``'s XLA path):
    scores and softmax in float32, the probabilities rounded to v's dtype before the weighted
    sum (as ``jax.nn.dot_product_attention``'s XLA path)."""
    b, n, h, s, n_kv = _check_args(q, k, v, positions)
    dtype = q.dtype
    q = q.reshape(b, n_kv, n // n_kv, h).astype(k.dtype)
    scores = jnp.einsum("bkgh,bskh->bkgs", q, k, preferred_element_type=_F32) / math.sqrt(h)
    valid = jnp.arange(s)[None, :] <= positions[:, None]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgs,bskh->bkgh", probs, v, preferred_element_type=_F32)
    return out.reshape(b, n, h).astype(dtype)
