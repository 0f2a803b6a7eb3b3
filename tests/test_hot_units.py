"""Hot units: a batch's busiest units on a dense GEMM, the rest on the lists; exact either way."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from pallas_kernels.add_product import (AddProductConfig, add_product, add_product_reference,
                                        fits)
from twell_jax import hot_units, inputs
from twell_jax.format import sampled_active
from tests.utils import (assert_close, dense_ffn_f32, ffn_float64, nested_eqns,
                         one_backup_size, seed_of, slow)

M, D, F = 96, 72, 200
NUM_HOT = 12
# hot_min_rows low enough for a CPU-sized batch; no density switch and no row cap, so the
# lists run on every pattern (heavy rows still come from tiles over S). One backup size
# (tests/utils.py: one_backup_size).
CONFIG = one_backup_size(tj.TwELLConfig(tile_width=32, slots_per_tile=4,
                                        dense_fallback_density=1.0, max_row_density=1.0,
                                        decode_rows=0, hot_min_rows=64, hot_units=16,
                                        hot_unit_rate=0.25), M)
NO_HOT = dataclasses.replace(CONFIG, hot_units=0)


def hot_inputs(seed: int, dtype, *, gated=True, dense_rows=(), bias=False):
    """x [M, D] and weights whose gate fires ``NUM_HOT`` units on ~80% of the tokens and the
    others on ~3%; the ``dense_rows`` have every unit active (heavy: the dense backup's).
    With ``bias`` the threshold is a separate bias [F] and x's last feature is random (but on
    the dense rows)."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    x = inputs.gaussian_rows(key, M, D)
    w_gate = jnp.asarray(rng.standard_normal((D, F)) / np.sqrt(D - 1), jnp.float32)
    rates = np.full(F, 0.03)
    hot = rng.choice(F, NUM_HOT, replace=False)
    rates[hot] = 0.8
    w_gate = inputs.with_threshold_row(w_gate, rates)
    for row in dense_rows:
        x = x.at[row, -1].set(-20.0)  # flips every threshold: all units active
    b = None
    if bias:
        b = w_gate[-1]
        w_gate = w_gate.at[-1].set(jnp.asarray(rng.standard_normal(F) / np.sqrt(D), jnp.float32))
        keep = np.ones(M, bool)
        keep[list(dense_rows)] = False  # the dense rows keep their -20: still dense
        x = x.at[:, -1].set(jnp.where(keep, jnp.asarray(rng.standard_normal(M), jnp.float32),
                                      x[:, -1]))
    w_up = jnp.asarray(rng.standard_normal((D, F)) / np.sqrt(D), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((F, D)) / np.sqrt(F * 0.1), jnp.float32)
    weights = (w_gate, w_up, w_down) if gated else (w_gate, w_down)
    cast = lambda a: None if a is None else a.astype(dtype)
    return cast(x), tuple(cast(w) for w in weights), cast(b), np.sort(hot)


def _call(x, weights, bias=None, *, implementation, config):
    fn = tj.gated_mlp if len(weights) == 3 else tj.mlp
    name = "b_gate" if len(weights) == 3 else "b_up"
    return fn(x, *weights, implementation=implementation, config=config, return_stats=True,
              **{name: bias})


def test_select_finds_the_hot_units_and_leaves_a_uniform_batch_alone():
    x, (w_gate, *_), _, hot = hot_inputs(seed_of("select"), jnp.float32)
    pre = x @ w_gate
    got = hot_units.select(sampled_active(pre), M, D, F, 4, CONFIG, cost_decides=False)
    assert bool(got.used)
    on = np.sort(np.asarray(got.index)[np.asarray(got.on)])
    assert set(hot) <= set(on.tolist())  # every hot unit; a few busy cold ones may join
    assert len(on) < NUM_HOT + 4
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(got.mask)), on)
    # 1% everywhere: nothing reaches the rate, so the batch takes no hot unit.
    uniform = inputs.with_threshold_row(w_gate, np.full(F, 0.01))
    got = hot_units.select(sampled_active(x @ uniform), M, D, F, 4, CONFIG, cost_decides=False)
    assert not bool(got.used) and not np.asarray(got.mask).any()
    # Too few rows: no slots at all.
    assert hot_units.slots(CONFIG.hot_min_rows - 1, F, CONFIG) == 0
    assert hot_units.select(sampled_active(pre[:32]), 32, D, F, 4, CONFIG, False) is None


def test_cost_model_takes_hot_units_only_when_they_pay():
    cost = tj.TwELLConfig().cost_model
    m, d, k = 16384, 2048, 64
    for differentiated in (True, False):
        assert bool(cost.hot_units_pay(m, d, k, m * 48.0, 2, differentiated))  # 48 a token
        assert not bool(cost.hot_units_pay(m, d, k, m * 1.0, 2, differentiated))  # one
    # ~9 a token (the Zipf-like case's busiest units): worth it for training, not inference.
    assert bool(cost.hot_units_pay(m, d, k, m * 9.0, 2, True))
    assert not bool(cost.hot_units_pay(m, d, k, m * 9.0, 2, False))


@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "plain"])
# The fast tier keeps the backup beside the hot units; light rows alone are in the slow tier.
@pytest.mark.parametrize("dense_rows", [slow(()), (3, 50)], ids=["light", "with_backup"])
# With a bias and 2M >= D, "pallas" widens x by the bias's column, and the hot GEMM reads
# that wider array (zero weight columns past D).
@pytest.mark.parametrize("bias", [False, True], ids=["threshold_row", "bias"])
@pytest.mark.parametrize("implementation, dtype", [
    ("reference", jnp.float32), ("pallas", jnp.bfloat16),
    slow("pallas", jnp.float32), slow("reference", jnp.bfloat16)])
def test_forward_and_stats_match_float64(implementation, dtype, bias, dense_rows, gated):
    x, weights, b, _ = hot_inputs(seed_of("fwd", dense_rows, gated, bias), dtype, gated=gated,
                                  dense_rows=dense_rows, bias=bias)
    run = jax.jit(functools.partial(_call, implementation=implementation, config=CONFIG))
    y, stats = run(x, weights, b)
    _, stats_without = jax.jit(functools.partial(_call, implementation=implementation,
                                                 config=NO_HOT))(x, weights, b)
    expected, l1 = ffn_float64(x, *weights, bias=b)
    assert_close(y, expected, dtype, what=f"{implementation} y")
    assert_close(stats.l1, l1, dtype, what=f"{implementation} l1")
    assert NUM_HOT <= int(stats.hot_units) < NUM_HOT + 4  # the hot GEMMs really ran
    assert int(stats_without.hot_units) == 0
    # The counts include the hot units, as without them.
    for name in ("nnz_mean", "nnz_p99", "nnz_max"):
        assert float(getattr(stats, name)) == float(getattr(stats_without, name)), name
    if dense_rows:
        assert int(stats.heavy_rows) >= len(dense_rows)  # the backup ran beside them


@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "plain"])
@pytest.mark.parametrize("bias", [slow(False), True], ids=["threshold_row", "bias"])
@pytest.mark.parametrize("implementation, dtype", [
    ("pallas", jnp.float32), slow("reference", jnp.float32), slow("pallas", jnp.bfloat16)])
def test_gradients_match_dense_vjp(implementation, dtype, bias, gated):
    """All gradients, the L1 term and a bias included, with heavy rows in the backup beside
    the hot units, against jax.vjp of the dense function."""
    x, weights, b, _ = hot_inputs(seed_of("grad", bias, gated), dtype, gated=gated,
                                  dense_rows=(7,), bias=bias)
    dy = jnp.asarray(np.random.default_rng(5).standard_normal((M, D)), dtype)
    l1_coeff = 0.05

    def loss(x, weights, b):
        y, stats = _call(x, weights, b, implementation=implementation, config=CONFIG)
        total = jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + l1_coeff * stats.l1
        return total, stats

    argnums = (0, 1, 2) if bias else (0, 1)
    grads, stats = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(x, weights, b)
    assert int(stats.hot_units) >= NUM_HOT
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)

    def dense(x, weights, b):
        return dense_ffn_f32(x, *weights, bias=b)

    _, vjp = jax.vjp(dense, f32(x), tuple(map(f32, weights)), f32(b))
    expected = vjp((f32(dy), jnp.float32(l1_coeff)))[:len(argnums)]
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected)):
        assert got.dtype == dtype
        assert_close(got, want, dtype, kind="grad", what=f"{implementation}")


def test_nan_in_a_hot_unit_propagates():
    x, weights, _, hot = hot_inputs(seed_of("nan"), jnp.float32)
    x = x.at[4, 0].set(jnp.nan)
    y, stats = jax.jit(functools.partial(_call, implementation="pallas", config=CONFIG))(
        x, weights)
    assert int(stats.hot_units) > 0
    assert np.isnan(np.asarray(y[4])).any()
    assert np.isfinite(np.asarray(jnp.delete(y, 4, axis=0))).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_add_product_kernel_adds_or_leaves_y(dtype):
    rng = np.random.default_rng(seed_of("add_product", str(dtype)))
    m, d, k = 64, 256, 32
    y, h, w = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((m, d), (m, k), (k, d)))
    config = AddProductConfig(block_m=32, block_d=128)
    assert fits(m, d, k, config) and not fits(m, 100, k, config) and not fits(m, d, 24, config)
    assert fits(m, 48, k, config)  # a block of 16 columns
    for run in (True, False):
        got = jax.jit(lambda y, h, w, r: add_product(y, h, w, r, config=config))(
            y, h, w, jnp.asarray(run))
        want = add_product_reference(y, h, w, jnp.asarray(run))
        if run:
            expected = (np.asarray(y, np.float64) + np.asarray(h.astype(jnp.float32), np.float64)
                        @ np.asarray(w.astype(jnp.float32), np.float64))
            assert_close(got, expected, dtype, what="add_product")
            assert_close(want, expected, dtype, what="add_product_reference")
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(y))
            np.testing.assert_array_equal(np.asarray(want), np.asarray(y))


@pytest.mark.slow  # ~30 s in interpret mode; the kernel itself has a fast test above
def test_pallas_adds_in_place_where_the_blocks_fit():
    """D = 128 and M = 128: the pallas backend adds the hot units' output and input gradient
    on the add_product kernel (not XLA's product), forward and backward exact."""
    m, d, f = 128, 128, 256
    key = jax.random.PRNGKey(seed_of("fits"))
    x = inputs.gaussian_rows(key, m, d)
    rates = np.full(f, 0.02)
    rates[:16] = 0.8
    w_gate = inputs.with_threshold_row(jax.random.normal(jax.random.PRNGKey(1), (d, f)) / d**0.5,
                                       rates)
    w_up, w_down = (jax.random.normal(jax.random.PRNGKey(i), s) / 8 for i, s in
                    ((2, (d, f)), (3, (f, d))))
    weights = (w_gate, w_up, w_down)
    config = dataclasses.replace(CONFIG, hot_units=16)
    call = functools.partial(_call, implementation="pallas", config=config)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(call(x, w)[0])))(x, weights))
    assert jaxpr.count("twell_add_product") == 2  # forward and backward
    y, stats = jax.jit(call)(x, weights)
    assert int(stats.hot_units) >= 16
    assert_close(y, ffn_float64(x, *weights)[0], jnp.float32, what="y")
    dy = jax.random.normal(jax.random.PRNGKey(4), (m, d))
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(call(x, w)[0] * dy), argnums=(0, 1)))(
        x, weights)
    _, vjp = jax.vjp(lambda x, w: dense_ffn_f32(x, *w)[0], x, weights)
    for got, want in zip(jax.tree_util.tree_leaves(grads),
                         jax.tree_util.tree_leaves(vjp(dy))):
        assert_close(got, want, jnp.float32, kind="grad", what="grad")


@pytest.mark.slow  # ~35 s: a tiny model's loss and gradients, twice
@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_model_reports_hot_units_and_keeps_its_gradients(implementation):
    """The tiny model at init (about half its units active on every token; no row heavy): with
    hot units on, its layers move units, say so in the loss metrics, and the loss and
    gradients stay those of the model without them."""
    from flax import nnx
    from twell_jax import model as model_lib

    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 256)  # 128 rows a layer
    base = tj.TwELLConfig(tile_width=16, slots_per_tile=16, max_row_density=1.0,
                          dense_fallback_density=1.0, hot_min_rows=64, hot_unit_rate=0.25)
    results = {}
    for k in (16, 0):
        model = model_lib.build("tiny", implementation=implementation, seed=1,
                                dtype=jnp.float32,  # compared in float32: bf16 rounds apart
                                twell=dataclasses.replace(base, hot_units=k))
        (loss, metrics), grads = nnx.jit(nnx.value_and_grad(model_lib.loss_fn, has_aux=True))(
            model, tokens, 0.01)
        results[k] = loss, metrics, jax.tree.leaves(nnx.state(grads, nnx.Param))
    (loss_on, metrics_on, grads_on), (loss_off, metrics_off, grads_off) = results[16], results[0]
    assert (np.asarray(metrics_on["hot_units"]) > 0).all()
    assert not np.asarray(metrics_off["hot_units"]).any()
    np.testing.assert_allclose(float(loss_on), float(loss_off), rtol=1e-5)
    for got, want in zip(grads_on, grads_off):
        assert_close(got, np.asarray(want, np.float64), jnp.float32, kind="grad",
                     what="model grad", zero_reference_ok=True)


def test_inference_hot_gemm_reads_the_widened_input():
    """With a gate bias folded into the gate GEMM, "pallas" inference reads x widened by the
    bias's column (the array a model's norm writes in one pass); the hot units' GEMM reads
    that array too, with zero weight columns past D, so x itself is not needed beside it."""
    x, weights, b, _ = hot_inputs(seed_of("widened"), jnp.bfloat16, bias=True)
    jaxpr = jax.make_jaxpr(functools.partial(_call, implementation="pallas", config=CONFIG))(
        x, weights, b).jaxpr
    k = hot_units.slots(M, F, CONFIG)
    dots = [tuple(tuple(v.aval.shape) for v in eqn.invars) for eqn in nested_eqns(jaxpr)
            if eqn.primitive.name == "dot_general"]
    hot_gemms = [(lhs, rhs) for lhs, rhs in dots if rhs[0] == 2 * k]
    assert hot_gemms, "no hot GEMM traced"
    assert all(lhs[0] == M and lhs[1] > D and rhs[1] == lhs[1] for lhs, rhs in hot_gemms), \
        hot_gemms
