"""``scan_up_down`` (up/down straight from the gate pre-activation) against numpy float64 and its
jnp reference, in interpret mode on the CPU (compiled on a GPU)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.common import finish_partial_sums
from pallas_kernels.gemv import GemvConfig, gemv, gemv_partial_sums
from pallas_kernels.scan_up_down import (EARLY_DOWN_MAX_GROUP, GatePartials, ScanUpDownConfig,
                                         default_scan_up_down_config, scan_up_down,
                                         scan_up_down_partial_sums, scan_up_down_reference)
from tests.test_row_kernels import make_pre
from tests.utils import assert_close, load_experiment, seed_of, slow

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
# The fast tier's dtype for the two costliest parametrizations below (bf16 through the scan
# kernel stays fast in tests/test_ffn.py's decode-path tests); bf16: slow.
F32_ONLY = [DTYPES[0], slow(jnp.bfloat16, id="bf16")]


def numpy_scan_up_down(pre, x, w_up_t, w_down, gated: bool):
    """Independent float64 loop over each row's active units: (y [M, D], l1 [M])."""
    pre, w_down = np.asarray(pre, np.float64), np.asarray(w_down, np.float64)
    y = np.zeros((pre.shape[0], w_down.shape[1]))
    l1 = np.zeros(pre.shape[0])
    for m, row in enumerate(pre):
        for j in np.nonzero(~(row <= 0))[0]:
            h = row[j]
            if gated:
                h *= np.dot(np.asarray(x[m], np.float64), np.asarray(w_up_t[j], np.float64))
            y[m] += h * w_down[j]
            l1[m] += abs(h)
    return y, l1


def make_inputs(m, d, f, pattern, dtype, rng):
    pre = np.array(make_pre(m, f, pattern, dtype, rng))
    pre[3] = np.where(np.isnan(pre[3]), 0.5, pre[3])  # NaN has its own test
    cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
    x = cast(rng.standard_normal((m, d)))
    w_up_t = cast(rng.standard_normal((f, d)) / np.sqrt(d))
    w_down = cast(rng.standard_normal((f, d)) / np.sqrt(f))
    return pre, x, w_up_t, w_down


@pytest.mark.parametrize("dtype", F32_ONLY)
@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "nongated"])
@pytest.mark.parametrize("pattern", [slow("uniform"), "heavy"])  # heavy: both branches
@pytest.mark.parametrize("m,d,f,config", [
    (5, 64, 256, ScanUpDownConfig(block_f=128, scan_width=64, block_d=32, num_warps=1)),
    slow(8, 128, 300, None),  # F not a multiple of the slice: the last slice is masked
    # The default's narrow slices for few rows (on five rows, to mix every row pattern).
    (5, 64, 300, default_scan_up_down_config(2, 64, 300)),
    slow(6, 64, 384, ScanUpDownConfig(block_f=512, scan_width=128, block_d=64, num_warps=2)),
])
def test_scan_up_down_matches_numpy_and_reference(m, d, f, config, pattern, gated, dtype):
    rng = np.random.default_rng(seed_of("scan_up_down", m, d, f, pattern, gated, str(dtype)))
    pre, x, w_up_t, w_down = make_inputs(m, d, f, pattern, dtype, rng)
    args = [jnp.asarray(a, dtype) for a in (pre, x, w_up_t, w_down)]
    if not gated:
        args[1] = args[2] = None
    y, l1 = scan_up_down(*args, out_dtype=jnp.float32, config=config)
    want, want_l1 = numpy_scan_up_down(pre, x, w_up_t, w_down, gated)
    assert y.dtype == jnp.float32 and y.shape == (m, d) and l1.shape == (m,)
    assert_close(y, want, jnp.float32, what="scan_up_down vs numpy")
    assert_close(l1, want_l1, jnp.float32, what="l1 vs numpy")
    np.testing.assert_array_equal(np.asarray(y[1]), 0.0)  # the all-zero row
    assert float(l1[1]) == 0.0
    ref, ref_l1 = scan_up_down_reference(*args, out_dtype=jnp.float32)
    assert_close(ref, want, jnp.float32, what="reference vs numpy")
    assert_close(ref_l1, want_l1, jnp.float32, what="reference l1 vs numpy")
    got, _ = scan_up_down(*args, config=config)
    assert got.dtype == dtype
    assert_close(got, want, dtype, what="scan_up_down in the input dtype")
    # Left unfinished: one float32 partial sum per slice of F, which finished in order are
    # scan_up_down's y bit for bit.
    parts, parts_l1 = scan_up_down_partial_sums(*args, config=config)
    used = config or default_scan_up_down_config(m, d, f)
    assert parts.dtype == jnp.float32 and parts.shape == (-(-f // used.block_f), m, d)
    np.testing.assert_array_equal(np.asarray(finish_partial_sums(parts, None, dtype)),
                                  np.asarray(got))
    np.testing.assert_array_equal(np.asarray(parts_l1), np.asarray(l1))


@pytest.mark.slow  # the fast tier has empty, sparse and full chunks in the next test
@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "nongated"])
def test_unit_group_sizes_agree(gated):
    """The units taken 1, 4 or 16 at a time (a chunk holds up to 64: many groups, a last one
    part full; the small groups read their w_down rows early, the large one late): the same
    result, against numpy, on rows from empty to full."""
    rng = np.random.default_rng(seed_of("scan_up_down_group_sizes", gated))
    pre, x, w_up_t, w_down = make_inputs(6, 64, 300, "heavy", jnp.float32, rng)
    args = [jnp.asarray(a) for a in (pre, x, w_up_t, w_down)]
    if not gated:
        args[1] = args[2] = None
    want, want_l1 = numpy_scan_up_down(pre, x, w_up_t, w_down, gated)
    groups = [1, 4, 16]
    assert min(groups) <= EARLY_DOWN_MAX_GROUP < max(groups)
    for group in groups:
        config = ScanUpDownConfig(block_f=128, scan_width=64, block_d=32, num_warps=1,
                                  group=group)
        y, l1 = scan_up_down(*args, config=config)
        what = f"group={group}"
        assert_close(y, want, jnp.float32, what=f"y, {what}")
        assert_close(l1, want_l1, jnp.float32, what=f"l1, {what}")


@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "nongated"])
def test_d_splits_give_the_same_bits(gated):
    """Programs sharing a (row, slice), each writing a part of D (with groups as large as the
    registers allow): the y and l1 of one program per (row, slice) bit for bit (the same units,
    in the same order, per output column), and against numpy, on rows from empty to full."""
    rng = np.random.default_rng(seed_of("scan_up_down_d_splits", gated))
    pre, x, w_up_t, w_down = make_inputs(6, 128, 300, "heavy", jnp.bfloat16, rng)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (pre, x, w_up_t, w_down)]
    if not gated:
        args[1] = args[2] = None
    base = ScanUpDownConfig(block_f=128, scan_width=64, block_d=32, num_warps=1, group=2)
    want_y, want_l1 = scan_up_down(*args, out_dtype=jnp.float32, config=base)
    numpy_y, numpy_l1 = numpy_scan_up_down(pre, x, w_up_t, w_down, gated)
    ref_y, ref_l1 = scan_up_down_reference(*args, out_dtype=jnp.float32)
    assert_close(want_y, numpy_y, jnp.float32, what="y without a D split vs numpy")
    assert_close(want_l1, numpy_l1, jnp.float32, what="l1 without a D split vs numpy")
    for splits, group in [(2, 2), (4, 8)]:
        config = dataclasses.replace(base, d_splits=splits, group=group)
        y, l1 = scan_up_down(*args, out_dtype=jnp.float32, config=config)
        assert_close(y, numpy_y, jnp.float32, what=f"y, d_splits={splits} vs numpy")
        assert_close(y, ref_y, jnp.float32, what=f"y, d_splits={splits} vs the reference")
        assert_close(l1, ref_l1, jnp.float32, what=f"l1, d_splits={splits} vs the reference")
        if group == base.group:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
            np.testing.assert_array_equal(np.asarray(l1), np.asarray(want_l1))
        assert_close(l1, numpy_l1, jnp.float32, what=f"l1, d_splits={splits} vs numpy")
    with pytest.raises(ValueError, match="d_splits=8"):
        scan_up_down(*args, config=dataclasses.replace(base, d_splits=8))
    with pytest.raises(ValueError, match="power of two"):
        dataclasses.replace(base, d_splits=3)


@pytest.mark.parametrize("dtype", F32_ONLY)
@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "nongated"])
@pytest.mark.parametrize("splits,bias", [(3, True), slow(1, True), slow(2, False)])
def test_scan_reads_the_gemv_partial_sums(splits, bias, gated, dtype):
    """The gate as the GEMV's unsummed partial sums (the decode path): the same y and l1 as
    the kernel on the finished pre-activation, and against numpy on that pre-activation; the
    gate threshold bias makes ~5-15% of the units active, a few rows dense."""
    m, d, f = 5, 96, 300
    rng = np.random.default_rng(seed_of("scan_partials", splits, bias, gated, str(dtype)))
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w_in = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), dtype)
    b = jnp.asarray(-1.3 + 0.2 * rng.standard_normal(f), jnp.float32) if bias else None
    w_in = w_in.at[:, :40].multiply(-1.0) if not bias else w_in
    x = x.at[2].set(jnp.abs(x[2]))  # with w_in >= 0 below: row 2 active almost everywhere
    w_in = w_in.at[:, 100:].set(jnp.abs(w_in[:, 100:]))
    w_up_t = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(d), dtype)
    w_down = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(f), dtype)
    gemv_config = GemvConfig(block_f=64, block_k=32, k_splits=splits)
    sums = gemv_partial_sums(x, w_in, config=gemv_config)
    assert sums.shape == (splits, m, f) and sums.dtype == jnp.float32
    gate = GatePartials(sums, b, dtype)
    pre = gate.pre()
    assert pre.dtype == dtype
    assert_close(pre, gemv(x, w_in, b, config=gemv_config), dtype, kind="kernel",
                 what="finished partial sums vs gemv")
    active = np.mean(np.asarray(pre, np.float32) > 0)
    assert 0.03 < active < 0.9, active
    xs, w_up_ts = (x, w_up_t) if gated else (None, None)
    config = ScanUpDownConfig(block_f=128, scan_width=64, block_d=32, num_warps=1)
    y, l1 = scan_up_down(gate, xs, w_up_ts, w_down, out_dtype=jnp.float32, config=config)
    y_pre, l1_pre = scan_up_down(pre, xs, w_up_ts, w_down, out_dtype=jnp.float32,
                                 config=config)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_pre), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l1_pre), rtol=1e-6, atol=1e-6)
    cast = lambda a: None if a is None else np.asarray(jnp.asarray(a, jnp.float32))
    want, want_l1 = numpy_scan_up_down(cast(pre), cast(x), cast(w_up_t), cast(w_down), gated)
    assert_close(y, want, jnp.float32, what="scan on partial sums vs numpy")
    assert_close(l1, want_l1, jnp.float32, what="l1 on partial sums vs numpy")
    ref, ref_l1 = scan_up_down_reference(gate, xs, w_up_ts, w_down, out_dtype=jnp.float32)
    assert_close(ref, want, jnp.float32, what="reference on partial sums vs numpy")


@pytest.mark.parametrize("gated", [True, slow(False)], ids=["gated", "nongated"])
def test_sparse_and_full_chunks_in_one_program(gated):
    """One program, two 64-column chunks: a few units then a full chunk, a full chunk then a
    few units, only a few units, only full chunks, nothing (stored as zeros)."""
    rng = np.random.default_rng(seed_of("scan_up_down_mixed", gated))
    m, d, f = 5, 64, 128
    pre = -np.abs(rng.standard_normal((m, f)))
    few = lambda row, col0: pre.__setitem__((row, col0 + rng.choice(64, 3, replace=False)),
                                            rng.uniform(0.1, 1.0, 3))
    many = lambda row, col0: pre.__setitem__((row, slice(col0, col0 + 64)),
                                             rng.uniform(0.1, 1.0, 64))
    few(0, 0), many(0, 64)
    many(1, 0), few(1, 64)
    few(2, 0), few(2, 64)
    many(3, 0), many(3, 64)  # row 4 stays empty
    cast = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
    x = cast(rng.standard_normal((m, d)))
    w_up_t = cast(rng.standard_normal((f, d)) / np.sqrt(d))
    w_down = cast(rng.standard_normal((f, d)) / np.sqrt(f))
    args = [jnp.asarray(a) for a in (pre, x, w_up_t, w_down)]
    if not gated:
        args[1] = args[2] = None
    config = ScanUpDownConfig(block_f=128, scan_width=64, block_d=32, num_warps=1, group=2)
    y, l1 = scan_up_down(*args, config=config)
    want, want_l1 = numpy_scan_up_down(pre, x, w_up_t, w_down, gated)
    assert_close(y, want, jnp.float32, what="y, mixed chunks")
    assert_close(l1, want_l1, jnp.float32, what="l1, mixed chunks")
    np.testing.assert_array_equal(np.asarray(y[4]), 0.0)


def test_scan_up_down_propagates_nan():
    rng = np.random.default_rng(seed_of("scan_up_down_nan"))
    pre, x, w_up_t, w_down = make_inputs(6, 64, 256, "uniform", jnp.float32, rng)
    pre[4, 7] = np.nan
    y = np.asarray(scan_up_down(*map(jnp.asarray, (pre, x, w_up_t, w_down)))[0])
    assert np.all(np.isnan(y[4]))
    assert np.all(np.isfinite(np.delete(y, 4, axis=0)))


def test_default_config_at_decode_sizes():
    """The slices measured fastest on the H100, the D split where the (row, slice) pairs are
    fewer than the SMs and D is a multiple of 2048, and the groups and warps measured on an
    H200 (split programs of one row on 4 warps, of more rows on 8, the others on 4)."""
    for m, slices, group, splits, warps in [(1, 44, 8, 2, 4), (2, 44, 8, 2, 8),
                                            (3, 44, 4, 1, 4), (4, 44, 4, 1, 4),
                                            (8, 22, 4, 1, 4), (32, 22, 4, 1, 4),
                                            (64, 11, 4, 1, 4), (4096, 1, 4, 1, 4)]:
        config = default_scan_up_down_config(m, 2048, 5632)
        assert -(-5632 // config.block_f) == slices and config.group == group, (m, config)
        assert config.num_warps == warps, (m, config)
        assert config.d_splits == splits and config.block_d * splits == 2048, (m, config)
        assert config.scan_width <= config.block_f
    assert default_scan_up_down_config(1, 4096, 14336).d_splits == 2  # 112 pairs
    assert default_scan_up_down_config(2, 4096, 14336).d_splits == 1  # 224 pairs
    assert default_scan_up_down_config(1, 1536, 4096).d_splits == 1


def test_default_d_split_for_one_row_at_d_2048():
    """The default config's D split (one row, D 2048) on the kernel: one slice empty, one with
    a few units, one busy, against numpy."""
    d, f = 2048, 384
    config = default_scan_up_down_config(1, d, f)
    assert config.d_splits == 2
    rng = np.random.default_rng(seed_of("scan_up_down_default_d_split"))
    pre = -np.abs(rng.standard_normal((1, f))) - 0.1
    pre[0, 128 + rng.choice(128, 3, replace=False)] = rng.uniform(0.1, 1.0, 3)
    pre[0, 256:] = rng.uniform(0.1, 1.0, 128)
    cast = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
    pre, x = cast(pre), cast(rng.standard_normal((1, d)))
    w_up_t = cast(rng.standard_normal((f, d)) / np.sqrt(d))
    w_down = cast(rng.standard_normal((f, d)) / np.sqrt(f))
    args = [jnp.asarray(a, jnp.bfloat16) for a in (pre, x, w_up_t, w_down)]
    y, l1 = scan_up_down(*args, out_dtype=jnp.float32)
    want, want_l1 = numpy_scan_up_down(pre, x, w_up_t, w_down, True)
    assert_close(y, want, jnp.float32, what="y, default D split")
    assert_close(l1, want_l1, jnp.float32, what="l1, default D split")
    ref, ref_l1 = scan_up_down_reference(*args, out_dtype=jnp.float32)
    assert_close(y, ref, jnp.float32, what="y, default D split vs the reference")
    assert_close(l1, ref_l1, jnp.float32, what="l1, default D split vs the reference")


def test_scan_up_down_rejects_bad_input():
    pre, x = jnp.zeros((4, 256)), jnp.zeros((4, 64))
    w = jnp.zeros((256, 64))
    with pytest.raises(ValueError, match="pre has shape"):
        scan_up_down(pre[:, :128], x, w, w)
    with pytest.raises(ValueError, match="x has shape"):
        scan_up_down(pre, x[:, :32], w, w)
    with pytest.raises(ValueError, match="w_up_t has shape"):
        scan_up_down(pre, x, w[:, :32], w)
    with pytest.raises(ValueError, match="needs x and w_up_t"):
        scan_up_down(pre, x, None, w)
    with pytest.raises(ValueError, match="takes no x or w_up_t"):
        scan_up_down(pre, None, w, w)
    with pytest.raises(ValueError, match="multiple of block_d"):
        scan_up_down(pre, x, w, w, config=ScanUpDownConfig(block_d=128))
    with pytest.raises(ValueError, match="scan_width"):
        ScanUpDownConfig(block_f=128, scan_width=256)
    with pytest.raises(ValueError, match="power of two"):
        ScanUpDownConfig(block_f=96)
    with pytest.raises(ValueError, match="group must be a power of two"):
        ScanUpDownConfig(group=3)
    with pytest.raises(ValueError, match="GatePartials.sums has shape"):
        scan_up_down(GatePartials(jnp.zeros((2, 4, 128)), None, jnp.float32), x, w, w)
    with pytest.raises(ValueError, match="must be float32"):
        scan_up_down(GatePartials(jnp.zeros((2, 4, 256), jnp.bfloat16), None, jnp.bfloat16),
                     x, w, w)
    with pytest.raises(ValueError, match="GatePartials.bias"):
        scan_up_down(GatePartials(jnp.zeros((2, 4, 256)), jnp.zeros(128), jnp.float32), x, w, w)


@pytest.mark.slow  # ~30 s on 2 cores: twelve jitted calls in interpret mode
def test_probe_script_times_every_variant(tmp_path):
    """``tools/probe_decode_scan.py --smoke --trained``: the default config, a variant and the
    two dense FFNs timed in both ways on uniform rows and on rows with the trained model's
    counts, each variant checked against float64 first, after a header that names the
    command."""
    with load_experiment("probe_decode_scan") as probe:
        rows = probe.main(["--smoke", "--trained", "--out", str(tmp_path / "probe.jsonl")])
    assert [r["pattern"] for r in rows] == ["uniform", "trained"]
    for row in rows:
        for mode in ("loop", "unrolled"):
            assert set(row[mode]) == {"default", "group=2", "dense", "plain"}
            assert all(v["median_us"] > 0 for v in row[mode].values())
        assert set(row["rel_error_float64"]) == {"default", "group=2"}
        assert all(0 < e < 1e-2 for e in row["rel_error_float64"].values())
    header = json.loads((tmp_path / "probe.jsonl").read_text().splitlines()[0])
    assert {"date", "device", "jax", "commit", "command"} <= set(header)
