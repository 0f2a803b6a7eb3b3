"""experiments/bench_sweep.py on the CPU: every cell of the smoke map measured, checked and drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.utils import load_experiment


@pytest.fixture(scope="module")
def sweep():
    with load_experiment("bench_sweep") as module:
        yield module


def test_smoke_map(sweep, tmp_path):
    out, plot = tmp_path / "sweep.jsonl", tmp_path / "sweep.png"
    rows = sweep.main(["--smoke", "--out", str(out), "--plot", str(plot)])
    cells = [r for r in rows if r["kind"] == "cell"]
    assert len(cells) == len(rows) == 4  # 2 densities x forward, forward + backward
    assert {(r["pass"], r["density_pct"]) for r in cells} == {
        (p, d) for p in ("forward", "forward+backward") for d in (2.0, 50.0)}
    for r in cells:
        assert r["finite"] and r["rel_err_vs_dense"] < 2e-2, r
        assert r["dense_ms"] > 0 and r["sparse_ms"] > 0
        assert r["ratio"] == pytest.approx(r["dense_ms"] / r["sparse_ms"])
    dense_cells = [r for r in cells if r["density_pct"] == 50.0]
    sparse_cells = [r for r in cells if r["density_pct"] == 2.0]
    assert all(r["nnz_mean"] > 64 for r in dense_cells)  # ~128 of 256 units
    assert all(r["nnz_mean"] < 20 for r in sparse_cells)  # ~5 of 256
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["args"]["smoke"]
    assert len(lines) == 5
    assert plot.stat().st_size > 1000


def test_bad_flags_are_one_line_errors(sweep):
    with pytest.raises(SystemExit):
        sweep.main(["--shapes", "64by256"])
    with pytest.raises(SystemExit):
        sweep.main(["--passes", "sideways"])


def test_repeated_sums_every_call(sweep):
    import jax.numpy as jnp
    x = jnp.ones((2, 3), jnp.float32)
    out = sweep.repeated(lambda x, w: x * w, 4)(x, jnp.float32(2.0))
    np.testing.assert_allclose(out, 8.0 * np.ones((2, 3)))


def test_draw_from_recorded_runs(sweep, tmp_path, capsys):
    """A map redrawn from two runs: the later run's cell replaces the earlier one's, the
    header and error lines are skipped, nothing is measured."""
    cell = dict(kind="cell", d=64, f=256, m=8, density_pct=2.0, pass_="forward", nnz_mean=5.0,
                nnz_max=7, rel_err_vs_dense=1e-3, finite=True, dense_ms=2.0, sparse_ms=1.0,
                ratio=2.0)
    cell["pass"] = cell.pop("pass_")
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "header"}, cell, {**cell, "density_pct": 50.0, "ratio": 0.5, "sparse_ms": 4.0},
        {"kind": "error", "d": 64, "f": 256, "m": 8, "density_pct": 5.0, "pass": "forward",
         "error": "OOM"}]) + "\n")
    second.write_text(json.dumps({**cell, "ratio": 1.5, "sparse_ms": 2.0 / 1.5}) + "\n")
    plot = tmp_path / "map.png"
    rows = sweep.main(["--draw-from", str(first), str(second), "--plot", str(plot)])
    assert sorted((r["density_pct"], r["ratio"]) for r in rows) == [(2.0, 1.5), (50.0, 0.5)]
    assert plot.stat().st_size > 1000
    assert "cells below 0.95x: 1 of 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sweep.main(["--draw-from", str(tmp_path / "missing.jsonl"), "--plot", ""])
    headers_only = tmp_path / "empty.jsonl"
    headers_only.write_text(json.dumps({"kind": "header"}) + "\n")
    with pytest.raises(SystemExit):
        sweep.main(["--draw-from", str(headers_only), "--plot", ""])
