"""experiments/bench_multi_gpu.py on the CPU with 2 fake devices: every mesh runs and reports."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from tests.utils import load_experiment, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    with load_experiment("bench_multi_gpu") as module:
        yield module


def test_meshes(bench):
    cfg = bench.MultiConfig(fsdp="2,4,3")
    labels = lambda n: [m["label"] for m in bench.meshes(cfg, n)]
    assert labels(1) == ["1 device"]
    assert labels(2) == ["1 device", "data=2", "data=1,fsdp=2"]
    assert labels(4) == ["1 device", "data=4", "data=2,fsdp=2", "data=1,fsdp=4"]


def test_bad_flags_exit(bench):
    for flags in (["--presets", "nope"], ["--batch", "8by2048"], ["--batch", "2x8,4x8"],
                  ["--implementations", "cuda"], ["--fsdp", "0"], ["--pgle-steps", "-2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags)


@pytest.mark.slow  # a subprocess with two fake devices, as test_sharding's step (slow too)
def test_two_fake_devices(tmp_path):
    out = tmp_path / "bench.jsonl"
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2",
                         JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "experiments/bench_multi_gpu.py", "--presets", "tiny", "--batch",
         "2x32", "--runs", "1", "--implementations", "xla", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["kind"] == "header" and rows[0]["devices"] == 2
    assert not [r for r in rows if r["kind"] == "error"], rows
    times = {r["mesh"]: r for r in rows if r["kind"] == "time"}
    assert sorted(times) == ["1 device", "data=1,fsdp=2", "data=2"]
    assert times["data=2"]["mesh_shape"] == {"data": 2, "fsdp": 1}
    for r in times.values():
        assert r["per_device_batch"] == [2, 32] and len(r["peak_bytes_per_device"]) == r["devices"]
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert math.isfinite(r["loss"])
        assert math.isfinite(r["synchronised_ms"]) and r["synchronised_ms"] > 0
        # The model's own setting: the default --remat reached it (model_bench builds with
        # remat off unless told).
        assert r["remat"] is True
    # FSDP halves the parameters and AdamW state each device holds.
    assert (times["data=1,fsdp=2"]["compiled_bytes_per_device"]
            < times["data=2"]["compiled_bytes_per_device"])
    assert "speedup" in proc.stdout and "data=1,fsdp=2" in proc.stdout


def test_scaling_table_compares_each_mesh_with_dense(bench):
    row = lambda impl, mesh, devices, rate: {
        "kind": "time", "preset": "0.5b", "implementation": impl, "mesh": mesh,
        "devices": devices, "tokens_per_s": rate, "peak_bytes_per_device": [2**30] * devices,
        "compiled_bytes_per_device": None}
    rows = [row("xla", "1 device", 1, 100.0), row("xla", "data=2", 2, 180.0),
            row("pallas", "1 device", 1, 120.0), row("pallas", "data=2", 2, 225.0)]
    table = {(t["implementation"], t["mesh"]): t for t in bench.scaling_table(rows)}
    assert table[("pallas", "data=2")]["speedup"] == 225.0 / 120.0
    assert table[("pallas", "data=2")]["vs_dense"] == 225.0 / 180.0
    assert table[("pallas", "1 device")]["vs_dense"] == 1.2
    assert table[("xla", "data=2")]["vs_dense"] == 1.0
    bench.print_table(bench.scaling_table(rows[2:]))  # no dense rows: printed as "-"
