"""A Llama-style decoder whose FFNs are TwELL sparse gated MLPs (``nn.SparseGatedMLP``).

Architecture: token embedding (tied with the output projection), ``n_layers`` pre-norm blocks of
RMSNorm -> causal multi-head attention with rotary embeddings -> residual, RMSNorm -> ReLU-gated
FFN -> residual, then a final RMSNorm and ``logits = h @ embedding.T`` in float32. No biases,
except an optional per-unit gate bias in each FFN (``ModelConfig.gate_bias``).

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
``save_only_these_names("ffn_out")``: the FFN outputs (``nn.CHECKPOINT_NAME``) are kept, everything
else in the block is recomputed in the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from twell_jax import nn, sharding
from twell_jax.config import TwELLConfig
from twell_jax.ffn import IMPLEMENTATIONS, FFNStats

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
      implementation: the FFN path, ``"xla"`` (dense), ``"reference"`` (TwELL in jnp) or
        ``"pallas"`` (TwELL kernels; interpret mode without a GPU).
      twell: the TwELL format's knobs (``TwELLConfig()`` when None).
      dtype: compute dtype of activations and matmuls.
      param_dtype: storage dtype of the parameters.
      remat: recompute each block in the backward pass, keeping only the FFN outputs.
      gate_bias: each FFN has a learnable per-unit gate bias ``b_gate`` [F] (zeros at init);
        benchmarks set it to calibrate the sparsity of an untrained model.
    """

    vocab_size: int
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    max_seq_len: int
    rope_theta: float = 10_000.0
    implementation: str = "xla"
    twell: TwELLConfig | None = None
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    remat: bool = False
    gate_bias: bool = False

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
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
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
        for name in ("remat", "gate_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def param_count(self) -> int:
        """Parameters, counting the tied embedding once."""
        d, f = self.d_model, self.d_ff
        per_layer = 4 * d * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; two norms
        per_layer += f if self.gate_bias else 0
        return self.vocab_size * d + self.n_layers * per_layer + d


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


@functools.lru_cache(maxsize=16)
def rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, head_dim / 2] (float32) of the rotary embedding angles."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates feature pairs (i, i + H/2) of x [B, T, N, H] by the angles of positions 0..T-1."""
    t = x.shape[1]
    cos = cos[None, :t, None, :]
    sin = sin[None, :t, None, :]
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
    """Causal multi-head self-attention with rotary embeddings; no biases."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads, self.head_dim, self.dtype = cfg.n_heads, cfg.head_dim, cfg.dtype
        self.w_q = _dense(rngs, d, d, cfg, ("embed", "heads"))
        self.w_k = _dense(rngs, d, d, cfg, ("embed", "heads"))
        self.w_v = _dense(rngs, d, d, cfg, ("embed", "heads"))
        self.w_o = _dense(rngs, d, d, cfg, ("heads", "embed"))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, d = x.shape

        def project(w):
            y = jnp.dot(x, w[...].astype(self.dtype), preferred_element_type=_F32)
            return y.astype(self.dtype).reshape(b, t, self.n_heads, self.head_dim)

        q = apply_rope(project(self.w_q), cos, sin)
        k = apply_rope(project(self.w_k), cos, sin)
        v = project(self.w_v)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=_attention_implementation(q.dtype, t))
        out = out.reshape(b, t, d)
        return jnp.dot(out, self.w_o[...].astype(self.dtype),
                       preferred_element_type=_F32).astype(self.dtype)


class Block(nnx.Module):
    """Pre-norm decoder block: ``x += attn(norm(x)); x += ffn(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, **kw)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, **kw)
        self.ffn = nn.SparseGatedMLP(cfg.d_model, cfg.d_ff, implementation=cfg.implementation,
                                     config=cfg.twell, rngs=rngs, gate_bias=cfg.gate_bias, **kw)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        nn.sow_if_captured(self, FFNInput, FFN_INPUT_NAME, h)
        return x + self.ffn(h)


def _run_block(block: Block, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return block(x, cos, sin)


_REMAT_POLICY = jax.checkpoint_policies.save_only_these_names(nn.CHECKPOINT_NAME)
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
        self.final_norm = RMSNorm(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> logits [B, T, V] float32."""
        x = self.features(tokens)
        embedding = self.embedding[...].astype(self.cfg.dtype)
        return jnp.dot(x, embedding.T, preferred_element_type=_F32)

    def features(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> the final-normed hidden states [B, T, D] (compute dtype), the
        input of the tied output projection. Prefill needs only the last position's logits:
        ``model.features(tokens)[:, -1] @ embedding.T`` avoids the [B, T, V] logits."""
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, time], got {tokens.shape}")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds "
                             f"max_seq_len={cfg.max_seq_len}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
        embedding = self.embedding[...]
        x = (jnp.take(embedding, tokens, axis=0) * math.sqrt(cfg.d_model)).astype(cfg.dtype)
        cos, sin = (jnp.asarray(a) for a in rope_tables(cfg.max_seq_len, cfg.head_dim,
                                                         cfg.rope_theta))
        run = _run_block_remat if cfg.remat else _run_block
        for block in self.blocks:
            x = run(block, x, cos, sin)
        return self.final_norm(x)


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
    inputs = [leaf for leaf in jax.tree.leaves(captured)]
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


def unit_activity(model: Transformer, tokens: jax.Array) -> jax.Array:
    """[n_layers, d_ff] bool: FFN unit j of layer l was active (gate > 0) for some token.

    Runs the model once, capturing each block's FFN input (sown as ``FFNInput``), and recomputes
    the dense gate ``relu(x @ w_gate)`` in the compute dtype with float32 accumulation, as the
    layer does. A unit inactive over a window of tokens (OR this over batches) is *dead*:
    ``1 - activity.mean(-1)`` is the dead fraction per layer. Costs one forward pass plus one
    gate GEMM per layer; meant for evaluation, not every training step.
    """
    return jnp.stack([jnp.any(g > 0, axis=0) for g in gate_preactivations(model, tokens)])


def token_nnz(model: Transformer, tokens: jax.Array) -> jax.Array:
    """[n_layers, B * T] int32: active FFN units of each token in each layer (the per-token
    distribution behind ``FFNStats``' mean / p99 / max). Same cost as ``unit_activity``."""
    gates = gate_preactivations(model, tokens)
    return jnp.stack([jnp.sum(g > 0, axis=1, dtype=jnp.int32) for g in gates])


def activity_and_token_nnz(model: Transformer, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(unit_activity, token_nnz)`` from one pass (one gate GEMM per layer)."""
    gates = gate_preactivations(model, tokens)
    return (jnp.stack([jnp.any(g > 0, axis=0) for g in gates]),
            jnp.stack([jnp.sum(g > 0, axis=1, dtype=jnp.int32) for g in gates]))
