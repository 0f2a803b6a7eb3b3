"""The one-program-per-row kernels (``row_pack``, ``row_up_down``) against their jnp references
and against independent numpy loops, in interpret mode on the CPU (compiled on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.row_pack import RowPackConfig, row_pack, row_pack_reference
from pallas_kernels.row_up_down import RowUpDownConfig, row_up_down, row_up_down_reference
from tests.utils import assert_close, seed_of, slow

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


# --------------------------------------------------------------------------------------------
# row_pack


def make_pre(m: int, f: int, pattern: str, dtype, rng) -> np.ndarray:
    """Pre-activations [m, f] whose rows mix the patterns: ~3% positive, heavy-tailed (a
    lognormal per-row offset), all <= 0, all > 0; a NaN in one row."""
    z = rng.standard_normal((m, f))
    if pattern == "uniform":
        pre = z - 1.9
    else:  # heavy-tailed: most rows very sparse, a few nearly dense
        pre = z - 2.5 + np.exp(1.2 * rng.standard_normal((m, 1)))
    pre[1] = -np.abs(pre[1]) - 0.1  # all-zero row
    pre[2] = np.abs(pre[2]) + 0.1  # dense row
    pre[3, f // 3] = np.nan
    pre[4] = -1.0  # only the top bit of some 32-bit masks (their sign bit)
    pre[4, 31::32] = 0.5
    return np.asarray(jnp.asarray(pre, dtype).astype(jnp.float32))


def numpy_pack(pre: np.ndarray, tile_width: int, num_slots: int):
    """Independent loop: (list of per-row (columns, values) for the first num_slots positives,
    counts [M, F / T], totals [M])."""
    gate = pre  # the pre-activation: the ReLU keeps its positive entries
    lists, counts, totals = [], [], []
    for row in gate:
        positive = ~(row <= 0)
        cols = np.nonzero(positive)[0]
        lists.append((cols[:num_slots], row[cols[:num_slots]]))
        counts.append(positive.reshape(-1, tile_width).sum(axis=1))
        totals.append(positive.sum())
    return lists, np.asarray(counts), np.asarray(totals)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["uniform", "heavy"])
@pytest.mark.parametrize("m,f,t,k,config", [
    (6, 256, 64, 12, RowPackConfig(tiles_per_chunk=2, num_warps=1)),
    slow(16, 384, 128, 20, None),  # 3 chunks of one tile
    slow(12, 512, 32, 7, RowPackConfig(tiles_per_chunk=8, num_warps=2, num_stages=1)),
    slow(5, 128, 16, 9, None),  # 16-bit masks
])
def test_row_pack_matches_numpy_and_reference(m, f, t, k, config, pattern, dtype):
    rng = np.random.default_rng(seed_of("row_pack", m, f, t, k, pattern, str(dtype)))
    pre = make_pre(m, f, pattern, dtype, rng)
    values, columns, counts, totals = row_pack(jnp.asarray(pre, dtype), tile_width=t,
                                               num_slots=k, config=config)
    lists, want_counts, want_totals = numpy_pack(pre, t, k)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)
    np.testing.assert_array_equal(np.asarray(totals), want_totals)
    assert values.dtype == dtype and values.shape == (m, k) and columns.shape == (m, k)
    for i, (cols, vals) in enumerate(lists):
        n = len(cols)
        np.testing.assert_array_equal(np.asarray(columns[i, :n]), cols)
        want = np.asarray(jnp.asarray(vals, dtype).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(values[i, :n].astype(jnp.float32)), want)
    ref = row_pack_reference(jnp.asarray(pre, dtype), tile_width=t, num_slots=k)
    valid = np.arange(k)[None, :] < np.minimum(want_totals, k)[:, None]
    for got, expected in zip((values, columns), ref[:2]):
        np.testing.assert_array_equal(np.where(valid, np.asarray(got, np.float32), 0),
                                      np.asarray(expected, np.float32))
    np.testing.assert_array_equal(np.asarray(ref[2]), want_counts)


def test_row_pack_skip_flag():
    # skip False lists as usual; skip True lists nothing and its outputs are unspecified, so
    # it is only run here (test_ffn checks that a skipped batch's results are exact).
    rng = np.random.default_rng(seed_of("row_pack_skip"))
    pre = jnp.asarray(make_pre(8, 256, "uniform", jnp.float32, rng), jnp.float32)
    pack = jax.jit(lambda p, s: row_pack(p, tile_width=64, num_slots=12, skip=s))
    _, columns, counts, totals = pack(pre, jnp.asarray(False))
    _, want_counts, want_totals = numpy_pack(np.asarray(pre), 64, 12)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)
    np.testing.assert_array_equal(np.asarray(totals), want_totals)
    assert want_totals.sum() > 0
    pack(pre, jnp.asarray(True))  # runs; nothing to compare


@pytest.mark.parametrize("t", [64, 16])
def test_row_pack_excludes_columns(t):
    # The excluded columns (hot units) are neither listed nor counted, in every tile and word
    # (bit 31 of a 32-bit word included); the others are listed as without exclusion.
    rng = np.random.default_rng(seed_of("row_pack_exclude", t))
    m, f, k = 9, 256, 40
    pre = make_pre(m, f, "uniform", jnp.float32, rng)
    pre = np.where(rng.random((m, f)) < 0.3, np.abs(pre) + 0.5, pre)  # some rows past K
    exclude = rng.random(f) < 0.25
    exclude[[0, 31, 32, 63, f - 1]] = True
    values, columns, counts, totals = row_pack(jnp.asarray(pre), tile_width=t, num_slots=k,
                                               exclude=jnp.asarray(exclude))
    kept = np.where(exclude[None, :], -1.0, pre)
    lists, want_counts, want_totals = numpy_pack(kept, t, k)
    assert want_totals.sum() > 0 and (np.where(exclude, pre, -1.0) > 0).sum() > 0
    np.testing.assert_array_equal(np.asarray(counts), want_counts)
    np.testing.assert_array_equal(np.asarray(totals), want_totals)
    for i, (cols, vals) in enumerate(lists):
        n = min(len(cols), k)
        np.testing.assert_array_equal(np.asarray(columns[i, :n]), cols[:n])
        np.testing.assert_array_equal(np.asarray(values[i, :n]), np.asarray(vals[:n], np.float32))
    ref = row_pack_reference(jnp.asarray(pre), tile_width=t, num_slots=k,
                             exclude=jnp.asarray(exclude))
    np.testing.assert_array_equal(np.asarray(ref[3]), want_totals)
    np.testing.assert_array_equal(np.asarray(ref[2]), want_counts)


def test_row_pack_propagates_nan():
    pre = np.full((4, 128), -1.0, np.float32)
    pre[0, 5] = np.nan
    values, columns, _, totals = row_pack(jnp.asarray(pre), tile_width=64, num_slots=4)
    assert int(totals[0]) == 1 and int(columns[0, 0]) == 5 and np.isnan(float(values[0, 0]))
    assert int(totals[1:].sum()) == 0


def test_row_pack_rejects_bad_input():
    pre = jnp.zeros((4, 256), jnp.float32)
    with pytest.raises(ValueError, match="tile_width"):
        row_pack(pre, tile_width=96, num_slots=4)
    with pytest.raises(ValueError, match="tiles_per_chunk"):
        row_pack(pre, tile_width=128, num_slots=4, config=RowPackConfig(tiles_per_chunk=4))
    with pytest.raises(ValueError, match="num_slots"):
        row_pack(pre, tile_width=64, num_slots=0)
    with pytest.raises(ValueError, match="power of two"):
        RowPackConfig(tiles_per_chunk=3)


# --------------------------------------------------------------------------------------------
# row_up_down


def make_lists(m, d, f, k, dtype, rng, *, garbage: bool):
    """x, w_up_t, w_down, gate values, columns, row_nnz: per-row counts 0..k+2 (past K:
    clipped), a hot column shared by every row, and (with ``garbage``) NaN values and
    out-of-range columns past each row's count, which the kernel must never read."""
    x = rng.standard_normal((m, d))
    w_up_t = rng.standard_normal((f, d)) / np.sqrt(d)
    w_down = rng.standard_normal((f, d)) / np.sqrt(k)
    columns = np.stack([rng.permutation(f)[:k] for _ in range(m)]).astype(np.int32)
    columns[:, 0] = 7  # a hot column
    gate = rng.random((m, k)) + 0.1
    row_nnz = rng.integers(0, k + 3, size=m).astype(np.int32)
    row_nnz[0], row_nnz[-1] = 0, k
    if garbage:
        past = np.arange(k)[None, :] >= row_nnz[:, None]
        gate = np.where(past, np.nan, gate)
        columns = np.where(past, f + 1000, columns).astype(np.int32)
    as_dtype = lambda a: jnp.asarray(a, dtype)
    return (as_dtype(x), as_dtype(w_up_t), as_dtype(w_down), as_dtype(gate),
            jnp.asarray(columns), jnp.asarray(row_nnz))


def numpy_up_down(x, w_up_t, w_down, gate, columns, row_nnz, gated: bool):
    f64 = lambda a: None if a is None else np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    x, w_up_t, w_down, gate = map(f64, (x, w_up_t, w_down, gate))
    columns, row_nnz = np.asarray(columns), np.asarray(row_nnz)
    m, k = gate.shape
    y, up, l1 = np.zeros((m, w_down.shape[1])), np.zeros((m, k)), np.zeros(m)
    for i in range(m):
        for kk in range(min(max(row_nnz[i], 0), k)):
            j = columns[i, kk]
            h = gate[i, kk]
            if gated:
                up[i, kk] = x[i] @ w_up_t[j]
                h = h * up[i, kk]
            y[i] += h * w_down[j]
            l1[i] += abs(h)
    return y, up, l1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m,d,f,k,config", [
    slow(8, 64, 96, 5, None),
    (13, 192, 200, 17, None),  # D = 3 chunks of 64, awkward M, F, K
    slow(6, 256, 64, 9, RowUpDownConfig(block_d=128, num_warps=2, num_stages=2)),
    slow(13, 192, 200, 17, RowUpDownConfig(block_d=64)),
])
def test_row_up_down_matches_numpy_and_reference(m, d, f, k, config, gated, dtype):
    rng = np.random.default_rng(seed_of("row_up_down", m, d, f, k, gated, str(dtype)))
    x, w_up_t, w_down, gate, columns, row_nnz = make_lists(m, d, f, k, dtype, rng, garbage=True)
    if not gated:
        x = w_up_t = None
    y, up, l1 = row_up_down(x, w_up_t, w_down, gate, columns, row_nnz, config=config)
    want_y, want_up, want_l1 = numpy_up_down(x, w_up_t, w_down, gate, columns, row_nnz, gated)
    assert y.dtype == dtype and y.shape == (m, d)
    assert_close(y, want_y, dtype, kind="kernel", what="y")
    assert l1.dtype == jnp.float32 and l1.shape == (m,)
    assert np.all(np.asarray(want_l1)[np.asarray(row_nnz) > 0] > 0)  # the check can fail
    assert_close(l1, want_l1, jnp.float32 if dtype == jnp.float32 else dtype, kind="kernel",
                 what="l1")
    if gated:
        assert up.dtype == jnp.float32 and up.shape == (m, k)
        assert_close(up, want_up, jnp.float32 if dtype == jnp.float32 else dtype, kind="kernel",
                     what="up")
        past = np.arange(k)[None, :] >= np.asarray(row_nnz)[:, None]
        assert np.all(np.asarray(up)[past] == 0.0)  # 0 past each row's count
    else:
        assert up is None
    clean = make_lists(m, d, f, k, dtype, np.random.default_rng(1), garbage=False)
    if not gated:
        clean = (None, None) + clean[2:]
    ref_y, ref_up, ref_l1 = row_up_down_reference(*clean)
    got_y, got_up, got_l1 = row_up_down(*clean, config=config)
    assert_close(got_y, ref_y, dtype, kind="kernel", what="y vs reference")
    assert_close(got_l1, ref_l1, jnp.float32, kind="kernel", what="l1 vs reference")
    if gated:
        assert_close(got_up, ref_up, jnp.float32, kind="kernel", what="up vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_up_down_reads_the_first_d_columns_of_a_wider_x(dtype):
    """x wider than D (the gate GEMM's operand with the folded bias's column) gives the
    outputs of its first D columns, bit for bit; the extra columns (here NaN and huge) are
    never read."""
    rng = np.random.default_rng(seed_of("row_up_down_wide_x", str(dtype)))
    x, w_up_t, w_down, gate, columns, row_nnz = make_lists(9, 128, 96, 6, dtype, rng,
                                                           garbage=True)
    extra = jnp.full((9, 64), jnp.nan, dtype).at[:, 0].set(1e30)
    wide = jnp.concatenate([x, extra], axis=1)
    got = row_up_down(wide, w_up_t, w_down, gate, columns, row_nnz)
    want = row_up_down(x, w_up_t, w_down, gate, columns, row_nnz)
    assert np.all(np.isfinite(np.asarray(got[0], np.float32)))
    assert np.any(np.asarray(got[0], np.float32) != 0)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    ref = row_up_down_reference(wide, w_up_t, w_down, gate, columns,
                                jnp.minimum(row_nnz, 6))
    assert_close(got[0], ref[0], dtype, kind="kernel", what="y vs reference, wide x")


def test_row_up_down_out_dtype_and_nan_propagation():
    rng = np.random.default_rng(3)
    x, w_up_t, w_down, gate, columns, row_nnz = make_lists(4, 64, 32, 4, jnp.float32, rng,
                                                           garbage=False)
    row_nnz = jnp.full((4,), 4, jnp.int32)
    x = x.at[1, 3].set(jnp.nan)
    y, up, l1 = row_up_down(x, w_up_t, w_down, gate, columns, row_nnz, out_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isnan(y[1]))) and bool(jnp.all(jnp.isnan(up[1])))
    assert bool(jnp.isnan(l1[1])) and bool(jnp.all(jnp.isfinite(l1[jnp.array([0, 2, 3])])))
    assert bool(jnp.all(jnp.isfinite(y[jnp.array([0, 2, 3])])))


def test_row_up_down_rejects_bad_input():
    rng = np.random.default_rng(4)
    x, w_up_t, w_down, gate, columns, row_nnz = make_lists(4, 64, 32, 4, jnp.float32, rng,
                                                           garbage=False)
    with pytest.raises(ValueError, match="x has shape"):
        row_up_down(x[:, :32], w_up_t, w_down, gate, columns, row_nnz)
    with pytest.raises(ValueError, match="w_up_t"):
        row_up_down(x, w_up_t[:16], w_down, gate, columns, row_nnz)
    with pytest.raises(ValueError, match="int32"):
        row_up_down(x, w_up_t, w_down, gate, columns.astype(jnp.int16), row_nnz)
    with pytest.raises(ValueError, match="row_nnz"):
        row_up_down(x, w_up_t, w_down, gate, columns, row_nnz[:2])
    with pytest.raises(ValueError, match="non-gated"):
        row_up_down(None, w_up_t, w_down, gate, columns, row_nnz)
    with pytest.raises(ValueError, match="block_d"):
        row_up_down(x, w_up_t, w_down, gate, columns, row_nnz,
                    config=RowUpDownConfig(block_d=128))
