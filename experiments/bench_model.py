"""End-to-end benchmark: the sparse model ("pallas") against the same model dense ("xla").

On the H100 (the numbers in docs/performance.md; about 4 minutes for 0.5b, 9 for 1.5b):

    python experiments/bench_model.py --presets 0.5b,1.5b --out runs/bench_model.jsonl

On a CPU (interpret mode, a tiny model, about a minute):

    python experiments/bench_model.py --presets tiny --prefill 2x32 --train-batch 2x32 \\
        --decode 1,4 --runs 2

Sparsity without a trained checkpoint of these sizes: each FFN gets a per-unit gate bias
(``ModelConfig.gate_bias``) calibrated on one batch of random tokens, layer by layer (layer l's
bias changes layer l + 1's input), so that unit j fires on a fraction p_j of the tokens:
``b_j = -quantile(x @ w_gate[:, j], 1 - p_j)``. ``--pattern uniform``: p_j = target / F for all
units. ``--pattern heavy``: Zipf-like p_j (a few units fire often), the same mean. The
calibrated statistics (mean / p99 / max active units per token, heavy rows) are reported.

Per preset, one subprocess calibrates and saves the biases, then one subprocess per
implementation measures (each its own process, so ``memory_stats()``' peak is its own): prefill
(last-position logits of B x T tokens, both models reading their blocks' parameters stacked once
before the calls, ``Transformer.stack_for_inference``), decode-sized forwards (n sequences of
one token, no KV cache: the FFN and projections of a decode step, not its attention over a
cache), a training step (loss with the L1 term, backward, AdamW) under each ``--remat`` setting
(on: each block recomputed in the backward, the FFN outputs and the sparse lists kept; off:
nothing recomputed; a setting that does not fit is reported as ``oom``), the FFN and attention
sublayers alone (for the time breakdown), peak device memory and energy per token (the driver's
energy counter over at least ``ENERGY_WINDOW_S`` of repeated calls after the timed ones, with
NVML's board power, SM clock and power-limit reasons sampled every few ms beside it). Median
over ``--runs`` synchronised repetitions after two warm-up calls; prefill and training also back
to back (``back_to_back_ms``: ``model_bench.time_back_to_back``, calls issued as a serving or
training loop issues them, one wait per few calls).
One JSON line per measurement goes to ``--out``; a table of xla / pallas ratios is printed last,
training compared per setting and fastest against fastest (the honest baseline: the dense
model trained as fast as it fits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import cli

from twell_jax import model as model_lib
from twell_jax.backends import Implementation
from twell_jax.benchmarking.power import PowerSampler
from twell_jax.benchmarking.model_bench import (BenchConfig, MEASURED, adamw_step, build_model,
                                                compile_timed, compiled_bytes, device_bytes_limit,
                                                jit_over_state, last_logits, layer_statistics,
                                                parse_shapes, peak_bytes, time_back_to_back,
                                                time_call, timing_optimizer, token_batch,
                                                worker_calibrate)


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, str | None]:
    cfg, worker, parser = cli.parse_driver_args(BenchConfig, __doc__.split("\n")[0], argv)
    try:
        for name in filter(None, cfg.presets.split(",")):
            if name not in model_lib.CONFIGS:
                raise ValueError(f"unknown preset {name!r}; have {sorted(model_lib.CONFIGS)}")
        if cfg.pattern not in ("uniform", "heavy"):
            raise ValueError(f"--pattern must be uniform or heavy, got {cfg.pattern!r}")
        parse_shapes(cfg.prefill, "--prefill")
        parse_shapes(cfg.train_batch, "--train-batch")
        if any(int(n) <= 0 for n in filter(None, cfg.decode.split(","))):
            raise ValueError("--decode sizes must be positive")
        remat_settings(cfg.remat)
        implementations(cfg.implementations)
        if cfg.runs < 1 or cfg.target_nnz <= 0:
            raise ValueError("--runs and --target-nnz must be positive")
    except ValueError as e:
        parser.error(str(e))
    return cfg, worker


def implementations(text: str) -> list[Implementation]:
    """'pallas' -> ['pallas']: the models a run measures, in MEASURED's order."""
    names = [name for name in text.split(",") if name]
    if not names or len(set(names)) != len(names) or not set(names) <= set(MEASURED):
        raise ValueError(f"--implementations: a comma list of {', '.join(MEASURED)} without "
                         f"repeats, got {text!r}")
    return [impl for impl in MEASURED if impl in names]


def remat_settings(text: str) -> list[bool]:
    """'off,on' -> [True, False]: the remat settings training is timed under, remat on first
    (the peak-memory counter only grows, so the lighter setting is measured first)."""
    settings = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in settings if v not in ("on", "off")]
    if bad or len(set(settings)) != len(settings):
        raise ValueError(f"--remat: a comma list of on / off without repeats, got {text!r}")
    return sorted((v == "on" for v in settings), reverse=True)  # on first: peak memory grows


# ------------------------------------------------------------------------------------------
# Calibration: per-unit gate biases that set each unit's firing rate.


# ------------------------------------------------------------------------------------------
# Measuring: time, memory, energy.


# ------------------------------------------------------------------------------------------
# The worker: one process per (preset, implementation) or for the calibration.


def worker_measure(spec: dict, cfg: BenchConfig, emit: Callable) -> None:
    preset, impl = spec["preset"], spec["implementation"]
    model = build_model(preset, impl, cfg)
    mcfg = model.cfg
    for block, bias in zip(model.blocks, np.load(spec["bias_file"])):
        block.ffn.b_gate[...] = jnp.asarray(bias, block.ffn.b_gate[...].dtype)
    sampler = PowerSampler()
    base = {"preset": preset, "implementation": impl, "pattern": cfg.pattern}

    def record(mode, shape, tokens_per_call, timing, **extra):
        row = {"kind": "time", **base, "mode": mode, "shape": shape, **timing, **extra}
        row["tokens_per_s"] = tokens_per_call / (timing["median_ms"] / 1e3)
        if "back_to_back_ms" in extra:
            row["back_to_back_tokens_per_s"] = tokens_per_call / (extra["back_to_back_ms"] / 1e3)
        if timing.get("energy_j") is not None:
            row["mj_per_token"] = timing["energy_j"] * 1e3 / (tokens_per_call
                                                              * timing["energy_calls"])
        emit(row)

    _, prefill_jitted, state = jit_over_state(last_logits, model)
    # Made once, as a server would: the prefill then reads the stacked weights in place.
    stacked = model.stack_for_inference() if cfg.prefill else None
    for b, t in parse_shapes(cfg.prefill, ""):
        tokens = token_batch(mcfg, cfg, b, t)
        stats = layer_statistics(model, tokens)
        cli.progress(f"compiling prefill {b}x{t}")
        prefill, compile_s = compile_timed(prefill_jitted, state, tokens, stacked)
        call = lambda: prefill(state, tokens, stacked)
        record("prefill", [b, t], b * t, time_call(call, cfg.runs, sampler),
               back_to_back_ms=time_back_to_back(call, cfg.runs)["median_ms"],
               compiled_bytes=compiled_bytes(prefill), compile_s=compile_s,
               stacked_for_inference=True, **stats)
    del stacked  # out of the training measurements' peak memory
    for n in (int(v) for v in filter(None, cfg.decode.split(","))):
        tokens = token_batch(mcfg, cfg, n, 1)
        decode, compile_s = compile_timed(prefill_jitted, state, tokens)
        record("decode", [n, 1], n, time_call(lambda: decode(state, tokens), cfg.runs),
               compile_s=compile_s)
    emit({"kind": "memory", **base, "phase": "inference", "peak_bytes": peak_bytes()})

    for b, t in parse_shapes(cfg.train_batch, ""):
        tokens = token_batch(mcfg, cfg, b, t + 1)
        cli.progress("timing layer 0's FFN and attention alone")
        breakdown(model, tokens[:, :-1], cfg, emit, base)
        # Every setting starts from the calibrated weights, kept in host memory (out of the
        # device's peak): the timed steps leave them as they are (``timing_optimizer``), but
        # each setting's optimizer owns and donates the model's arrays.
        initial = jax.device_get(nnx.state(model))
        for remat in remat_settings(cfg.remat):
            nnx.update(model, jax.device_put(initial))
            if not time_training(model, tokens, remat, cfg, sampler, record, emit, base):
                break  # out of memory: the model's arrays may have been donated


def time_training(model, tokens, remat: bool, cfg: BenchConfig, sampler, record, emit,
                  base: dict) -> bool:
    """Times AdamW steps on ``tokens`` [B, T + 1] with remat on or off (the model keeps its
    parameters; only the traced program changes). A step that does not fit in the allocator's
    limit (``bytes_limit``: by default 75% of the device, ``XLA_PYTHON_CLIENT_MEM_FRACTION``
    raises it) is reported as an ``oom`` row (False returned), not as a failed worker: the
    fastest setting that fits is the honest baseline."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    model.cfg = dataclasses.replace(model.cfg, remat=remat)
    optimizer = nnx.Optimizer(model, timing_optimizer(), wrt=nnx.Param)
    cli.progress(f"compiling the training step {b}x{t}, remat {'on' if remat else 'off'}")
    step, compiled, sync, compile_s = adamw_step(model, optimizer, tokens, cfg.l1_coeff)
    step_bytes = compiled_bytes(compiled)
    limit = device_bytes_limit()
    oom = {"kind": "oom", **base, "mode": "train", "shape": [b, t], "remat": remat,
           "compiled_bytes": step_bytes, "bytes_limit": limit}
    if step_bytes is not None and limit is not None and step_bytes > limit:
        emit({**oom, "reason": "the compiled step needs more than the device holds"})
        return True  # nothing ran: the state is intact
    try:
        cli.progress(f"compiled in {compile_s:.0f} s; timing")
        loss = float(step()[0])
        timing = time_call(step, cfg.runs, sampler)
        back_to_back_ms = time_back_to_back(step, cfg.runs)["median_ms"]
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        emit({**oom, "reason": str(e).splitlines()[0][:300]})
        return False
    record("train", [b, t], b * t, timing, loss=loss, remat=remat, compiled_bytes=step_bytes,
           compile_s=compile_s, back_to_back_ms=back_to_back_ms)
    sync()
    emit({"kind": "memory", **base, "phase": "training", "remat": remat,
          "peak_bytes": peak_bytes()})
    return True


def breakdown(model, tokens, cfg: BenchConfig, emit: Callable, base: dict) -> None:
    """Times one layer's FFN and attention sublayers alone on layer 0's real inputs, forward
    and forward + backward, so the step time can be split into FFN / attention / the rest."""
    block = model.blocks[0]
    ffn_in = nnx.jit(lambda m, t: jax.tree.leaves(
        nnx.capture(m, model_lib.FFNInput)(t)[1])[0])(model, tokens)
    x = nnx.jit(lambda m, t: (jnp.take(m.embedding[...], t, axis=0)
                              * math.sqrt(m.cfg.d_model)).astype(m.cfg.dtype))(model, tokens)
    cos, sin = (jnp.asarray(a) for a in model_lib.rope_tables(
        model.cfg.max_seq_len, model.cfg.head_dim, model.cfg.rope_theta))
    parts = {"ffn": (block.ffn, lambda m, v: m(v), ffn_in),
             "attention": (block, lambda m, v: m.attn(m.attn_norm(v), cos, sin), x)}
    for name, (module, fn, value) in parts.items():
        fwd = jit_over_state(fn, module)[0]
        fwd_bwd = jit_over_state(nnx.grad(lambda m, v: jnp.sum(fn(m, v).astype(jnp.float32)),
                                          argnums=(0, 1)), module)[0]
        for label, f in (("forward", fwd), ("forward+backward", fwd_bwd)):
            timing = time_call(lambda: f(value), cfg.runs)
            emit({"kind": "breakdown", **base, "part": name, "pass": label,
                  "tokens": int(tokens.size), "per_layer_ms": timing["median_ms"],
                  "all_layers_ms": timing["median_ms"] * model.cfg.n_layers})


# ------------------------------------------------------------------------------------------
# The driver.


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Runs the benchmark (or, with ``--worker``, one of its subprocesses); returns the rows."""
    return cli.main_or_worker(argv, parse_args, {"calibrate": worker_calibrate,
                                                    "measure": worker_measure}, drive)


def drive(cfg: BenchConfig, argv: list[str]) -> list[dict]:
    """The driver: one worker subprocess per calibration and measurement."""
    start = time.perf_counter()
    header = cli.header(" ".join(["bench_model.py", *argv]), config=dataclasses.asdict(cfg))
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    rows = [header]
    with open(cfg.out, "a") as out, tempfile.TemporaryDirectory() as tmp:
        def log(text):
            print(text, flush=True)

        out.write(json.dumps(header) + "\n")
        for preset in filter(None, cfg.presets.split(",")):
            spent = time.perf_counter() - start
            if cfg.time_budget and spent > cfg.time_budget:
                row = {"kind": "skipped", "preset": preset,
                       "reason": f"time budget {cfg.time_budget:.0f} s spent ({spent:.0f} s)"}
                log(json.dumps(row))
                out.write(json.dumps(row) + "\n")
                rows.append(row)
                continue
            bias_file = os.path.join(tmp, f"{preset}_bias.npy")
            specs = [{"task": "calibrate", "preset": preset, "bias_file": bias_file}]
            specs += [{"task": "measure", "preset": preset, "implementation": impl,
                       "bias_file": bias_file}
                      for impl in implementations(cfg.implementations)]
            rows += cli.run_specs(__file__, specs, argv, out, header["commit"], log)
    table = ratio_table(rows)
    print_table(table)
    if cfg.plot:
        write_plot(table, cfg.plot)
    return rows


def _label(r: dict) -> str:
    """A time or memory row's measurement, e.g. 'train 8x2048 remat off'."""
    if r["kind"] == "memory":
        phase = r["phase"] + ("" if r.get("remat") is None else
                              f", remat {'on' if r['remat'] else 'off'}")
        return f"peak memory ({phase}) GiB"
    label = f"{r['mode']} {'x'.join(map(str, r['shape']))}"
    if r["mode"] == "train" and r.get("remat") is not None:
        label += f" remat {'on' if r['remat'] else 'off'}"
    return label


def ratio_table(rows: list[dict]) -> list[dict]:
    """One row per (preset, metric): xla, pallas and pallas / xla (tokens/s, mJ per token,
    the energy window's mean SM clock and power-capped share, peak bytes). Training is also
    compared best against best: each model's fastest remat setting that fitted (the honest
    baseline: the dense model as fast as it can be trained)."""
    by_key: dict = {}
    best: dict = {}  # (preset, shape) -> {implementation: (tokens/s, remat)}
    for r in rows:
        if r["kind"] == "time":
            metrics = {f"{_label(r)} tokens/s": r["tokens_per_s"]}
            if r.get("back_to_back_tokens_per_s") is not None:
                metrics[f"{_label(r)} tokens/s back to back"] = r["back_to_back_tokens_per_s"]
            if r.get("mj_per_token") is not None:
                metrics[f"{_label(r)} mJ/token"] = r["mj_per_token"]
                # Whether the board held its power limit (then time follows energy).
                metrics[f"{_label(r)} mean SM clock MHz"] = r["mean_sm_clock_mhz"]
                metrics[f"{_label(r)} power-capped share"] = r["power_capped_fraction"]
            if r["mode"] == "train":
                key = (r["preset"], "x".join(map(str, r["shape"])))
                mine = best.setdefault(key, {})
                if r["tokens_per_s"] > mine.get(r["implementation"], (0.0, None))[0]:
                    mine[r["implementation"]] = (r["tokens_per_s"], r.get("remat"))
        elif r["kind"] == "memory":
            metrics = {_label(r): None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30}
        elif r["kind"] == "breakdown":
            metrics = {f"{r['part']} {r['pass']} ms (all layers)": r["all_layers_ms"]}
        else:
            continue
        for name, value in metrics.items():
            by_key.setdefault((r["preset"], name), {})[r["implementation"]] = value
    for (preset, shape), mine in best.items():
        remat = {impl: "on" if v[1] else "off" for impl, v in mine.items()}
        name = (f"train {shape} fastest tokens/s (remat xla {remat.get('xla', '-')}, "
                f"pallas {remat.get('pallas', '-')})")
        by_key[(preset, name)] = {impl: v[0] for impl, v in mine.items()}
    table = []
    for (preset, name), values in by_key.items():
        xla, pallas = values.get("xla"), values.get("pallas")
        ratio = pallas / xla if xla and pallas is not None else None
        table.append({"preset": preset, "metric": name, "xla": xla, "pallas": pallas,
                      "ratio": ratio})
    return table


def print_table(table: list[dict]) -> None:
    fmt = lambda v: "-" if v is None else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}")
    print(f"\n{'preset':<7} {'metric':<58} {'xla':>12} {'pallas':>12} {'pallas/xla':>10}")
    for r in table:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['preset']:<7} {r['metric']:<58} {fmt(r['xla']):>12} {fmt(r['pallas']):>12} "
              f"{ratio:>10}")


def write_plot(table: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if r["ratio"] is not None and "(all layers)" not in r["metric"]
            and "MHz" not in r["metric"] and "share" not in r["metric"]]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    labels = [f"{r['preset']} {r['metric']}" for r in rows]
    ax.barh(labels, [r["ratio"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("pallas / xla (tokens/s: higher is better; mJ, GiB, ms: lower is better)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
