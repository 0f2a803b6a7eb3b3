"""gated_mlp / mlp: every implementation against float64, gradients against jax.vjp of dense."""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from pallas_kernels.common import finish_partial_sums
from pallas_kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from twell_jax import backends, ffn
from twell_jax.format import mask_lists
from tests.utils import (PATTERNS, assert_close, dense_ffn_f32, ffn_float64,
                         make_ffn_inputs, one_backup_size, seed_of, slow, slow_unless)

SPARSE_IMPLS = ("reference", "pallas")
DTYPES = (jnp.float32, jnp.bfloat16)
# An awkward shape: nothing divides a tile or a block.
M, D, F = 42, 72, 200
# No density switch and no row cap: the sparse kernels must run on every pattern, however dense
# (heavy rows still come from tiles over S).
# decode_rows=0: these M-row calls take the list path (packing, backup) even when not
# differentiated; the list-free decode path has its own tests (DECODE).
# One backup size (tests/utils.py: one_backup_size); the ladder of sizes has its own tests
# (backup_rows=None below).
CONFIG = one_backup_size(tj.TwELLConfig(tile_width=32, slots_per_tile=4,
                                        dense_fallback_density=1.0, max_row_density=1.0,
                                        decode_rows=0), M)
DECODE = dataclasses.replace(CONFIG, decode_rows=M)
# The fast tier keeps one pattern (and mostly the gated form) of each parametrization below; the
# others are marked slow (tests/utils.py: slow_unless).
HEAVY_ONLY = slow_unless(["heavy_tailed"], PATTERNS)
GATED_ONLY = [True, slow(False)]
# Where a kernel path repeats what a cheaper case of the same test already shows, the fast
# tier keeps one implementation or dtype (each kernel's numerics have their own kernel tests).
REFERENCE_ONLY = slow_unless(["reference"], SPARSE_IMPLS)
PALLAS_ONLY = slow_unless(["pallas"], SPARSE_IMPLS)
F32_ONLY = slow_unless([jnp.float32], DTYPES)


def _call(gated, x, weights, **kwargs):
    fn = tj.gated_mlp if gated else tj.mlp
    return fn(x, *weights, **kwargs)


def _impl_dtype(implementation, dtype, fast):
    case = (implementation, dtype)
    ident = f"{implementation}-{jnp.dtype(dtype).name}"
    return pytest.param(*case, id=ident) if fast else slow(*case, id=ident)


# Fast tier: each implementation in one dtype (the kernels' own tests cover both dtypes).
@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
@pytest.mark.parametrize("pattern", HEAVY_ONLY)
@pytest.mark.parametrize("implementation, dtype", [
    _impl_dtype(implementation, dtype, fast=(implementation, dtype) in (
        ("reference", jnp.float32), ("pallas", jnp.bfloat16), ("xla", jnp.float32)))
    for implementation in SPARSE_IMPLS + ("xla",) for dtype in DTYPES])
def test_forward_matches_float64(implementation, dtype, pattern, gated):
    x, *weights = make_ffn_inputs(seed_of(pattern, gated), M, D, F, pattern, dtype,
                                  gated=gated)
    run = jax.jit(functools.partial(_call, gated, implementation=implementation, config=CONFIG,
                                    return_stats=True))
    y, stats = run(x, weights)
    expected, l1 = ffn_float64(x, *weights)
    assert y.dtype == dtype and y.shape == (M, D)
    assert_close(y, expected, dtype, what=f"{implementation} y")
    assert_close(stats.l1, l1, dtype, what=f"{implementation} l1")
    if pattern in ("heavy_tailed", "dense_rows"):
        assert int(stats.heavy_rows) > 0  # the backup really ran
    if pattern == "uniform":
        assert 0 < float(stats.nnz_mean) < 0.2 * F


@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
@pytest.mark.parametrize("pattern", slow_unless(["uniform"], PATTERNS))
@pytest.mark.parametrize("dtype", [jnp.float32, slow(jnp.bfloat16)],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", [slow("reference"), "pallas"])
def test_decode_path_matches_float64_and_the_list_path(implementation, dtype, pattern, gated):
    """At most ``decode_rows`` rows, not differentiated: the list-free decode path. Same result
    (to float64) and the same statistics as the list path, heavy and dense rows included."""
    x, *weights = make_ffn_inputs(seed_of("decode", pattern, gated), M, D, F, pattern, dtype,
                                  gated=gated)
    run = lambda config: jax.jit(functools.partial(
        _call, gated, implementation=implementation, config=config, return_stats=True))(
            x, weights)
    y, stats = run(DECODE)
    y_lists, stats_lists = run(CONFIG)
    expected, l1 = ffn_float64(x, *weights)
    assert y.dtype == dtype and y.shape == (M, D)
    assert_close(y, expected, dtype, what=f"{implementation} decode y")
    assert_close(stats.l1, l1, dtype, what=f"{implementation} decode l1")
    for name in ("nnz_mean", "nnz_p99", "nnz_max", "heavy_rows"):
        assert float(getattr(stats, name)) == float(getattr(stats_lists, name)), name
    assert not bool(stats.backup_overflow) and not bool(stats.dense_fallback)
    assert_close(y, y_lists.astype(jnp.float32), dtype, what="decode vs lists")


@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
@pytest.mark.parametrize("pattern", HEAVY_ONLY)
@pytest.mark.parametrize("dtype", [slow(jnp.float32), jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
def test_decode_path_runs_the_gate_on_gemv(dtype, pattern, gated):
    """Up to ``gemv.MAX_ROWS`` rows the "pallas" decode path computes the gate product on the
    GEMV kernel: a few rows against float64 and the list path (the pattern's busiest rows,
    its heavy or dense ones, its first row, zero or dense in those patterns, and its last);
    the whole M-row call runs the kernel too."""
    x, *weights = make_ffn_inputs(seed_of("decode_few", pattern, gated), M, D, F, pattern, dtype,
                                  gated=gated)
    gate = np.asarray(x, np.float64) @ np.asarray(weights[0], np.float64)
    busiest = np.argsort(-(gate > 0).sum(axis=1), kind="stable")[:3]
    rows = np.unique(np.concatenate([[0, M - 1], busiest]))
    assert len(rows) < M <= GEMV_MAX_ROWS
    call = lambda config: functools.partial(_call, gated, implementation="pallas",
                                            config=config, return_stats=True)
    assert "twell_gemv" in str(jax.make_jaxpr(lambda x: call(DECODE)(x, weights))(x))
    x = x[rows]
    assert "twell_gemv" in str(jax.make_jaxpr(lambda x: call(DECODE)(x, weights))(x))
    y, stats = jax.jit(call(DECODE))(x, weights)
    _, stats_lists = jax.jit(call(CONFIG))(x, weights)
    expected, l1 = ffn_float64(x, *weights)
    assert_close(y, expected, dtype, what="few-row decode y")
    assert_close(stats.l1, l1, dtype, what="few-row decode l1")
    for name in ("nnz_mean", "nnz_p99", "nnz_max", "heavy_rows"):
        assert float(getattr(stats, name)) == float(getattr(stats_lists, name)), name
    if pattern in ("heavy_tailed", "dense_rows"):
        assert int(stats.heavy_rows) > 0  # heavy rows among them


@pytest.mark.slow
def test_decode_path_runs_the_decode_kernel_only_when_not_differentiated():
    """Traced jaxprs: the primal call holds ``twell_scan_up_down`` and no packing kernel; the
    gradient holds the list kernels (the sparse backward needs the lists) and no scan."""
    x, *weights = make_ffn_inputs(3, M, D, F, "uniform", jnp.float32)
    primal = lambda x: tj.gated_mlp(x, *weights, implementation="pallas", config=DECODE)
    grad = jax.grad(lambda x: jnp.sum(primal(x)))
    primal_text, grad_text = str(jax.make_jaxpr(primal)(x)), str(jax.make_jaxpr(grad)(x))
    assert "twell_scan_up_down" in primal_text and "twell_row_pack" not in primal_text
    assert "twell_row_pack" in grad_text and "twell_scan_up_down" not in grad_text
    ref_grad = jax.grad(lambda x: jnp.sum(dense_ffn_f32(x, *weights)[0]))(x)
    assert_close(grad(x), ref_grad, jnp.float32, what="grad through the decode-sized call")


@pytest.mark.slow
@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
def test_partial_sums_on_the_decode_path_only(gated):
    """``partial_sums=True``: the "pallas" decode path returns its float32 partial sums, which
    finished in order are the plain call's y bit for bit (same statistics); every other call
    (the reference decode path, the dense implementation, the list path) returns y as usual;
    differentiating such a call raises."""
    # F = 600: three slices of 256 columns (F = 200 would be one).
    x, *weights = make_ffn_inputs(seed_of("partial_sums", gated), 5, D, 600, "heavy_tailed",
                                  jnp.bfloat16, gated=gated)
    run = lambda impl, config, **kw: _call(gated, x, weights, implementation=impl,
                                           config=config, return_stats=True, **kw)
    y, stats = run("pallas", DECODE)
    parts, parts_stats = run("pallas", DECODE, partial_sums=True)
    assert isinstance(parts, ffn.PartialSums)
    assert parts.sums.dtype == jnp.float32 and parts.sums.ndim == 3
    assert parts.sums.shape == (3, 5, D)
    np.testing.assert_array_equal(np.asarray(finish_partial_sums(parts.sums, None, x.dtype)),
                                  np.asarray(y))
    for a, b in zip(stats, parts_stats):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for impl, config in (("reference", DECODE), ("xla", DECODE), ("pallas", CONFIG)):
        want, _ = run(impl, config)
        got, _ = run(impl, config, partial_sums=True)
        assert not isinstance(got, ffn.PartialSums), impl
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=impl)
    loss = lambda x: jnp.sum(_call(gated, x, weights, implementation="pallas", config=DECODE,
                                   partial_sums=True).sums)
    with pytest.raises(ValueError, match="cannot be differentiated"):
        jax.grad(loss)(x)


@pytest.mark.parametrize("implementation", REFERENCE_ONLY)
def test_three_d_input_and_stats(implementation):
    x, *weights = make_ffn_inputs(7, 2 * 21, D, F, "heavy_tailed", jnp.float32)
    x3 = x.reshape(2, 21, D)
    y, stats = tj.gated_mlp(x3, *weights, implementation=implementation, config=CONFIG,
                            return_stats=True)
    assert y.shape == (2, 21, D)
    expected, _ = ffn_float64(x, *weights)
    assert_close(y.reshape(-1, D), expected, jnp.float32)
    gate = np.asarray(x, np.float64) @ np.asarray(weights[0], np.float64) > 0
    assert int(stats.nnz_max) == gate.sum(1).max()
    rank = int(np.ceil(0.99 * M)) - 1  # nearest rank
    assert int(stats.nnz_p99) == np.sort(gate.sum(1))[rank]
    np.testing.assert_allclose(float(stats.nnz_mean), gate.sum(1).mean(), rtol=1e-6)
    tiles = np.pad(gate, ((0, 0), (0, 224 - F))).reshape(M, 7, 32).sum(-1)
    assert int(stats.heavy_rows) == int((tiles > 4).any(1).sum())


@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
@pytest.mark.parametrize("pattern", [slow("uniform"), "heavy_tailed", slow("dense_rows")])
@pytest.mark.parametrize("dtype", F32_ONLY, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", PALLAS_ONLY)
def test_gradients_match_dense_vjp(implementation, dtype, pattern, gated):
    """All gradients, with the L1 term, against jax.vjp of the dense function."""
    x, *weights = make_ffn_inputs(seed_of(3, pattern), M, D, F, pattern, dtype, gated=gated)
    rng = np.random.default_rng(11)
    dy = jnp.asarray(rng.standard_normal((M, D)), dtype)
    l1_coeff = 0.05

    def loss(x, weights):
        y, stats = _call(gated, x, weights, implementation=implementation, config=CONFIG,
                         return_stats=True)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + l1_coeff * stats.l1

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, tuple(weights))
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    _, vjp = jax.vjp(lambda x, w: dense_ffn_f32(x, *w), f32(x), tuple(map(f32, weights)))
    expected = vjp((f32(dy), jnp.float32(l1_coeff)))
    names = ["dx"] + [f"d{n}" for n in (["w_gate", "w_up", "w_down"] if gated else ["w_up", "w_down"])]
    for name, got, want in zip(names, jax.tree_util.tree_leaves(grads),
                               jax.tree_util.tree_leaves(expected)):
        assert got.dtype == dtype
        assert_close(got, want, dtype, kind="grad", what=f"{implementation} {name}")


@pytest.mark.parametrize("route", [slow("lists"), "lists_and_backup", slow("dense")])
@pytest.mark.parametrize("implementation", REFERENCE_ONLY + ["xla"])
def test_float32_master_weights_with_bfloat16_activations(implementation, route):
    """Float32 weights, bf16 x (a model's master weights): the op computes with the weights
    rounded to bf16 and returns float32 weight gradients. The sparse op returns its kernels'
    float32 dW without rounding them to bf16 first (no round trip through x.dtype)."""
    pattern = {"lists": "uniform", "lists_and_backup": "heavy_tailed", "dense": "uniform"}[route]
    x, *weights = make_ffn_inputs(seed_of(31, pattern), M, D, F, pattern, jnp.float32)
    x = x.astype(jnp.bfloat16)
    config = {"lists": dataclasses.replace(CONFIG, slots_per_tile=16),  # no row heavy
              "lists_and_backup": dataclasses.replace(CONFIG, backup_rows=M),
              "dense": dataclasses.replace(CONFIG, dense_fallback_density=0.0)}[route]
    dy = jnp.asarray(np.random.default_rng(6).standard_normal((M, D)), jnp.bfloat16)
    f32 = lambda a: jnp.asarray(a, jnp.float32)

    def loss(x, weights):
        y, stats = tj.gated_mlp(x, *weights, implementation=implementation, config=config,
                                return_stats=True)
        return jnp.sum(f32(y) * f32(dy)) + 0.05 * stats.l1, stats

    (_, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        x, tuple(weights))
    if implementation == "pallas":
        assert bool(stats.dense_fallback) == (route == "dense")
    if route != "dense":
        assert (int(stats.heavy_rows) > 0) == (route == "lists_and_backup")
    rounded = tuple(f32(w.astype(jnp.bfloat16)) for w in weights)  # what the op computes with
    _, vjp = jax.vjp(lambda x, w: dense_ffn_f32(x, *w), f32(x), rounded)
    expected = vjp((f32(dy), jnp.float32(0.05)))
    dx, d_weights = grads
    assert dx.dtype == jnp.bfloat16
    assert_close(dx, expected[0], jnp.bfloat16, kind="grad", what=f"{implementation} dx")
    for name, got, want in zip(("dw_gate", "dw_up", "dw_down"), d_weights, expected[1]):
        assert got.dtype == jnp.float32
        assert_close(got, want, jnp.bfloat16, kind="grad", what=f"{implementation} {name}")
        if implementation != "xla" and route == "lists":
            # Not rounded to bf16 on the way: most entries are not bf16 numbers.
            got = np.asarray(got)
            nonzero = got != 0
            as_bf16 = np.asarray(f32(jnp.asarray(got).astype(jnp.bfloat16)))
            assert np.mean(got[nonzero] != as_bf16[nonzero]) > 0.5, name


@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
@pytest.mark.parametrize("pattern", [slow("uniform"), "heavy_tailed", slow("zero_rows")])
@pytest.mark.parametrize("dtype", F32_ONLY, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", REFERENCE_ONLY + ["xla"])
def test_gate_bias_forward_and_gradients(implementation, dtype, pattern, gated):
    """The threshold moved from a constant input feature into the bias: y, L1 and every
    gradient (the bias's included) against jax.vjp of the dense function with the bias."""
    x, *weights = make_ffn_inputs(seed_of(21, pattern), M, D, F, pattern, dtype, gated=gated)
    bias = weights[0][-1]  # the threshold row (x's last feature is 1 in these patterns)
    x = x[:, :-1]
    weights = tuple(w[:-1] for w in weights[:-1]) + (weights[-1][:, :-1],)
    dy = jnp.asarray(np.random.default_rng(5).standard_normal((M, D - 1)), dtype)
    l1_coeff = 0.05
    bias_arg = {"b_gate" if gated else "b_up": bias}

    def loss(x, weights, bias):
        y, stats = _call(gated, x, weights, implementation=implementation, config=CONFIG,
                         return_stats=True, **{k: bias for k in bias_arg})
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + l1_coeff * stats.l1, y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, weights, bias)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    (want_y, _), vjp = jax.vjp(lambda x, w, b: dense_ffn_f32(x, *w, bias=b), f32(x),
                               tuple(map(f32, weights)), f32(bias))
    assert_close(y, want_y, dtype, what=f"{implementation} y")
    expected = vjp((f32(dy), jnp.float32(l1_coeff)))
    for i, (got, want) in enumerate(zip(jax.tree_util.tree_leaves(grads),
                                        jax.tree_util.tree_leaves(expected))):
        assert got.dtype == dtype
        assert_close(got, want, dtype, kind="grad", what=f"{implementation} grad {i}")


def test_bad_bias_raises():
    x, w_gate, w_up, w_down = make_ffn_inputs(0, 8, D, F, "uniform", jnp.float32)
    with pytest.raises(ValueError, match=r"b_gate has shape \(199,\), expected \(200,\)"):
        tj.gated_mlp(x, w_gate, w_up, w_down, b_gate=jnp.zeros(F - 1))
    with pytest.raises(TypeError, match="b_up must be a floating-point array"):
        tj.mlp(x, w_up, w_down, b_up=jnp.zeros(F, jnp.int32))


@pytest.mark.parametrize("implementation", REFERENCE_ONLY)
def test_backup_capacity_boundary_stays_exact(implementation):
    x, *weights = make_ffn_inputs(5, M, D, F, "dense_rows", jnp.float32)
    expected, _ = ffn_float64(x, *weights)
    _, stats = tj.gated_mlp(x, *weights, implementation="reference", config=CONFIG,
                            return_stats=True)
    heavy = int(stats.heavy_rows)
    assert heavy > 1
    for capacity, overflow in [(heavy, False), (heavy - 1, True), (0, True)]:
        config = dataclasses.replace(CONFIG, backup_rows=capacity)
        y, stats = tj.gated_mlp(x, *weights, implementation=implementation, config=config,
                                return_stats=True)
        assert bool(stats.backup_overflow) == overflow
        assert bool(stats.dense_fallback) == overflow
        assert_close(y, expected, jnp.float32, what=f"capacity {capacity}")


def test_backup_fills_its_room_with_the_densest_light_rows():
    """The backup computes its whole size: the heavy rows, then the light rows with the most
    units (all rows at or above a count, so ties never split), never a row without units."""
    heavy = jnp.asarray([1, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    row_nnz = jnp.asarray([50, 3, 9, 40, 9, 0, 7, 1, 0], jnp.int32)
    sizes = (2, 4, 6, 9)
    want = {0: [0, 3], 1: [0, 3], 2: [0, 2, 3, 4], 3: [0, 1, 2, 3, 4, 6],
            4: [0, 1, 2, 3, 4, 6, 7], 5: [0, 3]}  # 0: lists alone, 5: dense (heavy only)
    for route, rows in want.items():
        got = ffn._backup_rows(heavy, row_nnz, jnp.int32(route), sizes, 12)
        assert np.nonzero(np.asarray(got))[0].tolist() == rows, route
    # Random batches against the rule written out in numpy (light rows hold <= max_light).
    rng = np.random.default_rng(5)
    max_light, sizes = 12, (8, 16, 32)
    for trial in range(40):
        heavy_np = rng.random(40) < rng.uniform(0.0, 0.5)
        nnz_np = np.where(heavy_np, rng.integers(13, 90, 40), rng.integers(0, 13, 40))
        route = int(rng.integers(0, len(sizes) + 2))
        size = ((0,) + sizes + (0,))[route]
        room = size - heavy_np.sum()
        want_rows = heavy_np.copy()
        if room > 0:
            t = next(t for t in range(1, max_light + 2)
                     if np.sum(~heavy_np & (nnz_np >= t)) <= room)
            want_rows |= ~heavy_np & (nnz_np >= t)
        got = ffn._backup_rows(jnp.asarray(heavy_np), jnp.asarray(nnz_np, jnp.int32),
                               jnp.int32(route), sizes, max_light)
        assert np.array_equal(np.asarray(got), want_rows), trial
    # In a call: the filled rows leave the lists (row_nnz 0) and the result stays exact.
    x, *weights = make_ffn_inputs(3, M, D, F, "heavy_tailed", jnp.float32)
    config = dataclasses.replace(CONFIG, backup_rows=None)
    (y, stats), residuals = ffn._twell_forward(x, tuple(tj.prepare_weights(*weights)), None, True,
                                                    "pallas", config)
    heavy = int(stats.heavy_rows)
    size = min(s for s in ffn._backup_sizes(M, config) if s >= heavy)
    backup = np.asarray(residuals.backup)
    assert heavy < backup.sum() <= size
    assert np.all(np.asarray(residuals.row_nnz)[backup] == 0)
    assert_close(y, ffn_float64(x, *weights)[0], jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", REFERENCE_ONLY)
def test_more_than_half_the_rows_heavy_goes_dense(implementation):
    """Without a fixed capacity the backup holds up to M/2 rows; past that the whole batch
    takes the dense path (reusing the gate GEMM), reported as a dense fallback, not an
    overflow, and exact either way."""
    x, *weights = make_ffn_inputs(4, M, D, F, "uniform", jnp.float32, density=0.1)
    config = dataclasses.replace(CONFIG, backup_rows=None)
    sizes = ffn._backup_sizes(M, config)
    assert sizes[-1] == M // 2 and len(sizes) == len(set(sizes))
    for rows, dense in [(M, True), (M // 2, False)]:
        xs = x.at[rows:].set(0.0)  # zero rows: light
        y, stats = tj.gated_mlp(xs, *weights, implementation=implementation, config=config,
                                return_stats=True)
        heavy = int(stats.heavy_rows)
        assert (heavy > M // 2) == dense and heavy > 0
        assert bool(stats.dense_fallback) == dense and not bool(stats.backup_overflow)
        assert_close(y, ffn_float64(xs, *weights)[0], jnp.float32, what=f"{rows} rows")


@pytest.mark.parametrize("route", ["lists_and_backup", slow("overflow_dense"),
                                   slow("density_dense")])
@pytest.mark.parametrize("implementation", PALLAS_ONLY)
def test_gradients_on_every_route(implementation, route):
    """The backward takes the forward's branch (one ``lax.switch`` each way): the backup at
    exactly its capacity, the whole batch dense on overflow, and dense past the density
    threshold ("pallas" only: the reference does not route by cost) all give the dense
    function's gradients."""
    if route == "density_dense" and implementation != "pallas":
        pytest.skip("only the pallas backend routes by density")
    x, *weights = make_ffn_inputs(5, M, D, F, "dense_rows", jnp.float32)
    _, stats = tj.gated_mlp(x, *weights, implementation="reference", config=CONFIG,
                            return_stats=True)
    heavy = int(stats.heavy_rows)
    assert heavy > 1
    config = {"lists_and_backup": dataclasses.replace(CONFIG, backup_rows=heavy),
              "overflow_dense": dataclasses.replace(CONFIG, backup_rows=heavy - 1),
              "density_dense": dataclasses.replace(CONFIG, dense_fallback_density=0.0)}[route]
    dy = jnp.asarray(np.random.default_rng(12).standard_normal((M, D)), jnp.float32)

    def loss(x, weights):
        y, stats = tj.gated_mlp(x, *weights, implementation=implementation, config=config,
                                return_stats=True)
        return jnp.sum(y * dy) + 0.05 * stats.l1, stats

    (_, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        x, tuple(weights))
    assert bool(stats.dense_fallback) == (route != "lists_and_backup")
    _, vjp = jax.vjp(lambda x, w: dense_ffn_f32(x, *w), x, tuple(weights))
    expected = vjp((dy, jnp.float32(0.05)))
    for i, (got, want) in enumerate(zip(jax.tree_util.tree_leaves(grads),
                                        jax.tree_util.tree_leaves(expected))):
        assert_close(got, want, jnp.float32, kind="grad", what=f"{route} grad {i}")


@pytest.mark.parametrize("implementation", REFERENCE_ONLY)
def test_deterministic(implementation):
    x, *weights = make_ffn_inputs(9, M, D, F, "heavy_tailed", jnp.bfloat16)
    run = jax.jit(lambda x, *w: tj.gated_mlp(x, *w, implementation=implementation, config=CONFIG))
    first = np.asarray(run(x, *weights).astype(jnp.float32))
    second = np.asarray(run(x, *weights).astype(jnp.float32))
    np.testing.assert_array_equal(first, second)


def test_pallas_switches_to_dense_past_the_density_threshold():
    x, *weights = make_ffn_inputs(4, M, D, F, "uniform", jnp.float32, density=0.1)
    expected, _ = ffn_float64(x, *weights)
    for threshold, dense in [(0.02, True), (0.5, False)]:
        # A backup of M rows: the density threshold alone decides (most rows are heavy here).
        config = dataclasses.replace(CONFIG, dense_fallback_density=threshold, backup_rows=M)
        y, stats = tj.gated_mlp(x, *weights, implementation="pallas", config=config,
                                return_stats=True)
        assert bool(stats.dense_fallback) == dense and not bool(stats.backup_overflow)
        assert_close(y, expected, jnp.float32, what=f"threshold {threshold}")


@pytest.mark.parametrize("implementation", REFERENCE_ONLY)
def test_rows_over_the_row_cap_take_the_backup(implementation):
    x, *weights = make_ffn_inputs(8, M, D, F, "heavy_tailed", jnp.float32)
    gate = np.asarray(x, np.float64) @ np.asarray(weights[0], np.float64) > 0
    config = dataclasses.replace(CONFIG, max_row_density=0.05)  # cap: 10 of 200 units
    tiles = np.pad(gate, ((0, 0), (0, 224 - F))).reshape(M, 7, 32).sum(-1)
    heavy = (tiles > 4).any(1) | (gate.sum(1) > 10)
    assert heavy.sum() > (tiles > 4).any(1).sum()  # the cap adds heavy rows
    y, stats = tj.gated_mlp(x, *weights, implementation=implementation, config=config,
                            return_stats=True)
    assert int(stats.heavy_rows) == heavy.sum()
    assert_close(y, ffn_float64(x, *weights)[0], jnp.float32)


@pytest.mark.slow
def test_pallas_threshold_row_or_bias_compute_the_same_function():
    x, *weights = make_ffn_inputs(12, M, D, F, "heavy_tailed", jnp.bfloat16)
    # The same function with the threshold as a gate bias instead of w_gate's last row (x's
    # last feature is 1).
    w_gate, w_up, w_down = weights
    weights_nb, bias = (w_gate.at[-1].set(0), w_up, w_down), w_gate[-1]
    run = jax.jit(lambda x, w, b: tj.gated_mlp(x, *w, b_gate=b, implementation="pallas",
                                               config=CONFIG, return_stats=True))
    y, stats = run(x, weights, None)
    y_bias, _ = run(x, weights_nb, bias)
    assert int(stats.heavy_rows) > 0
    expected = ffn_float64(x, *weights)[0]
    assert_close(y, expected, jnp.bfloat16)
    assert_close(y_bias, expected, jnp.bfloat16, what="with b_gate")


@pytest.mark.parametrize("route", ["backup", slow("dense")])
def test_pallas_hands_x_with_the_bias_column_to_pack_and_up_down(monkeypatch, route):
    """With a gate bias the pallas backend gives its pack and its up/down one array, x with the
    folded bias's column (``Backend.widen_input``), so x's producer writes it once. Output and
    statistics equal those of x handed over as it is, bit for bit: on heavy-tailed rows (the
    backup takes its rows from the wide array) and on a batch sent dense (which reads x's
    columns back). A differentiated call keeps x as it is (its backward saves x anyway)."""
    from twell_jax.backends import pallas as pallas_backend

    x, *weights = make_ffn_inputs(13, M, D, F, "heavy_tailed", jnp.bfloat16)
    w_gate, w_up, w_down = weights
    weights, bias = (w_gate.at[-1].set(0), w_up, w_down), w_gate[-1].astype(jnp.float32)
    config = CONFIG if route == "backup" else dataclasses.replace(
        CONFIG, dense_fallback_density=0.0)
    dy = jnp.asarray(np.random.default_rng(2).standard_normal((M, D)), jnp.bfloat16)

    def forward(x, w, b):
        return tj.gated_mlp(x, *w, b_gate=b, implementation="pallas", config=config,
                            return_stats=True)

    def loss(x, w, b):
        y, stats = forward(x, w, b)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + 0.05 * stats.l1

    def run(backend):
        jax.clear_caches()  # inner jitted functions keep traces made under another backend
        monkeypatch.setattr(pallas_backend, "BACKEND", backend)
        grad = jax.grad(loss, argnums=(0, 1, 2))
        jaxprs = [str(jax.make_jaxpr(fn)(x, weights, bias)) for fn in (forward, grad)]
        assert "twell_row_pack" in jaxprs[0] and "twell_row_up_down" in jaxprs[0]
        barriers = [text.count("optimization_barrier") for text in jaxprs]
        return (barriers, jax.jit(forward)(x, weights, bias), jax.jit(grad)(x, weights, bias))

    widened = run(pallas_backend.BACKEND)
    as_is = run(dataclasses.replace(pallas_backend.BACKEND, widen_input=None))
    assert (widened[0], as_is[0]) == ([1, 0], [0, 0])
    y, stats = widened[1]
    assert bool(stats.dense_fallback) == (route == "dense")
    assert int(stats.heavy_rows) > 0
    assert_close(y, ffn_float64(x, w_gate, w_up, w_down)[0], jnp.bfloat16)  # x[:, -1] = 1
    for got, want in zip(jax.tree.leaves(widened[1:]), jax.tree.leaves(as_is[1:])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("implementation", ["pallas", slow("reference")])
def test_inference_never_reads_list_entries_past_a_rows_count(monkeypatch, implementation):
    """A call that is not differentiated hands the packed lists to the up/down unmasked (the
    mask is one [M, K] pass a call): whatever lies past a row's count (NaN values, columns
    out of range) leaves its output unchanged. A differentiated call still masks them: its
    gradients stay equal too."""
    backend = backends.get(implementation)
    x, *weights = make_ffn_inputs(17, M, D, F, "heavy_tailed", jnp.bfloat16)

    def poisoned_pack(*args, **kwargs):
        lists, *rest = backend.pack(*args, **kwargs)
        k = lists.values.shape[1]
        past = jnp.arange(k)[None, :] >= lists.row_nnz[:, None]
        values = jnp.where(past, jnp.nan, lists.values)
        columns = jnp.where(past, F + 1000, lists.columns)
        return (tj.backends.RowLists(values, columns, lists.row_nnz), *rest)

    def forward(x, w):
        return tj.gated_mlp(x, *w, implementation=implementation, config=CONFIG,
                            return_stats=True)

    def grad(x, w):
        return jax.grad(lambda x, w: jnp.sum(forward(x, w)[0].astype(jnp.float32)),
                        argnums=(0, 1))(x, w)

    def run():
        jax.clear_caches()  # inner jitted functions keep traces made under another backend
        return jax.jit(forward)(x, weights), jax.jit(grad)(x, weights)

    masks = []
    monkeypatch.setattr(ffn, "mask_lists", lambda *a: masks.append(1) or mask_lists(*a))
    clean = run()
    assert len(masks) == 1  # the differentiated call's forward only
    monkeypatch.setattr(importlib.import_module(f"twell_jax.backends.{implementation}"),
                        "BACKEND", dataclasses.replace(backend, pack=poisoned_pack))
    poisoned = run()
    jax.clear_caches()
    assert int(clean[0][1].heavy_rows) > 0 and not bool(clean[0][1].dense_fallback)
    assert np.isfinite(np.asarray(poisoned[0][0], np.float32)).all()
    for got, want in zip(jax.tree.leaves(poisoned), jax.tree.leaves(clean)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("m,nnz,heavy_fraction,dense", [
    (16384, 28, 0.0, False), (16384, 60, 0.0, True),  # light rows: gathers against GEMMs
    (16384, 28, 0.2, False),  # a heavy tail in the backup: still sparse
    (16384, 114, 1.0, True),  # every row heavy (2% uniform): dense reuses the gate GEMM
    (8, 28, 0.0, False), (8, 600, 1.0, True)])  # decode sizes: weight reads dominate
def test_cost_model_chooses_dense_only_when_cheaper(monkeypatch, m, nnz, heavy_fraction, dense):
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)  # as on a GPU
    x = jax.ShapeDtypeStruct((m, 2048), jnp.bfloat16)
    heavy = jnp.arange(m) < int(heavy_fraction * m)
    row_nnz = jnp.full((m,), nnz, jnp.int32)
    assert bool(ffn._cheaper_dense(row_nnz, heavy, x, 5632, tj.TwELLConfig())) == dense


def test_small_batches_run_dense_on_gpu_but_sparse_in_interpret_mode(monkeypatch):
    """Without the decode path (decode_rows=0) a small call is dense on a GPU (the sparse path's
    fixed cost exceeds the dense FFN) and sparse in interpret mode; with it (the default) an
    undifferentiated small call takes the decode path, GPU or not."""
    config = tj.TwELLConfig(decode_rows=0)
    monkeypatch.setattr(ffn, "default_interpret", lambda: True)  # as without a GPU
    assert not ffn._sparse_never_pays(8, 2048, 5632, jnp.bfloat16, config)
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)
    assert ffn._sparse_never_pays(8, 2048, 5632, jnp.bfloat16, config)
    assert not ffn._sparse_never_pays(16384, 2048, 5632, jnp.bfloat16, config)
    fixed = dataclasses.replace(config, dense_fallback_density=1.0)
    assert not ffn._sparse_never_pays(8, 2048, 5632, jnp.bfloat16, fixed)
    x, *weights = make_ffn_inputs(6, 8, D, F, "uniform", jnp.float32)
    y, stats = tj.gated_mlp(x, *weights, implementation="pallas", config=config,
                            return_stats=True)
    assert bool(stats.dense_fallback)
    assert_close(y, ffn_float64(x, *weights)[0], jnp.float32)
    primal = lambda x: tj.gated_mlp(x, *weights, implementation="pallas")
    assert "twell_scan_up_down" in str(jax.make_jaxpr(primal)(x))
    y, stats = tj.gated_mlp(x, *weights, implementation="pallas", return_stats=True)
    assert not bool(stats.dense_fallback)
    assert_close(y, ffn_float64(x, *weights)[0], jnp.float32)


@pytest.mark.parametrize("gated", [True, False])
def test_differentiated_small_calls_run_dense_autodiff_on_gpu(monkeypatch, gated):
    """Under jax.grad a decode-sized call cannot take the list-free decode path; on a GPU its
    sparse path's fixed cost exceeds the dense FFN, so it runs the dense function with plain
    autodiff: gradients (the L1 statistic's included) equal "xla"'s bit for bit, no TwELL
    kernel in the backward, and the undifferentiated call still takes the decode path."""
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)  # as on a GPU
    x, *weights = make_ffn_inputs(11, 8, D, F, "heavy_tailed", jnp.float32)
    bias = -0.1 * jnp.ones((F,), jnp.float32)
    op, names = (tj.gated_mlp, "b_gate") if gated else (tj.mlp, "b_up")
    weights = weights if gated else weights[1:]

    def loss(implementation):
        def fn(x, weights, bias):
            y, stats = op(x, *weights, **{names: bias}, implementation=implementation,
                          return_stats=True)
            return jnp.sum(y * jnp.cos(y)) + 0.1 * stats.l1, stats
        return jax.grad(fn, argnums=(0, 1, 2), has_aux=True)

    grads, stats = loss("pallas")(x, weights, bias)
    expected, _ = loss("xla")(x, weights, bias)
    assert bool(stats.dense_fallback)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        assert bool(jnp.all(jnp.isfinite(got))) and float(jnp.max(jnp.abs(want))) > 0
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "twell_" not in str(jax.make_jaxpr(loss("pallas"))(x, weights, bias))
    primal = lambda x: op(x, *weights, implementation="pallas")
    assert "twell_scan_up_down" in str(jax.make_jaxpr(primal)(x))


@pytest.mark.parametrize("differentiated", [False, True])
@pytest.mark.parametrize("return_stats", [False, True])
def test_calls_routed_dense_lower_to_the_dense_program(compiled_kernels, differentiated,
                                                       return_stats):
    """Where the shapes alone route "pallas" dense on a GPU (too few rows for the sparse
    path's fixed cost), it steps aside at no cost: the lowered program is "xla"'s, statement
    for statement, the statistics and gradients included (only ``stats.dense_fallback``
    differs, a constant that says which path ran).

    A differentiated decode-sized call is not compared: it runs the dense function inside the
    sparse op's custom_vjp, which gets the L1 statistic's zero cotangent as an array, so its
    lowered program holds a few elementwise ops more; XLA's simplifier folds them away (the
    compiled programs have the same operations)."""
    m, d, f = 1024, 2048, 5632
    assert ffn.path_for("pallas", m, d, f, jnp.bfloat16, differentiated=differentiated) == "dense"

    def program(implementation: str) -> str:
        def call(x, w):
            out = tj.feed_forward(x, tj.FFNWeights(*w), implementation=implementation,
                                  return_stats=return_stats)
            if not return_stats:
                return out
            y, stats = out
            return y, stats._replace(dense_fallback=jnp.asarray(False))

        def loss(x, w):
            out = call(x, w)
            y = out[0] if return_stats else out
            return jnp.sum(y.astype(jnp.float32)) + (out[1].l1 if return_stats else 0.0)

        fn = jax.grad(loss, argnums=(0, 1)) if differentiated else call
        weights = tuple(jax.ShapeDtypeStruct((f, d), jnp.bfloat16) for _ in range(3))
        x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
        return jax.jit(fn).lower(x, weights).as_text(debug_info=False)

    assert program("pallas") == program("xla")


def test_path_for_names_the_path_a_call_takes(monkeypatch):
    monkeypatch.setattr(ffn, "default_interpret", lambda: True)  # as without a GPU
    bf16 = jnp.bfloat16
    assert ffn.path_for("xla", 8, 2048, 5632, bf16) == "dense"
    assert ffn.path_for("pallas", 8, 2048, 5632, bf16) == "decode"
    assert ffn.path_for("reference", 64, 2048, 5632, bf16) == "decode"
    assert ffn.path_for("pallas", 65, 2048, 5632, bf16) == "lists"  # interpret mode
    assert ffn.path_for("pallas", 8, 2048, 5632, bf16, differentiated=True) == "lists"
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)  # as on a GPU
    assert ffn.path_for("pallas", 8, 2048, 5632, bf16) == "decode"
    assert ffn.path_for("pallas", 1024, 2048, 5632, bf16) == "dense"
    assert ffn.path_for("pallas", 16384, 2048, 5632, bf16) == "lists"
    assert ffn.path_for("pallas", 8, 2048, 5632, bf16, differentiated=True) == "dense"
    assert ffn.path_for("pallas", 16384, 2048, 5632, bf16, differentiated=True) == "lists"
    no_decode = tj.TwELLConfig(decode_rows=0)
    assert ffn.path_for("pallas", 8, 2048, 5632, bf16, no_decode) == "dense"
    with pytest.raises(ValueError, match="implementation must be one of"):
        ffn.path_for("cuda", 8, 2048, 5632, bf16)


def test_nan_propagates_like_dense():
    x, *weights = make_ffn_inputs(1, M, D, F, "uniform", jnp.float32)
    x = x.at[3, 5].set(jnp.nan)
    for implementation in SPARSE_IMPLS + ("xla",):
        y = tj.gated_mlp(x, *weights, implementation=implementation, config=CONFIG)
        assert np.isnan(np.asarray(y[3])).any(), implementation
        assert np.isfinite(np.asarray(y[4])).all(), implementation


def test_residuals_hold_no_dense_hidden():
    """The backward keeps packed activations only: no saved array has F columns."""
    x, *weights = make_ffn_inputs(2, M, D, F, "heavy_tailed", jnp.float32)
    _, residuals = ffn._twell_forward(x, tuple(tj.prepare_weights(*weights)), None, True,
                                           "reference", CONFIG)
    for name, value in residuals._asdict().items():
        if name in ("x", "params", "weights", "bias"):  # the inputs (weights: cast)
            continue
        assert F not in np.shape(value), f"{name} has shape {np.shape(value)}"
    assert residuals.gate_values.shape == (M, CONFIG.row_slots(F))
    # With a row cap, the lists keep only the slots a light row can fill.
    capped = dataclasses.replace(CONFIG, max_row_density=0.05)
    _, residuals = ffn._twell_forward(x, tuple(tj.prepare_weights(*weights)), None, True,
                                           "reference", capped)
    assert residuals.gate_values.shape == residuals.columns.shape == (M, capped.max_row_nnz(F))
    assert residuals.up_values.shape == (M, capped.max_row_nnz(F))


def test_empty_batch():
    _, *weights = make_ffn_inputs(0, 4, D, F, "uniform", jnp.float32)
    y = tj.gated_mlp(jnp.zeros((0, D)), *weights, implementation="reference", config=CONFIG)
    assert y.shape == (0, D)


def test_bad_inputs_raise_with_names_and_values():
    x, w_gate, w_up, w_down = make_ffn_inputs(0, 8, D, F, "uniform", jnp.float32)
    with pytest.raises(ValueError, match=r"w_down has shape \(72, 200\)"):
        tj.gated_mlp(x, w_gate, w_up, w_down.T)
    with pytest.raises(ValueError, match=r"w_up has shape \(72, 100\)"):
        tj.gated_mlp(x, w_gate, w_up[:, :100], w_down)
    with pytest.raises(ValueError, match=r"w_gate has shape \(71, 200\)"):
        tj.gated_mlp(x, w_gate[:-1], w_up, w_down)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        tj.gated_mlp(x.astype(jnp.int32), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="implementation must be one of"):
        tj.gated_mlp(x, w_gate, w_up, w_down, implementation="cuda")
    with pytest.raises(TypeError, match="config must be a TwELLConfig"):
        tj.mlp(x, w_up, w_down, config={"tile_width": 32})


def test_backward_switch_does_not_copy_dx():
    """dx is made in each branch of the backward's route switch (the backup branches write
    their rows into it in place): no branch copies it. Passed through the switch, dx was
    copied in every branch with the dense branch first, and on the GPU in models of identical
    layers whatever the order (the CPU compiler does not reproduce that one)."""
    x, *weights = make_ffn_inputs(9, M, D, F, "heavy_tailed", jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(tj.gated_mlp(
        x, *w, implementation="reference", config=CONFIG).astype(jnp.float32)),
        argnums=(0, 1)))
    hlo = grad.lower(x, tuple(weights)).compile().as_text()
    copies = [line for line in hlo.splitlines() if f"bf16[{M},{D}]" in line and " copy(" in line]
    assert not copies, copies


# A row cap (the default max_row_density): rows of ~20 active units of 200 are heavy.
CAPPED = tj.TwELLConfig(tile_width=32, slots_per_tile=4, dense_fallback_density=1.0,
                        decode_rows=0)


@pytest.mark.parametrize("gated", GATED_ONLY, ids=["gated", "plain"])
@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, slow(3)], ids=["buckets", "fixed_capacity"])
def test_mostly_heavy_batch_skips_the_lists_and_stays_exact(gated, capacity):
    """A batch whose rows are mostly over the row cap goes dense without being listed
    ("pallas": ``row_pack`` returns at once); its output, gradients and statistics are those
    of the reference backend, which lists it and then goes dense."""
    x, *weights = make_ffn_inputs(6, M, D, F, "uniform", jnp.float32, gated=gated,
                                  density=0.1)
    config = dataclasses.replace(CAPPED, backup_rows=capacity)
    pre = x @ weights[0]
    assert bool(tj.format.mostly_heavy(pre, config, F))  # the skip really happens
    dy = jnp.asarray(np.random.default_rng(13).standard_normal((M, D)), jnp.float32)

    def loss(x, weights, implementation):
        y, stats = _call(gated, x, weights, implementation=implementation, config=config,
                         return_stats=True)
        return jnp.sum(y * dy) + 0.05 * stats.l1, (y, stats)

    results = {}
    for implementation in SPARSE_IMPLS:
        grad = jax.jit(jax.value_and_grad(functools.partial(loss, implementation=implementation),
                                          argnums=(0, 1), has_aux=True))
        (_, (y, stats)), grads = grad(x, tuple(weights))
        results[implementation] = y, stats, grads
    y, stats, grads = results["pallas"]
    _, want_stats, _ = results["reference"]
    assert bool(stats.dense_fallback) and bool(want_stats.dense_fallback)
    assert bool(stats.backup_overflow) == (capacity is not None) == bool(
        want_stats.backup_overflow)
    assert int(stats.heavy_rows) == int(want_stats.heavy_rows) > M // 2
    for name in ("nnz_mean", "nnz_p99", "nnz_max"):
        np.testing.assert_array_equal(np.asarray(getattr(stats, name)),
                                      np.asarray(getattr(want_stats, name)), err_msg=name)
    assert_close(stats.l1, want_stats.l1, jnp.float32, what="l1")
    assert_close(y, ffn_float64(x, *weights)[0], jnp.float32)
    _, vjp = jax.vjp(lambda x, w: dense_ffn_f32(x, *w), x, tuple(weights))
    expected = vjp((dy, jnp.float32(0.05)))
    for i, (got, want) in enumerate(zip(jax.tree_util.tree_leaves(grads),
                                        jax.tree_util.tree_leaves(expected))):
        assert_close(got, want, jnp.float32, kind="grad", what=f"grad {i}")


@pytest.mark.parametrize("f", [384, 300], ids=["whole_tiles", "cut_tile"])
def test_active_counts_match_a_per_row_count(f):
    """``_active_counts`` (the statistics of a batch counted without lists): row totals and
    heavy rows as counted row by row in numpy, with a last tile cut short, a row over a tile's
    slots and a row over the row cap."""
    config = tj.TwELLConfig(tile_width=128, slots_per_tile=8, max_row_density=1 / 16)
    rng = np.random.default_rng(5)
    active = rng.random((40, f)) < 0.03
    active[3, 130:140] = True  # 10 in one tile: over its 8 slots
    active[7] = False
    active[7, ::12] = True  # spread out: over the row cap only
    active[9] = False  # no active unit
    totals, heavy = ffn._active_counts(jnp.asarray(active), config)
    tiles = [active[:, t:t + 128].sum(axis=1) for t in range(0, f, 128)]
    want_heavy = (np.max(tiles, axis=0) > 8) | (active.sum(axis=1) > config.max_row_nnz(f))
    assert want_heavy[3] and want_heavy[7] and not want_heavy[9]
    np.testing.assert_array_equal(np.asarray(totals), active.sum(axis=1))
    assert int(heavy) == int(want_heavy.sum())
