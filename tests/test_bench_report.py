"""experiments/bench_report.py renders bench_ffn rows as tables and any other row as a line."""

from __future__ import annotations

import pytest

from tests.utils import load_experiment


@pytest.fixture(scope="module")
def report():
    with load_experiment("bench_report") as module:
        yield module


def test_bench_ffn_rows_render_as_a_table_with_ratios(report):
    rows = [{"kind": "header", "date": "2026-11-27T10:00:00", "device": "GPU", "jax": "0.11.2",
             "commit": "abc", "command": "bench_ffn.py", "config": {"tile_width": 128}},
            {"kind": "sparsity", "case": "c", "nnz_mean": 28.0, "nnz_p99": 44, "nnz_max": 54,
             "tiles_over_S": 0.0, "heavy_rows": 0},
            {"kind": "time", "case": "c", "label": "xla dense FFN", "median_ms": 2.0,
             "p10_ms": 1.9, "p90_ms": 2.1},
            {"kind": "time", "case": "c", "label": "pallas", "median_ms": 1.0, "p10_ms": 0.9,
             "p90_ms": 1.1, "rel_err": 1e-3}]
    text = report.render(rows)
    assert "commit abc" in text and '"tile_width": 128' in text
    assert "| pallas | 1.000 (0.900-1.100) | 2.00x | 1.00e-03 |" in text


def test_other_rows_render_as_their_scalar_fields(report):
    rows = [{"kind": "header", "date": "2026-11-27T10:00:00", "device": "2 GPUs", "jax": "0.11.2",
             "commit": "abc", "command": "bench_multi_gpu.py"},  # no config: still a header
            {"kind": "time", "preset": "0.5b", "mesh": "data=2", "median_ms": 96.61234,
             "nnz_mean": [28.1, 28.2], "gpus": {"0": {"nccl": 1.0}}}]
    text = report.render(rows)
    assert "on 2 GPUs" in text and "Config" not in text
    assert "- time: preset=0.5b, mesh=data=2, median_ms=96.61" in text
    assert "nnz_mean" not in text and "gpus" not in text  # left to the raw file
