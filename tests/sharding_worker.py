"""Worker of tests/test_sharding.py, run in a subprocess with fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.sharding_worker '<json>'

(the device count is fixed when jax starts, and the rest of the suite runs on one device).
The JSON names a task and its arguments; the result is one line ``RESULT <json>`` on stdout.

Tasks:
  step: one training step of experiments/train.py on one device and on a mesh, per
    implementation; the metrics of both, the parameters' largest relative difference, and the
    shardings the mesh run used.
  save: train.py's runs on a mesh, straight and resumed; the checkpoint's values (.npz).
  restore: the checkpoint restored on a mesh of this process's devices, compared with the .npz.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.utils import load_experiment
from twell_jax import model as model_lib
from twell_jax import sharding, xla_flags
from twell_jax.config import TwELLConfig

# Small enough for the Pallas kernels in interpret mode (a step in a few seconds).
PRESET = "shard-test"
# One dense-backup size (backup_rows) keeps the compiled program small; 64 rows, a device's
# share of the batch, so that no device overflows it (an overflow is decided per device).
model_lib.CONFIGS[PRESET] = model_lib.ModelConfig(
    vocab_size=256, d_model=64, d_ff=128, n_layers=1, n_heads=4, max_seq_len=32,
    gate_bias=True, twell=TwELLConfig(slots_per_tile=16, backup_rows=64))
# Gate bias -1.5 on a unit-RMS input: each unit fires for ~7% of the tokens, so the TwELL paths
# pack sparse rows instead of sending every row to the dense backup.
GATE_BIAS = -1.5
BATCH = 8


def _train_config(train, implementation: str, mesh: str, **kw):
    # warmup 0: the first step already moves the parameters (warm-up starts at lr 0).
    kw = {"batch_size": BATCH, **kw}
    return train.TrainConfig(model=PRESET, implementation=implementation, seq_len=32, steps=4,
                             warmup=0, l1_coeff=0.1, mesh=mesh, **kw)


def _build(train, cfg, mesh):
    model, optimizer = train.build(cfg, 256, mesh)
    for block in model.blocks:
        bias = block.ffn.b_gate
        bias[...] = jax.device_put(jnp.full(bias.shape, GATE_BIAS, bias.dtype),
                                   bias[...].sharding)
    return model, optimizer


def _mesh(text: str, n_devices: int):
    devices = jax.devices()[:n_devices]
    return sharding.make_mesh(sharding.parse_mesh(text, len(devices)), devices)


def _batch(train, step: int = 0) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, 256, 4096).astype(np.int32)
    return train.sample_batch(tokens, BATCH, 32, seed=0, step=step)


def _one_step(train, cfg, mesh) -> tuple[dict, dict, object, object]:
    model, optimizer = _build(train, cfg, mesh)
    args = (sharding.shard_batch(_batch(train), mesh), jnp.float32(cfg.l1_coeff))
    with jax.set_mesh(mesh):
        # The compiler options train.py gives a step on this mesh.
        step = train.TrainStep(model, optimizer, 0, xla_flags.step_compiler_options(mesh.shape))
        # Which Pallas kernels the step's program holds (their pallas_call names), and whether
        # the FFN went under shard_map (a manual computation).
        program = step.lower(*args).as_text(debug_info=True)
        metrics = step(*args)
        step.sync()
    metrics = {k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
    metrics["kernels"] = sorted(set(re.findall(r"twell_[a-z_]+", program)))
    metrics["shard_map"] = "manual_computation" in program
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    return metrics, params, model, optimizer


def _max_rel_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)) for x, y in pairs)


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, SystemExit) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def task_step(args: dict) -> dict:
    out = {}
    with load_experiment("train") as train:
        mesh = _mesh(args["mesh"], jax.device_count())
        cfg = _train_config(train, "xla", args["mesh"], batch_size=6)
        # Errors that name the sizes: a batch the mesh does not divide; a mesh of other devices.
        out["errors"] = [
            _error(lambda: sharding.shard_batch(np.zeros((6, 33), np.int32), mesh)),
            _error(lambda: train.train(cfg, corpus=train.Corpus(np.zeros(99, np.uint8),
                                                                np.zeros(99, np.uint8), 256, ""))),
            _error(lambda: train.train(_train_config(train, "xla", "data=3"))),
        ]
        for impl in args["implementations"]:
            single, p1, _, _ = _one_step(train, _train_config(train, impl, ""), _mesh("", 1))
            cfg = _train_config(train, impl, args["mesh"])
            mesh = _mesh(args["mesh"], jax.device_count())
            sharded, p2, model, optimizer = _one_step(train, cfg, mesh)
            adam = optimizer.opt_state[1][0]
            out[impl] = {
                "single": single, "sharded": sharded, "param_rel_diff": _max_rel_diff(p1, p2),
                "mesh": sharding.describe(mesh),
                "spec": {
                    "w_gate": list(model.blocks[0].ffn.w_gate[...].sharding.spec),
                    "w_gate_mu": list(adam.mu["blocks"][0]["ffn"]["w_gate"][...].sharding.spec),
                    "embedding": list(model.embedding[...].sharding.spec),
                    "step": list(optimizer.step[...].sharding.spec),
                }}
    return out


def _state_values(model, optimizer) -> dict:
    leaves = jax.tree.leaves_with_path((nnx.state(model), nnx.state(optimizer)))
    return {jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves}


def task_save(args: dict) -> dict:
    """experiments/train.py on a mesh: 4 steps straight, and 2 steps then ``--resume`` to 4
    (both checkpoint every 2 steps); the losses of both, and the first run's final state
    restored on the same mesh (.npz) with its checkpoint folder for task_restore."""
    tokens = np.random.default_rng(0).integers(1, 256, 20_000).astype(np.uint8)
    with load_experiment("train") as train:
        corpus = train.Corpus(tokens[:18_000], tokens[18_000:], 256, "random bytes")
        flags = dict(ckpt_every=2, eval_every=0, eval_batches=1, log_every=1)
        full = _train_config(train, "xla", args["mesh"], out_dir=args["full"], **flags)
        split = _train_config(train, "xla", args["mesh"], out_dir=args["split"], **flags)
        train.train(full, corpus=corpus, quiet=True)
        train.train(split, corpus=corpus, quiet=True, stop_after=2)
        train.train(dataclasses.replace(split, resume=True), corpus=corpus, quiet=True)
        losses = {name: [r["loss"] for r in train.read_metrics(
                      pathlib.Path(path) / "metrics.jsonl") if "loss" in r]
                  for name, path in (("full", args["full"]), ("split", args["split"]))}
        mesh = _mesh(args["mesh"], jax.device_count())
        model, optimizer = _build(train, dataclasses.replace(full, seed=1), mesh)
        manager = train.checkpoint_manager(pathlib.Path(args["full"]))
        step = train.restore_checkpoint(manager, model, optimizer)
        manager.close()
        np.savez(args["npz"], **_state_values(model, optimizer))
        return {"losses": losses, "step": step,
                "w_gate_spec": list(model.blocks[0].ffn.w_gate[...].sharding.spec)}


def task_restore(args: dict) -> dict:
    """Restores onto each of ``args["meshes"]``: [mesh text, devices (the first n)]."""
    out = []
    with load_experiment("train") as train:
        saved = np.load(args["npz"])
        for text, n in args["meshes"]:
            cfg = _train_config(train, "xla", text, seed=1)  # other values than the saved ones
            mesh = _mesh(text, n)
            model, optimizer = _build(train, cfg, mesh)
            manager = train.checkpoint_manager(pathlib.Path(args["full"]))
            step = train.restore_checkpoint(manager, model, optimizer)
            manager.close()
            restored = _state_values(model, optimizer)
            assert sorted(saved.files) == sorted(restored), (saved.files, list(restored))
            w_gate = model.blocks[0].ffn.w_gate[...]
            out.append({
                "step": step, "devices": len(w_gate.sharding.device_set),
                "w_gate_spec": list(w_gate.sharding.spec),
                "max_abs_diff": max(float(np.max(np.abs(saved[k] - restored[k]), initial=0))
                                    for k in restored)})
    return {"restored": out}


TASKS = {"step": task_step, "save": task_save, "restore": task_restore}

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = TASKS[spec.pop("task")](spec)
    print("RESULT " + json.dumps(result), flush=True)
