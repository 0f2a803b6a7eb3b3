"""The decoder's layers: RMSNorm, rotary embeddings, attention (with its decode path) and the
pre-norm block around a TwELL sparse FFN."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.decode_attention import decode_attention as decode_attention_kernel
from pallas_kernels.decode_attention import decode_attention_reference
from pallas_kernels.gemv import FEW_ROWS as GEMV_FEW_ROWS
from pallas_kernels.gemv import gemv_many_partial_sums, gemv_partial_sums
from pallas_kernels.qkv_rope_cache import qkv_rope_cache, supports_head_dim
from twell_jax import nn, sharding
from twell_jax.dense import few_row_matmuls, mixed_precision_matmul
from twell_jax.ffn import PartialSums
from twell_jax.model.config import ModelConfig

_F32 = jnp.float32

FFN_INPUT_NAME = "ffn_input"
"""The name each block sows its FFN input under (variable type ``FFNInput``)."""


class FFNInput(nnx.Intermediate):
    """The normalised input of a block's FFN, sown only for ``unit_activity``.

    A subclass of ``nnx.Intermediate``: ``nnx.capture`` matches the exact variable type, so
    capturing ``nnx.Intermediate`` (as ``loss_fn`` does) leaves these out.
    """


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``, computed in float32, returned in ``dtype``."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), **sharding.logical("embed"))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(_F32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(_F32)).astype(self.dtype)

    def add_and_norm(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """(x + delta, self(x + delta)) in one ``add_rms_norm`` launch (decode steps: XLA
        makes three of it). x [B, T, D] in the compute dtype (B * T <= 64); delta the sublayer
        output [B * T, D], float32 partial sums [S, B * T, D] (an unfinished ``gemv``'s, or
        the sparse FFN's ``PartialSums.sums``), or None (no add). Equal to the unfused add and
        norm up to the order of the mean's sum."""
        b, t, d = x.shape
        r, h = add_rms_norm(x.reshape(b * t, d), delta, self.scale[...], eps=self.eps)
        return r.reshape(b, t, d), h.reshape(b, t, d).astype(self.dtype)


@functools.lru_cache(maxsize=16)
def rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, head_dim / 2] (float32) of the rotary embedding angles."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates feature pairs (i, i + H/2) of x [B, T, N, H] by the angles of positions 0..T-1."""
    t = x.shape[1]
    return _rotate(x, cos[None, :t, None, :], sin[None, :t, None, :])


def apply_rope_at(x: jax.Array, cos: jax.Array, sin: jax.Array,
                  positions: jax.Array) -> jax.Array:
    """``apply_rope`` at per-sequence positions [B, T] int (decoding: each sequence of a batch
    is at its own offset); cos, sin [max_seq_len, H / 2] as ``rope_tables``."""
    return _rotate(x, cos[positions][:, :, None, :], sin[positions][:, :, None, :])


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # The split-halves convention (Hugging Face Llama's rotate_half), in float32.
    x1, x2 = jnp.split(x.astype(_F32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _dense(rngs: nnx.Rngs, d_in: int, d_out: int, cfg: ModelConfig,
           axes: tuple[str, str]) -> nnx.Param:
    """A [d_in, d_out] weight whose dimensions have the logical names ``axes``
    (``twell_jax.sharding.LOGICAL_RULES``)."""
    return nnx.Param(nn.default_kernel_init(rngs.params(), (d_in, d_out), cfg.param_dtype),
                     **sharding.logical(*axes))


def _attention_implementation(dtype, seq_len: int) -> str:
    """cuDNN flash attention on a GPU for bf16 / fp16 sequences of 128+ tokens
    (``implementation=None`` would pick XLA's unfused attention, which materialises the
    [B, N, T, T] scores); XLA elsewhere (short sequences: the scores are small)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half and seq_len >= 128 and jax.default_backend() == "gpu" else "xla"


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary embeddings; no biases. With
    ``cfg.n_kv_heads`` < ``n_heads``, grouped-query attention (``w_k``, ``w_v`` [D, Nkv * H])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads, self.head_dim, self.dtype = cfg.n_heads, cfg.head_dim, cfg.dtype
        self.n_kv_heads = cfg.kv_heads
        self.decode_kernels = cfg.uses_decode_kernels
        self.w_q = _dense(rngs, d, d, cfg, ("embed", "heads"))
        self.w_k = _dense(rngs, d, cfg.kv_heads * cfg.head_dim, cfg, ("embed", "heads"))
        self.w_v = _dense(rngs, d, cfg.kv_heads * cfg.head_dim, cfg, ("embed", "heads"))
        self.w_o = _dense(rngs, d, d, cfg, ("heads", "embed"))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        return self.prefill(x, cos, sin)[0]

    def _kernels(self) -> bool:
        """``decode_kernels``, on one device: under a context mesh of several devices XLA
        partitions the plain products (a ``pallas_call`` is not partitioned)."""
        return self.decode_kernels and sharding.on_one_device()

    def _gemv(self, x: jax.Array) -> bool:
        """Products of x [B, T, K] run on the GEMV kernel: fewer than ``GEMV_FEW_ROWS`` (8)
        rows, under ``decode_kernels``."""
        return self._kernels() and x.shape[0] * x.shape[1] < GEMV_FEW_ROWS

    def _matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x [B, T, K] @ w [K, N] -> [B, T, N] in the compute dtype (float32 accumulation)."""
        x, w = x.astype(self.dtype), w.astype(self.dtype)
        if self._gemv(x):
            return few_row_matmuls(x, (w,), self.dtype)[0]
        return mixed_precision_matmul(x, w, self.dtype)

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> q [B, T, N, H], k, v [B, T, Nkv, H], not rotated.

        On the GEMV kernel (decode) the three products share one launch that reads each
        weight where it lies (``few_row_matmuls``); one call over concatenated weights was
        slower on the H100: XLA did not hoist the concatenation out of the decode loop."""
        b, t, _ = x.shape
        heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        weights = tuple(w[...].astype(self.dtype) for w in (self.w_q, self.w_k, self.w_v))
        if self._gemv(x):
            outs = few_row_matmuls(x.astype(self.dtype), weights, self.dtype)
        else:
            outs = tuple(self._matmul(x, w) for w in weights)
        return tuple(o.reshape(b, t, n, self.head_dim) for o, n in zip(outs, heads))

    def _output(self, out: jax.Array) -> jax.Array:
        b, t = out.shape[:2]
        return self._matmul(out.reshape(b, t, -1), self.w_o[...])

    def _output_for_add(self, out: jax.Array) -> jax.Array:
        """The output projection of out [B, T, N, H] (B * T <= 64) as ``RMSNorm.add_and_norm``
        takes it: the GEMV kernel's float32 partial sums [S, B * T, D], left for that kernel
        to add (one launch less)."""
        b, t = out.shape[:2]
        return gemv_partial_sums(out.reshape(b * t, -1).astype(self.dtype),
                                 self.w_o[...].astype(self.dtype))

    def prefill(self, x: jax.Array, cos: jax.Array,
                sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> (output [B, T, D], k, v [B, T, Nkv, H] with k rotated), positions
        0..T-1. The model's attention path (cuDNN flash attention on a GPU for 128+ tokens)."""
        t = x.shape[1]
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=_attention_implementation(q.dtype, t))
        return self._output(out), k, v

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
               cache_k: jax.Array, cache_v: jax.Array, *,
               for_add: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One new position per sequence: x [B, 1, D] at ``positions`` [B] int; writes its k, v
        into the caches [B, S, Nkv, H] there and attends over cache positions <= its own.
        Returns (output [B, 1, D], cache_k, cache_v); with ``for_add`` the output as
        ``_output_for_add`` gives it."""
        if self._gemv(x) and supports_head_dim(self.head_dim):
            # The GEMV's partial sums, finished, rotated and written into the caches in one
            # launch (XLA makes five launches of it).
            weights = tuple(w[...].astype(self.dtype) for w in (self.w_q, self.w_k, self.w_v))
            parts = gemv_many_partial_sums(x.reshape(x.shape[0], -1).astype(self.dtype),
                                           weights)
            q, cache_k, cache_v = qkv_rope_cache(parts, cos, sin, positions, cache_k, cache_v,
                                                 n_heads=self.n_heads, dtype=self.dtype)
        else:
            pos = positions[:, None]
            q, k, v = self._qkv(x)
            q, k = apply_rope_at(q, cos, sin, pos), apply_rope_at(k, cos, sin, pos)
            rows = jnp.arange(x.shape[0])
            cache_k = cache_k.at[rows, positions].set(k[:, 0].astype(cache_k.dtype))
            cache_v = cache_v.at[rows, positions].set(v[:, 0].astype(cache_v.dtype))
            q = q[:, 0]
        out = decode_attention(q, cache_k, cache_v, positions, kernel=self._kernels())
        project = self._output_for_add if for_add else self._output
        return project(out[:, None]), cache_k, cache_v


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                     kernel: bool = False) -> jax.Array:
    """Attention of one query per sequence over a KV cache.

    Args:
      q: [B, N, H] queries (rotated).
      k, v: [B, S, Nkv, H] caches (Nkv divides N: grouped-query attention).
      positions: [B] int, the query's position; cache entries after it are masked out.
      kernel: the Pallas flash-decoding kernel (``pallas_kernels.decode_attention``: reads
        only the entries up to each position; probabilities kept in float32) instead of plain
        XLA (a masked softmax over the whole cache, probabilities rounded to v's dtype before
        the weighted sum, as ``jax.nn.dot_product_attention``'s XLA path).
    Returns:
      [B, N, H] in q's dtype.
    """
    if kernel:
        return decode_attention_kernel(q, k, v, positions)
    return decode_attention_reference(q, k, v, positions)


class Block(nnx.Module):
    """Pre-norm decoder block: ``x += attn(norm(x)); x += ffn(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
        self.ffn = nn.SparseGatedMLP(cfg.d_model, cfg.d_ff, implementation=cfg.implementation,
                                     config=cfg.twell, rngs=rngs, gate_bias=cfg.gate_bias, **kw)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return self._ffn_residual(x)

    def _ffn_residual(self, x: jax.Array) -> jax.Array:
        h = self.ffn_norm(x)
        nn.sow_if_captured(self, FFNInput, FFN_INPUT_NAME, h)
        return x + self.ffn(h)

    def prefill(self, x: jax.Array, cos: jax.Array,
                sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> (x [B, T, D], k, v [B, T, Nkv, H]) for the KV cache."""
        out, k, v = self.attn.prefill(self.attn_norm(x), cos, sin)
        return self._ffn_residual(x + out), k, v

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
               cache_k: jax.Array, cache_v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, 1, D] at ``positions`` [B] -> (x, cache_k, cache_v); see ``Attention.decode``."""
        out, cache_k, cache_v = self.attn.decode(self.attn_norm(x), cos, sin, positions,
                                                 cache_k, cache_v)
        return self._ffn_residual(x + out), cache_k, cache_v

    def decode_fused(self, x: jax.Array, delta: jax.Array | None, cos: jax.Array,
                     sin: jax.Array, positions: jax.Array, cache_k: jax.Array,
                     cache_v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``decode`` with each residual add done inside the norm after it (``RMSNorm.
        add_and_norm``: one launch where XLA makes three; see ``Transformer.
        _fused_decode_norms`` for when it is used). x [B, 1,
        D] is the residual stream before the previous block's FFN output ``delta`` is added
        (None: nothing to add). Returns (x, this block's FFN output, cache_k, cache_v): the
        next block, or the final norm, adds it. The FFN output is y [B, D], or on the sparse
        decode path its float32 partial sums [S, B, D] (``PartialSums``), which the norm's
        kernel adds itself: XLA's pass over them was one launch more a layer."""
        x, h = self.attn_norm.add_and_norm(x, delta)
        out, cache_k, cache_v = self.attn.decode(h, cos, sin, positions, cache_k, cache_v,
                                                 for_add=True)
        x, h = self.ffn_norm.add_and_norm(x, out)
        nn.sow_if_captured(self, FFNInput, FFN_INPUT_NAME, h)
        y = self.ffn(h, partial_sums=True)
        y = y.sums if isinstance(y, PartialSums) else y.reshape(-1, y.shape[-1])
        return x, y, cache_k, cache_v
