"""experiments/bench_ffn.py on the CPU: the timer's contract and the smoke suite as run."""

import json

import jax
import jax.numpy as jnp
import pytest

from tests.utils import load_experiment


@pytest.fixture(scope="module")
def bench():
    with load_experiment("bench_ffn") as module:
        yield module


def test_time_ms_queues_calls_and_reports_a_lone_calls_latency(bench):
    fn = jax.jit(lambda a: jnp.tanh(a @ a))
    t = bench.time_ms(fn, jnp.ones((64, 64)), runs=3, min_batch_ms=5.0)
    assert t["calls_per_batch"] >= 1
    assert 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
    assert t["latency_ms"] > 0
    # A batch lasts about min_batch_ms: a minimum above one call's time queues several.
    many = bench.time_ms(fn, jnp.ones((64, 64)), runs=2, min_batch_ms=50 * t["latency_ms"])
    assert many["calls_per_batch"] > 1


def test_smoke_case_runs_checks_and_times_every_variant(bench, tmp_path):
    out = tmp_path / "bench.jsonl"
    rows = bench.main(["--suite", "smoke_uniform", "--runs", "1", "--min-batch-ms", "1",
                       "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and len(lines) == len(rows) + 2  # + the sparsity line
    timed = {r["label"]: r for r in rows}
    assert not [r for r in rows if "error" in r]
    for label in ("xla dense FFN", "pallas TwELL FFN", "pallas TwELL FFN, sparse forced"):
        row = timed[label]
        assert row["median_ms"] > 0 and row["latency_ms"] > 0
        assert row["rel_err"] < 2e-2  # bf16 against float64 on sampled rows
    assert timed["xla dense FFN"]["speedup_vs_xla"] == 1.0
