"""TwELL format: pack / to_dense round trips and row compaction, as properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twell_jax as tj
from twell_jax import format as fmt
from twell_jax.format import heavy_rows, pack_tiles, row_compact

ROW_KINDS = ("zero", "dense", "sparse", "at_capacity", "over_capacity", "heavy_tailed")


def _row(rng, kind, f, tile, slots):
    row = np.zeros(f, np.float32)
    if kind == "dense":
        row[:] = rng.uniform(0.1, 2.0, f)
    elif kind == "sparse":
        row[:] = np.where(rng.random(f) < 0.05, rng.standard_normal(f), 0.0)
    elif kind in ("at_capacity", "over_capacity"):
        # Exactly S (or S + 1) non-zeros in one random tile, the rest sparse.
        t = rng.integers(0, -(-f // tile))
        cols = np.arange(t * tile, min(f, (t + 1) * tile))
        n = min(len(cols), slots + (kind == "over_capacity"))
        row[rng.choice(cols, n, replace=False)] = rng.uniform(0.5, 1.5, n)
    elif kind == "heavy_tailed":
        density = min(1.0, rng.lognormal(-3.0, 1.5))
        row[:] = np.where(rng.random(f) < density, rng.standard_normal(f), 0.0)
    return row


@st.composite
def _packing_case(draw):
    tile = draw(st.sampled_from([16, 32]))
    slots = draw(st.sampled_from([1, 2, 4, 8, 16]))
    m = draw(st.integers(1, 12))
    f = draw(st.integers(1, 100))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=m, max_size=m))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    h = np.stack([_row(rng, k, f, tile, slots) for k in kinds])
    density = draw(st.sampled_from([1 / 64, 0.1, 1.0]))
    return h, tj.TwELLConfig(tile_width=tile, slots_per_tile=slots, max_row_density=density)


# Each random case compiles its own shapes: the fast tier draws a few, the slow tier many more.
@settings(max_examples=4, deadline=None)
@given(_packing_case())
def test_pack_round_trip_is_exact(case):
    _check_pack_round_trip(case)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(_packing_case())
def test_pack_round_trip_is_exact_many_cases(case):
    _check_pack_round_trip(case)


def _check_pack_round_trip(case):
    h, config = case
    packed = fmt.pack(jnp.asarray(h), config)
    np.testing.assert_array_equal(np.asarray(packed.to_dense()), h)
    assert not bool(packed.overflowed)
    # Counts are the true counts; heavy rows are exactly those over S in some tile.
    n_tiles = config.num_tiles(h.shape[1])
    padded = np.pad(h != 0, ((0, 0), (0, n_tiles * config.tile_width - h.shape[1])))
    counts = padded.reshape(h.shape[0], n_tiles, -1).sum(-1)
    np.testing.assert_array_equal(np.asarray(packed.counts), counts)
    heavy = (counts > config.slots_per_tile).any(1) | (counts.sum(1) > config.max_row_nnz(h.shape[1]))
    assert int(packed.num_heavy) == int(heavy.sum())
    # Stored slots are in ascending column order within each (row, tile).
    cols = np.asarray(packed.columns)
    kept = np.minimum(counts, config.slots_per_tile)
    for r, t in zip(*np.nonzero(kept > 1)):
        assert np.all(np.diff(cols[r, t, : kept[r, t]]) > 0)


@settings(max_examples=5, deadline=None)
@given(_packing_case())
def test_row_compact_keeps_every_stored_entry_in_order(case):
    _check_row_compact(case)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(_packing_case())
def test_row_compact_keeps_every_stored_entry_in_order_many_cases(case):
    _check_row_compact(case)


def _check_row_compact(case):
    h, config = case
    values, columns, counts = pack_tiles(jnp.asarray(h), config.tile_width, config.slots_per_tile)
    flat_values, flat_columns, row_nnz = row_compact(values, columns, counts, config.slots_per_tile)
    heavy = np.asarray(heavy_rows(counts, config, h.shape[1]))
    flat_values, flat_columns, row_nnz = map(np.asarray, (flat_values, flat_columns, row_nnz))
    for r in range(h.shape[0]):
        n = row_nnz[r]
        assert np.all(flat_values[r, n:] == 0) and np.all(flat_columns[r, n:] == 0)
        rebuilt = np.zeros(h.shape[1], np.float32)
        rebuilt[flat_columns[r, :n]] = flat_values[r, :n]
        assert np.all(np.diff(flat_columns[r, :n]) > 0)
        if not heavy[r]:  # light rows are complete
            np.testing.assert_array_equal(rebuilt, h[r])


def test_backup_capacity_and_overflow():
    h = np.zeros((6, 40), np.float32)
    h[1, :20] = 1.0  # heavy
    h[4, 3:12] = 2.0  # heavy with S = 4
    h[2, 5] = -3.0  # light
    config = tj.TwELLConfig(tile_width=16, slots_per_tile=4, backup_rows=2)
    packed = fmt.pack(jnp.asarray(h), config)
    assert int(packed.num_heavy) == 2 and not bool(packed.overflowed)
    np.testing.assert_array_equal(np.asarray(packed.backup_index), [1, 4])
    np.testing.assert_array_equal(np.asarray(packed.to_dense()), h)
    small = fmt.pack(jnp.asarray(h), tj.TwELLConfig(tile_width=16, slots_per_tile=4, backup_rows=1))
    assert bool(small.overflowed)  # visible to the caller, never silent


def test_pack_works_under_jit_and_is_a_pytree():
    h = jnp.asarray(np.random.default_rng(0).standard_normal((8, 70)), jnp.bfloat16)
    config = tj.TwELLConfig(tile_width=32, slots_per_tile=4)
    packed = jax.jit(lambda a: fmt.pack(a, config))(h)
    assert isinstance(packed, fmt.TwELL) and packed.shape == (8, 70)
    leaves = jax.tree_util.tree_leaves(packed)
    assert len(leaves) == 6
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: p.to_dense())(packed)), np.asarray(h))


@pytest.mark.parametrize("kwargs", [
    dict(tile_width=48), dict(tile_width=8), dict(slots_per_tile=3),
    dict(tile_width=16, slots_per_tile=32), dict(backup_rows=-1),
    dict(dense_fallback_density=1.5), dict(max_row_density=0.0),
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="|".join(kwargs)):
        tj.TwELLConfig(**kwargs)


def test_pack_rejects_wrong_rank():
    with pytest.raises(ValueError, match="shape"):
        fmt.pack(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 6), (jnp.bfloat16, 5), (jnp.float16, 4),
                                     (jnp.float32, 3), (jnp.int8, 8), (jnp.int8, 6)])
def test_take_rows_and_set_rows_match_take_and_scatter(dtype, d):
    """The backup's row gathers move 32-bit words where a row's bytes allow (odd bf16 widths
    and int8 rows of 6 bytes stay element-wise), its writes declare unique indices: the same
    bits as jnp.take / .at[].set, zero rows for the padding of ``heavy_row_index``, padding
    writes dropped."""
    rng = np.random.default_rng(d)
    m = 11
    a = jnp.asarray(rng.standard_normal((m, d)) * 20).astype(dtype)
    a = a.at[3, 0].set(jnp.nan) if jnp.issubdtype(dtype, jnp.floating) else a
    heavy = jnp.asarray(rng.random(m) < 0.5).at[3].set(True)
    index = fmt.heavy_row_index(heavy, 8)  # more slots than heavy rows: padded with m
    assert int(jnp.sum(index == m)) > 0
    bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8)
                                if jnp.dtype(v.dtype).itemsize > 1 else v).tobytes()
    want = jnp.take(a, index, axis=0, mode="fill", fill_value=0)
    got = jax.jit(fmt.take_rows)(a, index)
    assert got.dtype == a.dtype and got.shape == (8, d)
    assert bits(got) == bits(want)
    assert not np.any(np.asarray(got[np.asarray(index) == m], np.float32))  # padding: zeros
    rows = jnp.asarray(rng.standard_normal((8, d)) * 5, jnp.float32)
    want = a.at[index].set(rows.astype(dtype), mode="drop")
    got = jax.jit(fmt.set_rows)(a, index, rows)
    assert got.dtype == a.dtype and bits(got) == bits(want)
    light = ~np.asarray(heavy)
    assert bits(got[light]) == bits(a[light])  # rows not indexed are untouched


@pytest.mark.parametrize("heavy_share, expected", [(0.7, False), (0.8, True), (1.0, True)])
def test_mostly_heavy_reads_a_sample_of_rows(heavy_share, expected):
    # 1024 rows, sampled every 4th (256 rows); heavy rows have cap + 1 active units, light
    # ones exactly the cap; the padded columns past d_ff are never positive.
    config = tj.TwELLConfig(tile_width=32, slots_per_tile=4)
    d_ff, m = 640, 1024
    cap = config.max_row_nnz(d_ff)
    heavy = (np.arange(m) // 4) < heavy_share * (m // 4)  # by sampled row
    active = np.where(heavy, cap + 1, cap)
    pre = np.where(np.arange(d_ff + 64)[None, :] < active[:, None], 1.0, -1.0)
    pre[:, d_ff:] = 0.0
    got = fmt.mostly_heavy(jnp.asarray(pre, jnp.bfloat16), config, d_ff)
    assert bool(got) == expected


@pytest.mark.parametrize("per_row, heavy_share, expected", [
    (28, 0.0, False),  # the design point: light rows, sparse by far
    (44, 0.0, False),  # light rows just past the break-even: within the margin, left to the counts
    (56, 0.0, True),   # light rows, 1.29x the dense estimate: dense
    (80, 0.4, True),   # 40% heavy: not mostly heavy, but the backup makes the batch dense
    (120, 1.0, True)])
def test_sampled_cost_skips_batches_the_cost_model_clearly_sends_dense(per_row, heavy_share,
                                                                       expected):
    """A sample of rows, scaled to the batch, through the cost model with a margin: the batch
    goes dense without its lists only when the sparse estimate exceeds 1.25 x the dense."""
    config = tj.TwELLConfig()
    m, d, d_ff = 4096, 2048, 5632
    cap = config.max_row_nnz(d_ff)
    rows = np.arange(m)
    heavy = (rows // 16) < heavy_share * (m // 16)  # by sampled row (every 16th is read)
    active = np.where(heavy, max(per_row, cap + 1), min(per_row, cap))
    pre = np.where(np.arange(d_ff)[None, :] < active[:, None], 1.0, -1.0)
    got = fmt.sampled_cost_says_dense(jnp.asarray(pre, jnp.bfloat16), config, d_ff, d, 2)
    cost = config.cost_model
    light_nnz = float(np.sum(np.where(heavy, 0, active)))
    sparse = float(cost.sparse_up_down_seconds(d, d_ff, light_nnz, float(heavy.sum()), 2))
    assert (sparse > 1.25 * cost.dense_up_down_seconds(m, d, d_ff, 2)) == expected
    assert bool(got) == expected


def test_hbm_gather_rate_by_device_kind():
    """Weights past the L2 are costed at the rate measured on the device's kind; an explicit
    rate wins; a kind never measured takes the H100's."""
    from twell_jax.config import HBM_GATHER_BYTES_PER_S, CostModel

    cost = CostModel()
    assert cost.hbm_gather_rate("NVIDIA H200") == HBM_GATHER_BYTES_PER_S["H200"]
    assert cost.hbm_gather_rate("NVIDIA H100 80GB HBM3") == HBM_GATHER_BYTES_PER_S["H100"]
    assert cost.hbm_gather_rate("cpu") == HBM_GATHER_BYTES_PER_S["H100"]
    assert CostModel(gather_hbm_bytes_per_s=1e12).hbm_gather_rate("NVIDIA H200") == 1e12
    # D = 4096, F = 14336 (235 MB of W_up and W_down): the rate sets the sparse cost.
    d, f = 4096, 14336
    h100, h200 = (CostModel(gather_hbm_bytes_per_s=rate) for rate in (2.6e12, 4.4e12))
    entries = 1.0e6
    assert float(h100.sparse_up_down_seconds(d, f, entries, 0.0, 2)) == pytest.approx(
        entries * 2 * d * 2 / 2.6e12)
    assert float(h200.sparse_up_down_seconds(d, f, entries, 0.0, 2)) == pytest.approx(
        entries * 2 * d * 2 / 4.4e12)
    # At 0.5% of F active (M = 16384) the rates fall on either side of two dense GEMMs: dense
    # under the H100's rate, sparse under the H200's.
    m = 16384
    light = m * 0.005 * f
    dense = cost.dense_up_down_seconds(m, d, f, 2)
    assert float(h100.sparse_up_down_seconds(d, f, light, 0.0, 2)) > dense
    assert float(h200.sparse_up_down_seconds(d, f, light, 0.0, 2)) < dense
