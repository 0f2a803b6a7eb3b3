"""The FFN weights are stored in the layout the kernels read ([F, D], one row per unit), so no
call transposes one, and with bf16 weights none is cast: read from the program lowered for the
GPU (``jax.export`` for CUDA, the kernels compiled rather than interpreted), for the sparse
forward, forward + backward and decode step. Plus ``prepare_weights`` and the old-layout
checkpoints that convert once."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from tests.test_lowering import export_for_cuda
from tests.utils import make_ffn_inputs, one_backup_size

D, F = 128, 512
S = jax.ShapeDtypeStruct
# Forced sparse: at these sizes the cost model would run small calls dense.
SPARSE = tj.TwELLConfig(dense_fallback_density=1.0)
_TYPE = re.compile(r"tensor<(\d+)x(\d+)x(\w+)>")


def weight_sized_ops(module: str, op: str) -> list[str]:
    """The ``stablehlo.<op>`` lines whose result is a weight-sized matrix ([F, D] or [D, F])."""
    found = []
    for line in module.splitlines():
        if f"stablehlo.{op} " not in line or "->" not in line:
            continue
        for rows, cols, _ in _TYPE.findall(line.rsplit("->", 1)[-1]):
            if {int(rows), int(cols)} == {D, F}:
                found.append(line.strip())
    return found


def casts_of_inputs(fn, args, positions: tuple[int, ...]) -> list[str]:
    """The ``convert_element_type`` equations applied to the inputs at ``positions`` (the
    weights themselves, followed into every nested jaxpr: jit, conditionals, custom rules),
    in ``fn``'s jaxpr, the backward included. (Casting a float32 gradient to the weights'
    dtype is no cast of a weight.)"""
    closed = jax.make_jaxpr(fn)(*args)
    found: list[str] = []

    def nested(value):
        if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a closed jaxpr
            return [value.jaxpr]
        if hasattr(value, "eqns"):
            return [value]
        if isinstance(value, (tuple, list)):
            return [j for v in value for j in nested(v)]
        return []

    def walk(jaxpr, tracked: set) -> None:
        for eqn in jaxpr.eqns:
            inputs = [None if type(v).__name__ == "Literal" else v for v in eqn.invars]
            if eqn.primitive.name == "convert_element_type" and inputs[0] in tracked:
                found.append(str(eqn))
            for sub in (j for value in eqn.params.values() for j in nested(value)):
                outer = inputs[len(inputs) - len(sub.invars):]  # cond: the index comes first
                walk(sub, {inner for inner, v in zip(sub.invars, outer) if v in tracked})

    walk(closed.jaxpr, {closed.jaxpr.invars[i] for i in positions})
    return found


def _weights(dtype):
    return tuple(S((F, D), dtype) for _ in range(3))


def _forward(config):
    return lambda x, *w: tj.feed_forward(x, tj.FFNWeights(*w), implementation="pallas",
                                         config=config)


def _forward_and_backward(x, *w):
    loss = lambda *a: jnp.sum(_forward(SPARSE)(*a).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, *w)


# Fast tier: bf16 weights everywhere, float32 master weights (cast, not transposed) in the
# forward + backward.
@pytest.mark.parametrize("call, m, weight_dtype", [
    pytest.param(call, m, dtype, id=f"{call}-{m}-{name}",
                 marks=() if dtype == jnp.bfloat16 or call == "forward_and_backward"
                 else pytest.mark.slow)
    for call, m in (("forward", 256), ("forward_and_backward", 256), ("decode", 1),
                    ("decode", 8), ("decode", 64))
    for dtype, name in ((jnp.bfloat16, "bf16"), (jnp.float32, "f32"))])
def test_no_weight_is_transposed_or_cast(compiled_kernels, call, m, weight_dtype):
    fn = {"forward": _forward(SPARSE), "forward_and_backward": _forward_and_backward,
          "decode": _forward(None)}[call]
    module = export_for_cuda(fn, S((m, D), jnp.bfloat16), *_weights(weight_dtype))
    kernels = set(re.findall(r"twell_\w+", module))
    assert ({"twell_scan_up_down", "twell_gemv"} if call == "decode" and m < 64
            else {"twell_scan_up_down"} if call == "decode"
            else {"twell_row_pack", "twell_row_up_down"}) <= kernels, kernels
    if call == "forward_and_backward":
        assert {"twell_row_backward", "twell_sparse_outer"} <= kernels, kernels
    assert weight_sized_ops(module, "transpose") == []
    # bf16 weights are never cast; float32 master weights are, to the compute dtype.
    casts = casts_of_inputs(fn, (S((m, D), jnp.bfloat16), *_weights(weight_dtype)), (1, 2, 3))
    assert (casts == []) == (weight_dtype == jnp.bfloat16), casts


def test_the_flax_layout_transposes_once_per_call(compiled_kernels):
    """``gated_mlp`` on [D, F] weights: the transposes ``prepare_weights`` would have made once
    are in the program (the reason the layers store [F, D])."""
    flax = (S((D, F), jnp.bfloat16), S((D, F), jnp.bfloat16), S((F, D), jnp.bfloat16))
    module = export_for_cuda(
        lambda x, *w: tj.gated_mlp(x, *w, implementation="pallas", config=SPARSE),
        S((256, D), jnp.bfloat16), *flax)
    assert weight_sized_ops(module, "transpose")


# The layouts meet in ffn.py, before any backend: the fast tier checks one (the kernels' own
# tests cover pallas against reference).
@pytest.mark.parametrize("gated, implementation", [
    pytest.param(True, "reference", id="gated-reference"),
    pytest.param(True, "pallas", id="gated-pallas", marks=pytest.mark.slow),
    pytest.param(False, "reference", id="plain-reference", marks=pytest.mark.slow)])
def test_prepared_weights_compute_the_flax_layout_op(gated, implementation):
    """``feed_forward`` on ``prepare_weights`` equals ``gated_mlp`` / ``mlp`` bit for bit, its
    gradients are theirs transposed."""
    m = 48
    x, *weights = make_ffn_inputs(11, m, 64, 200, "heavy_tailed", jnp.float32, gated=gated)
    flax_op = tj.gated_mlp if gated else tj.mlp
    w_gate = weights[0] if gated else None
    prepared = tj.prepare_weights(w_gate, *weights[-2:])
    assert prepared.gated == gated and prepared.up.shape == (200, 64)
    config = one_backup_size(tj.TwELLConfig(), m)  # the default routes, a smaller program
    loss_flax = lambda x, *w: jnp.sum(flax_op(x, *w, implementation=implementation,
                                              config=config) ** 2)
    loss_rows = lambda x, *w: jnp.sum(tj.feed_forward(
        x, tj.FFNWeights(*((None,) if not gated else ()) + w),
        implementation=implementation, config=config) ** 2)
    argnums = tuple(range(len(weights) + 1))
    want = jax.jit(jax.value_and_grad(loss_flax, argnums))(x, *weights)
    got = jax.jit(jax.value_and_grad(loss_rows, argnums))(x, *prepared.matrices)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1][0]), np.asarray(want[1][0]))
    for g, w in zip(got[1][1:], want[1][1:]):
        g = np.asarray(g)
        assert np.isfinite(g).all()
        np.testing.assert_array_equal(g, np.asarray(w).T if g.shape != w.shape else w)


def test_feed_forward_rejects_bad_weights():
    x = jnp.ones((4, 8))
    w = jnp.ones((16, 8))
    with pytest.raises(TypeError, match="FFNWeights"):
        tj.feed_forward(x, (w, w, w))
    with pytest.raises(ValueError, match=r"weights.down has shape \(8, 16\)"):
        tj.feed_forward(x, tj.FFNWeights(w, w, w.T))
    with pytest.raises(ValueError, match=r"x has shape \(4, 9\)"):
        tj.feed_forward(jnp.ones((4, 9)), tj.FFNWeights(w, w, w))
    with pytest.raises(ValueError, match=r"bias has shape \(8,\), expected \(16,\)"):
        tj.feed_forward(x, tj.FFNWeights(w, w, w), bias=jnp.ones(8))
    with pytest.raises(ValueError, match="w_up must be a 2-D array"):
        tj.prepare_weights(None, jnp.ones(3), w)


def test_checkpoints_of_the_earlier_layout_load_transposed(tmp_path):
    """A checkpoint without the layout item holds w_gate and w_up [D, F] (and their AdamW
    moments alike): it restores into today's [F, D] parameters, every value in place."""
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    from twell_jax import checkpoints
    from twell_jax import model as model_lib

    model = model_lib.build("tiny", implementation="xla")
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    grads = nnx.jit(nnx.grad(
        lambda m: model_lib.loss_fn(m, jnp.ones((1, 9), jnp.int32), 0.0)[0]))(model)
    optimizer.update(model, grads)  # moments no longer zero
    cfg = model.cfg
    assert cfg.d_model != cfg.d_ff  # the shapes tell the layouts apart
    earlier = lambda state: jax.tree_util.tree_map_with_path(
        lambda path, v: v.T if checkpoints._was_transposed(path, v) else v, state)
    manager = checkpoints.checkpoint_manager(tmp_path, writer=True)
    manager.save(3, args=ocp.args.Composite(
        model=ocp.args.StandardSave(earlier(nnx.state(model))),
        optimizer=ocp.args.StandardSave(earlier(nnx.state(optimizer)))))
    manager.wait_until_finished()
    transposed = [p for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(optimizer))
                  if checkpoints._was_transposed(p, v)]
    assert len(transposed) == 2 * 2 * cfg.n_layers  # w_gate, w_up: mu and nu per layer

    fresh = model_lib.build("tiny", implementation="xla", seed=1)
    fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-3), wrt=nnx.Param)
    assert checkpoints.restore_checkpoint(manager, fresh, fresh_opt) == 3
    for a, b in zip(jax.tree.leaves(nnx.state(fresh_opt)), jax.tree.leaves(nnx.state(optimizer))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Today's checkpoints record their layout (and restore as they are: tests/test_train.py).
    checkpoints.save_checkpoint(manager, 4, model, optimizer)
    assert (tmp_path / "ckpt" / "4" / "layout").is_dir()
    manager.close()
