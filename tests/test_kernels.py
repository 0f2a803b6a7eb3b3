"""Pallas kernels against their plain-jnp references (and against independent numpy checks).

On a machine without a GPU every kernel runs in the Pallas interpreter (``INTERPRET`` is True);
on a GPU machine the same tests run the compiled Triton kernels. Shapes are small: interpret
mode runs each program sequentially.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.common import default_interpret
from pallas_kernels.gate_pack import GatePackConfig, gate_pack, gate_pack_reference
from pallas_kernels.gated_up_down import (
    GatedUpDownConfig,
    gated_up_down,
    gated_up_down_reference,
)
from pallas_kernels.pack_rows import PackRowsConfig, pack_rows, pack_rows_reference
from pallas_kernels.pack_tiles import PackTilesConfig, pack_tiles, pack_tiles_reference
from pallas_kernels.sampled_dot import SampledDotConfig, sampled_dot, sampled_dot_reference
from pallas_kernels.sparse_down import SparseDownConfig, sparse_down, sparse_down_reference

INTERPRET = default_interpret()

# Relative error ||a - b|| / ||b|| allowed per output dtype (bf16: output rounding, 2^-8 per
# element, against an fp32 reference; fp32: summation order over contraction lengths <= 384).
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def seed_of(*parts) -> int:
    """A deterministic seed per test case (Python's str hash is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def assert_close(actual, expected, dtype, name: str = "output"):
    """Fails on NaN/Inf in ``actual`` and on a relative norm error above TOLERANCE[dtype]."""
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != expected {b.shape}"
    assert np.all(np.isfinite(a)), f"{name}: {np.sum(~np.isfinite(a))} non-finite entries"
    assert np.all(np.isfinite(b)), f"{name}: reference has non-finite entries"
    tol = TOLERANCE[jnp.dtype(dtype)]
    diff = np.abs(a - b)
    norm_b = np.linalg.norm(b)
    rel = np.linalg.norm(a - b) / norm_b if norm_b > 0 else np.linalg.norm(a)
    max_abs = float(diff.max(initial=0.0))
    max_rel = float((diff / np.maximum(np.abs(b), 1e-30)).max(initial=0.0))
    assert rel <= tol, (
        f"{name}: relative error {rel:.3e} > {tol:.0e} ({jnp.dtype(dtype).name}); "
        f"max abs {max_abs:.3e}, max elementwise rel {max_rel:.3e}"
    )


# --------------------------------------------------------------------------------------------
# gate_pack
# --------------------------------------------------------------------------------------------

GATE_SHAPES = [
    # (M, D, F, T, S, block_m, block_k)
    pytest.param(32, 64, 256, 128, 8, 16, 32, id="M32-D64-F256-T128-S8"),
    pytest.param(64, 128, 384, 128, 16, 32, 64, id="M64-D128-F384-T128-S16"),  # 3 tiles
    pytest.param(48, 96, 256, 64, 5, 16, 32, id="M48-D96-F256-T64-S5"),  # awkward M, D, S
]


def make_gate_inputs(m, d, f, t, s, dtype, pattern, rng, with_bias=False):
    """Integer-valued x, w (exact in bf16; every fp32 partial sum exact), so pre-activations
    are half-integers: never 0, and the kernel's GEMM equals the reference bit for bit.

    Features: 0 = row offset (w row of ones), 1 = rank of the column within its tile (a
    permutation of 0..T-1), 2 = +-0.5 (w row of halves), 3.. = random {-2..2} x {-1, 0, 1}.
    Row kinds: "uniform" (offset -2 std, ~2% positive), "heavy" (offset +1 std, ~84% positive:
    counts > S), "zero" (all <= 0), "dense" (all > 0), "exact_s" / "s_plus_1" (exactly S / S + 1
    positives in every tile, through the rank feature).
    """
    assert t <= 256, "ranks must be exact in bf16"
    x = np.zeros((m, d), np.float32)
    w = np.zeros((d, f), np.float32)
    w[0] = 1.0
    w[1] = np.concatenate([rng.permutation(t) for _ in range(f // t)])
    w[2] = 0.5
    w[3:] = rng.integers(-1, 2, (d - 3, f))
    std = np.sqrt((d - 3) * 2.0 * (2.0 / 3.0))
    kinds = {
        "uniform": ["uniform"],
        "heavy_tailed": ["uniform"] * 5 + ["heavy"],
        "special": ["uniform", "zero", "dense", "exact_s", "s_plus_1", "heavy"],
    }[pattern]
    for row in range(m):
        kind = kinds[row % len(kinds)]
        if kind in ("uniform", "heavy"):
            x[row, 0] = -round(2 * std) if kind == "uniform" else round(std)
            x[row, 2] = rng.choice([-1.0, 1.0])
            x[row, 3:] = rng.integers(-2, 3, d - 3)
        elif kind in ("zero", "dense"):
            x[row, 0] = -4.0 if kind == "zero" else 4.0
            x[row, 2] = 1.0
        else:  # rank - (T - S) + 0.5 > 0 exactly for the S (or S + 1) highest ranks
            x[row, 0] = -(t - s) if kind == "exact_s" else -(t - s - 1)
            x[row, 1] = 1.0
            x[row, 2] = 1.0
    bias = None
    if with_bias:  # integers keep the half-integer margin
        bias = jnp.asarray(rng.integers(-1, 2, f).astype(np.float32), dtype)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), bias


def unpack_dense(values, columns, counts, f):
    """Dense [M, F] float64 from packed outputs, for (row, tile)s with count <= S only; also
    returns the [M, F//T] mask of such tiles."""
    v = np.asarray(jnp.asarray(values, jnp.float32), np.float64)
    c = np.asarray(columns)
    n = np.asarray(counts)
    m, num_tiles, s = v.shape
    light = n <= s
    dense = np.zeros((m, f))
    for row in range(m):
        for t in range(num_tiles):
            if light[row, t]:
                dense[row, c[row, t, : n[row, t]]] = v[row, t, : n[row, t]]
    return dense, light


def check_packed_invariants(values, columns, counts, t, s):
    """Unused slots hold (0, 0); used slots are strictly ascending columns inside their tile."""
    v = np.asarray(jnp.asarray(values, jnp.float32))
    c = np.asarray(columns)
    n = np.asarray(counts)
    used = np.arange(s)[None, None, :] < np.minimum(n, s)[..., None]
    assert np.all(v[~used] == 0) and np.all(c[~used] == 0), "unused slots must be (0, 0)"
    assert np.all(v[used] > 0), "used slots must hold positive values"
    tile = np.arange(c.shape[1])[None, :, None]
    assert np.all((c[used] // t) == np.broadcast_to(tile, c.shape)[used]), "column outside tile"
    ascending = np.diff(c, axis=-1) > 0
    both_used = used[..., 1:]
    assert np.all(ascending[both_used]), "used columns must be strictly ascending"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pattern", ["uniform", "heavy_tailed", "special"])
@pytest.mark.parametrize("m,d,f,t,s,block_m,block_k", GATE_SHAPES)
def test_gate_pack_matches_reference(m, d, f, t, s, block_m, block_k, pattern, dtype):
    rng = np.random.default_rng(seed_of(m, d, f, pattern))
    x, w, bias = make_gate_inputs(m, d, f, t, s, dtype, pattern, rng, with_bias=pattern == "uniform")
    config = GatePackConfig(block_m=block_m, block_k=block_k)
    values, columns, counts = gate_pack(
        x, w, bias, tile_width=t, slots_per_tile=s, config=config, interpret=INTERPRET
    )
    ref_values, ref_columns, ref_counts = gate_pack_reference(
        x, w, bias, tile_width=t, slots_per_tile=s
    )
    assert values.shape == (m, f // t, s) and values.dtype == dtype
    assert columns.dtype == jnp.int32 and counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))
    np.testing.assert_array_equal(np.asarray(columns), np.asarray(ref_columns))
    assert_close(values, ref_values, dtype, "values")
    check_packed_invariants(values, columns, counts, t, s)

    # Independent of the reference's packing: light tiles unpack to the dense relu.
    pre = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if bias is not None:
        pre = pre + np.asarray(bias, np.float64)[None, :]
    dense_ref = np.maximum(pre, 0.0)
    np.testing.assert_array_equal(
        np.asarray(counts), (dense_ref > 0).reshape(m, f // t, t).sum(-1)
    )
    dense, light = unpack_dense(values, columns, counts, f)
    light_cols = np.repeat(light, t, axis=1)
    expected = np.asarray(jnp.asarray(dense_ref, dtype).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(dense[light_cols], expected[light_cols])
    if pattern == "special":  # the edge rows are really there
        n = np.asarray(counts)
        assert np.any(np.all(n == 0, axis=1)) and np.any(np.all(n == t, axis=1))
        assert np.any(np.all(n == s, axis=1)) and np.any(np.all(n == s + 1, axis=1))


@pytest.mark.parametrize("m,d,f,t,s,block_m,block_k", GATE_SHAPES[:2])
def test_gate_pack_prefix_sums_agree(m, d, f, t, s, block_m, block_k):
    rng = np.random.default_rng(7)
    x, w, _ = make_gate_inputs(m, d, f, t, s, jnp.bfloat16, "special", rng)
    outs = [
        gate_pack(
            x, w, tile_width=t, slots_per_tile=s, interpret=INTERPRET,
            config=GatePackConfig(block_m=block_m, block_k=block_k, prefix_sum=p),
        )
        for p in ("cumsum", "matmul")
    ]
    ref = gate_pack_reference(x, w, tile_width=t, slots_per_tile=s)
    for a, b, r in zip(*outs, ref):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))


@pytest.mark.parametrize("tiles_per_program,group_m,prefix_sum", [
    (2, 1, "cumsum"), (2, 3, "matmul"), (4, 2, "cumsum")])
def test_gate_pack_program_shapes_agree(tiles_per_program, group_m, prefix_sum):
    """Several tiles per program and grouped launch orders give the reference's exact output."""
    m, d, f, t, s = 80, 64, 256, 32, 4  # 5 row blocks of 16: groups of 3 leave a ragged one
    rng = np.random.default_rng(13)
    x, w, _ = make_gate_inputs(m, d, f, t, s, jnp.bfloat16, "special", rng)
    config = GatePackConfig(block_m=16, block_k=32, tiles_per_program=tiles_per_program,
                            group_m=group_m, prefix_sum=prefix_sum)
    got = gate_pack(x, w, tile_width=t, slots_per_tile=s, config=config, interpret=INTERPRET)
    ref = gate_pack_reference(x, w, tile_width=t, slots_per_tile=s)
    for a, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))


def test_gate_pack_rejects_tiles_per_program_not_dividing():
    x = jnp.ones((16, 32), jnp.bfloat16)
    w = jnp.ones((32, 96), jnp.bfloat16)  # 3 tiles of 32
    with pytest.raises(ValueError, match="tiles_per_program=2"):
        gate_pack(x, w, tile_width=32, slots_per_tile=4, interpret=INTERPRET,
                  config=GatePackConfig(block_m=16, block_k=32, tiles_per_program=2))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_gate_pack_gaussian_inputs(dtype):
    """Real-valued inputs (rounding differs from the reference): with S = T nothing overflows,
    so the unpacked result must match the dense relu within tolerance (a sign flip of a value
    near 0 costs only that tiny value)."""
    m, d, f, t = 32, 128, 256, 64
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), dtype)
    bias = jnp.asarray(rng.standard_normal(f) * 0.1 - 0.5, jnp.float32)
    values, columns, counts = gate_pack(
        x, w, bias, tile_width=t, slots_per_tile=t, interpret=INTERPRET,
        config=GatePackConfig(block_m=32, block_k=64),
    )
    dense, light = unpack_dense(values, columns, counts, f)
    assert light.all()
    pre = jnp.dot(
        x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    expected = jax.nn.relu(pre + bias)
    assert 0.1 < float(jnp.mean(expected > 0)) < 0.9
    assert_close(dense, expected, dtype, "unpacked relu")


def test_gate_pack_rejects_bad_shapes():
    x = jnp.zeros((32, 64), jnp.bfloat16)
    w = jnp.zeros((64, 256), jnp.bfloat16)
    cfg = GatePackConfig(block_m=16, block_k=32)
    kw = dict(tile_width=128, slots_per_tile=8, config=cfg, interpret=INTERPRET)
    with pytest.raises(ValueError, match="M=24"):
        gate_pack(jnp.zeros((24, 64), jnp.bfloat16), w, **kw)
    with pytest.raises(ValueError, match="D=48"):
        gate_pack(jnp.zeros((32, 48), jnp.bfloat16), jnp.zeros((48, 256), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="F=320"):
        gate_pack(x, jnp.zeros((64, 320), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="w has shape"):
        gate_pack(x, jnp.zeros((32, 256), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="dtype"):
        gate_pack(x, w.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="bias"):
        gate_pack(x, w, jnp.zeros((255,), jnp.float32), **kw)
    with pytest.raises(ValueError, match="slots_per_tile"):
        gate_pack(x, w, tile_width=128, slots_per_tile=129, config=cfg)
    with pytest.raises(ValueError, match="tile_width"):
        gate_pack(x, w, tile_width=96, slots_per_tile=8, config=cfg)
    with pytest.raises(ValueError, match="block_m"):
        GatePackConfig(block_m=24)
    with pytest.raises(ValueError, match="block_k"):
        GatePackConfig(block_k=8)
    with pytest.raises(ValueError, match="prefix_sum"):
        GatePackConfig(prefix_sum="scan")


# --------------------------------------------------------------------------------------------
# Row-compacted inputs for gated_up_down and sparse_down
# --------------------------------------------------------------------------------------------


def make_compact(m, f, k, dtype, rng, nnz=None):
    """Random row-compacted lists: distinct ascending columns per row, row_nnz in [0, K] with
    rows of 0 and of K entries; unused entries hold garbage (out-of-range or negative columns,
    NaN values) to prove the kernels mask them."""
    if nnz is None:
        nnz = rng.integers(0, k + 1, m)
        nnz[0], nnz[1] = 0, k
    nnz = np.asarray(nnz, np.int32)
    columns = np.empty((m, k), np.int32)
    values = np.full((m, k), np.nan, np.float32)
    garbage = np.array([10**6, -7, f, 2**31 - 1], np.int32)
    for row in range(m):
        n = int(nnz[row])
        columns[row] = garbage[(np.arange(k) + row) % len(garbage)]
        columns[row, :n] = np.sort(rng.choice(f, n, replace=False))
        values[row, :n] = rng.uniform(0.1, 2.0, n)
    return jnp.asarray(values, dtype), jnp.asarray(columns), jnp.asarray(nnz)


# --------------------------------------------------------------------------------------------
# gated_up_down
# --------------------------------------------------------------------------------------------

UP_DOWN_SHAPES = [
    # (M, D, F, K, block_m, block_d)
    pytest.param(32, 64, 256, 8, 16, 64, id="M32-D64-F256-K8"),
    pytest.param(48, 128, 384, 21, 16, 32, id="M48-D128-F384-K21-4chunks"),
]


def make_up_down_inputs(m, d, f, k, dtype, gate_dtype, rng, nnz=None):
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w_up_t = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(d), dtype)
    w_down = jnp.asarray(rng.standard_normal((f, d)), dtype)
    gates, columns, row_nnz = make_compact(m, f, k, gate_dtype, rng, nnz)
    return x, w_up_t, w_down, gates, columns, row_nnz


@pytest.mark.parametrize("schedule", ["fused", "two_pass"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,d,f,k,block_m,block_d", UP_DOWN_SHAPES)
def test_gated_up_down_matches_reference(m, d, f, k, block_m, block_d, dtype, schedule):
    rng = np.random.default_rng(seed_of(m, d, k, schedule))
    # bf16 activations with fp32 gates on the two-pass runs: both gate dtypes are accepted.
    gate_dtype = jnp.float32 if schedule == "two_pass" else dtype
    args = make_up_down_inputs(m, d, f, k, dtype, gate_dtype, rng)
    config = GatedUpDownConfig(
        block_m=block_m, block_d=block_d, schedule=schedule, preload_x=(d == 64)
    )
    y, up = gated_up_down(*args, return_up=True, config=config, interpret=INTERPRET)
    ref_y, ref_up = gated_up_down_reference(*args, return_up=True)
    assert y.dtype == dtype and up.dtype == jnp.float32 and up.shape == (m, k)
    assert_close(y, ref_y, dtype, "y")
    assert_close(up, ref_up, jnp.float32, "up_values")
    invalid = np.arange(k)[None, :] >= np.asarray(args[-1])[:, None]
    assert np.all(np.asarray(up)[invalid] == 0), "up_values must be 0 at invalid entries"
    assert np.all(np.asarray(y, np.float32)[0] == 0), "a row without entries gives y = 0"
    y_only = gated_up_down(*args, config=config, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(y_only, np.float32), np.asarray(y, np.float32))


def test_gated_up_down_empty_and_full_blocks():
    """A block with no entries at all (the k loop never runs) and one with every row full."""
    m, d, f, k = 32, 64, 256, 6
    rng = np.random.default_rng(11)
    nnz = np.array([0] * 16 + [k] * 16)
    args = make_up_down_inputs(m, d, f, k, jnp.float32, jnp.float32, rng, nnz=nnz)
    for schedule in ("fused", "two_pass"):
        config = GatedUpDownConfig(block_m=16, block_d=32, schedule=schedule)
        y, up = gated_up_down(*args, return_up=True, config=config, interpret=INTERPRET)
        ref_y, ref_up = gated_up_down_reference(*args, return_up=True)
        assert np.all(np.asarray(y)[:16] == 0) and np.all(np.asarray(up)[:16] == 0)
        assert_close(y, ref_y, jnp.float32, f"y ({schedule})")
        assert_close(up, ref_up, jnp.float32, f"up_values ({schedule})")


def test_gated_up_down_rejects_bad_shapes():
    m, d, f, k = 32, 64, 256, 8
    rng = np.random.default_rng(0)
    x, wu, wd, g, c, n = make_up_down_inputs(m, d, f, k, jnp.bfloat16, jnp.bfloat16, rng)
    cfg = GatedUpDownConfig(block_m=16, block_d=64)
    kw = dict(config=cfg, interpret=INTERPRET)
    with pytest.raises(ValueError, match="M=24"):
        gated_up_down(x[:24], wu, wd, g[:24], c[:24], n[:24], **kw)
    with pytest.raises(ValueError, match="D=64"):
        gated_up_down(x, wu, wd, g, c, n, config=GatedUpDownConfig(block_m=16, block_d=128))
    with pytest.raises(ValueError, match="w_down has shape"):
        gated_up_down(x, wu, wd[:128], g, c, n, **kw)
    with pytest.raises(ValueError, match="w_up_t has shape"):
        gated_up_down(x, wu[:, :32], wd, g, c, n, **kw)
    with pytest.raises(ValueError, match="row_nnz has shape"):
        gated_up_down(x, wu, wd, g, c, n[:16], **kw)
    with pytest.raises(ValueError, match="int32"):
        gated_up_down(x, wu, wd, g, c.astype(jnp.int16), n, **kw)
    with pytest.raises(ValueError, match="schedule"):
        GatedUpDownConfig(schedule="three_pass")
    with pytest.raises(ValueError, match="block_d"):
        GatedUpDownConfig(block_d=48)


# --------------------------------------------------------------------------------------------
# sparse_down
# --------------------------------------------------------------------------------------------

SPARSE_DOWN_SHAPES = [
    # (M, F, D, K, block_m, block_d)
    pytest.param(32, 256, 64, 8, 16, 32, id="M32-F256-D64-K8"),
    pytest.param(48, 384, 128, 19, 16, 64, id="M48-F384-D128-K19"),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,f,d,k,block_m,block_d", SPARSE_DOWN_SHAPES)
def test_sparse_down_matches_reference(m, f, d, k, block_m, block_d, dtype):
    rng = np.random.default_rng(seed_of(m, f, d, k))
    values, columns, row_nnz = make_compact(m, f, k, dtype, rng)
    w = jnp.asarray(rng.standard_normal((f, d)), dtype)
    config = SparseDownConfig(block_m=block_m, block_d=block_d)
    y = sparse_down(values, columns, row_nnz, w, config=config, interpret=INTERPRET)
    assert y.dtype == dtype and y.shape == (m, d)
    assert_close(y, sparse_down_reference(values, columns, row_nnz, w), dtype, "y")
    # Independent dense check: scatter the valid entries into a dense [M, F] and multiply.
    n = np.asarray(row_nnz)
    dense = np.zeros((m, f))
    for row in range(m):
        dense[row, np.asarray(columns)[row, : n[row]]] = np.asarray(values, np.float32)[
            row, : n[row]
        ]
    assert_close(y, dense @ np.asarray(w, np.float64), dtype, "y vs dense")


def test_sparse_down_out_dtype_and_nan_propagation():
    m, f, d, k = 32, 256, 64, 8
    rng = np.random.default_rng(5)
    values, columns, row_nnz = make_compact(m, f, k, jnp.bfloat16, rng)
    w = jnp.asarray(rng.standard_normal((f, d)), jnp.bfloat16)
    config = SparseDownConfig(block_m=16, block_d=64)
    y = sparse_down(
        values, columns, row_nnz, w, out_dtype=jnp.float32, config=config, interpret=INTERPRET
    )
    assert y.dtype == jnp.float32
    ref = sparse_down_reference(values, columns, row_nnz, w, out_dtype=jnp.float32)
    assert_close(y, ref, jnp.float32, "y (fp32 out)")
    # A NaN at a VALID entry propagates to its row (as in the dense product); garbage NaNs at
    # invalid entries (all rows) do not.
    values = values.at[1, 0].set(jnp.nan)
    y = np.asarray(sparse_down(values, columns, row_nnz, w, config=config, interpret=INTERPRET))
    assert np.all(np.isnan(y[1].astype(np.float32)))
    assert np.all(np.isfinite(np.delete(y, 1, axis=0).astype(np.float32)))


def test_sparse_down_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    values, columns, row_nnz = make_compact(32, 256, 8, jnp.float32, rng)
    w = jnp.zeros((256, 64), jnp.float32)
    cfg = SparseDownConfig(block_m=16, block_d=64)
    with pytest.raises(ValueError, match="M=24"):
        sparse_down(values[:24], columns[:24], row_nnz[:24], w, config=cfg)
    with pytest.raises(ValueError, match="D=64"):
        sparse_down(values, columns, row_nnz, w, config=SparseDownConfig(block_m=16, block_d=128))
    with pytest.raises(ValueError, match="values and columns"):
        sparse_down(values, columns[:, :4], row_nnz, w, config=cfg)
    with pytest.raises(ValueError, match="row_nnz has shape"):
        sparse_down(values, columns, row_nnz[:8], w, config=cfg)
    with pytest.raises(ValueError, match="block_m"):
        SparseDownConfig(block_m=12)


# --------------------------------------------------------------------------------------------
# sampled_dot
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,d,f,k,block_m,block_d", UP_DOWN_SHAPES)
def test_sampled_dot_matches_reference(m, d, f, k, block_m, block_d, dtype):
    rng = np.random.default_rng(seed_of("sampled", m, d, k))
    a, w, _, _, columns, row_nnz = make_up_down_inputs(m, d, f, k, dtype, dtype, rng)
    config = SampledDotConfig(block_m=block_m, block_k=4, block_d=block_d)
    out = sampled_dot(a, w, columns, row_nnz, config=config, interpret=INTERPRET)
    ref = sampled_dot_reference(a, w, columns, row_nnz)
    assert out.dtype == jnp.float32 and out.shape == (m, k)
    assert_close(out, ref, jnp.float32 if dtype == jnp.float32 else dtype, "sampled")
    # Independent check in float64, and exact zeros past each row's entries.
    nnz = np.asarray(row_nnz)
    cols = np.asarray(columns)
    a64 = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    got = np.asarray(out)
    for row in range(m):
        n = nnz[row]
        np.testing.assert_allclose(got[row, :n], w64[cols[row, :n]] @ a64[row], rtol=2e-3,
                                   atol=2e-3)
        assert np.all(got[row, n:] == 0)


def test_sampled_dot_rolled_chunk_loop():
    """More D chunks than are unrolled: the rolled loop gives the same result."""
    rng = np.random.default_rng(seed_of("sampled-rolled"))
    a, w, _, _, columns, row_nnz = make_up_down_inputs(16, 144, 64, 6, jnp.float32,
                                                       jnp.float32, rng)
    config = SampledDotConfig(block_m=16, block_k=4, block_d=8)  # 18 chunks
    out = sampled_dot(a, w, columns, row_nnz, config=config, interpret=INTERPRET)
    assert_close(out, sampled_dot_reference(a, w, columns, row_nnz), jnp.float32, "rolled")


def test_sampled_dot_rejects_bad_shapes():
    a = jnp.ones((16, 64), jnp.bfloat16)
    w = jnp.ones((32, 64), jnp.bfloat16)
    cols = jnp.zeros((16, 4), jnp.int32)
    nnz = jnp.ones((16,), jnp.int32)
    with pytest.raises(ValueError, match=r"w has shape \(32, 63\)"):
        sampled_dot(a, w[:, :63], cols, nnz)
    with pytest.raises(ValueError, match="row_nnz has shape"):
        sampled_dot(a, w, cols, nnz[:3])
    with pytest.raises(ValueError, match="block_d=128"):
        sampled_dot(a, w, cols, nnz, config=SampledDotConfig(block_m=16, block_d=128))


# --------------------------------------------------------------------------------------------
# pack_tiles (the packing pass alone)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("tiles_per_program,prefix_sum", [(1, "cumsum"), (2, "matmul")])
def test_pack_tiles_matches_reference(tiles_per_program, prefix_sum, dtype):
    m, d, f, t, s = 48, 64, 256, 32, 4
    rng = np.random.default_rng(seed_of("pack_tiles", tiles_per_program, prefix_sum))
    x, w, _ = make_gate_inputs(m, d, f, t, s, dtype, "special", rng)
    h = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)  # exact: integers
    config = PackTilesConfig(block_m=16, tiles_per_program=tiles_per_program,
                             prefix_sum=prefix_sum)
    got = pack_tiles(h, tile_width=t, slots_per_tile=s, config=config, interpret=INTERPRET)
    ref = pack_tiles_reference(h, tile_width=t, slots_per_tile=s)
    via_gate = gate_pack_reference(x, w, tile_width=t, slots_per_tile=s)
    for a, r, g in zip(got, ref, via_gate):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(g, np.float32))
    check_packed_invariants(*got, t, s)


def test_pack_tiles_rejects_bad_shapes():
    h = jnp.ones((16, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="tile_width=64"):
        pack_tiles(h, tile_width=64, slots_per_tile=4)
    with pytest.raises(ValueError, match="block_m=32"):
        pack_tiles(h, tile_width=32, slots_per_tile=4, config=PackTilesConfig(block_m=32))


# --------------------------------------------------------------------------------------------
# pack_rows (packing straight into row lists)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,f,t,s,block_m", [(48, 256, 32, 4, 16), (32, 384, 128, 8, 32)])
def test_pack_rows_matches_reference(m, f, t, s, block_m, dtype):
    rng = np.random.default_rng(seed_of("pack_rows", m, f, s))
    x, w, _ = make_gate_inputs(m, 64, f, t, s, dtype, "special", rng)
    h = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)  # exact: integers
    got = pack_rows(h, tile_width=t, slots_per_tile=s, config=PackRowsConfig(block_m=block_m),
                    interpret=INTERPRET)
    ref = pack_rows_reference(h, tile_width=t, slots_per_tile=s)
    for a, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))
    values, columns, counts, row_nnz = map(np.asarray, got)
    assert values.shape == (m, f // t * s) and counts.shape == (m, f // t)
    # Light rows rebuild the dense relu exactly; every row's list is ascending.
    dense = np.maximum(np.asarray(jnp.asarray(h, jnp.float32)), 0)
    for row in range(m):
        n = row_nnz[row]
        assert np.all(np.diff(columns[row, :n]) > 0)
        assert np.all(values[row, n:] == 0) and np.all(columns[row, n:] == 0)
        if np.all(counts[row] <= s):
            rebuilt = np.zeros(f, np.float32)
            rebuilt[columns[row, :n]] = values[row, :n].astype(np.float32)
            np.testing.assert_array_equal(rebuilt, dense[row])
