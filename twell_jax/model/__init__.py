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

The package's modules, one concern each: ``config`` (``ModelConfig``, ``CONFIGS``), ``layers``
(norm, rotary embeddings, attention, the block), ``transformer`` (the decoder and ``build``),
``cache`` (``KVCache``), ``loss`` (``loss_fn`` and activity statistics), ``generation`` and ``hf``
(Hugging Face folders). Every public name is importable from ``twell_jax.model`` itself.
"""

from twell_jax.model.cache import KVCache
from twell_jax.model.config import CONFIGS, ModelConfig
from twell_jax.model.generation import (PAD_TOKEN, DecodeState, Sampling, decode_runs_dense,
                                        generate, generate_chunks, generation_start,
                                        generation_steps, sample_logits)
from twell_jax.model.hf import from_hf, hf_config
from twell_jax.model.layers import (FFN_INPUT_NAME, Attention, Block, FFNInput, RMSNorm,
                                    apply_rope, apply_rope_at, decode_attention, rope_tables)
from twell_jax.model.loss import (activity_and_token_nnz, gate_preactivations, layer_stats,
                                  loss_fn, token_nnz, unit_activity)
from twell_jax.model.transformer import Transformer, build

__all__ = [
    "CONFIGS", "FFN_INPUT_NAME", "PAD_TOKEN", "Attention", "Block", "DecodeState", "FFNInput",
    "KVCache", "ModelConfig", "RMSNorm", "Sampling", "Transformer", "activity_and_token_nnz",
    "apply_rope", "apply_rope_at", "build", "decode_attention", "decode_runs_dense", "from_hf",
    "gate_preactivations", "generate", "generate_chunks", "generation_start", "generation_steps",
    "hf_config", "layer_stats", "loss_fn", "rope_tables", "sample_logits", "token_nnz",
    "unit_activity"
]
