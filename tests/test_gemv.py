"""``gemv`` (decode-sized products ``x @ w + bias``: the FFN gate, the attention projections)
against numpy float64 and its jnp reference, in interpret mode on the CPU (compiled on a GPU:
``tests/test_lowering.py`` checks the Triton lowering, ``tools/probe_gemv.py`` times
it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import (GemvConfig, default_gemv_config, finish_partial_sums, gemv,
                                 gemv_many, gemv_partial_sums, gemv_reference)
from twell_jax import dense
from tests.utils import assert_close, seed_of, slow

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
THRESHOLD = 1.645  # P(N(0, 1) > 1.645) = 5%: most pre-activations negative, as a gate's are


def make_inputs(m: int, d: int, f: int, dtype, bias: str, rng):
    """x [m, d], w [d, f] with x @ w ~ N(0, 1), and a bias [f] float32: None, "random"
    (N(0, 1)) or "threshold" (-THRESHOLD plus a little noise: ~5% of the outputs positive)."""
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), dtype)
    b = {"none": None,
         "random": rng.standard_normal(f),
         "threshold": -THRESHOLD + 0.1 * rng.standard_normal(f)}[bias]
    return x, w, None if b is None else jnp.asarray(b, jnp.float32)


def numpy_gate(x, w, b) -> np.ndarray:
    """float64 ``x @ w + b`` on the (already rounded) inputs."""
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    pre = as64(x) @ as64(w)
    return pre if b is None else pre + as64(b)


# D and F are never multiples of the blocks here: the last column block and D step are masked.
# Configs cover one and several D splits (an uneven split count too), 16-row steps, and the
# default.
# Fast tier: one row with D splits and 17 rows with one split; the others are marked slow.
CASES = [
    (1, 96, 200, GemvConfig(block_f=64, block_k=32, k_splits=2, num_warps=1)),
    slow(3, 320, 600, None),
    slow(8, 200, 300, GemvConfig(block_f=128, block_k=16, k_splits=5)),
    slow(8, 160, 250, GemvConfig(block_f=64, block_k=32, num_stages=1)),
    slow(9, 320, 600, None),  # the default for 8-15 rows: 64-column blocks, uneven D splits
    (17, 320, 600, GemvConfig(block_f=128, block_k=64, k_splits=1)),
    slow(64, 96, 200, GemvConfig(block_f=64, block_k=32, k_splits=2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", ["none", "threshold"])
@pytest.mark.parametrize("m,d,f,config", CASES)
def test_gemv_matches_numpy_and_reference(m, d, f, config, bias, dtype):
    rng = np.random.default_rng(seed_of("gemv", m, d, f, bias, str(dtype)))
    x, w, b = make_inputs(m, d, f, dtype, bias, rng)
    pre = gemv(x, w, b, config=config)
    assert pre.shape == (m, f) and pre.dtype == dtype
    want = numpy_gate(x, w, b)
    assert_close(pre, want, dtype, kind="ffn", what="gemv vs numpy float64")
    ref = gemv_reference(x, w, b)
    assert ref.dtype == dtype
    assert_close(pre, ref, dtype, kind="kernel", what="gemv vs reference")
    if dtype == jnp.bfloat16:  # both round one float32 sum (only the order differs) to bf16
        same = np.mean(np.asarray(pre, np.float32) == np.asarray(ref, np.float32))
        assert same >= 0.9, f"only {same:.1%} of the outputs equal the reference's"
    if bias == "threshold":  # the gate's decision: the same units active where it is clear
        clear = np.abs(want) > 0.05
        got = np.asarray(pre, np.float32)
        assert np.array_equal(got[clear] > 0, want[clear] > 0)
        assert 0.0 < np.mean(want > 0) < 0.2
    # The weight stored one row per unit ([F, D], the FFN's layout): the same sums, read
    # transposed.
    w_rows = jnp.asarray(w.T)
    pre_rows = gemv(x, w_rows, b, config=config, unit_rows=True)
    assert pre_rows.shape == (m, f) and pre_rows.dtype == dtype
    assert_close(pre_rows, want, dtype, kind="ffn", what="gemv on [F, D] vs numpy float64")
    assert_close(pre_rows, pre, dtype, kind="kernel", what="gemv on [F, D] vs on [D, F]")
    assert_close(gemv_reference(x, w_rows, b, unit_rows=True), want, dtype, kind="ffn",
                 what="reference on [F, D] vs numpy float64")


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_pre_activation_on_gemv(m, dtype):
    """``dense.gate_pre_activation``'s few-row biased product on ``gemv`` (its path on a GPU
    below 8 rows) against the float32 form it replaces and float64, forward and gradients."""
    # XLA's float32 products at full precision, as the kernel's (a GPU's default is TF32).
    with jax.default_matmul_precision("highest"):
        _check_gate_pre_activation_on_gemv(m, dtype)


def _check_gate_pre_activation_on_gemv(m, dtype):
    rng = np.random.default_rng(seed_of("gate_on_gemv", m, str(dtype)))
    x, w_flax, b = make_inputs(m, 200, 330, dtype, "threshold", rng)
    w = jnp.asarray(w_flax.T)  # the FFN's layout: [F, D]
    b = b.astype(dtype)
    on_gemv = dense.gate_pre_activation(x, w, b, kernel=True)
    plain = dense.gate_pre_activation(x, w, b, kernel=False)
    assert on_gemv.shape == (m, 330) and on_gemv.dtype == dtype
    assert_close(on_gemv, numpy_gate(x, w_flax, b), dtype, kind="ffn",
                 what="gemv gate vs float64")
    assert_close(on_gemv, plain, dtype, kind="kernel", what="gemv gate vs the float32 form")
    cotangent = jnp.asarray(rng.standard_normal((m, 330)), jnp.float32)

    def loss(kernel):
        return lambda *args: jnp.sum(
            dense.gate_pre_activation(*args, kernel=kernel).astype(jnp.float32) * cotangent)
    grads = jax.grad(loss(True), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(False), argnums=(0, 1, 2))(x, w, b)
    for name, g, ref in zip(("dx", "dw", "d_bias"), grads, want):
        assert g.dtype == ref.dtype
        assert_close(g, np.asarray(ref, np.float64), dtype, kind="kernel", what=name)
    # Compiled for a GPU only: on the CPU (interpret mode) and at 8 rows XLA's product runs.
    assert not dense._few_rows_on_gemv(1) or jax.default_backend() == "gpu"
    assert not dense._few_rows_on_gemv(8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_random_bias_jitted(dtype):
    m, d, f = 5, 130, 260
    rng = np.random.default_rng(seed_of("gate_gemv_random_bias", str(dtype)))
    x, w, b = make_inputs(m, d, f, dtype, "random", rng)
    config = GemvConfig(block_f=64, block_k=32, k_splits=3)
    pre = jax.jit(lambda *a: gemv(*a, config=config))(x, w, b)
    assert_close(pre, numpy_gate(x, w, b), dtype, kind="ffn", what="jitted, random bias")
    assert_close(pre, gemv_reference(x, w, b), dtype, kind="kernel")


@pytest.mark.parametrize("config", [
    GemvConfig(block_f=64, block_k=32, k_splits=3),
    GemvConfig(block_f=64, block_k=32, k_splits=1),
], ids=["split_sum", "dot_fused"])
def test_gemv_nan_propagates(config):
    """A NaN in a row of x makes that row's outputs NaN (and only that row's)."""
    m, d, f = 4, 100, 150
    rng = np.random.default_rng(seed_of("gate_gemv_nan"))
    x, w, b = make_inputs(m, d, f, jnp.bfloat16, "threshold", rng)
    x = x.at[2, 57].set(jnp.nan)
    pre = np.asarray(gemv(x, w, b, config=config), np.float32)
    assert np.all(np.isnan(pre[2]))
    keep = np.array([0, 1, 3])
    assert_close(pre[keep], numpy_gate(x[keep], w, b), jnp.bfloat16, what="rows without NaN")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [
    None,
    slow(GemvConfig(block_f=64, block_k=32, k_splits=3)),
    slow(GemvConfig(block_f=32, block_k=32, k_splits=1)),
], ids=["default", "split_sum", "dot_fused"])
def test_gemv_many_matches_numpy_and_one_at_a_time(config, dtype):
    """Three weights of two widths (q, and grouped k and v), none a multiple of the block,
    in one launch: each output against float64 and the one-weight kernel."""
    m, d = 3, 200
    rng = np.random.default_rng(seed_of("gemv_many", str(config), str(dtype)))
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    ws = tuple(jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), dtype)
               for f in (300, 72, 72))
    outs = gemv_many(x, ws, config=config)
    assert len(outs) == 3
    for out, w in zip(outs, ws):
        assert out.shape == (m, w.shape[1]) and out.dtype == dtype
        assert_close(out, numpy_gate(x, w, None), dtype, kind="ffn", what="gemv_many vs numpy")
        assert_close(out, gemv(x, w, None, config=config), dtype, kind="kernel",
                     what="gemv_many vs gemv")
    with pytest.raises(ValueError, match="non-empty tuple"):
        gemv_many(x, ())
    with pytest.raises(ValueError, match="expected"):
        gemv_many(x, (ws[0], ws[1][:50]))


@pytest.mark.parametrize("splits", [1, 3])
def test_gemv_partial_sums_finish_to_gemv(splits):
    m, d, f = 2, 130, 260
    rng = np.random.default_rng(seed_of("gemv_partial_sums", splits))
    x, w, b = make_inputs(m, d, f, jnp.bfloat16, "threshold", rng)
    config = GemvConfig(block_f=64, block_k=32, k_splits=splits)
    sums = gemv_partial_sums(x, w, config=config)
    assert sums.shape == (splits, m, f) and sums.dtype == jnp.float32
    assert_close(np.asarray(sums).sum(0), numpy_gate(x, w, None), jnp.float32, kind="ffn",
                 what="partial sums vs numpy")
    pre = finish_partial_sums(sums, b, jnp.bfloat16)
    assert_close(pre, gemv(x, w, b, config=config), jnp.bfloat16, kind="kernel")


def test_default_config():
    """Valid at every decode size: blocks no wider than needed, splits that each hold at
    least one step of D; the H100's measured best at M = 1, 8 and 64."""
    for m in range(1, 65):
        for d, f in [(2048, 5632), (320, 600), (96, 200), (5, 7)]:
            config = default_gemv_config(m, d, f)
            assert config.block_f <= max(16, 2 * f) and config.block_k <= max(16, 2 * d)
            assert 1 <= config.k_splits <= -(-d // config.block_k), (m, d, f, config)
    assert default_gemv_config(1, 2048, 5632) == GemvConfig(block_f=128, block_k=64, k_splits=8)
    assert default_gemv_config(8, 2048, 5632) == GemvConfig(block_f=64, block_k=64, k_splits=4)
    assert default_gemv_config(64, 2048, 5632) == GemvConfig(block_f=64, block_k=128, k_splits=2)


def test_bad_inputs():
    x = jnp.zeros((4, 32), jnp.bfloat16)
    w = jnp.zeros((32, 48), jnp.bfloat16)
    b = jnp.zeros((48,), jnp.float32)
    cases = [
        ((x[0], w, b), "2-D"),
        ((x, w[0], b), "2-D"),
        ((x, w[:16], b), "expected"),
        ((jnp.zeros((0, 32), jnp.bfloat16), w, b), "rows"),
        ((jnp.zeros((65, 32), jnp.bfloat16), w, b), "rows"),
        ((x, w.astype(jnp.float32), b), "dtype"),
        ((x.astype(jnp.int32), w.astype(jnp.int32), b), "bfloat16, float16 or float32"),
        ((x, w, b[:40]), "bias has shape"),
        ((x, w, b.astype(jnp.int32)), "floating"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            gemv(*args)
        with pytest.raises(ValueError, match=message):
            gemv_reference(*args)
    for kwargs, message in [({"block_f": 100}, "block_f"), ({"block_k": 0}, "block_k"),
                            ({"k_splits": 0}, "k_splits"), ({"num_stages": 0}, "num_stages"),
                            ({"num_warps": 3}, "num_warps"), ({"block_k": 8}, "dot needs"),
                            ({"block_f": 8}, "dot needs")]:
        with pytest.raises(ValueError, match=message):
            GemvConfig(**kwargs)


@pytest.mark.parametrize("d", [200, 256])
def test_gate_pre_activation_folds_the_bias_exactly_and_without_a_scatter(d):
    """At least D / 2 rows: the bias is one more contraction column, ``[x, 1, 0..] @ [w, b,
    0..].T`` (D padded to a multiple of 64): equal to float64 within one rounding, and the
    padding is a pad, not a scatter (on the GPU a scatter compiled to two small fusions of its
    own a call)."""
    rng = np.random.default_rng(seed_of("gate_fold", d))
    m, f = 128, 96
    x, w_flax, b = make_inputs(m, d, f, jnp.bfloat16, "threshold", rng)
    w = jnp.asarray(w_flax.T)
    b = b.astype(jnp.float32)
    assert dense.folds_bias(m, d, b) and not dense.folds_bias(m, d, None)
    wide = dense.with_bias_column(x)
    assert wide.shape == (m, d + 64 - d % 64)
    np.testing.assert_array_equal(np.asarray(wide[:, :d]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(wide[:, d:], np.float32),
                                  np.eye(1, wide.shape[1] - d)[[0] * m])
    pre = dense.gate_pre_activation(x, w, b)
    assert_close(pre, numpy_gate(x, w_flax, b), jnp.bfloat16, kind="ffn", what="fold vs float64")
    np.testing.assert_array_equal(
        np.asarray(dense.gate_pre_activation(x, w, b, x_wide=wide)), np.asarray(pre))
    jaxpr = str(jax.make_jaxpr(dense.gate_pre_activation)(x, w, b))
    assert "scatter" not in jaxpr and "dot_general" in jaxpr and "pad" in jaxpr
