"""The blocks under one scan (twell_jax/model/layer_scan.py) against the same blocks in a Python
loop: equal losses, statistics, gradients and prefill caches, and each kernel traced once
whatever the depth.

In float32 the two are compared for equality up to float32 rounding of reassociated sums. In
bf16 XLA may keep a fused chain of bf16 operations in float32 across a block boundary in the
loop (its "excess precision"), which the scan's carry rounds; the subprocess test turns that off
and asks for bitwise equality.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils import slow, subprocess_env
from twell_jax import model as model_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_CPU = jax.default_backend() == "cpu"
# On a GPU float32 products default to reduced-precision passes, and the two programs may be
# tuned to different GEMM algorithms: compare at full float32 precision, with a looser bound.
RTOL = 1e-5 if ON_CPU else 1e-3


@pytest.fixture(autouse=True)
def scan_every_call(monkeypatch):
    """The tests' calls are small: scan them all (production scans from 4096 tokens)."""
    monkeypatch.setattr(model_lib.layer_scan, "SCAN_MIN_TOKENS", 1)


def loop_features(model: model_lib.Transformer, tokens: jax.Array, *,
                  inference: bool = False, stacked=None) -> jax.Array:
    """``Transformer.features`` as a Python loop over the blocks (the old form); it takes
    ``inference`` and ``stacked`` as ``features`` does, and ignores them: the loop never
    scans."""
    x = model._embed(tokens)
    cos, sin = model._rope()
    run = nnx.remat(lambda b, h: b(h, cos, sin), policy=model_lib.layer_scan.REMAT_POLICY) \
        if model.cfg.remat else (lambda b, h: b(h, cos, sin))
    for block in model.blocks:
        x = run(block, x)
    return model.final_norm(x)


def loss_and_grads(model, tokens, loop: bool):
    features = model_lib.Transformer.features
    if loop:
        model_lib.Transformer.features = loop_features
    try:
        fn = nnx.jit(nnx.value_and_grad(model_lib.loss_fn, has_aux=True))
        with jax.default_matmul_precision("float32"):
            (loss, metrics), grads = fn(model, tokens, 0.01)
    finally:
        model_lib.Transformer.features = features
    return loss, metrics, grads


@pytest.mark.parametrize("implementation", [slow("pallas"), slow("reference"), "xla"])
def test_scan_equals_the_loop_in_float32(implementation):
    # A training forward scans only with remat (``run_blocks``).
    model = model_lib.build("tiny", implementation=implementation, remat=True, seed=3,
                            dtype=jnp.float32, n_layers=3)
    tokens = jax.random.randint(jax.random.key(1), (2, 25), 0, 256)
    loss, metrics, grads = loss_and_grads(model, tokens, loop=False)
    loss_ref, metrics_ref, grads_ref = loss_and_grads(model, tokens, loop=True)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(loss, loss_ref, rtol=RTOL / 10)
    for name in ("nnz_mean", "nnz_max", "heavy_rows", "l1_layer"):
        np.testing.assert_allclose(metrics[name], metrics_ref[name], rtol=RTOL)
    assert np.asarray(metrics["nnz_mean"]).shape == (3,)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, g_ref, rtol=2 * RTOL, atol=RTOL / 10)


@pytest.mark.slow  # the fast tier keeps test_scan_equals_the_loop_in_float32[xla-True]
def test_prefill_and_activity_equal_the_loop_in_float32():
    model = model_lib.build("tiny", implementation="pallas", seed=4, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
    lengths = jnp.array([12, 7])
    cache = model.init_cache(2, 16)
    with jax.default_matmul_precision("float32"):
        logits, filled = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))(model, tokens, lengths,
                                                                         cache)
        # The loop: each block's prefill in turn, its k, v written into the cache.
        x = model._embed(tokens)
        cos, sin = model._rope()
        for layer, block in enumerate(model.blocks):
            x, k, v = block.prefill(x, cos, sin)
            np.testing.assert_allclose(filled.k[layer][:, :12], k, rtol=RTOL, atol=RTOL / 10)
            np.testing.assert_allclose(filled.v[layer][:, :12], v, rtol=RTOL, atol=RTOL / 10)
            assert not np.any(filled.k[layer][:, 12:])
        last = x[jnp.arange(2), lengths - 1]
        np.testing.assert_allclose(logits, model.logits(model.final_norm(last)), rtol=RTOL,
                                   atol=RTOL)
    np.testing.assert_array_equal(filled.lengths, lengths)

    with jax.default_matmul_precision("float32"):
        activity, nnz = model_lib.activity_and_token_nnz(model, tokens)
        features = model_lib.Transformer.features
        model_lib.Transformer.features = loop_features
        try:
            activity_ref, nnz_ref = model_lib.activity_and_token_nnz(model, tokens)
        finally:
            model_lib.Transformer.features = features
    assert nnz.shape == (2, 24) and int(nnz.min()) > 0
    np.testing.assert_array_equal(activity, activity_ref)
    # A gate pre-activation within rounding of 0 may flip between two GPU programs.
    assert np.mean(nnz != nnz_ref) <= (0 if ON_CPU else 0.1)
    np.testing.assert_allclose(nnz, nnz_ref, atol=0 if ON_CPU else 1)


def test_each_kernel_is_traced_once_whatever_the_depth(monkeypatch):
    tokens = jnp.zeros((1, 16), jnp.int32)

    def kernels(n_layers: int, remat: bool = True) -> int:
        model = model_lib.build("tiny", implementation="pallas", n_layers=n_layers, remat=remat)
        jaxpr = jax.make_jaxpr(lambda m, t: model_lib.loss_fn(m, t, 0.01)[0])(model, tokens)
        return str(jaxpr).count("pallas_call")

    def prefill_kernels(n_layers: int) -> int:  # remat off: a prefill is never differentiated
        model = model_lib.build("tiny", implementation="pallas", n_layers=n_layers)
        cache = model.init_cache(1, 16)
        jaxpr = jax.make_jaxpr(lambda t, n, c: model.prefill(t, n, c)[0])(
            tokens, jnp.array([16]), cache)
        return str(jaxpr).count("pallas_call")

    def inference_kernels(n_layers: int) -> int:  # remat off, never differentiated
        model = model_lib.build("tiny", implementation="pallas", n_layers=n_layers)
        jaxpr = jax.make_jaxpr(lambda t: model(t, inference=True))(tokens)
        return str(jaxpr).count("pallas_call")

    one = kernels(1)
    assert one > 0
    assert kernels(4) == one
    assert prefill_kernels(4) == prefill_kernels(1) > 0
    assert inference_kernels(4) == inference_kernels(1) > 0
    # A training forward without remat runs the loop (a scan would stack every layer's
    # residuals for the backward): each block is traced on its own.
    assert kernels(4, remat=False) == 4 * kernels(1, remat=False)
    # Below the threshold the blocks run in a loop too.
    monkeypatch.setattr(model_lib.layer_scan, "SCAN_MIN_TOKENS", 17)
    assert prefill_kernels(4) == 4 * prefill_kernels(1)


@pytest.mark.slow  # a subprocess; the float32 comparisons stay in the fast tier
@pytest.mark.skipif(not ON_CPU, reason="GPU programs may be tuned to different GEMM algorithms")
def test_scan_equals_the_loop_bitwise_in_bf16_without_excess_precision():
    script = textwrap.dedent("""
        import jax, numpy as np
        from tests.test_layer_scan import loop_features, loss_and_grads
        from twell_jax import model as model_lib
        model_lib.layer_scan.SCAN_MIN_TOKENS = 1
        model = model_lib.build("tiny", implementation="pallas", seed=5, n_layers=3,
                                remat=True)
        tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, 256)
        a = loss_and_grads(model, tokens, loop=False)
        b = loss_and_grads(model, tokens, loop=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # Never differentiated, the scan stacks the FFN's weights already cast: same features.
        infer = model_lib.build("tiny", implementation="pallas", seed=6, n_layers=3)
        scanned = jax.jit(lambda t: infer.features(t, inference=True))(tokens)
        looped = jax.jit(lambda t: loop_features(infer, t))(tokens)
        assert scanned.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(scanned, np.float32),
                                      np.asarray(looped, np.float32))
        print("EQUAL", float(a[0]))
    """)
    env = subprocess_env(XLA_FLAGS="--xla_allow_excess_precision=false")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EQUAL" in out.stdout


@pytest.mark.parametrize("implementation", [slow("pallas"), "xla"])
def test_stacked_for_inference_equals_stacking_per_call(implementation):
    model = model_lib.build("tiny", implementation=implementation, seed=5, gate_bias=True,
                            n_layers=3)
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 256)
    stacked = model.stack_for_inference()
    assert all(a.shape[0] == 3 for a in jax.tree.leaves(stacked))
    assert {a.dtype for a in jax.tree.leaves(stacked) if a.ndim >= 3} == {jnp.dtype(jnp.bfloat16)}
    run = nnx.jit(lambda m, t, s: m(t, inference=True, stacked=s))
    logits = run(model, tokens, None)
    assert np.all(np.isfinite(logits)) and float(jnp.std(logits)) > 0
    np.testing.assert_array_equal(run(model, tokens, stacked), logits)
    lengths = jnp.array([16, 9])
    prefill = nnx.jit(lambda m, t, s: m.prefill(t, lengths, m.init_cache(2, 20), stacked=s))
    (last, cache), (last_ref, cache_ref) = prefill(model, tokens, stacked), \
        prefill(model, tokens, None)
    np.testing.assert_array_equal(last, last_ref)
    for k, k_ref in zip(cache.k + cache.v, cache_ref.k + cache_ref.v):
        np.testing.assert_array_equal(k, k_ref)


def test_the_scan_reads_the_stack_it_is_given():
    """A stack made before the parameters change still computes with the old parameters: the
    scan reads it and not the blocks (which is why it must be made again after training)."""
    model = model_lib.build("tiny", implementation="xla", seed=6, n_layers=2)
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 256)
    run = nnx.jit(lambda m, t, s: m(t, inference=True, stacked=s))
    before = run(model, tokens, None)
    stacked = model.stack_for_inference()
    model.blocks[1].ffn.w_down[...] = 2 * model.blocks[1].ffn.w_down[...]
    after = run(model, tokens, None)
    assert float(jnp.max(jnp.abs(after - before))) > 1e-3
    np.testing.assert_array_equal(run(model, tokens, stacked), before)
    np.testing.assert_array_equal(run(model, tokens, model.stack_for_inference()), after)


def test_stacked_parameters_are_checked():
    model = model_lib.build("tiny", implementation="xla", seed=7, n_layers=2)
    tokens = jax.random.randint(jax.random.key(5), (1, 8), 0, 256)
    stacked = model.stack_for_inference()
    with pytest.raises(ValueError, match="inference=True"):
        model(tokens, stacked=stacked)
    with pytest.raises(ValueError, match="inference=True"):
        jax.grad(lambda s: model(tokens, stacked=s).sum())(stacked)
    other = model_lib.build("tiny", implementation="xla", seed=7, n_layers=3)
    with pytest.raises(ValueError, match=r"expected bfloat16\[2,"):
        model(tokens, inference=True, stacked=other.stack_for_inference())
    as_stored = jax.tree.map(lambda a: a.astype(jnp.float32), stacked)
    with pytest.raises(ValueError, match="float32.*expected bfloat16"):
        model(tokens, inference=True, stacked=as_stored)
    with pytest.raises(ValueError, match="does not hold these blocks"):
        model(tokens, inference=True, stacked={"w": stacked})


def test_a_prefill_computes_no_statistics_unless_captured():
    """Under the scan, a prefill outside ``nnx.capture`` compiles without the FFN statistics
    (nnz mean, p99, max, L1: dead code, dropped), and one under a capture keeps them."""
    model = model_lib.build("tiny", implementation="reference", seed=8, gate_bias=True,
                            n_layers=2)
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 256)
    graphdef, state = nnx.split(model)

    def plain(state, tokens):
        return nnx.merge(graphdef, state).features(tokens, inference=True)

    def captured(state, tokens):
        return nnx.capture(lambda m, t: m.features(t, inference=True),
                           nnx.Intermediate)(nnx.merge(graphdef, state), tokens)

    hlo = {name: jax.jit(fn).lower(state, tokens).compile().as_text()
           for name, fn in (("plain", plain), ("captured", captured))}
    reductions = {name: len(re.findall(r" reduce\(", text)) for name, text in hlo.items()}
    assert 0 < reductions["plain"] < reductions["captured"], reductions
    features, inter = jax.jit(captured)(state, tokens)
    stats = model_lib.layer_stats(inter, 2)
    assert all(float(s.nnz_mean) > 0 for s in stats)
    np.testing.assert_array_equal(jax.jit(plain)(state, tokens), features)
