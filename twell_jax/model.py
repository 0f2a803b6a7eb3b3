"""A Llama-style decoder whose FFNs are TwELL sparse gated MLPs (``nn.SparseGatedMLP``).

Architecture: token embedding (tied with the output projection), ``n_layers`` pre-norm blocks of
RMSNorm -> causal multi-head attention with rotary embeddings -> residual, RMSNorm -> ReLU-gated
FFN -> residual, then a final RMSNorm and ``logits = h @ embedding.T`` in float32. No biases,
except an optional per-unit gate bias in each FFN (``ModelConfig.gate_bias``). For Hugging Face
Llama checkpoints (``from_hf``) the config can also give grouped-query attention, an untied
``lm_head``, no sqrt(D) embedding scale and another RMSNorm epsilon.

Dtypes: parameters in ``param_dtype`` (float32, the optimizer's master copy); activations, the
residual stream and every matmul in ``dtype`` (bf16 by default) with float32 accumulation; norms,
softmax and the logits in float32.

Statistics: each FFN sows its ``FFNStats`` under ``"ffn_stats"`` (``nnx.Intermediate``).
``loss_fn`` captures them and adds ``l1_coeff * nn.l1_penalty(...)`` (the mean over layers of
``stats.l1``) to the next-token cross-entropy. Each block also sows its FFN input under
``"ffn_input"`` as ``FFNInput``, a separate variable type that ``nnx.capture(model,
nnx.Intermediate)`` does not collect (capture matches the exact type), so training never keeps
it; ``unit_activity`` captures it to find dead units.

Remat: with ``ModelConfig.remat`` each block runs under ``nnx.remat`` with the policy
``save_only_these_names("ffn_out", "twell_residuals")``: the FFN outputs (``nn.CHECKPOINT_NAME``)
and the sparse FFN's packed lists (``ffn.RESIDUALS_NAME``, ~1% of a dense FFN's residuals) are
kept, so the sparse FFN forward is not run again in the backward; everything else in the block
(attention, norms; the whole dense FFN for ``"xla"``) is recomputed.

Generation: ``generate`` (one jitted program) and ``generate_chunks`` (a stream of jitted
chunks) prefill left-aligned prompts of any lengths into a ``KVCache`` (``Transformer.prefill``,
on the model's attention path), then decode one token per sequence per step
(``Transformer.decode_step``: per-sequence positions and rotary offsets, attention over the cache
in plain XLA, the FFN layers as they are) inside a ``lax.while_loop``, greedy or sampled
(``Sampling``: temperature, top-k, top-p), with stop tokens and per-step FFN statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.common import default_interpret
from pallas_kernels.decode_attention import decode_attention as decode_attention_kernel
from pallas_kernels.decode_attention import decode_attention_reference
from pallas_kernels.gemv import FEW_ROWS as GEMV_FEW_ROWS
from pallas_kernels.gemv import gemv_many_partial_sums, gemv_partial_sums
from pallas_kernels.qkv_rope_cache import qkv_rope_cache, supports_head_dim
from twell_jax import backends, nn, safetensors_io, sharding
from twell_jax.config import TwELLConfig
from twell_jax.dense import few_row_matmuls, mixed_precision_matmul
from twell_jax.backends import DEFAULT_IMPLEMENTATION, Implementation
from twell_jax.ffn import RESIDUALS_NAME, FFNStats, PartialSums

_F32 = jnp.float32

FFN_INPUT_NAME = "ffn_input"
"""The name each block sows its FFN input under (variable type ``FFNInput``)."""


class FFNInput(nnx.Intermediate):
    """The normalised input of a block's FFN, sown only for ``unit_activity``.

    A subclass of ``nnx.Intermediate``: ``nnx.capture`` matches the exact variable type, so
    capturing ``nnx.Intermediate`` (as ``loss_fn`` does) leaves these out.
    """


# ------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and knobs of the decoder. Frozen, so hashable (usable as a static jit argument).

    Attributes:
      vocab_size: V, tokens in the vocabulary (256 for the byte-level presets).
      d_model: D, the residual width.
      d_ff: F, the FFN hidden width.
      n_layers: number of decoder blocks.
      n_heads: attention heads; the head width is D / n_heads.
      max_seq_len: longest sequence the model accepts (positions for the rotary tables).
      rope_theta: base of the rotary embedding frequencies.
      implementation: the FFN path, ``"pallas"`` (TwELL kernels, the default; interpret mode
        without a GPU), ``"reference"`` (TwELL in jnp) or ``"xla"`` (dense).
      twell: the TwELL format's knobs (``TwELLConfig()`` when None).
      dtype: compute dtype of activations and matmuls.
      param_dtype: storage dtype of the parameters.
      remat: recompute each block in the backward pass, keeping only the FFN outputs.
      gate_bias: each FFN has a learnable per-unit gate bias ``b_gate`` [F] (zeros at init);
        benchmarks set it to calibrate the sparsity of an untrained model.
      n_kv_heads: key / value heads (grouped-query attention: each serves n_heads / n_kv_heads
        query heads); None means n_heads (plain multi-head attention).
      embed_scale: multiply the input embedding by sqrt(D) (our models; Hugging Face Llama
        checkpoints do not, see ``from_hf``).
      norm_eps: epsilon of every RMSNorm.
      tie_embeddings: the output projection is the embedding's transpose; False gives the
        model a separate ``lm_head`` [D, V].
      decode_kernels: the attention of decode steps runs on Pallas kernels: projections of
        fewer than 8 token rows on the GEMV kernel (``pallas_kernels.gemv``; XLA turns a
        one-row product into a slow column reduction) and, in ``decode_step``, the
        attention over the cache on the flash-decoding kernel
        (``pallas_kernels.decode_attention``: it reads only the filled positions) and, below
        8 sequences, q, k and v finished from the projection's partial sums, rotated and
        written into the cache in one launch (``pallas_kernels.qkv_rope_cache``), and each
        residual add with the RMSNorm after it in one launch
        (``pallas_kernels.add_rms_norm``, taking the output projection's partial sums). None
        (default): exactly when a GPU is present (interpret mode on a CPU would only be
        slower); True forces them (interpret mode without a GPU: how the tests run them);
        False keeps plain XLA. Under a context mesh of several devices XLA's products run
        either way. The FFN's own decode path is its implementation's business.
    """

    vocab_size: int
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    max_seq_len: int
    rope_theta: float = 10_000.0
    implementation: Implementation = DEFAULT_IMPLEMENTATION
    twell: TwELLConfig | None = None
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    remat: bool = False
    gate_bias: bool = False
    n_kv_heads: int | None = None
    embed_scale: bool = True
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    decode_kernels: bool | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_ff", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head width d_model / n_heads = {self.head_dim} must be even "
                             "(rotary embeddings rotate pairs of features)")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        backends.check(self.implementation)
        if self.twell is not None and not isinstance(self.twell, TwELLConfig):
            raise TypeError(f"twell must be a TwELLConfig or None, got {type(self.twell).__name__}")
        for name in ("dtype", "param_dtype"):
            dtype = getattr(self, name)
            try:
                ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"{name} must be a floating-point dtype, got {dtype!r}")
        for name in ("remat", "gate_bias", "embed_scale", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.decode_kernels is not None and not isinstance(self.decode_kernels, bool):
            raise TypeError(f"decode_kernels must be None or a bool, got "
                            f"{self.decode_kernels!r}")
        kv = self.n_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0
                               or self.n_heads % kv):
            raise ValueError(f"n_kv_heads must be None or a positive int dividing "
                             f"n_heads={self.n_heads}, got {kv!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def uses_decode_kernels(self) -> bool:
        """``decode_kernels`` resolved: None means exactly when a GPU is present."""
        return not default_interpret() if self.decode_kernels is None else self.decode_kernels

    @property
    def kv_heads(self) -> int:
        """Key / value heads: ``n_kv_heads``, or ``n_heads`` when that is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def param_count(self) -> int:
        """Parameters, counting the tied embedding once."""
        d, f = self.d_model, self.d_ff
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q, o; k, v; gate, up, down; norms
        per_layer += f if self.gate_bias else 0
        lm_head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * per_layer + d + lm_head


def _paper(n_layers: int) -> ModelConfig:
    # The paper's models (DESIGN.md section 6): D 2048, F 5632, 32 heads of 64, vocab 49152.
    return ModelConfig(vocab_size=49152, d_model=2048, d_ff=5632, n_layers=n_layers, n_heads=32,
                       max_seq_len=2048)


CONFIGS: dict[str, ModelConfig] = {
    # CPU and tests: 147,776 parameters, byte-level.
    "tiny": ModelConfig(vocab_size=256, d_model=64, d_ff=256, n_layers=2, n_heads=4,
                        max_seq_len=128),
    # 25,829,888 parameters, byte-level; F a multiple of the 128-wide TwELL tile.
    "25m": ModelConfig(vocab_size=256, d_model=512, d_ff=1408, n_layers=8, n_heads=8,
                       max_seq_len=512),
    # 99,306,240 parameters, byte-level.
    "100m": ModelConfig(vocab_size=256, d_model=768, d_ff=2560, n_layers=12, n_heads=12,
                        max_seq_len=1024),
    "0.5b": _paper(8),  # 511,739,904 parameters
    "1b": _paper(18),  # 1,025,583,104
    "1.5b": _paper(28),  # 1,539,426,304
    "2b": _paper(38),  # 2,053,269,504
}
"""Named presets; ``dataclasses.replace(CONFIGS[name], implementation=...)`` to adapt one."""


# ------------------------------------------------------------------------------------------
# Layers.


class KVCache(NamedTuple):
    """Per-layer keys and values of the positions decoded so far (a pytree).

    k, v: one [B, S, Nkv, H] array per layer (keys rotated), S the cache length.
    lengths: [B] int32, filled positions per sequence = where the next token is written.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array


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
        slower: the concatenation was not hoisted out of the decode loop (BENCHMARKS.md,
        run 23)."""
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
            # launch (XLA made five of it: BENCHMARKS.md, run 127).
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


def _run_block(block: Block, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return block(x, cos, sin)


_REMAT_POLICY = jax.checkpoint_policies.save_only_these_names(nn.CHECKPOINT_NAME,
                                                              RESIDUALS_NAME)
_run_block_remat = nnx.remat(_run_block, policy=_REMAT_POLICY)


class Transformer(nnx.Module):
    """The decoder: ``model(tokens [B, T] int) -> logits [B, T, V] float32``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # Embedding rows ~ N(0, 1/D): tied logits h @ E^T start near unit variance for a
        # unit-RMS h; the input side multiplies by sqrt(D) so the residual stream starts at RMS 1.
        self.embedding = nnx.Param(jax.random.normal(
            rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.param_dtype) / math.sqrt(cfg.d_model),
            **sharding.logical("vocab", "embed"))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype)
        # Untied: the output projection [D, V] (Hugging Face checkpoints with an lm_head).
        self.lm_head = (None if cfg.tie_embeddings
                        else _dense(rngs, cfg.d_model, cfg.vocab_size, cfg, ("embed", "vocab")))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> logits [B, T, V] float32."""
        return self.logits(self.features(tokens))

    def logits(self, x: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., D] -> logits [..., V] float32."""
        if self.lm_head is None:
            w = self.embedding[...].astype(self.cfg.dtype).T
        else:
            w = self.lm_head[...].astype(self.cfg.dtype)
        return mixed_precision_matmul(x, w, _F32)

    def features(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> the final-normed hidden states [B, T, D] (compute dtype), the
        input of the output projection. Prefill needs only the last position's logits:
        ``model.logits(model.features(tokens)[:, -1])`` avoids the [B, T, V] logits."""
        x = self._embed(tokens)
        cos, sin = self._rope()
        run = _run_block_remat if self.cfg.remat else _run_block
        for block in self.blocks:
            x = run(block, x, cos, sin)
        return self.final_norm(x)

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> embeddings [B, T, D] (compute dtype), validated."""
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, time], got {tokens.shape}")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds "
                             f"max_seq_len={cfg.max_seq_len}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if cfg.embed_scale:
            x = x * math.sqrt(cfg.d_model)
        return x.astype(cfg.dtype)

    def _rope(self) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        return tuple(jnp.asarray(a) for a in rope_tables(cfg.max_seq_len, cfg.head_dim,
                                                          cfg.rope_theta))

    def init_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        """An empty ``KVCache`` for ``batch`` sequences of up to ``length`` positions (at most
        ``max_seq_len``), in ``dtype`` (default: the compute dtype)."""
        cfg = self.cfg
        if not 1 <= length <= cfg.max_seq_len:
            raise ValueError(f"cache length {length} must be in [1, max_seq_len="
                             f"{cfg.max_seq_len}]")
        shape = (batch, length, cfg.kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype or cfg.dtype) for _ in range(cfg.n_layers))
        return KVCache(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))

    def prefill(self, tokens: jax.Array, lengths: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Runs left-aligned prompts through the model and fills the cache.

        Args:
          tokens: [B, T] int, prompt b in tokens[b, :lengths[b]] (the rest is padding: causal
            attention keeps it from touching the prompt, and decoding overwrites it).
          lengths: [B] int in [1, T], the prompt lengths.
          cache: from ``init_cache`` with length >= T; its contents are replaced.
        Returns:
          (logits [B, V] float32 at each prompt's last position, the filled cache with
          ``lengths`` as its next write positions).
        """
        b, t = tokens.shape
        if cache.k[0].shape[0] != b or cache.k[0].shape[1] < t:
            raise ValueError(f"a cache of shape {cache.k[0].shape} cannot hold prompts of "
                             f"shape {tokens.shape}")
        x = self._embed(tokens)
        cos, sin = self._rope()
        ks, vs = [], []
        for block, ck, cv in zip(self.blocks, cache.k, cache.v):
            x, k, v = block.prefill(x, cos, sin)
            ks.append(jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, 0)))
            vs.append(jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, 0, 0)))
        lengths = jnp.asarray(lengths, jnp.int32)
        last = x[jnp.arange(b), lengths - 1]
        return self.logits(self.final_norm(last)), KVCache(tuple(ks), tuple(vs), lengths)

    def decode_step(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Appends one token per sequence at position ``cache.lengths`` [B].

        Args:
          tokens: [B] int, the next token of each sequence.
          cache: a filled ``KVCache``; the caller keeps ``cache.lengths`` below its length.
        Returns:
          (logits [B, V] float32 for the position after it, the cache with lengths + 1).
        """
        x = self._embed(tokens[:, None])
        cos, sin = self._rope()
        ks, vs = [], []
        fused = self._fused_decode_norms(x.shape[0])
        delta = None  # fused: the last block's FFN output, not yet added to x
        for block, ck, cv in zip(self.blocks, cache.k, cache.v):
            if fused:
                x, delta, ck, cv = block.decode_fused(x, delta, cos, sin, cache.lengths, ck, cv)
            else:
                x, ck, cv = block.decode(x, cos, sin, cache.lengths, ck, cv)
            ks.append(ck)
            vs.append(cv)
        h = self.final_norm.add_and_norm(x, delta)[1] if fused else self.final_norm(x)
        logits = self.logits(h[:, 0])
        return logits, KVCache(tuple(ks), tuple(vs), cache.lengths + 1)

    def _fused_decode_norms(self, batch: int) -> bool:
        """Whether ``decode_step`` adds each residual inside the next norm's kernel
        (``Block.decode_fused``): under ``decode_kernels`` on one device (the attention's
        ``_kernels``), below ``GEMV_FEW_ROWS`` (8) sequences, where the output projection's
        partial sums go straight into the kernel. H100, 0.5b: batch 1 +3% tokens/s in both
        models; batch 8 (the projection finished by XLA) -0.5%, so not used there
        (BENCHMARKS.md, run 125)."""
        return bool(self.blocks) and self.blocks[0].attn._kernels() and (
            batch < GEMV_FEW_ROWS)


def build(cfg: ModelConfig | str, *, seed: int = 0, **overrides) -> Transformer:
    """A model from a config or preset name; ``overrides`` replace config fields."""
    if isinstance(cfg, str):
        if cfg not in CONFIGS:
            raise ValueError(f"unknown preset {cfg!r}; choose one of {sorted(CONFIGS)}")
        cfg = CONFIGS[cfg]
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return Transformer(cfg, rngs=nnx.Rngs(seed))


# ------------------------------------------------------------------------------------------
# Loss and statistics.


def layer_stats(intermediates: nnx.State, n_layers: int) -> list[FFNStats]:
    """Each layer's ``FFNStats``, in layer order, from ``nnx.capture(..., nnx.Intermediate)``."""
    stats = nn.sown_stats(intermediates)
    if len(stats) != n_layers:
        raise ValueError(f"found {len(stats)} FFNStats for {n_layers} layers")
    return stats


def loss_fn(model: Transformer, tokens: jax.Array, l1_coeff) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy + ``l1_coeff`` * mean over layers of ``stats.l1``.

    Args:
      model: the decoder.
      tokens: [B, T + 1] int; the model reads tokens[:, :-1] and predicts tokens[:, 1:].
      l1_coeff: the L1 coefficient (a Python float or a traced scalar).
    Returns:
      (loss, metrics): metrics holds scalars ``loss``, ``ce``, ``l1`` (the penalty before the
      coefficient), ``backup_overflow`` / ``dense_fallback`` (layers where it happened), and
      per-layer [n_layers] arrays ``nnz_mean``, ``nnz_p99``, ``nnz_max``, ``heavy_rows``,
      ``l1_layer``.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, intermediates = nnx.capture(model, nnx.Intermediate)(inputs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    stats = layer_stats(intermediates, model.cfg.n_layers)
    l1 = nn.l1_penalty(intermediates)
    loss = ce + l1_coeff * l1
    stack = lambda name, dtype: jnp.stack([jnp.asarray(getattr(s, name), dtype) for s in stats])
    metrics = {
        "loss": loss,
        "ce": ce,
        "l1": l1,
        "l1_layer": stack("l1", _F32),
        "nnz_mean": stack("nnz_mean", _F32),
        "nnz_p99": stack("nnz_p99", jnp.int32),
        "nnz_max": stack("nnz_max", jnp.int32),
        "heavy_rows": stack("heavy_rows", jnp.int32),
        "backup_overflow": stack("backup_overflow", jnp.int32).sum(),
        "dense_fallback": stack("dense_fallback", jnp.int32).sum(),
    }
    return loss, metrics


def gate_preactivations(model: Transformer, tokens: jax.Array) -> list[jax.Array]:
    """Each layer's gate pre-activation ``x @ w_gate (+ b_gate)`` [B * T, F] float32 on its
    captured FFN input, computed as the layer does (compute dtype, float32 accumulation)."""
    _, captured = nnx.capture(model, FFNInput)(tokens)
    inputs = jax.tree.leaves(captured)
    cfg = model.cfg
    if len(inputs) != cfg.n_layers:
        raise ValueError(f"captured {len(inputs)} FFN inputs for {cfg.n_layers} layers")
    gates = []
    for block, h in zip(model.blocks, inputs):
        h = h.reshape(-1, cfg.d_model).astype(cfg.dtype)
        gate = jnp.dot(h, block.ffn.w_gate[...].astype(cfg.dtype), preferred_element_type=_F32)
        if block.ffn.b_gate is not None:
            gate = gate + block.ffn.b_gate[...].astype(cfg.dtype).astype(_F32)
        gates.append(gate)
    return gates


def activity_and_token_nnz(model: Transformer, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(unit_activity [n_layers, d_ff] bool, token_nnz [n_layers, B * T] int32)`` from one
    pass: which FFN units were active (gate > 0) for some token, and each token's active units.

    Runs the model once, capturing each block's FFN input (sown as ``FFNInput``), and recomputes
    the dense gate in the compute dtype with float32 accumulation, as the layer does
    (``gate_preactivations``). Costs one forward pass plus one gate GEMM per layer; meant for
    evaluation, not every training step.
    """
    active = [g > 0 for g in gate_preactivations(model, tokens)]
    return (jnp.stack([jnp.any(a, axis=0) for a in active]),
            jnp.stack([jnp.sum(a, axis=1, dtype=jnp.int32) for a in active]))


def unit_activity(model: Transformer, tokens: jax.Array) -> jax.Array:
    """[n_layers, d_ff] bool: FFN unit j of layer l was active (gate > 0) for some token. A unit
    inactive over a window of tokens (OR this over batches) is *dead*: ``1 -
    activity.mean(-1)`` is the dead fraction per layer. As ``activity_and_token_nnz``."""
    return activity_and_token_nnz(model, tokens)[0]


def token_nnz(model: Transformer, tokens: jax.Array) -> jax.Array:
    """[n_layers, B * T] int32: active FFN units of each token in each layer (the per-token
    distribution behind ``FFNStats``' mean / p99 / max). As ``activity_and_token_nnz``."""
    return activity_and_token_nnz(model, tokens)[1]


# ------------------------------------------------------------------------------------------
# Generation: prefill into a KV cache, then a jitted decode loop.

PAD_TOKEN = -1
"""The value ``generate`` writes after a sequence's stop token (never a valid token id)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How ``generate`` picks each token. Frozen, so hashable (a static jit argument; stop
    tokens are not part of it, so that changing them does not compile again).

    Attributes:
      temperature: 0 = greedy (argmax; top_k / top_p are then irrelevant), else logits are
        divided by it before sampling.
      top_k: keep the k most likely tokens (None: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches p (nucleus
        sampling; None or 1: all). Applied after top_k.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0 < p <= 1):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] -> tokens [B] int32 under ``sampling`` (``key`` unused when greedy).

    Ties at the top-k or top-p boundary keep every tied token.
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(_F32) / sampling.temperature
    vocab = logits.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        # A token is kept while the mass of the tokens before it is below p: the top token
        # always, and the set stops at the first one that reaches p.
        keep = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p
        threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class DecodeState(NamedTuple):
    """The decode loop's carry between chunks (a pytree).

    cache: the ``KVCache``. token: [B] int32, the last token of each sequence (the next decode
    input). done: [B] bool, the sequence sampled a stop token. step: [] int32, tokens sampled
    so far. key: the PRNG key; token i is drawn with ``fold_in(key, i)``, so chunking does not
    change the samples. stop: [V] bool, the stop tokens.
    """

    cache: KVCache
    token: jax.Array
    done: jax.Array
    step: jax.Array
    key: jax.Array
    stop: jax.Array


def _with_layer_nnz(fn, n_layers: int, stats: bool):
    """``fn`` returning also the layers' nnz_mean [n_layers] float32: recorded under
    ``nnx.capture`` when ``stats``, else NaN and nothing captured (under jit the FFN layers'
    statistics are then dead code and XLA drops them)."""
    def run(*args):
        if not stats:
            return fn(*args), jnp.full((n_layers,), jnp.nan, _F32)
        out, inter = nnx.capture(fn, nnx.Intermediate)(*args)
        return out, jnp.stack([jnp.asarray(s.nnz_mean, _F32)
                               for s in layer_stats(inter, n_layers)])
    return run


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "stats"))
def generation_start(graphdef, state, prompts, lengths, key, stop, *, sampling: Sampling,
                     cache_len: int, stats: bool = True):
    """``generate``'s first stage (jitted): prefill and the first token: (DecodeState, token
    [B], nnz_mean [n_layers]; NaN without ``stats``)."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(prompts.shape[0], cache_len)
    prefill = _with_layer_nnz(model.prefill, model.cfg.n_layers, stats)
    (logits, cache), nnz = prefill(prompts, lengths, cache)
    token = sample_logits(logits, jax.random.fold_in(key, 0), sampling)
    decode_state = DecodeState(cache, token, stop[token], jnp.ones((), jnp.int32), key, stop)
    return decode_state, token, nnz


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "chunk", "stats"))
def generation_steps(graphdef, state, decode_state: DecodeState, n, *, sampling: Sampling,
                     chunk: int, stats: bool = True):
    """``generate``'s decode loop (jitted): up to ``n`` (<= chunk, traced) decode steps in one
    ``lax.while_loop``; stops early once every sequence is done. Returns (DecodeState, tokens
    [B, chunk] (PAD_TOKEN past the steps run or a stop), nnz_mean [chunk, n_layers] (NaN past
    the steps run, and everywhere without ``stats``: then no statistic is computed))."""
    n_layers = nnx.merge(graphdef, state).cfg.n_layers
    b = decode_state.token.shape[0]
    tokens = jnp.full((b, chunk), PAD_TOKEN, jnp.int32)
    nnz = jnp.full((chunk, n_layers), jnp.nan, _F32)

    def cond(carry):
        i, ds, _, _ = carry
        return (i < n) & ~jnp.all(ds.done)

    def body(carry):
        i, ds, tokens, nnz = carry
        # Merged inside the loop: the module lives in the loop body's trace.
        model = nnx.merge(graphdef, state)
        step = _with_layer_nnz(model.decode_step, n_layers, stats)
        (logits, cache), step_nnz = step(ds.token, ds.cache)
        token = sample_logits(logits, jax.random.fold_in(ds.key, ds.step), sampling)
        done = ds.done | ds.stop[token]
        # A finished sequence keeps feeding its last token: its outputs are discarded.
        feed = jnp.where(ds.done, ds.token, token)
        token = jnp.where(ds.done, PAD_TOKEN, token)
        ds = DecodeState(cache, feed, done, ds.step + 1, ds.key, ds.stop)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        nnz = jax.lax.dynamic_update_slice(nnz, step_nnz[None], (i, 0))
        return i + 1, ds, tokens, nnz

    _, decode_state, tokens, nnz = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), decode_state, tokens, nnz))
    return decode_state, tokens, nnz


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "steps",
                                             "stats"))
def _generate(graphdef, state, prompts, lengths, key, stop, *, sampling: Sampling,
              cache_len: int, steps: int, stats: bool):
    decode_state, first, nnz0 = generation_start(graphdef, state, prompts, lengths, key, stop,
                                                 sampling=sampling, cache_len=cache_len,
                                                 stats=stats)
    if steps == 0:
        return first[:, None], nnz0[None]
    _, tokens, nnz = generation_steps(graphdef, state, decode_state, steps, sampling=sampling,
                                      chunk=steps, stats=stats)
    return (jnp.concatenate([first[:, None], tokens], axis=1),
            jnp.concatenate([nnz0[None], nnz], axis=0))


def _prepare(model: Transformer, prompts, prompt_lengths, max_new_tokens, sampling: Sampling,
             key, stop_tokens) -> tuple[np.ndarray, np.ndarray, jax.Array, np.ndarray, int]:
    """Validates ``generate``'s arguments on the host; returns (prompts [B, T] int32,
    lengths [B] int32, key, stop mask [V] bool, cache length)."""
    cfg = model.cfg
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(prompts, (list, tuple)):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is for a padded [B, T] array; a list of prompts "
                             "carries its own lengths")
        rows = [np.asarray(p) for p in prompts]
        if not rows:
            raise ValueError("prompts is empty: give at least one prompt")
        for i, row in enumerate(rows):
            if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
                raise TypeError(f"prompt {i} must be a 1-D sequence of ints, got "
                                f"{row.dtype} {row.shape}")
        lengths = np.asarray([len(r) for r in rows], np.int32)
        array = np.zeros((len(rows), max(lengths)), np.int32)
        for i, row in enumerate(rows):
            array[i, :len(row)] = row
    else:
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise ValueError(f"prompts must be [batch, time] or a list of 1-D prompts, got "
                             f"shape {array.shape}")
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"prompts must be integers, got dtype {array.dtype}")
        if array.shape[0] == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        lengths = (np.full((array.shape[0],), array.shape[1], np.int32) if prompt_lengths is None
                   else np.asarray(prompt_lengths))
        if lengths.shape != (array.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"prompt_lengths must be [batch={array.shape[0]}] ints, got "
                             f"{lengths.dtype} {lengths.shape}")
        if np.any(lengths > array.shape[1]):
            raise ValueError(f"prompt_lengths {lengths.tolist()} exceed the prompts' width "
                             f"{array.shape[1]}")
    if np.any(lengths < 1):
        raise ValueError(f"empty prompt (prompt lengths {lengths.tolist()}): generation needs "
                         "at least one token to start from")
    valid = array[np.arange(array.shape[1])[None, :] < lengths[:, None]]
    if valid.min() < 0 or valid.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}), got "
                         f"[{valid.min()}, {valid.max()}]")
    stop = np.zeros((cfg.vocab_size,), bool)
    for s in stop_tokens:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"stop_tokens must be ints, got {s!r}")
        if not 0 <= s < cfg.vocab_size:
            raise ValueError(f"stop token {s} is outside the vocabulary [0, {cfg.vocab_size})")
        stop[s] = True
    # The last token is sampled, never fed back: positions up to T + max_new_tokens - 2.
    cache_len = array.shape[1] + int(max_new_tokens) - 1
    if cache_len > cfg.max_seq_len:
        raise ValueError(f"prompts of {array.shape[1]} tokens + max_new_tokens={max_new_tokens} "
                         f"need a cache of {cache_len} positions, more than max_seq_len="
                         f"{cfg.max_seq_len}")
    if key is not None and not (
            jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key)
            or (jnp.asarray(key).dtype == jnp.uint32 and jnp.shape(key) == (2,))):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)), got {key!r}")
    if key is None:
        if not sampling.greedy:
            raise ValueError(f"sampling at temperature {sampling.temperature} needs a PRNG key "
                             "(key=jax.random.key(seed))")
        key = jax.random.key(0)  # unused by greedy decoding
    return array.astype(np.int32), lengths.astype(np.int32), key, stop, cache_len


def generate(model: Transformer, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, key: jax.Array | None = None,
             stop_tokens=(), prompt_lengths=None, return_stats: bool = False):
    """Generates ``max_new_tokens`` tokens after each prompt, in one jitted program.

    Prefill runs the prompts through the model's attention path and fills a KV cache of
    T + max_new_tokens - 1 positions (compute dtype); a ``lax.while_loop`` then decodes one
    token per sequence per step (attention over the cache in plain XLA, the FFN layers as they
    are) without returning to the host, and ends early once every sequence has stopped.
    Sequences of different lengths batch together: each has its own positions and rotary
    offsets, so a prompt gives the same tokens padded in a batch as alone (up to rounding
    differences of batched matmuls in bf16).

    Args:
      model: the decoder.
      prompts: [B, T] int (left-aligned; with ``prompt_lengths`` the tail of a row is padding),
        or a list of B 1-D int sequences of any lengths.
      max_new_tokens: tokens to generate per sequence, >= 1.
      temperature, top_k, top_p: see ``Sampling``; temperature 0 (default) is greedy.
      key: PRNG key (``jax.random.key(seed)``); required when temperature > 0.
      stop_tokens: ids that end a sequence (kept in the output; later positions are
        ``PAD_TOKEN`` = -1).
      prompt_lengths: [B] int in [1, T], for a padded array; default T for every row.
      return_stats: also return the FFN statistics (without it none is computed).
    Returns:
      tokens [B, max_new_tokens] int32; with ``return_stats``, ``(tokens, stats)`` where
      ``stats["nnz_mean"]`` [max_new_tokens, n_layers] float32 is the mean active FFN units
      per token of the forward that produced token i: row 0 the prefill (over all B * T prompt
      positions, padding included), row i > 0 the decode step (over the B sequences, finished
      ones included); NaN for steps skipped after every sequence stopped.
    Raises:
      ValueError / TypeError: for an empty prompt, a prompt that does not fit max_seq_len with
      the new tokens, max_new_tokens < 1, bad sampling settings or sampling without a key.
    """
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    prompts, lengths, key, stop, cache_len = _prepare(model, prompts, prompt_lengths,
                                                      max_new_tokens, sampling, key, stop_tokens)
    graphdef, state = nnx.split(model)
    tokens, nnz = _generate(graphdef, state, prompts, lengths, key, stop, sampling=sampling,
                            cache_len=cache_len, steps=int(max_new_tokens) - 1,
                            stats=bool(return_stats))
    return (tokens, {"nnz_mean": nnz}) if return_stats else tokens


def generate_chunks(model: Transformer, prompts, *, max_new_tokens: int, chunk_size: int = 16,
                    temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, key: jax.Array | None = None, stop_tokens=(),
                    prompt_lengths=None):
    """``generate`` as a stream: yields ``(tokens [B, n] int32, nnz_mean [n, n_layers])``
    numpy arrays, first the prefill's token (n = 1), then one jitted ``lax.while_loop`` of up
    to ``chunk_size`` decode steps per yield, until max_new_tokens or every sequence stopped.
    The concatenated tokens equal ``generate``'s with the same arguments (PAD_TOKEN after a
    stop; the stream ends early when all sequences stopped). One compile serves every chunk."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    prompts, lengths, key, stop, cache_len = _prepare(model, prompts, prompt_lengths,
                                                      max_new_tokens, sampling, key, stop_tokens)
    graphdef, state = nnx.split(model)
    decode_state, token, nnz = generation_start(graphdef, state, prompts, lengths, key, stop,
                                                sampling=sampling, cache_len=cache_len)
    yield np.asarray(token)[:, None], np.asarray(nnz)[None]
    produced = 1
    while produced < max_new_tokens and not bool(np.all(np.asarray(decode_state.done))):
        n = min(chunk_size, max_new_tokens - produced)
        decode_state, tokens, nnz = generation_steps(graphdef, state, decode_state, jnp.int32(n),
                                                     sampling=sampling, chunk=chunk_size)
        ran = int(decode_state.step) - produced
        produced += ran
        yield np.asarray(tokens)[:, :ran], np.asarray(nnz)[:ran]


# ------------------------------------------------------------------------------------------
# Hugging Face Llama checkpoints.

# LlamaForCausalLM parameter names -> (our path, transpose): HF linear weights are [out, in].
_HF_LAYER_PARAMS = {
    "self_attn.q_proj.weight": (("attn", "w_q"), True),
    "self_attn.k_proj.weight": (("attn", "w_k"), True),
    "self_attn.v_proj.weight": (("attn", "w_v"), True),
    "self_attn.o_proj.weight": (("attn", "w_o"), True),
    "mlp.gate_proj.weight": (("ffn", "w_gate"), True),
    "mlp.up_proj.weight": (("ffn", "w_up"), True),
    "mlp.down_proj.weight": (("ffn", "w_down"), True),
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "post_attention_layernorm.weight": (("ffn_norm", "scale"), False),
}


def hf_config(hf: dict, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face Llama ``config.json`` (a dict).

    What differs from our defaults, and why the mapping is faithful: HF Llama does not scale
    the input embedding (``embed_scale=False``); its RMSNorm is ``weight * x / sqrt(mean(x^2) +
    eps)`` as ours (ones at init, not Gemma's 1 + weight), with ``rms_norm_eps``; its rotary
    embedding rotates the split halves (rotate_half) with inv_freq = theta^(-2i/H), as
    ``apply_rope``; ``num_key_value_heads`` maps to grouped-query attention; the output
    projection is tied or a separate ``lm_head``. Only what we can run is accepted: ``hidden_act``
    "relu" (the paper's ReLU-gated FFN), no biases, no rope scaling, head_dim = D / heads.
    ``overrides`` replace fields (dtype, implementation, max_seq_len, ...).
    """
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"model_type {model_type!r} is not supported (only 'llama')")
    act = hf.get("hidden_act", "silu")
    if act != "relu":
        raise ValueError(f"hidden_act {act!r} is not supported: TwELL FFNs are ReLU-gated "
                         "(hidden_act 'relu')")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            raise ValueError(f"{name}=true is not supported (the model has no biases)")
    # transformers >= 5 writes rope_parameters; older versions rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if scaling or rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {scaling or rope!r} is not supported (plain rotary "
                         "embeddings only)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads = "
                         f"{d // heads} is not supported")
    kv = hf.get("num_key_value_heads") or heads
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=d, d_ff=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=None if kv == heads else kv,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), embed_scale=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    return ModelConfig(**{**fields, **overrides})


def from_hf(folder, **overrides) -> Transformer:
    """Loads a local Hugging Face LlamaForCausalLM folder (``config.json`` + ``*.safetensors``).

    Args:
      folder: the folder's path.
      overrides: ``ModelConfig`` fields to replace (``implementation``, ``dtype``,
        ``max_seq_len``, ``twell`` ...); see ``hf_config`` for the mapping and what is rejected.
    Returns:
      The model, parameters in its ``param_dtype``. Every checkpoint tensor must be used and
      every parameter present (``rotary_emb.inv_freq`` buffers are ignored); ValueError names
      the offenders.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model folder")
    cfg = hf_config(json.loads(config_path.read_text()), **overrides)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(safetensors_io.load_file(path))

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = abstract.to_pure_dict()
    used = set()

    def take(name: str, target: dict, key: str, transpose: bool) -> None:
        if name not in tensors:
            raise ValueError(f"{folder}: tensor {name!r} is missing")
        value = np.asarray(tensors[name])
        value = value.T if transpose else value
        expected = target[key].shape
        if value.shape != tuple(expected):
            raise ValueError(f"{folder}: tensor {name!r} has shape {tensors[name].shape}, "
                             f"expected {expected[::-1] if transpose else expected}")
        target[key] = jnp.asarray(value.astype(np.float32), cfg.param_dtype)
        used.add(name)

    take("model.embed_tokens.weight", params, "embedding", False)
    take("model.norm.weight", params["final_norm"], "scale", False)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the copy as well
    else:
        take("lm_head.weight", params, "lm_head", True)
    for i in range(cfg.n_layers):
        for hf_name, ((module, param), transpose) in _HF_LAYER_PARAMS.items():
            take(f"model.layers.{i}.{hf_name}", params["blocks"][i][module], param, transpose)
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"{folder}: tensors not used by the model: {unused[:8]}"
                         + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)
