"""experiments/bench_generate.py on the CPU: every field of a decode record, the ratio table."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from tests.utils import load_experiment
from twell_jax.benchmarking.model_bench import calibrate


@pytest.fixture(scope="module")
def bench():
    with load_experiment("bench_generate") as module:
        yield module


def test_end_to_end_on_tiny(bench, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    # In-process (no subprocess per case) to stay well under a minute on two CPU cores.
    rows = bench.main(["--presets", "tiny", "--batches", "2", "--context", "40",
                       "--new-tokens", "6", "--runs", "1", "--mean-nnz", str(28.0 * 8),
                       "--no-subprocess", "--out", str(out)])
    assert not [r for r in rows if r["kind"] == "error"], rows
    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert saved[0]["kind"] == "header" and saved[0]["commit"] and len(saved) == len(rows)
    assert saved[0]["compile_cache_dir"] == (jax.config.jax_compilation_cache_dir or None)
    cases = {r["implementation"]: r for r in rows if r["kind"] == "generate"}
    assert set(cases) == {"xla", "pallas"}
    for r in cases.values():
        for name in ("ttft_ms", "decode_call_ms", "step_ms", "decode_tokens_per_s",
                     "weight_floor_ms", "kv_floor_ms", "step_over_floor", "nnz_decode_mean",
                     "decode_one_step_call_ms", "ttft_compile_s", "decode_compile_s"):
            assert math.isfinite(r[name]) and r[name] > 0, (name, r[name])
        assert math.isfinite(r["marginal_step_ms"])  # a difference: CPU noise may flip its sign
        assert r["prompt_len"] == 34 and r["decode_steps"] == 5
        assert r["decode_tokens_per_s"] == pytest.approx(2 / (r["step_ms"] / 1e3))
        assert len(r["nnz_decode_by_layer"]) == 2
        # Each decode token's count, recomputed from the generated sequences: the loop's own
        # mean (read one position off, the tiny model's means move by ~0.2), exactly for the
        # dense model on the CPU, else up to a unit flipped by rounding among the 10 tokens
        # (0.1 of the mean); on a GPU, whose recount may run other GEMM algorithms than the
        # loop, up to three; and a tail within F.
        cpu = jax.default_backend() == "cpu"
        tolerance = 1e-5 if cpu and r["implementation"] == "xla" else 0.15 if cpu else 0.35
        for mean, token_mean, p99, top in zip(
                r["nnz_decode_by_layer"], r["nnz_decode_token_mean_by_layer"],
                r["nnz_decode_token_p99_by_layer"], r["nnz_decode_token_max_by_layer"]):
            assert token_mean == pytest.approx(mean, abs=tolerance), (token_mean, mean)
            assert token_mean <= p99 <= top <= 256, (token_mean, p99, top)
        if jax.default_backend() == "gpu":  # NVML's energy counter
            assert r["energy_j"] > 0 and r["mj_per_token"] > 0
        else:
            assert r["energy_j"] is None and r["mj_per_token"] is None
        # Tied embedding: it is the output head, so the floor counts it.
        assert r["weight_bytes"] == 2 * bench.model_lib.CONFIGS["tiny"].param_count() \
            + 2 * 2 * 256  # bf16; plus the gate biases [F] of both layers
        assert len(r["tokens"]) == 2 and all(len(t) == 6 for t in r["tokens"])
        if saved[0]["compile_cache_dir"] is None:  # no persistent cache: nothing loaded
            assert r["programs_loaded_from_cache"] == 0
    # Decode steps of 2 rows take the list-free decode path; the prefill the lists in
    # interpret mode (where the cost model never routes to dense); on a GPU the tiny model's
    # prefill is too small for the lists to pay, and runs dense.
    assert cases["pallas"]["pallas_path"] == "decode"
    gpu = jax.default_backend() == "gpu"
    assert cases["pallas"]["pallas_path_prefill"] == ("dense" if gpu else "lists")
    # The same greedy tokens: the sparse FFN computes the dense function (up to rounding).
    assert cases["pallas"]["tokens"] == cases["xla"]["tokens"]
    (ratio,) = [r for r in rows if r["kind"] == "ratio"]
    assert ratio["decode_ratio"] > 0 and ratio["ttft_ratio"] > 0 and ratio["tokens_agree"] == 1.0
    assert "TTFT" in capsys.readouterr().out


def test_bad_flags_exit(bench):
    for flags in (["--presets", "nope"], ["--presets", "tiny", "--context", "4096"],
                  ["--new-tokens", "1"], ["--presets", "tiny", "--context", "8",
                                          "--new-tokens", "8"], ["--batches", "0"],
                  ["--token-spread", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags)


def test_token_spread_gives_heavy_tailed_counts(bench):
    """--token-spread: with the biases calibrated to the same mean, a few tokens fire many
    units (a p99 several times the mean, as a trained model's) where without it every token
    fires about the mean."""
    def counts(spread):
        cfg = bench.GenBenchConfig(presets="tiny", batches="4", context=128, new_tokens=8,
                                   token_spread=spread)
        model = bench.build_model("tiny", "xla", cfg)
        tokens = jax.numpy.asarray(bench.prompt_batch(model.cfg, cfg, 4))
        calibrate(model, tokens, 4.0, "uniform", lambda message: None)
        _, nnz = nnx.jit(bench.model_lib.activity_and_token_nnz)(model, tokens)
        return np.asarray(nnz, np.float64)  # [layers, tokens]

    flat, spread = counts(0.0), counts(1.0)
    for nnz in (flat, spread):
        assert np.all(np.abs(nnz.mean(axis=1) - 4.0) < 1.0), nnz.mean(axis=1)
    tail = lambda nnz: np.percentile(nnz, 99, axis=1) / nnz.mean(axis=1)
    assert np.all(tail(spread) > 2 * tail(flat)), (tail(flat), tail(spread))


def test_decode_hlo_lists_weight_ops():
    """tools/decode_hlo.py: the dense model's decode loop casts or transposes no weight
    every step (bf16 parameters: nothing to cast; XLA keeps the rest outside the loop)."""
    with load_experiment("decode_hlo") as tool:
        found = tool.main(["--preset", "tiny", "--implementation", "xla"])
    assert set(found) == {"loop", "loop, in a branch", "outside the loop"}
    assert found["loop"] == [] and found["loop, in a branch"] == []
