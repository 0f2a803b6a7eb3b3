"""Sharded training (twell_jax.sharding): a 2 x 2 (data x fsdp) mesh of fake CPU devices trains
like one device, for every FFN implementation; checkpoints move between device counts.

The multi-device runs happen in subprocesses (tests/sharding_worker.py): the fake device count
is fixed when jax starts, and this process runs on one device.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.utils import subprocess_env
from twell_jax import sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Statistics that sharding reproduces exactly (up to float32 summation order); nnz_p99 is the
# maximum of the per-device percentiles (nn.reduce_stats), an upper bound.
EXACT_STATS = ("nnz_mean", "nnz_max", "heavy_rows", "backup_overflow", "dense_fallback")


def run_worker(task: dict, n_devices: int) -> dict:
    env = subprocess_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}",
                         JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.sharding_worker", json.dumps(task)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------------------------------
# In this process: the mesh flag and the partition rules.


def test_parse_mesh():
    assert sharding.parse_mesh("", 4) == {"data": 4, "fsdp": 1}
    assert sharding.parse_mesh("data=2,fsdp=2", 4) == {"data": 2, "fsdp": 2}
    assert sharding.parse_mesh("fsdp=4", 4) == {"data": 1, "fsdp": 4}
    assert sharding.parse_mesh("fsdp=2", 8) == {"data": 4, "fsdp": 2}
    for text, match in (("data=3", "3 devices, but 4"), ("data=2,fsdp=4", "8 devices"),
                        ("model=2", "axes"), ("data=x", "must be an int"),
                        ("data=0", ">= 1"), ("data=2,data=2", "twice"), ("fsdp=3", "visible")):
        with pytest.raises(ValueError, match=match):
            sharding.parse_mesh(text, 4)


def test_logical_spec_takes_the_largest_divisible_dimension():
    spec = lambda names, shape, fsdp=2: tuple(sharding.logical_spec(
        names, shape, {"data": 2, "fsdp": fsdp}))
    assert spec(("embed", "mlp"), (64, 128)) == (None, "fsdp")  # F > D
    assert spec(("mlp", "embed"), (128, 64)) == ("fsdp", None)
    assert spec(("vocab", "embed"), (256, 512)) == (None, "fsdp")  # byte vocabulary < D
    assert spec(("vocab", "embed"), (49152, 2048)) == ("fsdp", None)
    assert spec(("embed", "mlp"), (64, 126), fsdp=4) == ("fsdp", None)  # 4 does not divide 126
    assert spec(("embed",), (62,), fsdp=4) == (None,)  # nothing divides: replicated
    assert spec(None, ()) == ()  # counters: replicated
    assert spec(("embed", "mlp"), (64, 128), fsdp=1) == (None, None)
    with pytest.raises(ValueError, match="do not match"):
        spec(("embed",), (64, 128))


def test_every_parameter_has_logical_axes():
    from flax import nnx
    from twell_jax import model as model_lib

    model = model_lib.build("tiny", gate_bias=True, implementation="xla")
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = param.get_metadata().get(sharding.LOGICAL_AXES_KEY)
        assert names is not None and len(names) == param[...].ndim, path
        assert all(n in sharding.LOGICAL_RULES for n in names), (path, names)


# ------------------------------------------------------------------------------------------
# In subprocesses with fake devices.


# Slow: a training step in a subprocess with four fake devices per case (the fast tier keeps
# the mesh parsing and the logical axes above).
@pytest.mark.slow
@pytest.mark.parametrize("implementation", [pytest.param("xla", marks=pytest.mark.slow),
                                            "reference",
                                            pytest.param("pallas", marks=pytest.mark.slow)])
def test_step_on_2x2_mesh_matches_one_device(implementation):
    task = {"task": "step", "mesh": "data=2,fsdp=2", "implementations": [implementation]}
    result = run_worker(task, 4)
    bad_batch, bad_flag, bad_mesh = result["errors"]
    assert bad_batch.startswith("ValueError") and "multiple of 4" in bad_batch, bad_batch
    assert bad_flag.startswith("SystemExit: --batch-size 6 must be a multiple of the mesh's 4 "
                               "devices"), bad_flag
    assert bad_mesh.startswith("SystemExit: --mesh") and "4 are visible" in bad_mesh, bad_mesh
    r = result[implementation]
    single, sharded = r["single"], r["sharded"]
    assert r["mesh"].startswith("data=2 x fsdp=2 over 4 cpu devices"), r["mesh"]
    # FSDP: w_gate [F, D] split along F, its Adam moment alike; counters replicated.
    assert r["spec"]["w_gate"] == r["spec"]["w_gate_mu"] == ["fsdp", None]
    assert r["spec"]["embedding"] == ["fsdp", None]  # [256, 64]: vocab, the larger
    assert r["spec"]["step"] == []
    assert sharded["shard_map"] and not single["shard_map"]
    if implementation == "pallas":
        kernels = {"twell_row_pack", "twell_row_up_down", "twell_row_backward",
                   "twell_sparse_outer"}
        assert kernels <= set(sharded["kernels"]), sharded["kernels"]
    else:
        assert not {"twell_row_pack", "twell_row_up_down"} & set(sharded["kernels"])
    # Up to rounding: each device's dense backup fills its spare rows with its densest light
    # rows (``ffn._backup_rows``), so a few rows take the dense path on one device count and
    # the lists on the other (bf16 GEMM outputs against float32 sums).
    for key in ("loss", "ce", "l1", "grad_norm"):
        assert sharded[key] == pytest.approx(single[key], rel=1e-4), key
    assert sharded["l1_layer"] == pytest.approx(single["l1_layer"], rel=1e-4)
    for key in EXACT_STATS:
        assert sharded[key] == single[key], key
    assert single["nnz_p99"] <= sharded["nnz_p99"] <= single["nnz_max"]
    # The sparse regime (a few heavy rows through the backup), not every row dense.
    assert 0 < single["nnz_mean"][0] < 20 and 0 < single["heavy_rows"][0] < 64, single
    # One AdamW step (lr 3e-3, L1 0.1) from the same start: bf16-rounding-level differences.
    assert r["param_rel_diff"] < 5e-3, r["param_rel_diff"]


@pytest.mark.slow  # exact resume stays in the fast tier in test_train
def test_checkpoints_resume_and_move_between_device_counts(tmp_path):
    task = {"full": str(tmp_path / "full"), "split": str(tmp_path / "split"),
            "npz": str(tmp_path / "state.npz")}
    saved = run_worker({"task": "save", "mesh": "data=2,fsdp=2", **task}, 4)
    assert saved["step"] == 4 and saved["w_gate_spec"] == ["fsdp", None]
    # --resume on the 2 x 2 mesh follows the uninterrupted run exactly.
    assert len(saved["losses"]["full"]) == 4
    assert saved["losses"]["split"] == saved["losses"]["full"]
    # One process with 2 devices restores onto 1 of them, then onto both (fsdp=2).
    restored = run_worker({"task": "restore", "meshes": [["", 1], ["fsdp=2", 2]], **task},
                          2)["restored"]
    assert [r["devices"] for r in restored] == [1, 2]
    assert [r["w_gate_spec"] for r in restored] == [[None, None], ["fsdp", None]]
    for r in restored:
        assert r["step"] == 4 and r["max_abs_diff"] == 0.0, r
