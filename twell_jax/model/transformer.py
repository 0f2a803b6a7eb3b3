"""The decoder (``Transformer``): embedding, the blocks, the final norm and the logits; its
prefill and decode steps over a ``KVCache``; ``build`` from a config or preset."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from twell_jax import sharding
from twell_jax.dense import mixed_precision_matmul
from twell_jax.model.cache import KVCache
from twell_jax.model.config import CONFIGS, ModelConfig
from twell_jax.model.layer_scan import run_blocks, stack_for_inference
from twell_jax.model.layers import GEMV_FEW_ROWS, Block, RMSNorm, _dense, rope_tables

_F32 = jnp.float32


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

    def __call__(self, tokens: jax.Array, *, inference: bool = False,
                 stacked: nnx.State | None = None) -> jax.Array:
        """tokens [B, T] int -> logits [B, T, V] float32. ``inference``, ``stacked``: as in
        ``features``."""
        return self.logits(self.features(tokens, inference=inference, stacked=stacked))

    def logits(self, x: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., D] -> logits [..., V] float32."""
        if self.lm_head is None:
            w = self.embedding[...].astype(self.cfg.dtype).T
        else:
            w = self.lm_head[...].astype(self.cfg.dtype)
        return mixed_precision_matmul(x, w, _F32)

    def features(self, tokens: jax.Array, *, inference: bool = False,
                 stacked: nnx.State | None = None) -> jax.Array:
        """tokens [B, T] int -> the final-normed hidden states [B, T, D] (compute dtype), the
        input of the output projection. Prefill needs only the last position's logits:
        ``model.logits(model.features(tokens, inference=True)[:, -1])`` avoids the [B, T, V]
        logits.

        ``inference=True`` promises that the call is never differentiated: a long one then runs
        the blocks under the layer scan even without remat, so each kernel compiles once (a
        differentiated call scans only with remat; see ``layer_scan.run_blocks``). Broken, the
        promise costs no correctness: the gradients stay right, but the sparse FFN's weight
        gradients round through the compute dtype and the scan keeps every layer's residuals.

        ``stacked`` (with ``inference=True``): ``stack_for_inference()``'s value, made once,
        which the layer scan then reads instead of stacking the blocks' parameters per call."""
        x = self._embed(tokens)
        cos, sin = self._rope()
        x, _ = run_blocks(self, self.blocks, self.cfg, lambda b, h: (b(h, cos, sin), ()), x,
                          inference=inference, stacked=stacked)
        return self.final_norm(x)

    def stack_for_inference(self) -> nnx.State:
        """The blocks' parameters stacked along a leading layer axis, every floating matrix
        in the compute dtype: what a long inference call (``features``, ``__call__`` or
        ``prefill`` of at least ``layer_scan.SCAN_MIN_TOKENS`` tokens) would otherwise stack
        on every call (its cost: ``layer_scan``'s module docstring). Make it once and pass it
        as ``stacked``; it is a copy (1.5b: 3 GB in bf16), so make it again after the
        parameters change."""
        return stack_for_inference(self.blocks, self.cfg)

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

    def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache, *,
                stacked: nnx.State | None = None) -> tuple[jax.Array, KVCache]:
        """Runs left-aligned prompts through the model and fills the cache.

        Args:
          tokens: [B, T] int, prompt b in tokens[b, :lengths[b]] (the rest is padding: causal
            attention keeps it from touching the prompt, and decoding overwrites it).
          lengths: [B] int in [1, T], the prompt lengths.
          cache: from ``init_cache`` with length >= T; its contents are replaced.
          stacked: ``stack_for_inference()``'s value, or None (as in ``features``).
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

        def step(block, h):
            h, k, v = block.prefill(h, cos, sin)
            return h, (k.astype(cache.k[0].dtype), v.astype(cache.v[0].dtype))

        x, kv = run_blocks(self, self.blocks, self.cfg, step, x, inference=True,
                           stacked=stacked)
        ks = [jax.lax.dynamic_update_slice(ck, k, (0, 0, 0, 0)) for ck, (k, _) in zip(cache.k, kv)]
        vs = [jax.lax.dynamic_update_slice(cv, v, (0, 0, 0, 0)) for cv, (_, v) in zip(cache.v, kv)]
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
        models; batch 8 (the projection finished by XLA) -0.5%, so not used there."""
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
