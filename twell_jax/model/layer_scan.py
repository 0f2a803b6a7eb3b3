"""The blocks of a forward pass with many tokens run as one ``lax.scan`` over their stacked
parameters.

Why: in a Python loop every block is traced, and every Pallas kernel compiled, once per layer,
so the compile time grows with the depth (H100: the 1.5b sparse training step compiled in 137 s
against the dense model's 22 s; under the scan in 17-22 s against 13 s). Under one scan each
kernel is compiled once whatever the depth.

The parameters stay stored per block (``Transformer.blocks``, as checkpoints and Hugging Face
folders hold them); each call stacks them along a new leading layer axis. Matrices are stacked
already cast to the compute dtype where the blocks cast them on use anyway (the attention's, and
the dense FFN's), so the stack replaces those casts instead of adding a pass; everything else
keeps its storage dtype, so the blocks compute exactly what the loop computes.

Inference can skip the stack: ``stack_for_inference`` makes it once, and a call that is never
differentiated reads it in place (``run_blocks(..., stacked=...)``). Stacking per call moves
every parameter twice (float32 read, compute dtype written): H100, 8 x 2048-token prefill,
1.5b 5.9 ms of the dense model's 100.1 and 6.6 of the sparse model's 86.2 (0.5b: 0.2 and 0.4
ms).

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


def _stack_params(blocks: Sequence[Block], cfg: ModelConfig, inference: bool) -> nnx.State:
    """The blocks' parameters stacked along a new axis 0, matrices cast to the compute dtype,
    except, in a call that may be differentiated, the sparse FFN's: its backward returns
    float32 master weights' gradients straight from its kernels, which a cast outside it would
    round through the compute dtype. A call that is never differentiated casts those too: the
    FFN casts its weights to the compute dtype on use, so the result is the same, and the stack
    writes half the bytes (1.5b: 1.9 instead of 3.9 GB of FFN weights per call)."""
    sparse_ffn = cfg.implementation != "xla" and not inference

    def stack(path, *leaves: jax.Array) -> jax.Array:
        return jnp.stack([v.astype(_stacked_dtype(path, v, cfg, sparse_ffn)) for v in leaves])

    return jax.tree_util.tree_map_with_path(stack, *[nnx.state(b, nnx.Param) for b in blocks])


def _stacked_dtype(path, leaf: jax.Array, cfg: ModelConfig, keep_sparse_ffn: bool) -> jnp.dtype:
    """The dtype ``leaf`` is stacked in: the compute dtype for a floating matrix (except the
    sparse FFN's, with ``keep_sparse_ffn``), else its own."""
    keep = keep_sparse_ffn and any(getattr(key, "key", None) == "ffn" for key in path)
    if not keep and leaf.ndim >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating):
        return jnp.dtype(cfg.dtype)
    return leaf.dtype


def stack_for_inference(blocks: Sequence[Block], cfg: ModelConfig) -> nnx.State:
    """The blocks' parameters as a call that is never differentiated stacks them (every
    floating matrix in the compute dtype), for ``run_blocks(..., stacked=...)``: make it once
    and reuse it. It is a copy: made again after the parameters change, or calls read the old
    weights."""
    return _stack_params(blocks, cfg, inference=True)


def check_stacked(stacked: nnx.State, blocks: Sequence[Block], cfg: ModelConfig) -> None:
    """Raises ValueError unless ``stacked`` has the structure, shapes and dtypes that
    ``stack_for_inference(blocks, cfg)`` gives."""
    params = nnx.state(blocks[0], nnx.Param)
    if jax.tree.structure(stacked) != jax.tree.structure(params):
        raise ValueError("stacked does not hold these blocks' parameters; make it with "
                         "Transformer.stack_for_inference()")

    def check(path, leaf, got):
        want = ((len(blocks), *leaf.shape), _stacked_dtype(path, leaf, cfg, False))
        if (tuple(got.shape), got.dtype) != want:
            raise ValueError(f"stacked parameter {jax.tree_util.keystr(path)} is "
                             f"{got.dtype}{list(got.shape)}, expected {want[1]}{list(want[0])}; "
                             "make it with Transformer.stack_for_inference()")

    jax.tree_util.tree_map_with_path(check, params, stacked)


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


SCAN_MIN_TOKENS = 4096
"""Calls of fewer tokens (B * T) run the blocks in a Python loop instead of the scan.

Stacking costs a pass over every parameter per call, and inside the scan each layer's slice
of the stack is copied before the kernels read it. A call with many tokens pays that back
(H100, 1.5b, 8 x 2048 tokens: prefill 1-5% faster than the loop, a training step 2-4%
slower, its compile 6-8x faster), but a call with a few tokens is bound by reading the
weights (H100, 1.5b, one token: 12.6 ms under the scan against 5.3 ms in the loop). Such calls
compile once per layer, as before."""


def run_blocks(model: nnx.Module, blocks: Sequence[Block], cfg: ModelConfig, step: Callable,
               x: jax.Array, *, inference: bool = False,
               stacked: nnx.State | None = None) -> tuple[jax.Array, list]:
    """Runs ``step(block, x) -> (x, out)`` for every block in order: under one scan when
    ``cfg.scan_layers``, x holds at least ``SCAN_MIN_TOKENS`` tokens and either ``cfg.remat``
    or ``inference`` (a call never differentiated, such as a prefill); else in a Python loop.

    Why not a training forward without remat: differentiated, a scan saves each layer's
    residuals into stacked buffers, a copy of every activation the backward keeps (H100, 0.5b,
    8 x 2048 tokens, remat off: training step 104.4 -> 126.7 ms dense, 89.8 -> 105.5 ms sparse
    under the scan; its prefill 29.6 -> 27.6 and 26.1 -> 24.5 ms). With remat the scan keeps
    only what the policy names, and step times stay within 2-4% of the loop's.

    Args:
      model: the module that holds ``blocks`` (its capture, if any, is forwarded).
      blocks: the blocks, all built from ``cfg``.
      cfg: their config; with ``cfg.remat`` each block is recomputed in the backward pass,
        keeping only what ``REMAT_POLICY`` names.
      step: called with each block in turn (under the scan, a block rebuilt from its layer's
        parameters).
      x: the carry (the residual stream [B, T, D]).
      inference: the call is never differentiated (it may scan without remat).
      stacked: ``stack_for_inference(blocks, cfg)``, made earlier: the scan reads it instead
        of stacking the parameters (inference only; the loop reads the blocks as they are).
    Returns:
      (x after the last block, the list of each block's ``out``).
    Raises:
      ValueError: ``stacked`` without ``inference`` (gradients would not reach the blocks'
        parameters), or one that does not match the blocks.
    """
    if stacked is not None:
        if not inference:
            raise ValueError("stacked parameters are for inference=True calls only: a "
                             "differentiated call must read the blocks' own parameters")
        check_stacked(stacked, blocks, cfg)
    if (cfg.scan_layers and (cfg.remat or inference)
            and x.size // x.shape[-1] >= SCAN_MIN_TOKENS):
        x, outs = _scan(model, blocks, cfg, step, x, inference, stacked)
        return x, [jax.tree.map(lambda a: a[layer], outs) for layer in range(len(blocks))]
    run = nnx.remat(step, policy=REMAT_POLICY) if cfg.remat else step
    outs = []
    for block in blocks:
        x, out = run(block, x)
        outs.append(out)
    return x, outs


def _scan(model: nnx.Module, blocks: Sequence[Block], cfg: ModelConfig, step: Callable,
          x: jax.Array, inference: bool, stacked: nnx.State | None) -> tuple[jax.Array, object]:
    """``run_blocks`` under one scan; the outs come stacked along a new axis 0."""
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
    if stacked is None:
        stacked = _stack_params(blocks, cfg, inference)
    x, (outs, captured) = jax.lax.scan(body, x, stacked)
    for var_type, state in zip(types, captured):
        _sow_per_layer(blocks, var_type, state)
    return x, outs
