"""tools/probe_up_down_chunks.py on the CPU: the chunked up/down equals the whole-list kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from pallas_kernels.row_pack import row_pack
from pallas_kernels.row_up_down import row_up_down
from tests.utils import load_experiment, slow


@pytest.fixture(scope="module")
def probe():
    with load_experiment("probe_up_down_chunks") as module:
        yield module


# Few entries a row; many heavy rows (their lists empty).
@pytest.mark.parametrize("mean_active", [3.0, slow(12.0)])
def test_chunks_match_the_whole_lists(probe, mean_active):
    m, d, f = 16, 64, 384
    cfg = tj.TwELLConfig()
    kx, kg, ku, kd = jax.random.split(jax.random.PRNGKey(int(mean_active)), 4)
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
    w_gate = jax.random.normal(kg, (d, f), jnp.float32) / np.sqrt(d)
    # A per-unit threshold: about mean_active of F positive a row.
    threshold = float(jax.scipy.stats.norm.ppf(1 - mean_active / f))
    pre = (jnp.dot(x.astype(jnp.float32), w_gate) - threshold).astype(jnp.bfloat16)
    w_up_t = (jax.random.normal(ku, (f, d)) / np.sqrt(d)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(kd, (f, d)) / np.sqrt(f)).astype(jnp.bfloat16)
    values, columns, counts, total = row_pack(pre, tile_width=cfg.tile_width,
                                              num_slots=cfg.max_row_nnz(f))
    row_nnz = jnp.where(tj.format.heavy_rows(counts, cfg, f), 0, total)
    assert int(jnp.sum(row_nnz)) > 0
    values, columns = tj.format.mask_lists(values, columns, row_nnz)
    y0, up0, l0 = row_up_down(x, w_up_t, w_down, values, columns, row_nnz)
    for num_chunks in (2, 5):
        parts, _, _ = probe.split_lists(values, columns, row_nnz, f, num_chunks)
        assert sum(int(jnp.sum(n) > 0) for _, _, n in parts) >= 2  # the entries really split
        assert sum(int(jnp.sum(n)) for _, _, n in parts) == int(jnp.sum(row_nnz))
        y, up, l1 = probe.chunked_up_down(x, w_up_t, w_down, values, columns, row_nnz,
                                          num_chunks)
        assert bool(jnp.all(jnp.isfinite(y)))
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y0, np.float32),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(up), np.asarray(up0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-5, atol=1e-6)
