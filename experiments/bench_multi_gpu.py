"""Training throughput on several GPUs against one: the sparse ("pallas") and dense ("xla")
models, the same per-device batch, and peak memory per device with FSDP.

On a machine with 2 GPUs (e.g. 2x H200; about 10 minutes):

    python experiments/bench_multi_gpu.py --presets 0.5b,1.5b --out runs/bench_multi_gpu.jsonl

On a CPU, with fake devices (tiny model; about a minute):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python experiments/bench_multi_gpu.py \\
        --presets tiny --batch 2x32 --runs 2 --implementations xla

Per preset, one subprocess calibrates the FFN gate biases to ``--target-nnz`` active units per
token (``model_bench.calibrate``) on the largest global batch, so every run's batch (its first
rows) has the calibrated sparsity. Then one subprocess per (implementation, mesh) times a
training step (loss with the L1 term, backward, AdamW with a learning rate of 0 so the
calibrated sparsity holds; remat by default), stepped as ``experiments/train.py`` steps (one
``jax.jit`` over the donated state, with ``train.py``'s compiler options for the mesh; on a
GPU mesh of several devices compiled again from the costs of a few profiled steps, as
``train.py``'s ``--pgle-steps`` does) and timed back to back
(``model_bench.time_back_to_back``: tokens/s and ``median_ms`` come from steps issued as a
training loop issues them, one wait per few steps; ``synchronised_ms`` waits for every step),
on:

  - ``1 device``: the first device alone (the baseline);
  - ``data=N``: every visible device, data parallel (parameters replicated);
  - ``fsdp=K`` for each ``--fsdp`` size K (data = N / K): parameters and AdamW state split.

Each device gets ``--batch`` B x T tokens, so the N-device step processes N times the tokens;
``speedup`` = tokens/s on N devices / tokens/s on one, ``efficiency`` = speedup / N. Memory:
the peak bytes in use on each device (``memory_stats``; not on CPU) and XLA's static estimate
per device (``compiled_bytes``). One JSON line per measurement goes to ``--out``; a table is
printed last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.benchmarking import model_bench
from twell_jax import cli
from twell_jax.cli import flag

from twell_jax import model as model_lib
from twell_jax import backends, sharding, xla_flags


@dataclasses.dataclass(frozen=True)
class MultiConfig:
    presets: str = flag("0.5b,1.5b", "comma list of model presets (twell_jax.model.CONFIGS)")
    implementations: str = flag("xla,pallas", "comma list of FFN implementations")
    batch: str = flag("8x2048", "per-device training batch BxT")
    fsdp: str = flag("2", "comma list of fsdp sizes to measure besides data parallel")
    target_nnz: float = flag(28.0, "mean active FFN units per token at F = 5632 (scaled to F)")
    pattern: str = flag("uniform", "per-unit firing rates: uniform or heavy (Zipf-like)")
    runs: int = flag(10, "timed repetitions per measurement (median reported)")
    remat: bool = flag(True, "recompute blocks in the backward (ModelConfig.remat)")
    pgle_steps: int = flag(-1, "steps profiled before the step is compiled again with XLA's "
                                "scheduler given their measured costs, as train.py's flag "
                                f"(-1: {xla_flags.PROFILED_STEPS} on a GPU mesh of several "
                                "devices, else 0; 0: off)")
    l1_coeff: float = flag(1e-4, "L1 coefficient in the training loss")
    seed: int = flag(0, "seed of the weights and the token batches")
    out: str = flag("runs/bench_multi_gpu.jsonl", "JSON-lines file the rows are appended to")


def parse_args(argv: Sequence[str] | None) -> tuple[MultiConfig, str | None]:
    cfg, worker, parser = cli.parse_driver_args(MultiConfig, __doc__.split("\n")[0], argv)
    try:
        for name in _split(cfg.presets):
            if name not in model_lib.CONFIGS:
                raise ValueError(f"unknown preset {name!r}; have {sorted(model_lib.CONFIGS)}")
        for impl in _split(cfg.implementations):
            backends.check(impl)
        if len(model_bench.parse_shapes(cfg.batch, "--batch")) != 1:
            raise ValueError(f"--batch: expected one BxT, got {cfg.batch!r}")
        if any(int(k) < 1 for k in _split(cfg.fsdp)):
            raise ValueError(f"--fsdp sizes must be positive, got {cfg.fsdp!r}")
        if cfg.pattern not in ("uniform", "heavy"):
            raise ValueError(f"--pattern must be uniform or heavy, got {cfg.pattern!r}")
        if cfg.pgle_steps < -1:
            raise ValueError(f"--pgle-steps must be >= -1, got {cfg.pgle_steps}")
        if cfg.runs < 1 or cfg.target_nnz <= 0:
            raise ValueError("--runs and --target-nnz must be positive")
    except ValueError as e:
        parser.error(str(e))
    return cfg, worker


def _split(text: str) -> list[str]:
    return [s for s in text.split(",") if s]


def meshes(cfg: MultiConfig, n_devices: int) -> list[dict]:
    """The runs' meshes: {"label", "devices" (the first n), "mesh" (parse_mesh text)}. fsdp
    sizes that do not divide the device count are skipped (reported by the driver)."""
    runs = [{"label": "1 device", "devices": 1, "mesh": ""}]
    if n_devices > 1:
        runs.append({"label": f"data={n_devices}", "devices": n_devices, "mesh": ""})
    for k in (int(v) for v in _split(cfg.fsdp)):
        if k > 1 and n_devices % k == 0:
            runs.append({"label": f"data={n_devices // k},fsdp={k}", "devices": n_devices,
                         "mesh": f"fsdp={k}"})
    return runs


def _bench_config(cfg: MultiConfig, n_devices: int) -> model_bench.BenchConfig:
    """bench_model's view: its training batch is the largest global batch (the calibration
    batch); no prefill or decode measurements."""
    b, t = model_bench.parse_shapes(cfg.batch, "--batch")[0]
    return model_bench.BenchConfig(presets="", target_nnz=cfg.target_nnz, pattern=cfg.pattern,
                                   prefill="", train_batch=f"{b * n_devices}x{t}", decode="",
                                   runs=cfg.runs, l1_coeff=cfg.l1_coeff,
                                   seed=cfg.seed)


# ------------------------------------------------------------------------------------------
# The worker.


def worker_measure(spec: dict, cfg: MultiConfig, emit: Callable) -> None:
    preset, impl = spec["preset"], spec["implementation"]
    devices = jax.devices()[:spec["devices"]]
    mesh = sharding.make_mesh(sharding.parse_mesh(spec["mesh"], len(devices)), devices)
    bcfg = _bench_config(cfg, spec["all_devices"])
    model = model_bench.build_model(preset, impl, bcfg, remat=cfg.remat)
    for block, bias in zip(model.blocks, np.load(spec["bias_file"])):
        block.ffn.b_gate[...] = jnp.asarray(bias, block.ffn.b_gate[...].dtype)
    optimizer = nnx.Optimizer(model, model_bench.timing_optimizer(), wrt=nnx.Param)
    for obj in (model, optimizer):
        sharding.shard_state(obj, mesh)
    b, t = model_bench.parse_shapes(cfg.batch, "")[0]
    tokens = model_bench.token_batch(model.cfg, bcfg, b * len(devices), t + 1)
    tokens = sharding.shard_batch(np.asarray(tokens), mesh)
    pgle_steps = xla_flags.profiled_steps(cfg.pgle_steps, len(devices), jax.default_backend())
    options = xla_flags.step_compiler_options(mesh.shape)
    with jax.set_mesh(mesh):
        # As train.py steps: one jax.jit over the donated state. Through nnx.jit every call
        # would walk the objects' graphs in Python, host time the synchronised timer counts.
        step, compiled, _, compile_s = model_bench.adamw_step(
            model, optimizer, tokens, cfg.l1_coeff, pgle_steps, options)
        loss, metrics = jax.device_get(step())
        synchronised = model_bench.time_call(step, cfg.runs)
        timing = model_bench.time_back_to_back(step, cfg.runs)
    step_bytes = model_bench.compiled_bytes(compiled)
    stats = [d.memory_stats() for d in devices]
    peaks = [None if not s else int(s.get("peak_bytes_in_use", 0)) for s in stats]
    global_tokens = b * len(devices) * t
    emit({"kind": "time", "preset": preset, "implementation": impl, "mesh": spec["label"],
          "mesh_shape": dict(mesh.shape), "devices": len(devices), "per_device_batch": [b, t],
          **timing, "tokens_per_s": global_tokens / (timing["median_ms"] / 1e3),
          "synchronised_ms": synchronised["median_ms"],
          "loss": float(loss), "nnz_mean": np.asarray(metrics["nnz_mean"]).tolist(),
          "dense_fallback_layers": int(metrics["dense_fallback"]), "remat": model.cfg.remat,
          "pgle_steps": pgle_steps, "compiler_options": options,
          "compile_s": compile_s, "peak_bytes_per_device": peaks,
          "compiled_bytes_per_device": step_bytes})


def worker_calibrate(spec: dict, cfg: MultiConfig, emit: Callable) -> None:
    model_bench.worker_calibrate(spec, _bench_config(cfg, spec["all_devices"]), emit)


# ------------------------------------------------------------------------------------------
# The driver.


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Runs the benchmark (or, with ``--worker``, one of its subprocesses); returns the rows."""
    return cli.main_or_worker(argv, parse_args, {"calibrate": worker_calibrate,
                                                    "measure": worker_measure}, drive)


def drive(cfg: MultiConfig, argv: list[str]) -> list[dict]:
    """The driver: one worker subprocess per calibration and measurement."""
    n = jax.device_count()
    header = cli.header(" ".join(["bench_multi_gpu.py", *argv]), devices=n,
                           config=dataclasses.asdict(cfg))
    runs = meshes(cfg, n)
    skipped = [k for k in (int(v) for v in _split(cfg.fsdp)) if k > 1 and n % k]
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    rows = [header]
    log = lambda text: print(text, flush=True)
    if skipped:
        log(f"fsdp sizes {skipped} do not divide the {n} devices: skipped")
    with open(cfg.out, "a") as out, tempfile.TemporaryDirectory() as tmp:
        out.write(json.dumps(header) + "\n")
        for preset in _split(cfg.presets):
            base = {"preset": preset, "all_devices": n,
                    "bias_file": os.path.join(tmp, f"{preset}_bias.npy")}
            specs = [{"task": "calibrate", **base}]
            specs += [{"task": "measure", "implementation": impl, **base, **run}
                      for impl in _split(cfg.implementations) for run in runs]
            rows += cli.run_specs(__file__, specs, argv, out, header["commit"], log)
    print_table(scaling_table(rows))
    return rows


def scaling_table(rows: list[dict]) -> list[dict]:
    """Per (preset, implementation, mesh): tokens/s, speedup over one device, efficiency
    (speedup / devices), ``vs_dense`` (tokens/s over the dense model's on the same mesh) and
    the largest per-device peak (or XLA's estimate) in GiB."""
    times = [r for r in rows if r["kind"] == "time"]
    single = {(r["preset"], r["implementation"]): r["tokens_per_s"]
              for r in times if r["devices"] == 1}
    dense = {(r["preset"], r["mesh"]): r["tokens_per_s"]
             for r in times if r["implementation"] == "xla"}
    table = []
    for r in times:
        base = single.get((r["preset"], r["implementation"]))
        speedup = r["tokens_per_s"] / base if base else None
        dense_rate = dense.get((r["preset"], r["mesh"]))
        peaks = [p for p in r["peak_bytes_per_device"] if p is not None]
        memory = max(peaks) if peaks else r["compiled_bytes_per_device"]
        table.append({"preset": r["preset"], "implementation": r["implementation"],
                      "mesh": r["mesh"], "devices": r["devices"],
                      "tokens_per_s": r["tokens_per_s"], "speedup": speedup,
                      "efficiency": None if speedup is None else speedup / r["devices"],
                      "vs_dense": r["tokens_per_s"] / dense_rate if dense_rate else None,
                      "memory_gib": None if memory is None else memory / 2**30,
                      "memory_source": "peak" if peaks else "compiled estimate"})
    return table


def print_table(table: list[dict]) -> None:
    fmt = lambda v, f: "-" if v is None else format(v, f)
    print(f"\n{'preset':<7} {'impl':<7} {'mesh':<16} {'tokens/s':>12} {'speedup':>8} "
          f"{'effic.':>7} {'vs dense':>8} {'GiB/device':>11}")
    for r in table:
        print(f"{r['preset']:<7} {r['implementation']:<7} {r['mesh']:<16} "
              f"{r['tokens_per_s']:>12,.0f} {fmt(r['speedup'], '.3f'):>8} "
              f"{fmt(r['efficiency'], '.3f'):>7} {fmt(r['vs_dense'], '.3f'):>8} "
              f"{fmt(r['memory_gib'], '.3f'):>11}"
              f"{'' if r['memory_source'] == 'peak' else ' (est.)'}")


if __name__ == "__main__":
    main()
