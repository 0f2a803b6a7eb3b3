"""experiments/profile_kernels.py: every program runs and is reported (without a GPU there are
no GPU kernels, so the kernel tables are empty; with one they list its kernels), and the trace
arithmetic of twell_jax.benchmarking.gpu_trace on made-up events."""

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from tests.utils import load_experiment, subprocess_env
from twell_jax.benchmarking import gpu_trace

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prof():
    with load_experiment("profile_kernels") as module:
        yield module


def test_busy_time_is_the_union_of_intervals():
    events = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("d", 31.0, 1.0)]
    assert gpu_trace.busy_ns(events) == 20.0  # [0, 15) and [30, 35)
    assert gpu_trace.busy_ns([]) == 0.0


def test_collectives_alone_are_those_no_other_kernel_overlaps():
    events = [("gemm_a", 0.0, 10.0), ("ncclDevKernel_AllReduce_Sum_bf16", 5.0, 10.0),
              ("ncclDevKernel_AllReduce_Sum_f32", 30.0, 5.0), ("loop_fusion", 31.0, 1.0)]
    assert gpu_trace.collective_alone_ns(events) == 9.0  # [10, 15) and [30, 35) less [31, 32)
    assert gpu_trace.collective_alone_ns(events[:1]) == 0.0
    summary = gpu_trace.device_summary(events, runs=2)
    assert summary == {"busy_ms": 20.0 / 2e6, "collective_ms": 15.0 / 2e6,
                       "collective_alone_ms": 9.0 / 2e6,
                       "collective_alone_by_kernel_ms": {
                           "ncclDevKernel_AllReduce_Sum_f32": 4.0 / 2e6,
                           "ncclDevKernel_AllReduce_Sum_bf16": 5.0 / 2e6}}


def test_exposed_time_per_collective_kernel():
    """Each collective's time outside every other kernel's intervals, summed per name: a
    collective spanning several other kernels, one inside another kernel, two at once."""
    events = [("gemm_a", 0.0, 10.0), ("fusion_b", 12.0, 3.0), ("gemm_c", 14.0, 4.0),
              ("ncclDevKernel_ReduceScatter_bf16", 5.0, 20.0),  # hidden [5, 10), [12, 18)
              ("ncclDevKernel_AllGather_bf16", 1.0, 2.0),  # inside gemm_a
              ("ncclDevKernel_AllGather_bf16", 20.0, 10.0),  # alone, beside the other
              ("ncclDevKernel_AllReduce_f32", 40.0, 1.0)]
    got = gpu_trace.alone_ns_by_collective(events)
    assert got == {"ncclDevKernel_ReduceScatter_bf16": 20.0 - 5.0 - 6.0,
                   "ncclDevKernel_AllGather_bf16": 0.0 + 10.0,
                   "ncclDevKernel_AllReduce_f32": 1.0}
    assert gpu_trace.alone_ns_by_collective(events[:3]) == {}


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collective"),
    ("twell_row_up_down", "twell"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("gemm_fusion_dot_189", "gemm"),
    ("input_reduce_fusion_55", "fusion"),
    ("loop_dynamic_update_slice_fusion_2", "copy"),
    ("memcpy128", "copy"),
    ("set_case_condition", "other"),
])
def test_kernel_kinds(name, kind):
    assert gpu_trace.kind_of(name) == kind


def test_smoke_xla_only(prof, tmp_path):
    """The smallest run of the script: one implementation, one-token shapes, one decode step."""
    out = tmp_path / "profile.jsonl"
    rows = prof.main(["--presets", "tiny", "--implementations", "xla", "--prefill", "1x8",
                      "--train", "1x8", "--decode-batch", "1", "--context", "8",
                      "--decode-steps", "1", "--runs", "1", "--out", str(out)])
    assert {(r["program"], r["implementation"]) for r in rows} == {
        (p, "xla") for p in ("prefill", "train", "decode")}
    assert all(r["wall_ms"] > 0 and r["profiled_wall_ms"] > 0 for r in rows)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and len(lines) == 1 + len(rows)


@pytest.mark.slow  # both implementations; the fast tier: test_smoke_xla_only
def test_every_program_reported(prof, tmp_path, capsys):
    out = tmp_path / "profile.jsonl"
    rows = prof.main(["--presets", "tiny", "--implementations", "xla,pallas", "--prefill",
                      "2x16", "--train", "2x16", "--decode-batch", "2", "--context", "20",
                      "--decode-steps", "2", "--runs", "1", "--hlo-dir", str(tmp_path / "hlo"),
                      "--out", str(out)])
    got = {(r["program"], r["implementation"]) for r in rows}
    assert got == {(p, i) for p in ("prefill", "train", "decode") for i in ("xla", "pallas")}
    on_gpu = jax.default_backend() == "gpu"
    for r in rows:
        assert r["wall_ms"] > 0 and r["profiled_wall_ms"] > 0
        if on_gpu:  # every program launches kernels, and the trace records them
            assert r["kernels"] and r["busy_ms"] > 0.0, (r["program"], r["implementation"])
        else:  # the trace has no GPU plane
            assert r["kernels"] == [] and r["busy_ms"] == 0.0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and len(lines) == 1 + len(rows)
    assert len(list((tmp_path / "hlo").iterdir())) == 6
    assert "tiny decode pallas (per step)" in capsys.readouterr().out


@pytest.mark.slow  # a second profile_kernels run (test_smoke_xla_only is the smoke run)
def test_ffn_programs_reported_with_sources(prof, tmp_path):
    """``--ffn``: one FFN layer alone, forward and forward + backward, for each implementation;
    with no GPU the kernel tables are empty, so the source names are checked on the CPU HLO."""
    rows = prof.main(["--presets", "", "--ffn", "smoke_uniform", "--implementations",
                      "xla,pallas", "--runs", "1", "--out", str(tmp_path / "p.jsonl")])
    assert {(r["preset"], r["program"], r["implementation"]) for r in rows} == {
        ("smoke_uniform", p, i) for p in ("ffn_forward", "ffn_fwd_bwd") for i in ("xla", "pallas")}
    assert all(r["wall_ms"] > 0 for r in rows)
    with pytest.raises(ValueError, match="unknown --ffn case"):
        prof.main(["--presets", "", "--ffn", "nope", "--out", str(tmp_path / "q.jsonl")])


def test_fusion_sources_name_the_ops(prof):
    import jax
    import jax.numpy as jnp

    def f(x, w):
        return jnp.tanh(x @ w).astype(jnp.bfloat16).T

    hlo = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 32))).compile().as_text()
    sources = prof.fusion_sources(hlo)
    assert sources and all("." not in name for name in sources)
    # On the CPU the elementwise ops get fusions of their own; on a GPU they may all sit in
    # the GEMM's fusion, named after the dot.
    assert any(op in s for s in sources.values()
               for op in ("tanh", "transpose", "convert", "dot_general"))


@pytest.mark.slow  # a subprocess with two fake devices
def test_training_step_on_a_mesh(tmp_path):
    out = tmp_path / "profile.jsonl"
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2",
                         JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "experiments/profile_kernels.py", "--presets", "tiny",
         "--implementations", "xla", "--prefill", "", "--decode-batch", "0", "--train", "1x8",
         "--mesh", "data=2", "--runs", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["program"] for r in rows[1:]] == ["train"]
    assert rows[1]["mesh"] == {"data": 2, "fsdp": 1} and rows[1]["wall_ms"] > 0
    assert rows[1]["devices"] == {}  # no GPU planes on the CPU


@pytest.mark.parametrize("flags", [["--train", "1x8", "--mesh", "data=3"],  # one CPU device
                                   ["--mesh", "data=1"]])  # no training step to profile
def test_bad_mesh_exits(prof, flags):
    with pytest.raises(SystemExit):
        prof.main(["--presets", "tiny", *flags])
