"""Tests of the TwELL decoder in ``twell_jax.model``: configs, forward, loss, remat, training."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.utils import TOLERANCES, one_backup_size, rel_err
from twell_jax import model as model_lib
from twell_jax.config import TwELLConfig

TINY = dataclasses.replace(model_lib.CONFIGS["tiny"], implementation="xla")
# Slots as wide as the tile and no row-density limit: no row is ever heavy, so the sparse
# paths compute every token themselves (at init about half of the units are active, and the
# default config would send every row to the dense backup). Pallas never switches to dense.
# No backup (backup_rows=0): with no heavy row it never runs, and its switch branches would
# only make the interpreter's programs bigger.
ALL_SPARSE = TwELLConfig(tile_width=16, slots_per_tile=16, max_row_density=1.0,
                         dense_fallback_density=1.0, backup_rows=0)


IMPLEMENTATIONS = ["xla", "reference", "pallas"]


X_SHAPE = (2, 25)  # [B, T + 1] for loss_fn; one shape so the jitted functions compile once
# The default config with one backup size for the loss's B x T token rows (tests/utils.py:
# one_backup_size): the reference model's loss and gradients compile in less than half the time.
ONE_BACKUP = one_backup_size(TwELLConfig(), X_SHAPE[0] * (X_SHAPE[1] - 1))


def tokens(shape=X_SHAPE, seed=0, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


@nnx.jit
def forward(model, x):
    return model(x)


@nnx.jit
def loss_and_grads(model, x, l1_coeff):
    return nnx.value_and_grad(model_lib.loss_fn, has_aux=True)(model, x, l1_coeff)


# ------------------------------------------------------------------------------------------
# Configs.


@pytest.mark.parametrize("name", list(model_lib.CONFIGS))
def test_preset_param_count(name):
    cfg = model_lib.CONFIGS[name]
    assert cfg.d_model % cfg.n_heads == 0
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == cfg.param_count()


def test_paper_presets():
    for name, layers in {"0.5b": 8, "1b": 18, "1.5b": 28, "2b": 38}.items():
        cfg = model_lib.CONFIGS[name]
        assert (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.head_dim, cfg.vocab_size,
                cfg.max_seq_len, cfg.n_layers) == (2048, 5632, 32, 64, 49152, 2048, layers)


@pytest.mark.parametrize("change, message", [
    (dict(n_heads=5), "not divisible"),
    (dict(d_model=0), "d_model must be a positive int"),
    (dict(n_layers=2.0), "n_layers must be a positive int"),
    (dict(implementation="cuda"), "implementation must be one of"),
    (dict(dtype=jnp.int32), "dtype must be a floating-point dtype"),
    (dict(d_model=12, n_heads=4), "must be even"),
])
def test_config_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)
    with pytest.raises(TypeError, match="decode_kernels must be None or a bool"):
        dataclasses.replace(TINY, decode_kernels=1)


def test_config_is_hashable():
    assert hash(TINY) == hash(dataclasses.replace(TINY))


# ------------------------------------------------------------------------------------------
# Forward and loss.


def test_forward_shapes():
    model = model_lib.build("tiny", implementation="xla")
    logits = forward(model, tokens((2, 17)))
    assert logits.shape == (2, 17, TINY.vocab_size) and logits.dtype == jnp.float32
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(tokens((1, TINY.max_seq_len + 1)))


def test_causal():
    """Changing a later token leaves the logits at earlier positions unchanged."""
    model = model_lib.build("tiny", implementation="xla")
    x = tokens((2, 17))
    y = x.at[0, 8].set((x[0, 8] + 1) % TINY.vocab_size)
    a, b = forward(model, x), forward(model, y)
    np.testing.assert_array_equal(np.asarray(a[:, :8]), np.asarray(b[:, :8]))
    assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


@nnx.jit
def logits_and_metrics(model, x):
    """One forward pass: logits and the per-layer statistics."""
    logits, intermediates = nnx.capture(model, nnx.Intermediate)(x[:, :-1])
    stats = model_lib.layer_stats(intermediates, model.cfg.n_layers)
    return logits, {name: jnp.stack([jnp.asarray(getattr(s, name)) for s in stats])
                    for name in ("nnz_mean", "heavy_rows", "dense_fallback")}


@pytest.mark.parametrize("twell", [pytest.param(None, marks=pytest.mark.slow), ALL_SPARSE],
                         ids=["default", "all_sparse"])
def test_implementations_agree_bf16(twell):
    """bf16 logits and nnz of every implementation match the dense "xla" model. With the
    default config every row is heavy at init (about half of 256 units active): the backup runs."""
    x = tokens(seed=1)
    results = {impl: logits_and_metrics(model_lib.build("tiny", implementation=impl,
                                                        twell=twell, seed=3), x)
               for impl in IMPLEMENTATIONS}
    logits_x, metrics_x = results["xla"]
    for impl in IMPLEMENTATIONS[1:]:
        logits, metrics = results[impl]
        assert rel_err(logits, logits_x) < TOLERANCES["logits"][jnp.dtype(jnp.bfloat16)], impl
        np.testing.assert_allclose(metrics["nnz_mean"], metrics_x["nnz_mean"], rtol=0.02)
        if twell is ALL_SPARSE:  # the sparse path computed every row
            assert int(metrics["heavy_rows"].sum()) == 0 and not metrics["dense_fallback"].any()
        else:
            assert int(metrics["heavy_rows"].min()) > 0


def _set_gate_biases(model, seed):
    """Random negative gate biases (thresholds), so the bias shapes the sparsity."""
    for i, block in enumerate(model.blocks):
        key = jax.random.key(seed + i)
        block.ffn.b_gate[...] = -jnp.abs(jax.random.normal(key, block.ffn.b_gate[...].shape))


# Slow (the fast tier takes a model's gradients in test_loss_and_grads_finite, and the sparse
# backward against the dense one in tests/test_ffn.py).
@pytest.mark.slow
@pytest.mark.parametrize("gate_bias", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["no_bias", "gate_bias"])
def test_implementations_agree_f32_grads(gate_bias):
    """float32 loss and gradients of the sparse paths equal the dense model's to ~1e-6 (in bf16
    the dense model's own gradients are ~5% off float32, too loose a check)."""
    x = tokens(seed=1)
    results = {}
    for impl in IMPLEMENTATIONS:
        model = model_lib.build("tiny", implementation=impl, twell=ALL_SPARSE, seed=3,
                                dtype=jnp.float32, gate_bias=gate_bias)
        if gate_bias:
            _set_gate_biases(model, seed=7)
        (loss, metrics), grads = loss_and_grads(model, x, 0.01)
        assert int(metrics["heavy_rows"].sum()) == 0 and int(metrics["dense_fallback"]) == 0
        results[impl] = loss, jax.tree.leaves(nnx.state(grads))
    loss_x, grads_x = results["xla"]
    for impl in IMPLEMENTATIONS[1:]:
        loss, grads = results[impl]
        np.testing.assert_allclose(loss, loss_x, rtol=1e-5)
        worst = max(rel_err(a, b) for a, b in zip(grads, grads_x))
        assert worst < 2e-5, f"{impl}: gradient relative error {worst:.3e}"


def test_gate_bias_params_features_and_activity():
    cfg = dataclasses.replace(TINY, gate_bias=True)
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.param_count() == TINY.param_count() + TINY.n_layers * TINY.d_ff
    assert model_lib.build("tiny", implementation="xla").blocks[0].ffn.b_gate is None
    _set_gate_biases(model, seed=0)
    x = tokens((2, 17))
    logits = forward(model, x)
    features = nnx.jit(lambda m, t: m.features(t))(model, x)
    assert features.shape == (2, 17, TINY.d_model)
    expected = jnp.dot(features, model.embedding[...].astype(cfg.dtype).T,
                       preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-6, atol=1e-6)
    # unit_activity applies the bias as the layer does: a huge bias silences a unit.
    model.blocks[0].ffn.b_gate[...] = model.blocks[0].ffn.b_gate[...].at[:5].set(-1e4)
    active = np.asarray(model_lib.unit_activity(model, x))
    assert not active[0, :5].any() and active[0, 5:].any()
    with pytest.raises(TypeError, match="gate_bias must be a bool"):
        dataclasses.replace(TINY, gate_bias=1)


@pytest.mark.parametrize("gemv_kernel", [False, True], ids=["xla", "gemv"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["out_f32", "out_bf16"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mixed_precision_matmul(dtype, out_dtype, gemv_kernel):
    """``dense.mixed_precision_matmul`` (the projections and the logits; with ``gemv_kernel``
    ``dense.few_row_matmuls`` of one weight: the GEMV kernel, interpret mode here): the output
    dtype asked for, gradients as autodiff's of the float32 product (exactly in float32), and
    every backward GEMM reads the compute dtype and accumulates in float32."""
    from twell_jax.dense import few_row_matmuls, mixed_precision_matmul

    kx, kw, kc = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 5, 32), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (32, 48), jnp.float32) / 6).astype(dtype)
    ct = jax.random.normal(kc, (2, 5, 48), jnp.float32)
    fn = ((lambda x, w: few_row_matmuls(x, (w,), out_dtype)[0]) if gemv_kernel
          else (lambda x, w: mixed_precision_matmul(x, w, out_dtype)))
    forward = str(jax.make_jaxpr(fn)(x, w))
    assert ("twell_gemv" in forward) == gemv_kernel
    plain = lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST)
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct))
    assert fn(x, w).dtype == jnp.dtype(out_dtype)
    exact = dtype == jnp.float32 and out_dtype == jnp.float32  # nothing rounded to bf16
    assert rel_err(fn(x, w), plain(x, w)) < (1e-6 if exact else 1e-2)
    got = jax.grad(loss(fn), argnums=(0, 1))(x, w)
    want = jax.grad(loss(plain), argnums=(0, 1))(x, w)
    for g, ref, arg in zip(got, want, (x, w)):
        assert g.dtype == arg.dtype and np.isfinite(np.asarray(g, np.float32)).all()
        assert rel_err(g, ref) < (1e-6 if exact else 1e-2)
    # The forward's dot sits inside the custom_vjp call; the top level holds the backward's.
    jaxpr = jax.make_jaxpr(jax.grad(loss(fn), argnums=(0, 1)))(x, w)
    backward = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(backward) == 2
    assert all(v.aval.dtype == dtype for e in backward for v in e.invars)
    assert all(e.outvars[0].aval.dtype == jnp.float32 for e in backward)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16],
                         ids=["f32", "bf16"])
def test_few_row_matmuls(dtype):
    """``dense.few_row_matmuls`` (q, k and v in one GEMV launch): each output and every
    gradient as ``mixed_precision_matmul`` (XLA's GEMM) computes them one weight at a time."""
    from twell_jax.dense import few_row_matmuls, mixed_precision_matmul

    keys = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(keys[0], (1, 3, 40), jnp.float32).astype(dtype)
    ws = tuple((jax.random.normal(k, (40, n), jnp.float32) / 6).astype(dtype)
               for k, n in zip(keys[1:4], (48, 16, 16)))
    cts = [jax.random.normal(jax.random.fold_in(keys[4], i), (1, 3, w.shape[1]))
           for i, w in enumerate(ws)]
    together = lambda x, ws: few_row_matmuls(x, ws, dtype)
    apart = lambda x, ws: tuple(mixed_precision_matmul(x, w, dtype) for w in ws)
    assert str(jax.make_jaxpr(together)(x, ws)).count("name=twell_gemv") == 1
    loss = lambda f: (lambda x, ws: sum(jnp.sum(y.astype(jnp.float32) * c)
                                        for y, c in zip(f(x, ws), cts)))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for got, want in zip(together(x, ws), apart(x, ws)):
        assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
        assert rel_err(got, want) < tol
    got = jax.grad(loss(together), argnums=(0, 1))(x, ws)
    want = jax.grad(loss(apart), argnums=(0, 1))(x, ws)
    for g, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.dtype(dtype) and np.isfinite(np.asarray(g, np.float32)).all()
        assert rel_err(g, ref) < tol


@pytest.mark.slow
def test_decode_kernels_differentiable():
    """A training batch of fewer than 8 token rows with ``decode_kernels`` takes the GEMV
    kernel in the attention projections (interpret mode here); its loss and gradients are the
    plain XLA model's (the kernel's backward is XLA's)."""
    x = tokens((1, 7))  # 6 rows read by the model
    results = {}
    for flag in (False, True):
        model = model_lib.build("tiny", implementation="xla", dtype=jnp.float32,
                                decode_kernels=flag)
        (loss, _), grads = loss_and_grads(model, x, 0.0)
        results[flag] = (loss, nnx.state(grads, nnx.Param))
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(results[True][1]), jax.tree.leaves(results[False][1])):
        assert np.isfinite(np.asarray(got)).all()
        assert rel_err(got, want) < 1e-4


def test_loss_and_grads_finite():
    model = model_lib.build("tiny", implementation="reference", twell=ONE_BACKUP)
    (loss, m), grads = loss_and_grads(model, tokens(), 0.01)
    assert np.isfinite(loss) and np.isfinite(m["ce"]) and np.isfinite(m["l1"])
    np.testing.assert_allclose(loss, m["ce"] + 0.01 * m["l1"], rtol=1e-6)
    np.testing.assert_allclose(m["l1"], np.mean(m["l1_layer"]), rtol=1e-6)
    # A fresh model's logits are about unit variance: cross-entropy near log(V) + 1/2 = 6.0.
    assert 4.5 < float(m["ce"]) < 7.5
    for name in ("nnz_mean", "nnz_p99", "nnz_max", "heavy_rows", "l1_layer"):
        assert m[name].shape == (TINY.n_layers,), name
    assert np.all(m["nnz_max"] >= m["nnz_p99"]) and np.all(m["nnz_max"] >= m["nnz_mean"])
    leaves = jax.tree.leaves(nnx.state(grads))
    assert leaves and all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    assert any(np.any(np.asarray(g) != 0) for g in leaves)


def test_l1_gradient_reaches_gate():
    """The L1 term alone has a non-zero gradient on every layer's FFN weights."""
    model = model_lib.build("tiny", implementation="reference", twell=ONE_BACKUP)
    x = tokens()
    g1 = nnx.state(loss_and_grads(model, x, 1.0)[1])
    g0 = nnx.state(loss_and_grads(model, x, 0.0)[1])
    for i in range(TINY.n_layers):
        diff = g1["blocks"][i]["ffn"]["w_gate"][...] - g0["blocks"][i]["ffn"]["w_gate"][...]
        assert float(jnp.abs(diff).max()) > 0, i


def test_layer_stats_in_layer_order():
    """Stats come back in layer order also past 10 layers (sorted paths: 0, 1, ..., 10)."""
    cfg = dataclasses.replace(TINY, n_layers=11)
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
    dead = 10
    w = model.blocks[dead].ffn.w_gate
    w[...] = jnp.zeros_like(w[...])
    _, m = nnx.jit(model_lib.loss_fn)(model, tokens((1, 9)), 0.0)
    nnz = np.asarray(m["nnz_mean"])
    assert nnz[dead] == 0 and np.all(np.delete(nnz, dead) > 0), nnz


def test_unit_activity():
    model = model_lib.build("tiny", implementation="xla")
    w = model.blocks[0].ffn.w_gate
    w[...] = w[...].at[:10].set(0.0)  # these units' gates ([F, D] rows) are 0: never active
    act = nnx.jit(model_lib.unit_activity)(model, tokens((2, 16)))
    assert act.shape == (TINY.n_layers, TINY.d_ff) and act.dtype == jnp.bool_
    assert not np.any(act[0, :10])
    assert np.mean(act[:, 10:]) > 0.9  # 32 tokens at ~50% density: almost every unit fires
    # One token: the active units are exactly the ones its FFN counted.
    one = tokens((1, 1), seed=5)
    act1 = nnx.jit(model_lib.unit_activity)(model, one)
    _, m = nnx.jit(model_lib.loss_fn)(model, jnp.concatenate([one, one], axis=1), 0.0)
    np.testing.assert_array_equal(np.asarray(act1).sum(-1), np.asarray(m["nnz_max"]))


# ------------------------------------------------------------------------------------------
# Remat and training.


@pytest.mark.slow
def test_remat_same_loss_and_grads():
    """float32, so that the comparison is tight: in bf16 XLA fuses the recomputed block
    differently and single gradient entries differ by bf16 roundings. The plain model is the
    one of test_implementations_agree_f32_grads (its compiled step is reused)."""
    x = tokens(seed=1)
    kw = dict(implementation="reference", twell=ALL_SPARSE, seed=3, dtype=jnp.float32)
    plain = model_lib.build("tiny", **kw)
    remat = model_lib.build("tiny", remat=True, **kw)
    (l0, m0), g0 = loss_and_grads(plain, x, 0.01)
    (l1, m1), g1 = loss_and_grads(remat, x, 0.01)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(m1["nnz_mean"], m0["nnz_mean"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g0))):
        assert rel_err(a, b) < 1e-5


def test_remat_saves_only_ffn_outputs():
    """Under remat the backward pass recomputes the attention: the jaxpr holds a remat."""
    remat = model_lib.build("tiny", remat=True, implementation="xla")
    graphdef, state = nnx.split(remat)
    x = tokens((1, 9))

    def f(state):
        return model_lib.loss_fn(nnx.merge(graphdef, state), x, 0.01)[0]

    text = str(jax.make_jaxpr(jax.grad(f))(state))
    assert "remat" in text or "checkpoint" in text


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_remat_keeps_the_sparse_lists_not_the_dense_ffn(implementation, capsys):
    """The sparse FFN's packed lists cross the remat boundary (named ``RESIDUALS_NAME``), so
    its forward is not recomputed; nothing of size [tokens, F] is saved. The dense FFN saves
    no lists (it is recomputed, as before)."""
    import re

    from jax.ad_checkpoint import print_saved_residuals

    from twell_jax.ffn import RESIDUALS_NAME

    # d_ff 384: no other [tokens, d_ff] tensor (the tiny vocabulary is 256 wide).
    remat = model_lib.build("tiny", remat=True, implementation=implementation, d_ff=384)
    cfg = remat.cfg
    graphdef, state = nnx.split(remat)
    x = tokens((2, 9))

    def f(state):
        return model_lib.loss_fn(nnx.merge(graphdef, state), x, 0.01)[0]

    capsys.readouterr()
    print_saved_residuals(f, state)  # one line per residual: "f32[16,4] named '...' from ..."
    lines = capsys.readouterr().out.splitlines()
    shapes = [tuple(int(n) for n in re.match(r"\w+\[([\d,]*)\]", line).group(1).split(",") if n)
              for line in lines]
    lists = [shape for shape, line in zip(shapes, lines) if RESIDUALS_NAME in line]
    n_tokens = x.shape[0] * (x.shape[1] - 1)
    if implementation == "xla":
        assert not lists
        return
    assert len(lists) == 7 * cfg.n_layers, lines  # values, u, columns, counts, heavy, 2 flags
    assert (n_tokens, (cfg.twell or TwELLConfig()).max_row_nnz(cfg.d_ff)) in lists
    dense = [line for shape, line in zip(shapes, lines)
             if shape in ((n_tokens, cfg.d_ff), (x.shape[0], x.shape[1] - 1, cfg.d_ff))]
    assert not dense, dense


def test_train_steps_decrease_loss():
    """AdamW steps on one batch with the TwELL reference FFN. The loss and gradients are the
    jitted ones of the tests above (compiled once); the optimizer update is jitted too (run
    eagerly, its many small ops cost seconds a step)."""
    model = model_lib.build("tiny", implementation="reference", seed=4,
                            twell=ONE_BACKUP)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    update = nnx.jit(lambda optimizer, model, grads: optimizer.update(model, grads))
    x = tokens(seed=4)
    losses = []
    for _ in range(15):
        (loss, _), grads = loss_and_grads(model, x, 0.01)
        update(optimizer, model, grads)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses
