"""experiments/bench_ffn.py on the CPU: the timer's contract and the smoke suite as run."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from tests.utils import load_experiment
from twell_jax.benchmarking import ffn_cases


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
    for label in ("xla dense FFN", "pallas TwELL FFN", "xla dense FFN, with statistics",
                  "pallas TwELL FFN, with statistics", "pallas TwELL FFN, sparse forced"):
        row = timed[label]
        assert row["median_ms"] > 0 and row["latency_ms"] > 0
        assert row["rel_err"] < 2e-2  # bf16 against float64 on sampled rows
    assert timed["xla dense FFN"]["speedup_vs_xla"] == 1.0


@pytest.mark.slow  # ~5 min on 2 cores: the smoke suite with every backward, then decode sizes
def test_float32_master_weights(bench, tmp_path, monkeypatch):
    """--weights-dtype float32: the FFNs get float32 weights (as the models hold them), with
    --backward every gradient checked against the float32 reference before timing, and at
    decode sizes too."""
    out = tmp_path / "bench.jsonl"
    rows = bench.main(["--suite", "smoke_uniform", "--backward", "--weights-dtype", "float32",
                       "--runs", "1", "--min-batch-ms", "1", "--out", str(out)])
    header = json.loads(out.read_text().splitlines()[0])
    assert header["args"]["weights_dtype"] == "float32"
    assert rows and not [r for r in rows if "error" in r]
    stages = [r for r in rows if r["kind"] == "stage_bwd"]
    assert len(stages) == 3 and all(r["TB_per_s"] > 0 and r["bytes"] > 0 for r in stages)
    for row in rows:
        if row["kind"] == "stage_bwd":  # the backward's kernels alone: timed, not checked
            continue
        errors = [v for k, v in row.items() if k.startswith("rel_err_")]
        assert len(errors) == 4 and max(errors) < 2e-2, row
        assert row["median_ms"] > 0
    # Decode sizes take the flag too (the timed FFNs of the on-device loop; a short loop).
    monkeypatch.setattr(bench, "DECODE_STEPS", 1)
    monkeypatch.setattr(bench, "DECODE_LAYERS", 1)
    monkeypatch.setattr(bench, "UNROLLED_SETS", 2)
    case = dataclasses.replace(bench.CASES["decode_m1"], d=64, f=256, nnz_target=8.0)
    weight_dtypes, time_ms = [], bench.time_ms
    def recording_time_ms(fn, x, weight_sets, **kwargs):  # the weights each loop was timed on
        weight_dtypes.append({str(w.dtype) for w in jax.tree.leaves(weight_sets)})
        return time_ms(fn, x, weight_sets, **kwargs)
    monkeypatch.setattr(bench, "time_ms", recording_time_ms)
    timed = []
    bench.run_decode_case(case, bench.BenchArgs(runs=1, weights_dtype="float32"),
                          tj.TwELLConfig(), timed.append)
    labels = [r.get("label") for r in timed if "label" in r]
    ffns = [r for r in timed if r.get("label") in ("xla dense FFN", "pallas TwELL FFN")]
    assert len(ffns) == 2 and all("error" not in r and r["rel_err"] < 2e-2 for r in ffns), ffns
    # The calls unrolled over distinct weight sets, the sparse op on both layouts.
    unrolled = [r for r in timed if str(r.get("label")).startswith("unrolled: ")]
    assert len(unrolled) == 3 and all("error" not in r and r["rel_err"] < 2e-2
                                      for r in unrolled), unrolled
    for label in ("xla dense FFN", "pallas TwELL FFN"):
        assert weight_dtypes[labels.index(label)] == {"float32"}, label


def test_trained_pattern_follows_the_trained_models_counts(bench):
    case = bench.CASES["smoke_trained"]
    hist, d_ff = ffn_cases.trained_histogram()
    assert d_ff == 2560 and hist.sum() > 0
    want_mean = (hist * np.arange(len(hist))).sum() / hist.sum() * case.f / d_ff
    assert case.nnz_target == pytest.approx(want_mean)
    big = bench.Case("trained_check", 4096, 256, 1024, "trained", case.nnz_target)
    x, w_gate, *_ = bench.make_case_inputs(big)
    stats, heavy = bench.sparsity_stats(x, w_gate, tj.TwELLConfig())
    assert stats["nnz_mean"] == pytest.approx(want_mean, rel=0.15)
    # Heavy-tailed like the model's counts: a p99 far above the mean, some heavy rows.
    cdf = np.cumsum(hist) / hist.sum()
    want_p99 = np.searchsorted(cdf, 0.99) * case.f / d_ff
    assert 0.6 * want_p99 < stats["nnz_p99"] < 1.6 * want_p99
    assert stats["nnz_p99"] > 3 * stats["nnz_mean"] and heavy.any()
