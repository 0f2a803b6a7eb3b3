"""The decoder's configuration (``ModelConfig``) and its named presets (``CONFIGS``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_kernels.common import default_interpret
from twell_jax import backends
from twell_jax.backends import DEFAULT_IMPLEMENTATION, Implementation
from twell_jax.config import TwELLConfig


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
      scan_layers: calls of at least ``layer_scan.SCAN_MIN_TOKENS`` tokens (training with
        remat, long prefills) run the blocks under one ``lax.scan``, so each kernel compiles
        once whatever the depth (H100, 1.5b sparse training step: 17 s against the loop's
        ~100 s and more). The scan copies each layer's weights out of the stacked parameters,
        which costs a few percent of a step (1.5b training ~3%); False runs the blocks in a
        Python loop. A training forward without remat always runs the loop: differentiated,
        a scan stacks every layer's residuals (0.5b step +17-21% on the H100).
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
    scan_layers: bool = True
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
        for name in ("remat", "scan_layers", "gate_bias", "embed_scale", "tie_embeddings"):
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
    # The paper's models: D 2048, F 5632, 32 heads of 64, vocab 49152.
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
