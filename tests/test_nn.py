"""Tests of the Flax NNX layers in ``twell_jax.nn``, run for each implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import twell_jax
from twell_jax import nn
from twell_jax.inputs import with_threshold_row
from tests.utils import TOLERANCES, assert_close, one_backup_size, slow_unless


SPARSE_IMPLEMENTATIONS = ["reference", "pallas"]
ALL_IMPLEMENTATIONS = SPARSE_IMPLEMENTATIONS + ["xla"]
LAYERS = {"gated": nn.SparseGatedMLP, "plain": nn.SparseMLP}
# Every weight is stored [F, D], one row per unit; name -> (shape, fan_in).
PARAM_SHAPES = {
    "gated": lambda d, f: {"w_gate": ((f, d), d), "w_up": ((f, d), d), "w_down": ((f, d), f)},
    "plain": lambda d, f: {"w_up": ((f, d), d), "w_down": ((f, d), f)},
}

def make_layer(kind: str, d_model: int, d_ff: int, implementation: str, seed: int = 0,
               density: float | None = 0.05, **kwargs):
    """A layer whose gate (first weight) is about ``density`` active on ``make_x`` rows
    (x's last feature is 1; the last row of the gate weight is minus a per-unit threshold).
    ``density=None`` keeps the plain init (about half the units active)."""
    layer = LAYERS[kind](d_model, d_ff, implementation=implementation, rngs=nnx.Rngs(seed),
                         **kwargs)
    if density is not None:
        gate = layer.w_gate if kind == "gated" else layer.w_up
        gate[...] = with_threshold_row(gate[...].T, density).T  # [F, D]: the last column
    return layer


def make_x(shape, dtype, seed: int = 1):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return x.at[..., -1].set(1.0).astype(dtype)


# Jitted calls: eager dispatch of the sparse paths costs seconds per call on a CPU.
@nnx.jit
def captured(layer, x):
    """(y, [FFNStats, ...]) of one call under ``nnx.capture``."""
    y, intermediates = nnx.capture(layer, nnx.Intermediate)(x)
    return y, nn.sown_stats(intermediates)


@nnx.jit
def call(layer, x):
    """A plain call, outside ``nnx.capture``."""
    return layer(x)


@jax.jit(static_argnames=("implementation",))
def functional_ffn(x, gate, up, down, implementation):
    """The functional op on a gated layer's weights ([F, D] each)."""
    return twell_jax.feed_forward(x, twell_jax.FFNWeights(gate, up, down),
                                  implementation=implementation, return_stats=True)


# ------------------------------------------------------------------------------------------
# Construction.


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_params_layout_and_dtypes(kind, param_dtype):
    layer = LAYERS[kind](12, 42, implementation="reference", rngs=nnx.Rngs(0),
                         param_dtype=param_dtype)
    params = nnx.state(layer, nnx.Param)
    expected = PARAM_SHAPES[kind](12, 42)
    assert set(params.keys()) == set(expected)
    for name, (shape, _) in expected.items():
        w = getattr(layer, name)
        assert isinstance(w, nnx.Param), name
        assert w[...].shape == shape, name
        assert w[...].dtype == jnp.dtype(param_dtype), name
    # lecun-normal init: standard deviation 1 / sqrt(fan_in), fan_in D for w_gate and w_up.
    big = LAYERS[kind](256, 512, implementation="reference", rngs=nnx.Rngs(0))
    for name, (_, fan_in) in PARAM_SHAPES[kind](256, 512).items():
        std = float(jnp.std(getattr(big, name)[...]))
        assert abs(std * np.sqrt(fan_in) - 1.0) < 0.05, (name, std)
    assert not nnx.state(layer, nnx.Intermediate)  # nothing but parameters


@pytest.mark.parametrize("kind", slow_unless(["plain"], LAYERS))
def test_gate_bias_is_a_param_that_thresholds_and_trains(kind):
    layer = LAYERS[kind](12, 40, implementation="reference", rngs=nnx.Rngs(0), gate_bias=True)
    bias = layer.b_gate if kind == "gated" else layer.b_up
    assert isinstance(bias, nnx.Param) and bias[...].shape == (40,)
    assert not np.any(np.asarray(bias[...]))  # zeros at init: the layer without a bias
    plain = LAYERS[kind](12, 40, implementation="reference", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (6, 12))
    run = nnx.jit(lambda m: m(x))  # (eagerly the reference op runs op by op: seconds)
    np.testing.assert_array_equal(np.asarray(run(layer)), np.asarray(run(plain)))
    bias[...] = jnp.full((40,), -1e4)  # every unit below threshold
    assert not np.any(np.asarray(run(layer)))
    bias[...] = jnp.full((40,), -0.3)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(layer)
    g = grads.b_gate if kind == "gated" else grads.b_up
    assert np.all(np.isfinite(np.asarray(g[...]))) and np.any(np.asarray(g[...]) != 0)
    with pytest.raises(TypeError, match="gate_bias must be a bool"):
        LAYERS[kind](12, 40, rngs=nnx.Rngs(0), gate_bias="yes")


def test_same_seed_same_params_any_implementation():
    a = nn.SparseGatedMLP(8, 16, implementation="xla", rngs=nnx.Rngs(3))
    b = nn.SparseGatedMLP(8, 16, implementation="reference", rngs=nnx.Rngs(3))
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(getattr(a, name)[...], getattr(b, name)[...])


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=0), "d_model must be a positive int, got 0"),
    (dict(d_model=-3), "d_model must be a positive int, got -3"),
    (dict(d_model=2.5), "d_model must be a positive int, got 2.5"),
    (dict(d_model=True), "d_model must be a positive int, got True"),
    (dict(d_ff=0), "d_ff must be a positive int, got 0"),
    (dict(d_ff="64"), "d_ff must be a positive int, got '64'"),
    (dict(implementation="cuda"), "implementation must be one of .*'cuda'"),
    (dict(dtype=jnp.int32), "dtype must be a floating-point dtype"),
    (dict(param_dtype=None), "param_dtype must be a floating-point dtype, got None"),
    (dict(param_dtype=jnp.int8), "param_dtype must be a floating-point dtype"),
])
def test_bad_constructor_args_raise(kind, kwargs, match):
    args = dict(d_model=8, d_ff=16, implementation="reference") | kwargs
    with pytest.raises(ValueError, match=match):
        LAYERS[kind](args.pop("d_model"), args.pop("d_ff"), rngs=nnx.Rngs(0), **args)


def test_bad_config_type_raises():
    with pytest.raises(TypeError, match="config must be a TwELLConfig or None, got dict"):
        nn.SparseGatedMLP(8, 16, config={"tile_width": 16}, rngs=nnx.Rngs(0))


def test_wrong_input_width_raises():
    layer = nn.SparseGatedMLP(8, 16, implementation="reference", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x has shape \(4, 9\).*d_model = 8"):
        layer(jnp.ones((4, 9)))


# ------------------------------------------------------------------------------------------
# Forward: shapes, dtypes, agreement between implementations.


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_output_shape_and_dtype(kind, implementation):
    layer = make_layer(kind, 16, 40, implementation)
    for shape, dtype in (((5, 16), jnp.float32), ((2, 3, 16), jnp.bfloat16)):
        y = call(layer, make_x(shape, dtype))
        assert y.shape == shape
        assert y.dtype == jnp.dtype(dtype)  # dtype=None: compute in x's dtype


def test_forced_compute_dtype():
    layer = make_layer("gated", 16, 40, "reference", dtype=jnp.bfloat16)
    x = make_x((6, 16), jnp.float32)
    y = call(layer, x)
    assert y.dtype == jnp.bfloat16
    # Same as the functional op on bf16-rounded inputs and weights: bit for bit on the CPU; on
    # a GPU, XLA fuses the two programs' bf16 roundings differently.
    expected, _ = functional_ffn(
        x.astype(jnp.bfloat16),
        *(w[...].astype(jnp.bfloat16) for w in (layer.w_gate, layer.w_up, layer.w_down)),
        implementation="reference")
    if jax.default_backend() == "gpu":
        assert_close(y, expected, jnp.bfloat16, kind="layer", what="layer vs functional op")
    else:
        np.testing.assert_array_equal(np.asarray(y, np.float32),
                                      np.asarray(expected, np.float32))


# (kind, dtype, M, D, F, gate density): awkward sizes (F not a multiple of the tile width) for
# every layer and dtype; the plain init (about half the units active, so every row is heavy and
# takes the dense backup) once per layer.
AGREEMENT_CASES = [
    pytest.param(kind, dtype, 42, 24, 431, 0.03, id=f"sparse-awkward-{kind}-{dtype_id}")
    for kind in LAYERS for dtype, dtype_id in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))
] + [
    pytest.param("gated", jnp.bfloat16, 64, 32, 256, None, id="dense-init-gated-bf16",
                 marks=pytest.mark.slow),
    pytest.param("plain", jnp.float32, 64, 32, 256, None, id="dense-init-plain-f32",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("implementation", SPARSE_IMPLEMENTATIONS)
@pytest.mark.parametrize("kind, dtype, m, d_model, d_ff, density", AGREEMENT_CASES)
def test_implementations_agree_with_xla(kind, dtype, m, d_model, d_ff, density, implementation):
    config = twell_jax.TwELLConfig(tile_width=64, slots_per_tile=4)
    sparse = make_layer(kind, d_model, d_ff, implementation, density=density, config=config)
    dense = make_layer(kind, d_model, d_ff, "xla", density=density, config=config)
    x = make_x((m, d_model), dtype)
    y_sparse, (s_sparse,) = captured(sparse, x)
    y_dense, (s_dense,) = captured(dense, x)
    assert_close(y_sparse, y_dense, dtype, kind="layer", what=f"{implementation} vs xla",
                 zero_reference_ok=True)
    # The gate is computed the same way on every path, so the counts agree exactly.
    assert int(s_sparse.nnz_max) == int(s_dense.nnz_max)
    assert float(s_sparse.nnz_mean) == pytest.approx(float(s_dense.nnz_mean))
    assert int(s_sparse.heavy_rows) == int(s_dense.heavy_rows)
    assert float(s_sparse.l1) == pytest.approx(float(s_dense.l1), rel=TOLERANCES["layer"][jnp.dtype(dtype)])
    if density is None:
        assert int(s_sparse.heavy_rows) == m  # the dense backup took every row
    else:
        assert 0 < float(s_sparse.nnz_mean) < 0.1 * d_ff


# ------------------------------------------------------------------------------------------
# Statistics.


@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_stats_are_sown_and_match_functional_op(implementation):
    layer = make_layer("gated", 16, 40, implementation)  # as in test_output_shape_and_dtype
    x = make_x((5, 16), jnp.float32)
    y, stats_list = captured(layer, x)
    (stats,) = stats_list
    assert isinstance(stats, twell_jax.FFNStats)
    y_fn, stats_fn = functional_ffn(
        x, layer.w_gate[...], layer.w_up[...], layer.w_down[...], implementation=implementation)
    np.testing.assert_array_equal(y, y_fn)
    for name, a, b in zip(twell_jax.FFNStats._fields, stats, stats_fn):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # Outside nnx.capture nothing is recorded and the layer holds no extra state.
    call(layer, x)
    assert not nnx.state(layer, nnx.Intermediate)


def test_stats_of_nested_layers_and_repeated_calls():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.ffn1 = make_layer("gated", 16, 32, "reference", seed=1)
            self.ffn2 = make_layer("plain", 16, 32, "reference", seed=2)

        def __call__(self, x):
            return self.ffn2(self.ffn1(x) + x) + self.ffn1(x)

    model = Model(nnx.Rngs(0))
    x = make_x((8, 16), jnp.float32)
    intermediates = nnx.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x)[1])(model, x)
    stats = nn.sown_stats(intermediates)
    assert len(stats) == 3  # ffn1 twice (one tuple), ffn2 once
    assert len(intermediates["ffn1"][nn.STATS_NAME].get_value()) == 2
    assert len(intermediates["ffn2"][nn.STATS_NAME].get_value()) == 1
    expected = sum(float(s.l1) for s in stats) / 3
    assert float(nn.l1_penalty(intermediates)) == pytest.approx(expected, rel=1e-6)


def test_l1_penalty_without_capture_raises():
    with pytest.raises(ValueError, match="no FFNStats in intermediates"):
        nn.l1_penalty(nnx.State({}))


def test_output_is_named_for_remat():
    layer = make_layer("gated", 8, 16, "xla")
    graphdef, state = nnx.split(layer)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, make_x((4, 8), jnp.float32))
    assert f"name={nn.CHECKPOINT_NAME}" in str(jaxpr)


# ------------------------------------------------------------------------------------------
# Training: a jitted nnx + optax step with the L1 penalty from the sown statistics.


@pytest.mark.parametrize("kind", slow_unless(["gated"], LAYERS))
def test_train_step_decreases_loss(kind):
    d_model, d_ff, m = 16, 64, 64
    model = make_layer(kind, d_model, d_ff, "reference", density=0.1,
                       config=one_backup_size(twell_jax.TwELLConfig(), m))
    teacher = make_layer(kind, d_model, d_ff, "xla", seed=7, density=0.1)
    x = make_x((m, d_model), jnp.float32, seed=5)
    target = teacher(x)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, target):
        def loss_fn(model):
            y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
            mse = jnp.mean((y - target) ** 2)
            return mse + 1e-3 * nn.l1_penalty(intermediates), mse

        (loss, mse), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(10):
        loss, grads = train_step(model, optimizer, x, target)
        losses.append(float(loss))
        for name, g in nnx.to_flat_state(grads):
            assert np.all(np.isfinite(np.asarray(g[...]))), name
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    assert not nnx.state(model, nnx.Intermediate)  # the jitted step leaves no sown state


def test_l1_gradient_matches_xla():
    """The L1 term's gradient through the sparse backward equals the dense one."""
    x = make_x((32, 16), jnp.float32)

    @nnx.jit
    @nnx.grad
    def l1_grad(layer):
        _, intermediates = nnx.capture(layer, nnx.Intermediate)(x)
        return nn.l1_penalty(intermediates)

    grads = {implementation: l1_grad(make_layer("gated", 16, 96, implementation, density=0.1))
             for implementation in ("reference", "xla")}
    for name in ("w_gate", "w_up", "w_down"):
        assert_close(grads["reference"][name][...], grads["xla"][name][...], tol=2e-5,
                     what=name, zero_reference_ok=True)
