"""The decode path's dense switch: the counting GEMV, the scan's dense mode, ``slice_down``, and
the public op choosing between walking and multiplying every unit on the device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from pallas_kernels.common import finish_partial_sums
from pallas_kernels.gemv import GemvConfig, gemv_reference, gemv_with_counts
from pallas_kernels.scan_up_down import (DenseSwitch, ScanUpDownConfig,
                                         default_scan_up_down_config,
                                         scan_up_down_partial_sums, scan_up_down_reference)
from pallas_kernels.slice_down import slice_down, slice_down_reference
from tests.utils import assert_close, ffn_float64, make_ffn_inputs, nested_eqns, seed_of

F32, BF16 = jnp.float32, jnp.bfloat16
NEVER, ALWAYS = 10**9, -1


def _counts_of(pre, block_f: int) -> list[int]:
    active = ~(np.asarray(jnp.asarray(pre, F32)) <= 0)  # > 0 or NaN
    return [int(active[:, i:i + block_f].sum()) for i in range(0, pre.shape[1], block_f)]


@pytest.mark.parametrize("m,d,f,dtype", [(1, 256, 200, BF16), (5, 128, 96, F32),
                                         (16, 64, 64, BF16)])
def test_gemv_with_counts_matches_gemv_and_counts_its_blocks(m, d, f, dtype):
    k = jax.random.split(jax.random.key(seed_of(m, d, f)), 3)
    x = jax.random.normal(k[0], (m, d), dtype)
    w = (jax.random.normal(k[1], (f, d)) / 8).astype(dtype)
    bias = jax.random.normal(k[2], (f,)) - 1.0
    x = x.at[0, 0].set(jnp.nan) if m > 1 else x  # a NaN row counts every unit as active
    pre, counts = gemv_with_counts(x, w, bias, unit_rows=True)
    ref = gemv_reference(x, w, bias, unit_rows=True)
    np.testing.assert_array_equal(np.isnan(np.asarray(pre, np.float32)),
                                  np.isnan(np.asarray(ref, np.float32)))
    ok = ~np.isnan(np.asarray(ref, np.float32))
    assert_close(np.asarray(pre, np.float32)[ok], np.asarray(ref, np.float32)[ok], dtype,
                 kind="kernel", what="pre")
    assert counts.dtype == jnp.int32
    assert list(np.asarray(counts)) == _counts_of(pre, 32)  # of the outputs it wrote


def test_gemv_with_counts_rejects_a_split_d():
    x, w = jnp.ones((2, 64), BF16), jnp.ones((32, 64), BF16)
    with pytest.raises(ValueError, match="unsplit"):
        gemv_with_counts(x, w, None, unit_rows=True,
                         config=GemvConfig(block_f=32, block_k=16, k_splits=2))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_slice_down_writes_the_products_when_dense_and_nothing_otherwise(dtype):
    m, f, d, block_f = 3, 200, 128, 64
    k = jax.random.split(jax.random.key(seed_of("slice_down", dtype)), 3)
    h = jax.random.normal(k[0], (m, f), F32)
    w_down = jax.random.normal(k[1], (f, d), dtype)
    poison = jax.random.normal(k[2], (4, m, d), F32)  # what the sparse walk would have written
    counts = jnp.asarray([5, 0, 7], jnp.int32)
    dense = slice_down(h, w_down, counts, poison, dense_above=11, block_f=block_f)
    assert_close(dense, slice_down_reference(h, w_down, block_f), F32, kind="kernel",
                 tol=1e-5, what="dense slices")
    sparse = slice_down(h, w_down, counts, poison, dense_above=12, block_f=block_f)
    np.testing.assert_array_equal(np.asarray(sparse), np.asarray(poison))


@pytest.mark.parametrize("m,d,f,pattern,dtype", [
    (1, 128, 320, "uniform", BF16),
    (3, 64, 256, "dense_rows", BF16),
    (4, 128, 200, "zero_rows", F32),
    (6, 64, 300, "heavy_tailed", BF16),
])
@pytest.mark.parametrize("above", [NEVER, ALWAYS], ids=["walk", "dense"])
def test_scan_with_the_switch_matches_the_reference_in_either_mode(m, d, f, pattern, dtype,
                                                                   above):
    x, w_gate, w_up, w_down = make_ffn_inputs(seed_of(m, d, f, pattern), m, d, f, pattern,
                                              dtype, density=0.1)
    pre, counts = gemv_with_counts(x, w_gate.T, None, unit_rows=True)
    w_up_t = w_up.T
    y_parts, l1 = scan_up_down_partial_sums(pre, x, w_up_t, w_down,
                                            switch=DenseSwitch(counts, above))
    y_ref, l1_ref = scan_up_down_reference(pre, x, w_up_t, w_down, out_dtype=F32)
    assert_close(finish_partial_sums(y_parts, None, F32), y_ref, F32, kind="kernel",
                 tol=1e-5, what="y")
    assert_close(l1, l1_ref, F32, kind="kernel", tol=1e-5, what="l1",
                 zero_reference_ok=pattern == "zero_rows" and m == 1)


def test_dense_mode_covers_a_slice_whose_programs_do_not_divide_it():
    """3 rows sharing a 256-unit slice: each program's share rounds up to a power of two
    (128), so every unit is multiplied even though 256 / 3 is not a whole width."""
    m, d, f = 3, 64, 512
    x, w_gate, w_up, w_down = make_ffn_inputs(seed_of("share", m), m, d, f, "dense_rows",
                                              BF16, density=0.2)
    pre, counts = gemv_with_counts(x, w_gate.T, None, unit_rows=True)
    config = ScanUpDownConfig(block_f=256, scan_width=256, block_d=64, dense_width=16)
    y_parts, l1 = scan_up_down_partial_sums(pre, x, w_up.T, w_down, config=config,
                                            switch=DenseSwitch(counts, ALWAYS))
    y_ref, l1_ref = scan_up_down_reference(pre, x, w_up.T, w_down, out_dtype=F32)
    assert_close(finish_partial_sums(y_parts, None, F32), y_ref, F32, kind="kernel",
                 tol=1e-5, what="y")
    assert_close(l1, l1_ref, F32, kind="kernel", tol=1e-5, what="l1")


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_dense_mode_on_the_default_tiles_of_a_narrow_layer(dtype):
    """The defaults of a layer whose F gives few 64-unit programs: 32 units a program and, for
    at most 8 rows, 256-row D steps (D = 512: two of them), on heavy-tailed rows; 8 rows
    share each 256-unit slice, so every program takes 32."""
    m, d, f = 8, 512, 384
    config = default_scan_up_down_config(m, d, f)
    assert (config.dense_width, config.dense_block_k) == (32, 256)
    x, w_gate, w_up, w_down = make_ffn_inputs(seed_of("tiles", str(dtype)), m, d, f,
                                              "heavy_tailed", dtype, density=0.3)
    pre, counts = gemv_with_counts(x, w_gate.T, None, unit_rows=True)
    y_parts, l1 = scan_up_down_partial_sums(pre, x, w_up.T, w_down,
                                            switch=DenseSwitch(counts, ALWAYS))
    y_ref, l1_ref = scan_up_down_reference(pre, x, w_up.T, w_down, out_dtype=F32)
    assert_close(finish_partial_sums(y_parts, None, F32), y_ref, F32, kind="kernel",
                 tol=1e-5, what="y")
    assert_close(l1, l1_ref, F32, kind="kernel", tol=1e-5, what="l1")


def test_wide_layers_and_many_rows_keep_the_larger_dense_tiles():
    wide = default_scan_up_down_config(8, 4096, 14336)
    many_rows = default_scan_up_down_config(64, 2048, 5632)
    assert (wide.dense_width, wide.dense_block_k) == (64, 128)
    assert (many_rows.dense_width, many_rows.dense_block_k) == (32, 128)


@pytest.mark.parametrize("above", [NEVER, ALWAYS], ids=["walk", "dense"])
def test_scan_with_the_switch_propagates_nan(above):
    m, d, f = 2, 64, 128
    x, w_gate, w_up, w_down = make_ffn_inputs(seed_of("nan", above), m, d, f, "uniform", BF16)
    pre, counts = gemv_with_counts(x, w_gate.T, None, unit_rows=True)
    pre = pre.at[1, 5].set(jnp.nan)
    y_parts, _ = scan_up_down_partial_sums(pre, x, w_up.T, w_down,
                                           switch=DenseSwitch(counts, above))
    y = np.asarray(finish_partial_sums(y_parts, None, F32))
    assert np.all(np.isnan(y[1])) and np.all(np.isfinite(y[0]))


def _kernel_names(fn, *args) -> set[str]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return {eqn.params["name"] for eqn in nested_eqns(jaxpr)
            if eqn.primitive.name == "pallas_call" and "name" in eqn.params}


@pytest.mark.parametrize("share,switched", [(0.0, True), (1.0, False)])
def test_public_op_at_decode_size_takes_the_switch_and_stays_exact(share, switched):
    """dense_fallback_density sets the switch by hand (the cost model decides on a GPU only):
    0.0 multiplies every unit, 1.0 keeps the plain walk; both compute the FFN."""
    m, d, f = 4, 64, 256
    x, w_gate, w_up, w_down = make_ffn_inputs(seed_of("op", share), m, d, f, "uniform", BF16)
    weights = tj.prepare_weights(w_gate, w_up, w_down)
    config = tj.TwELLConfig(dense_fallback_density=share)
    fn = jax.jit(lambda x, w: tj.feed_forward(x, w, config=config, return_stats=True))
    y, stats = fn(x, weights)
    want, l1_mean = ffn_float64(x, w_gate, w_up, w_down)
    assert_close(y, want, BF16, what="y")
    assert_close(stats.l1, l1_mean, F32, tol=1e-4, what="l1")
    names = _kernel_names(fn, x, weights)
    assert ("twell_slice_down" in names) == switched
    assert "twell_scan_up_down" in names


def test_the_models_decode_steps_keep_the_plain_walk():
    """partial_sums (a model's decode step): no switch, the loop decided once already."""
    m, d, f = 2, 64, 128
    x, w_gate, w_up, w_down = make_ffn_inputs(seed_of("model"), m, d, f, "uniform", BF16)
    weights = tj.prepare_weights(w_gate, w_up, w_down)
    config = tj.TwELLConfig(dense_fallback_density=0.0)
    fn = lambda x, w: tj.feed_forward(x, w, config=config, partial_sums=True)
    assert "twell_slice_down" not in _kernel_names(fn, x, weights)


def test_cost_model_threshold_grows_to_one_entry_per_unit():
    cost = tj.TwELLConfig().cost_model
    f = 5632
    assert cost.decode_dense_above(1, f) is None  # one row walks: no switch
    assert cost.decode_dense_above(2, f) == int(2 * cost.decode_dense_max_share * f)
    one_row = dataclasses.replace(cost, decode_switch_min_rows=1)
    assert one_row.decode_dense_above(1, f) == int(cost.decode_dense_max_share * f)
    assert cost.decode_dense_above(8, f) == f
    assert cost.decode_dense_above(64, f) == f
    off = dataclasses.replace(cost, decode_dense_entries_per_unit=0.5)
    assert off.decode_dense_above(64, f) == f // 2
