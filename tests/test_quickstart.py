"""Smoke test of experiments/quickstart.py: main() end to end with tiny flags."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tests.utils import load_experiment

@pytest.fixture(scope="module")
def quickstart():
    with load_experiment("quickstart") as module:
        yield module


TINY = ["--d-model", "16", "--d-ff", "96", "--tokens", "48", "--density", "0.05",
        "--timing-runs", "2", "--train-steps", "6", "--log-every", "2",
        "--learning-rate", "1e-2"]


def test_main_tiny(quickstart, tmp_path, capsys):
    log = tmp_path / "quickstart.jsonl"
    result = quickstart.main(TINY + ["--jsonl", str(log)])
    out = capsys.readouterr().out

    rows = result["rows"]
    assert {r["implementation"] for r in rows} == {"xla", "reference", "pallas"}
    assert {r["dtype"] for r in rows} == {"bfloat16", "float32"}
    tol = {"bfloat16": 2e-2, "float32": 1e-5}
    for r in rows:
        assert r["rel_err"] < tol[r["dtype"]], r
        assert 0 < r["nnz_mean"] < 0.25 * 96, r  # the threshold made the gate sparse
        assert r["ms_median"] > 0
    assert "rel err" in out and "nnz mean" in out  # the table was printed

    history = result["history"]
    assert [h["step"] for h in history] == list(range(1, 7))
    losses = [h["loss"] for h in history]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert "step    6" in out

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(r["kind"] == "check" for r in records) == len(rows)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 4, 6]


def test_every_flag_has_help(quickstart):
    for field in dataclasses.fields(quickstart.Defaults):
        assert field.metadata.get("help"), field.name


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--density", "1.5"],
                                  ["--implementations", "cuda"], ["--d-model", "1"]])
def test_bad_flags_exit(quickstart, argv):
    with pytest.raises(SystemExit):
        quickstart.parse_args(argv)
