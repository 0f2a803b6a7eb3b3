"""experiments/bench_model.py on the CPU: calibration, every measurement, the ratio table."""

import json
import math

import numpy as np
import pytest

from tests.utils import load_experiment
from twell_jax import inputs
from twell_jax.benchmarking import model_bench, power


@pytest.fixture(scope="module")
def bench():
    with load_experiment("bench_model") as module:
        yield module


@pytest.mark.parametrize("pattern", ["uniform", "heavy"])
def test_firing_rates_keep_the_mean(pattern):
    p = inputs.firing_rates(5632, 28.0, pattern)
    assert p.shape == (5632,) and np.all(p > 0) and np.all(p <= 0.5)
    assert p.sum() == pytest.approx(28.0, rel=1e-6)
    if pattern == "heavy":
        assert p.max() > 50 * np.median(p)


def test_firing_rates_reject_an_unknown_pattern():
    with pytest.raises(ValueError, match="uniform, heavy or hot64"):
        inputs.firing_rates(64, 2.0, "zipf")


@pytest.mark.parametrize("remat", [True, False])
def test_model_is_built_with_the_remat_asked_for(bench, remat):
    cfg = bench.BenchConfig(presets="tiny")
    assert model_bench.build_model("tiny", "xla", cfg, remat=remat).cfg.remat is remat
    assert model_bench.build_model("tiny", "xla", cfg).cfg.remat is False


def test_adamw_step_compiles_with_its_compiler_options(bench):
    """``adamw_step``'s compiler options reach XLA: a value XLA does not know fails the
    step's compilation; none compiles it."""
    from flax import nnx

    from twell_jax import xla_flags

    cfg = bench.BenchConfig(presets="tiny")
    model = model_bench.build_model("tiny", "xla", cfg)
    optimizer = nnx.Optimizer(model, model_bench.timing_optimizer(), wrt=nnx.Param)
    tokens = model_bench.token_batch(model.cfg, cfg, 2, 17)
    (name,) = xla_flags.PIPELINED_ALL_REDUCE
    with pytest.raises(Exception, match=name):
        model_bench.adamw_step(model, optimizer, tokens, 0.0,
                               compiler_options={name: "NOT_A_MODE"})
    step, *_ = model_bench.adamw_step(model, optimizer, tokens, 0.0)
    loss, _ = step()
    assert np.isfinite(float(loss))


def test_calibration_hits_the_target(bench):
    cfg = bench.BenchConfig(presets="tiny", train_batch="8x64", target_nnz=28.0 * 8)
    model = model_bench.build_model("tiny", "xla", cfg)
    tokens = model_bench.calibration_tokens(model.cfg, cfg)
    target = cfg.target_nnz * model.cfg.d_ff / 5632  # 10.2 of 256 units
    model_bench.calibrate(model, tokens, target, "uniform", lambda _: None)
    stats = model_bench.layer_statistics(model, tokens)
    assert all(0.7 * target < n < 1.3 * target for n in stats["nnz_mean"]), stats["nnz_mean"]


def test_smoke_xla_only(bench, tmp_path):
    """The smallest run of the script: one implementation, no remat, one-token shapes."""
    out = tmp_path / "bench.jsonl"
    rows = bench.main(["--presets", "tiny", "--implementations", "xla", "--remat", "off",
                       "--prefill", "1x8", "--train-batch", "1x8", "--decode", "1", "--runs", "1",
                       "--out", str(out)])
    assert not [r for r in rows if r["kind"] == "error"], rows
    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert saved[0]["kind"] == "header" and len(saved) == len(rows)
    times = [r for r in rows if r["kind"] == "time"]
    assert {(r["implementation"], r["mode"]) for r in times} == {
        ("xla", m) for m in ("prefill", "decode", "train")}
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in times)
    assert all(math.isfinite(r["loss"]) for r in times if r["mode"] == "train")
    # Prefill and training are also timed back to back; decode-sized forwards are not.
    for r in times:
        assert (r.get("back_to_back_tokens_per_s", 0) > 0) == (r["mode"] != "decode")
    assert [t for t in bench.ratio_table(rows)
            if t["metric"] == "train 1x8 remat off tokens/s back to back"]


@pytest.mark.slow  # both implementations, both remat settings; the fast tier: test_smoke_xla_only
def test_end_to_end_on_tiny(bench, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    rows = bench.main(["--presets", "tiny", "--prefill", "2x32", "--train-batch", "2x32",
                       "--decode", "2", "--runs", "1", "--out", str(out),
                       "--plot", str(tmp_path / "ratios.png")])
    assert not [r for r in rows if r["kind"] == "error"], rows
    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert saved[0]["kind"] == "header" and len(saved) == len(rows)
    times = [r for r in rows if r["kind"] == "time"]
    modes = {(r["implementation"], r["mode"]) for r in times}
    assert modes == {(i, m) for i in ("xla", "pallas") for m in ("prefill", "decode", "train")}
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in times)
    assert all(math.isfinite(r["loss"]) for r in times if r["mode"] == "train")
    prefill = [r for r in times if r["mode"] == "prefill"]
    assert all(len(r["nnz_mean"]) == 2 for r in prefill)  # per-layer statistics
    parts = {(r["part"], r["pass"]) for r in rows if r["kind"] == "breakdown"}
    assert len(parts) == 4
    train = [r for r in times if r["mode"] == "train"]
    assert sorted((r["implementation"], r["remat"]) for r in train) == [
        ("pallas", False), ("pallas", True), ("xla", False), ("xla", True)]
    table = bench.ratio_table(rows)
    fastest = [r for r in table if "fastest" in r["metric"]]
    assert len(fastest) == 1 and fastest[0]["ratio"] > 0
    for impl in ("xla", "pallas"):  # the fastest row holds each model's best setting
        assert fastest[0][impl] == max(r["tokens_per_s"] for r in train
                                       if r["implementation"] == impl)
    assert (tmp_path / "ratios.png").stat().st_size > 1000
    assert "pallas/xla" in capsys.readouterr().out


def test_bad_flags_exit(bench):
    for flags in (["--presets", "nope"], ["--prefill", "8by2048"], ["--pattern", "zipf"],
                  ["--remat", "maybe"], ["--remat", "on,on"], ["--implementations", "jax"],
                  ["--implementations", ""], ["--implementations", "xla,xla"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags)


def test_implementations(bench):
    assert bench.implementations("pallas,xla") == ["xla", "pallas"]
    assert bench.implementations("pallas") == ["pallas"]


def test_remat_settings(bench):
    assert bench.remat_settings("off,on") == [True, False]  # on first: peak memory only grows
    assert bench.remat_settings("off") == [False]
    assert bench.remat_settings("") == []


def test_ratio_table_fastest_training_against_fastest(bench):
    """The dense model's fastest setting is the baseline, whichever it is."""
    base = {"kind": "time", "preset": "p", "mode": "train", "shape": [8, 2048]}
    power = {"mj_per_token": 2.0, "mean_sm_clock_mhz": 1700.0, "power_capped_fraction": 0.5}
    rows = [{**base, "implementation": "xla", "remat": True, "tokens_per_s": 100.0},
            {**base, "implementation": "xla", "remat": False, "tokens_per_s": 130.0, **power},
            {**base, "implementation": "pallas", "remat": True, "tokens_per_s": 120.0},
            {**base, "implementation": "pallas", "remat": False, "tokens_per_s": 90.0,
             **power, "mj_per_token": 1.5, "mean_sm_clock_mhz": 1900.0},
            {"kind": "oom", "preset": "p", "implementation": "pallas", "remat": True,
             "shape": [8, 4096]}]
    table = {r["metric"]: r for r in bench.ratio_table(rows)}
    fastest = table["train 8x2048 fastest tokens/s (remat xla off, pallas on)"]
    assert fastest["ratio"] == pytest.approx(120 / 130)
    assert table["train 8x2048 remat on tokens/s"]["ratio"] == pytest.approx(1.2)
    assert table["train 8x2048 remat off mJ/token"]["ratio"] == pytest.approx(0.75)
    assert table["train 8x2048 remat off mean SM clock MHz"]["pallas"] == 1900.0
    assert table["train 8x2048 remat off power-capped share"]["xla"] == 0.5


def test_compiled_bytes_counts_donated_buffers_once(bench):
    """A donated argument that the output reuses is one buffer, not two (the 1.5b dense
    training step's state was counted twice: 77.2 GB estimated, 58.8 GB at its peak)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1024,), jnp.float32)
    donated = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x)
    kept = jax.jit(lambda a: a * 2).lower(x)
    got_donated, got_kept = bench.compiled_bytes(donated), bench.compiled_bytes(kept)
    assert got_kept == 2 * 4096  # argument + output
    assert got_donated == 4096  # the output is the argument's buffer


def test_timing_optimizer_computes_adamw_without_moving_weights(bench):
    """The timed training step's optimizer: AdamW's whole update runs (its moments change),
    but the learning rate is 0, held in the state (traced), so the weights stay."""
    import jax.numpy as jnp
    import optax

    opt = bench.timing_optimizer()
    params = {"w": jnp.linspace(-1.0, 1.0, 8)}
    state = opt.init(params)
    grads = {"w": jnp.arange(8.0) - 3.0}
    updates, state = opt.update(grads, state, params)
    np.testing.assert_array_equal(np.asarray(optax.apply_updates(params, updates)["w"]),
                                  np.asarray(params["w"]))
    assert float(state.hyperparams["learning_rate"]) == 0.0
    mu = state.inner_state[0].mu["w"]
    assert np.all(np.asarray(mu)[np.asarray(grads["w"]) != 0] != 0)  # the moments moved


def test_power_summary(bench):
    # (time s, power W, SM clock MHz, clock event reasons): the board at its power limit in
    # the last two samples (SW power cap, then the HW power brake with the idle bit).
    samples = [(0.0, 100.0, 1980, 0), (1.0, 300.0, 1700, 0x4), (2.0, 300.0, 1500, 0x81)]
    got = power.summarize_power(samples, 612.5, {"power_limit_w": 700.0})
    assert got["energy_j"] == 612.5  # the driver's counter
    assert got["energy_sampled_j"] == pytest.approx(200.0 + 300.0)  # trapezoid
    assert got["mean_power_w"] == pytest.approx(700.0 / 3)
    assert got["mean_sm_clock_mhz"] == pytest.approx(5180 / 3)
    assert got["power_capped_fraction"] == pytest.approx(2 / 3)
    assert got["power_samples"] == 3 and got["power_limit_w"] == 700.0


def test_energy_is_measured_over_its_window(bench):
    # The timed runs give the median; the energy comes from enough further calls to fill
    # the window (~5 ms a call, 60 ms: ~12 calls).
    import time

    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.005)
        return np.zeros(())

    class Sampler:
        available = True

        def measure(self, loop):
            before = len(calls)
            loop()
            return {"energy_j": float(len(calls) - before)}  # one joule a call

    timing = bench.time_call(fn, 3, Sampler(), energy_window_s=0.06)
    assert timing["runs"] == 3 and timing["median_ms"] >= 5.0
    assert 3 <= timing["energy_calls"] <= 13
    assert timing["energy_j"] == timing["energy_calls"]
    assert len(calls) == 2 + 3 + timing["energy_calls"]  # warm-up, timed, energy
    assert bench.time_call(fn, 2)["runs"] == 2 and "energy_j" not in bench.time_call(fn, 1)


def test_back_to_back_waits_once_per_sample():
    # A step whose result is ready only when waited for: each sample must issue `steps`
    # calls and wait once, and report the time per call.
    import time

    from twell_jax.benchmarking import model_bench

    issued, waits = [], []

    class Result:
        def block_until_ready(self):
            waits.append(len(issued))
            return self

    def step():
        issued.append(None)
        time.sleep(0.004)
        return Result()

    timing = model_bench.time_back_to_back(step, runs=3, steps=4)
    assert len(issued) == 2 + 3 * 4  # two warm-up calls, then 3 samples of 4
    assert waits == [1, 2, 6, 10, 14]  # one wait per warm-up call and per sample
    assert timing["runs"] == 3 and timing["steps_per_sample"] == 4
    assert 4.0 <= timing["median_ms"] < 40.0  # per call, not per sample
