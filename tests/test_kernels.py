"""Pallas kernels against their plain-jnp references (and against independent numpy checks).

On a machine without a GPU every kernel runs in the Pallas interpreter (``INTERPRET`` is True);
on a GPU machine the same tests run the compiled Triton kernels. Shapes are small: interpret
mode runs each program sequentially.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.common import default_interpret
from pallas_kernels.row_backward import (row_backward, row_backward_reference, row_dx,
                                         row_entry_grads)
from pallas_kernels.row_up_down import RowUpDownConfig
from tests.utils import assert_close, seed_of, slow

INTERPRET = default_interpret()

# --------------------------------------------------------------------------------------------
# Row-compacted inputs
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
# row_backward
# --------------------------------------------------------------------------------------------


def numpy_row_backward(dy, w_down, w_up_t, w_gate_t, gate, up, columns, row_nnz, l1):
    """Independent float64 loop over each row's entries."""
    f64 = lambda a: None if a is None else np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    dy, w_down, w_up_t, w_gate_t, gate, up = map(f64, (dy, w_down, w_up_t, w_gate_t, gate, up))
    columns, row_nnz = np.asarray(columns), np.asarray(row_nnz)
    m, k = gate.shape
    dx, d1, d2 = np.zeros(dy.shape), np.zeros((m, k)), np.zeros((m, k))
    for i in range(m):
        for kk in range(min(int(row_nnz[i]), k)):
            j, g = columns[i, kk], gate[i, kk]
            dh = dy[i] @ w_down[j]
            if w_gate_t is None:
                d1[i, kk] = dh + l1 * np.sign(g)
                dx[i] += d1[i, kk] * w_up_t[j]
            else:
                dh += l1 * np.sign(g * up[i, kk])
                d1[i, kk], d2[i, kk] = dh * g, dh * up[i, kk]
                dx[i] += d1[i, kk] * w_up_t[j] + d2[i, kk] * w_gate_t[j]
    return dx, d1, d2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m,d,f,k,config", [
    slow(16, 64, 256, 8, None),
    (21, 192, 300, 13, RowUpDownConfig(block_d=64, num_warps=2)),  # 3 chunks, awkward sizes
])
def test_row_backward_matches_numpy_and_reference(m, d, f, k, config, gated, dtype):
    rng = np.random.default_rng(seed_of("row_backward", m, d, f, k, gated, str(dtype)))
    as_dtype = lambda shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    dy, w_down, w_up_t = as_dtype((m, d)), as_dtype((f, d), d ** -0.5), as_dtype((f, d))
    gate, columns, row_nnz = make_compact(m, f, k, dtype, rng)  # garbage past each count
    w_gate_t = as_dtype((f, d)) if gated else None
    up = (jnp.asarray(np.where(np.isnan(np.asarray(gate, np.float32)), np.nan,
                               rng.standard_normal((m, k))), jnp.float32) if gated else None)
    l1 = 0.3
    dx, d1, d2 = row_backward(dy, w_down, w_up_t, w_gate_t, gate, up, columns, row_nnz,
                              jnp.float32(l1), config=config)
    want = numpy_row_backward(dy, w_down, w_up_t, w_gate_t, gate, up, columns, row_nnz, l1)
    tol = jnp.float32 if dtype == jnp.float32 else dtype
    assert dx.dtype == jnp.float32 and dx.shape == (m, d)
    assert_close(dx, want[0], tol, kind="kernel", what="dx")
    # dx in the input dtype: the same float32 sums, rounded once in the kernel.
    dx_low = row_backward(dy, w_down, w_up_t, w_gate_t, gate, up, columns, row_nnz,
                          jnp.float32(l1), dx_dtype=dtype, config=config)[0]
    assert dx_low.dtype == dtype
    np.testing.assert_array_equal(np.asarray(dx_low, np.float32),
                                  np.asarray(dx.astype(dtype), np.float32))
    assert_close(d1, want[1], tol, kind="kernel", what="du" if gated else "dh")
    if gated:
        assert_close(d2, want[2], tol, kind="kernel", what="dg")
    else:
        assert d2 is None
    # Garbage past the counts must not leak: compare with the reference on cleaned lists.
    valid = jnp.arange(k)[None, :] < row_nnz[:, None]
    clean = lambda a: None if a is None else jnp.where(valid, a, 0)
    ref = row_backward_reference(dy, w_down, w_up_t, w_gate_t, clean(gate), clean(up),
                                 jnp.where(valid, columns, 0), row_nnz, l1)
    for got, expected in zip((dx, d1, d2), ref):
        if expected is not None:
            assert_close(got, expected, tol, kind="kernel", what="vs reference")
    ref_low = row_backward_reference(dy, w_down, w_up_t, w_gate_t, clean(gate), clean(up),
                                     jnp.where(valid, columns, 0), row_nnz, l1,
                                     dx_dtype=dtype)[0]
    assert ref_low.dtype == dtype
    assert_close(dx_low, ref_low, tol, kind="kernel", what="dx in the input dtype vs reference")


def test_row_backward_rejects_bad_input():
    dy = jnp.ones((4, 64), jnp.float32)
    w = jnp.ones((32, 64), jnp.float32)
    gate = jnp.ones((4, 3), jnp.float32)
    cols = jnp.zeros((4, 3), jnp.int32)
    nnz = jnp.ones((4,), jnp.int32)
    with pytest.raises(ValueError, match="w_up_t has shape"):
        row_backward(dy, w, w[:, :32], None, gate, None, cols, nnz, 0.0)
    with pytest.raises(ValueError, match="both w_gate_t and up_values"):
        row_backward(dy, w, w, w, gate, None, cols, nnz, 0.0)
    with pytest.raises(ValueError, match="int32"):
        row_backward(dy, w, w, None, gate, None, cols.astype(jnp.int16), nnz, 0.0)
    with pytest.raises(ValueError, match="up_values has shape"):
        row_entry_grads(dy, w, gate, gate[:, :2], cols, nnz, 0.0)
    with pytest.raises(ValueError, match="both w_gate_t and d2"):
        row_dx(w, w, gate, None, cols, nnz)
    with pytest.raises(ValueError, match="d1 has shape"):
        row_dx(w, None, gate[:, :2], None, cols, nnz)
    with pytest.raises(ValueError, match="w_gate_t has shape"):
        row_dx(w, w[:, :32], gate, gate, cols, nnz)
