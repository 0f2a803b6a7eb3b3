"""The training loss (next-token cross-entropy + the L1 penalty on FFN activity) and the
per-layer activity statistics used for evaluation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from twell_jax import nn
from twell_jax.dense import dot_rows
from twell_jax.ffn import FFNStats
from twell_jax.model.layers import FFNInput
from twell_jax.model.transformer import Transformer

_F32 = jnp.float32


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
      ``hot_units``, ``l1_layer``.
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
        "hot_units": stack("hot_units", jnp.int32),
        "backup_overflow": stack("backup_overflow", jnp.int32).sum(),
        "dense_fallback": stack("dense_fallback", jnp.int32).sum(),
    }
    return loss, metrics


def gate_preactivations(model: Transformer, tokens: jax.Array) -> list[jax.Array]:
    """Each layer's gate pre-activation ``x @ w_gate.T (+ b_gate)`` [B * T, F] float32 on its
    captured FFN input, computed as the layer does (compute dtype, float32 accumulation)."""
    _, captured = nnx.capture(model, FFNInput)(tokens)
    inputs = jax.tree.leaves(captured)
    cfg = model.cfg
    if len(inputs) != cfg.n_layers:
        raise ValueError(f"captured {len(inputs)} FFN inputs for {cfg.n_layers} layers")
    gates = []
    for block, h in zip(model.blocks, inputs):
        h = h.reshape(-1, cfg.d_model).astype(cfg.dtype)
        gate = dot_rows(h, block.ffn.w_gate[...].astype(cfg.dtype), _F32)
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
