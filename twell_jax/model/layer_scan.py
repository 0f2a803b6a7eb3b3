"""The blocks of a forward pass run as one ``lax.scan`` over their stacked parameters.

Why: in a Python loop every block is traced, and every Pallas kernel compiled, once per layer,
so the compile time grows with the depth (the 1.5b sparse training step compiled in 96 s against
the dense model's 16 s). Under one scan each kernel is compiled once whatever the depth.

The parameters stay stored per block (``Transformer.blocks``, as checkpoints and Hugging Face
folders hold them); each call stacks them along a new leading layer axis. Matrices are stacked
already cast to the compute dtype: the blocks cast each one on use anyway, so the stack replaces
those casts instead of adding a pass, and the blocks compute exactly what the loop computes.
Norm scales and gate biases keep their storage dtype (their casts are not plain ``astype``s to
the compute dtype everywhere).

Statistics: when the model runs under ``nnx.capture``, each block runs under its own capture of
the same variable types inside the scan; the captured values come out stacked and are sown
again into the stored blocks, layer by layer, so ``loss_fn`` and ``unit_activity`` see what the
loop would have sown.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from twell_jax import nn
from twell_jax.ffn import RESIDUALS_NAME
from twell_jax.model.config import ModelConfig
from twell_jax.model.layers import Block

REMAT_POLICY = jax.checkpoint_policies.save_only_these_names(nn.CHECKPOINT_NAME, RESIDUALS_NAME)
"""Keep the FFN outputs and the sparse FFN's packed lists; recompute the rest of each block."""


@functools.lru_cache(maxsize=16)
def _block_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """The structure of one block (shapes only; no parameter is allocated)."""
    return nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))[0]


def _stack_params(blocks: Sequence[Block], dtype) -> nnx.State:
    """The blocks' parameters stacked along a new axis 0; matrices cast to ``dtype``."""

    def stack(*leaves: jax.Array) -> jax.Array:
        cast = [v.astype(dtype) if v.ndim >= 2 and jnp.issubdtype(v.dtype, jnp.floating) else v
                for v in leaves]
        return jnp.stack(cast)

    return jax.tree.map(stack, *[nnx.state(b, nnx.Param) for b in blocks])


def _captured_types(module: nnx.Module) -> tuple[type, ...]:
    """The variable types an enclosing ``nnx.capture`` collects (none outside a capture)."""
    return tuple(type(v) for v in getattr(module, "__captures__", ()))


def _sow_per_layer(blocks: Sequence[Block], var_type: type, captured: nnx.State) -> None:
    """Sows layer l's slice of each stacked captured value into ``blocks[l]`` at its path."""
    for path, variable in nnx.to_flat_state(captured):
        for layer, block in enumerate(blocks):
            module = block
            for part in path[:-1]:
                module = getattr(module, part)
            for item in variable.get_value():
                module.sow(var_type, path[-1], jax.tree.map(lambda a: a[layer], item))


def scan_blocks(model: nnx.Module, blocks: Sequence[Block], cfg: ModelConfig, step: Callable,
                x: jax.Array) -> tuple[jax.Array, object]:
    """Runs ``step(block, x) -> (x, out)`` for every block in order under one scan.

    Args:
      model: the module that holds ``blocks`` (its capture, if any, is forwarded).
      blocks: the blocks, all built from ``cfg``.
      cfg: their config; with ``cfg.remat`` each block is recomputed in the backward pass,
        keeping only what ``REMAT_POLICY`` names.
      step: called inside the scan with a block rebuilt from its layer's parameters.
      x: the carry (the residual stream [B, T, D]).
    Returns:
      (x after the last block, each step's ``out`` stacked along a new axis 0).
    """
    graphdef = _block_graphdef(cfg)
    types = _captured_types(model)

    def body(carry: jax.Array, params: nnx.State):
        block = nnx.merge(graphdef, params)
        if not types:
            carry, out = step(block, carry)
            return carry, (out, ())
        (carry, out), *captured = nnx.capture(step, *types)(block, carry)
        return carry, (out, tuple(captured))

    if cfg.remat:
        body = jax.checkpoint(body, policy=REMAT_POLICY)
    x, (outs, captured) = jax.lax.scan(body, x, _stack_params(blocks, cfg.dtype))
    for var_type, state in zip(types, captured):
        _sow_per_layer(blocks, var_type, state)
    return x, outs
