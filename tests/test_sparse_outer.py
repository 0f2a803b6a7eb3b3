"""The sparse_outer kernel (the backward's transposed products) against its jnp reference and
float64, and the "pallas" backend's gradients against the "reference" backend's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from pallas_kernels.sparse_outer import (SparseOuterConfig, column_pieces, column_view,
                                         max_later_pieces, sparse_outer,
                                         sparse_outer_reference)
from tests.utils import assert_close, make_ffn_inputs, slow, slow_unless

M, K, D, F = 48, 12, 64, 96


def make_pattern(seed: int, pattern: str, dtype, n_values: int = 1):
    """Row lists with garbage (NaN values, out-of-range columns) past row_nnz."""
    rng = np.random.default_rng(seed)
    row_nnz = rng.integers(0, K + 1, M)
    if pattern == "zero_rows":
        row_nnz[: M // 3] = 0
    elif pattern == "full_rows":
        row_nnz[:] = K
    columns = np.stack([rng.choice(F, K, replace=False) for _ in range(M)])
    if pattern == "hot_column":  # every row's first entry hits unit 5
        columns[:, 0] = 5
        columns[:, 1:] = np.where(columns[:, 1:] == 5, 6, columns[:, 1:])
        row_nnz = np.maximum(row_nnz, 1)
    values = [rng.standard_normal((M, K)) for _ in range(n_values)]
    invalid = np.arange(K)[None, :] >= row_nnz[:, None]
    columns = np.where(invalid, rng.integers(-7, 3 * F, (M, K)), columns)
    values = [np.where(invalid, np.nan, v) for v in values]
    b = rng.standard_normal((M, D))
    return (tuple(jnp.asarray(v, dtype) for v in values), jnp.asarray(columns, jnp.int32),
            jnp.asarray(row_nnz, jnp.int32), jnp.asarray(b, dtype))


def float64_outer(values, columns, row_nnz, b):
    out = [np.zeros((F, D)) for _ in values]
    b64 = np.asarray(b.astype(jnp.float32), np.float64)
    for m in range(M):
        for k in range(int(row_nnz[m])):
            for o, v in zip(out, values):
                o[int(columns[m, k])] += float(v[m, k].astype(jnp.float32)) * b64[m]
    return out


# Fast tier: the hot-column pattern in cut pieces (the busiest case) in bf16, every value
# count; the other patterns, float32 and whole columns are marked slow.
@pytest.mark.parametrize("pattern", slow_unless(["hot_column"],
                                                ["uniform", "zero_rows", "full_rows", "hot_column"]))
@pytest.mark.parametrize("dtype", [slow(jnp.float32), jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n_values", [1, 2])
@pytest.mark.parametrize("min_piece", [slow(64), 1], ids=["whole_columns", "cut_columns"])
def test_kernel_matches_reference_and_float64(pattern, dtype, n_values, min_piece):
    # min_piece 1: pieces of ~2 E / F = 6 entries, so busy columns (all of unit 5's 48 in
    # "hot_column") are cut into several pieces whose partial sums are added afterwards.
    seed = {"uniform": 1, "zero_rows": 2, "full_rows": 3, "hot_column": 4}[pattern]
    values, columns, row_nnz, b = make_pattern(seed, pattern, dtype, n_values)
    expected = float64_outer(values, columns, row_nnz, b)
    config = SparseOuterConfig(block_f=16, block_d=32, min_piece=min_piece)
    got = sparse_outer(values, columns, row_nnz, b, F, config=config)
    if pattern == "hot_column" and min_piece == 1:  # the cut path really ran
        _, starts, counts = column_view(columns, row_nnz, F)
        assert 5 in np.asarray(column_pieces(starts, counts, min_piece).busy)
    ref = jax.jit(sparse_outer_reference, static_argnums=4)(values, columns, row_nnz, b, F)
    assert len(got) == len(ref) == n_values
    for g, r, e in zip(got, ref, expected):
        assert g.dtype == jnp.float32 and g.shape == (F, D)
        # Both accumulate in fp32 from the same (rounded) inputs: float32 tolerance for both.
        assert_close(g, e, jnp.float32, what=f"kernel {pattern}")
        assert_close(r, e, jnp.float32, what=f"reference {pattern}")


def test_skip_stores_nothing():
    """``skip`` read on the device: false computes what no flag does, bit for bit; true stores
    nothing (the interpreter's unwritten outputs hold NaN), so a batch that went dense does
    not pay a pass of zeros over every dW it discards."""
    values, columns, row_nnz, b = make_pattern(1, "hot_column", jnp.bfloat16, 2)
    config = SparseOuterConfig(block_f=16, block_d=32, min_piece=1)  # later pieces too
    # Interpreted whatever the machine: only the interpreter fills unwritten outputs with NaN.
    run = jax.jit(lambda skip: sparse_outer(values, columns, row_nnz, b, F, config=config,
                                            skip=skip, interpret=True))
    plain = sparse_outer(values, columns, row_nnz, b, F, config=config, interpret=True)
    for got, want in zip(run(jnp.asarray(False)), plain):
        assert float(jnp.max(jnp.abs(want))) > 0
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got in run(jnp.asarray(True)):
        assert np.isnan(np.asarray(got)).all()


@pytest.mark.parametrize("unroll", [1, 3])
@pytest.mark.parametrize("pattern", ["uniform", "hot_column"])
def test_entries_per_step_match_float64(unroll, pattern):
    # Entries of each piece per loop step: with 3, a piece's last step is partly past its end
    # (masked); short pieces (min_piece 1) make that common.
    values, columns, row_nnz, b = make_pattern(5, pattern, jnp.bfloat16, 2)
    expected = float64_outer(values, columns, row_nnz, b)
    config = SparseOuterConfig(block_f=16, block_d=32, min_piece=1, unroll=unroll)
    got = sparse_outer(values, columns, row_nnz, b, F, config=config)
    for g, e in zip(got, expected):
        assert_close(g, e, jnp.float32, what=f"unroll {unroll} {pattern}")


@pytest.mark.parametrize("d_ff", [F, 70_000])  # 16-bit sort keys; 32-bit past 65,534 units
def test_column_view_groups_entries_by_column(d_ff):
    _, columns, row_nnz, _ = make_pattern(3, "uniform", jnp.float32)
    if d_ff != F:  # spread the units over the wide range, the last one included
        columns = jnp.where(columns == F - 1, d_ff - 1, columns * (d_ff // F))
    order, starts, counts = column_view(columns, row_nnz, d_ff)
    cols, nnz = np.asarray(columns), np.asarray(row_nnz)
    valid = np.arange(K)[None, :] < nnz[:, None]
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(cols[valid], minlength=d_ff))
    assert np.sum(np.asarray(counts)) == np.sum(np.minimum(nnz, K)) > 0
    order = np.asarray(order)
    for f in sorted(set(cols[valid][:3].tolist()) | {0, d_ff - 1}):
        entries = order[starts[f]: starts[f] + counts[f]]
        assert np.all(cols.reshape(-1)[entries] == f) and np.all(np.diff(entries) > 0)


@pytest.mark.parametrize("counts", [
    [0] * 10 + [500] + [0] * 5,  # one unit holds every entry
    [3] * 16,  # all alike: one piece each
    [0] * 16,  # nothing
    [1, 40, 0, 7, 7, 100, 2, 0, 9, 64, 65, 1, 0, 0, 33, 12],
])
@pytest.mark.parametrize("min_piece", [1, 8])
def test_column_pieces_cover_every_entry_once(counts, min_piece):
    counts = np.asarray(counts, np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    f = len(counts)
    p = jax.tree.map(np.asarray, column_pieces(jnp.asarray(starts), jnp.asarray(counts),
                                               min_piece))
    n_later = max_later_pieces(f)
    assert p.start.shape == p.size.shape == (f + n_later,) and p.busy.shape == (n_later,)
    length = int(p.length)
    assert length == max(min_piece, -(-2 * int(counts.sum()) // f))
    assert np.all(p.size <= length) and np.all(p.size >= 0)
    assert p.later_count.sum() <= n_later and np.all(p.size[f + p.later_count.sum():] == 0)
    for u in range(f):  # the first piece, then the later ones, cover the column in order
        mine = np.concatenate([[u], f + p.later_first[u] + np.arange(p.later_count[u])])
        assert np.all(p.size[mine[:-1]] == length)  # only the last piece may be short
        covered = np.concatenate([np.arange(s, s + n) for s, n in zip(p.start[mine], p.size[mine])])
        np.testing.assert_array_equal(covered, starts[u] + np.arange(counts[u]))
    np.testing.assert_array_equal(p.busy[p.busy < f], np.nonzero(p.later_count)[0])


def test_bad_arguments_raise():
    values, columns, row_nnz, b = make_pattern(0, "uniform", jnp.float32)
    with pytest.raises(ValueError, match="non-empty tuple"):
        sparse_outer(values[0], columns, row_nnz, b, F)
    with pytest.raises(ValueError, match="b must be"):
        sparse_outer(values, columns, row_nnz, b[:-1], F)
    with pytest.raises(ValueError, match="not a multiple of block_f"):
        sparse_outer(values, columns, row_nnz, b, F, config=SparseOuterConfig(block_f=64))
    with pytest.raises(ValueError, match="int32"):
        sparse_outer(values, columns.astype(jnp.int16), row_nnz, b, F)
    with pytest.raises(ValueError, match="min_piece"):
        SparseOuterConfig(min_piece=0)
    with pytest.raises(ValueError, match="unroll"):
        SparseOuterConfig(unroll=0)


@pytest.mark.slow  # the sparse backward against the dense one: tests/test_ffn.py
def test_backend_gradients_equal_the_reference_backend():
    m, d, f = 40, 72, 200  # nothing divides a block: the backend pads
    x, *weights = make_ffn_inputs(4, m, d, f, "heavy_tailed", jnp.bfloat16)
    config = tj.TwELLConfig(tile_width=32, slots_per_tile=4, dense_fallback_density=1.0)
    dy = jnp.asarray(np.random.default_rng(2).standard_normal((m, d)), jnp.bfloat16)

    def grads(implementation):
        def loss(x, w):
            y, st = tj.gated_mlp(x, *w, implementation=implementation, config=config,
                                 return_stats=True)
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + 1e-3 * st.l1
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, tuple(weights))

    got = grads("pallas")
    want = grads("reference")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, jnp.bfloat16, kind="grad", what="pallas vs reference")
