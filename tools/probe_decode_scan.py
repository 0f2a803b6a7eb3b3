"""Probe: ``scan_up_down`` configurations against its default at decode sizes.

    python tools/probe_decode_scan.py --rows 8,16 --nnz 28,282 --heavy \
        --variant block_f=128,scan_width=128,num_warps=4,group=4 --out runs/scan.jsonl
    python tools/probe_decode_scan.py --smoke    # CPU, interpret mode, one step

Each variant overrides fields of ``default_scan_up_down_config(M, D, F)`` (a value may name
another field of the default, ``scan_width=block_f``), or with a ``gemv.`` prefix fields of the
gate GEMV's ``default_gemv_config(M, D, F)`` (``gemv.k_splits=2``), with ``gemv_counts.`` those
of ``default_gemv_counts_config`` (the unsplit GEMV of the dense switch), with
``slice_down.`` those of ``default_slice_down_config`` (its busy blocks' down), with ``twell.``
fields of the ``TwELLConfig`` the op is called with (``twell.dense_fallback_density=1.0``: no
dense switch; ``0.0``: the dense mode always), and replaces the defaults
for the public op (``feed_forward`` on [F, D] weights, ``"pallas"``), which is timed two ways
beside the dense FFN (``"xla"``, and ``"plain"``: three bf16-output ``jnp.dot`` as bf16
``nnx.Linear`` layers compute them): inside an on-device loop of 100 steps over 4 weight sets (as
a decode loop runs its layers) and as 8 calls on distinct weight sets unrolled in one jit (as a
user's program makes them). The variants are timed in turn, ``--reps`` times, and the medians are
reported in microseconds per call; uniform rows with ``--nnz`` active units of F on average,
``--heavy`` rows (60 on average, p99 580) or ``--trained`` rows (drawn from the trained 100m
model's counts, scaled to F). One JSON line per case goes to ``--out``, after
the header every benchmark writes (``twell_jax.cli.header``: date, device, jax version,
commit, command, XLA flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.gemv as gemv_module
import pallas_kernels.scan_up_down as scan_module
import pallas_kernels.slice_down as slice_down_module
import twell_jax as tj
from twell_jax import cli, xla_flags
from twell_jax.benchmarking.gpu_trace import profile
from twell_jax.benchmarking.ffn_cases import (Case, decode_loop, make_case_inputs, trained_mean,
                                              unrolled_calls)

LOOP_STEPS, LOOP_LAYERS, UNROLLED_SETS = 100, 4, 8
SMOKE_STEPS, SMOKE_SETS = 1, 1
DEFAULT_CONFIG = scan_module.default_scan_up_down_config
DEFAULT_GEMV_CONFIG = gemv_module.default_gemv_config
DEFAULT_GEMV_COUNTS_CONFIG = gemv_module.default_gemv_counts_config
GEMV_PREFIX = "gemv."
GEMV_COUNTS_PREFIX = "gemv_counts."
SLICE_DOWN_PREFIX = "slice_down."
TWELL_PREFIX = "twell."
DEFAULT_SLICE_DOWN_CONFIG = slice_down_module.default_slice_down_config
DEFAULT_CONFIGS = (DEFAULT_CONFIG, DEFAULT_GEMV_CONFIG, DEFAULT_GEMV_COUNTS_CONFIG,
                   tj.TwELLConfig(), DEFAULT_SLICE_DOWN_CONFIG)


def _overridden(default, fields: dict[str, str]):
    """A function (m, d, f) -> ``default(m, d, f)`` with ``fields`` replaced (a value naming
    another field of the default takes that field's value)."""
    def config(m, d, f):
        base = default(m, d, f)
        values = {k: getattr(base, v) if hasattr(base, v) else int(v) for k, v in fields.items()}
        return dataclasses.replace(base, **values)
    return config


def parse_variant(text: str):
    """'a=1,b=scan_width,gemv.k_splits=2,twell.dense_fallback_density=1.0' -> (scan, gemv and
    counting-gemv config functions, each (m, d, f) -> its default config with those fields;
    the op's TwELLConfig; the slice_down config function, (m, d, block_f) -> its config)."""
    items = [item for item in text.split(",") if item]
    if not items or any("=" not in item for item in items):
        raise ValueError("expected field=value pairs separated by commas")
    fields = dict(item.split("=", 1) for item in items)

    def take(prefix):
        return {k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix)}

    scan = {k: v for k, v in fields.items() if "." not in k}
    twell = {k: float(v) for k, v in take(TWELL_PREFIX).items()}
    slice_down = take(SLICE_DOWN_PREFIX)
    slice_down_config = DEFAULT_SLICE_DOWN_CONFIG
    if slice_down:
        slice_down_config = lambda *shape: dataclasses.replace(
            DEFAULT_SLICE_DOWN_CONFIG(*shape), **{k: int(v) for k, v in slice_down.items()})
    return (_overridden(DEFAULT_CONFIG, scan), _overridden(DEFAULT_GEMV_CONFIG, take(GEMV_PREFIX)),
            _overridden(DEFAULT_GEMV_COUNTS_CONFIG, take(GEMV_COUNTS_PREFIX)),
            dataclasses.replace(tj.TwELLConfig(), **twell), slice_down_config)


def use_configs(configs) -> tj.TwELLConfig:
    """Makes the public op use ``configs``' kernel configs as its defaults from the next
    trace; returns the TwELLConfig to call it with."""
    (scan_module.default_scan_up_down_config, gemv_module.default_gemv_config,
     gemv_module.default_gemv_counts_config, twell,
     slice_down_module.default_slice_down_config) = configs
    return twell


def timer(fn, calls: int, x, sets, repeat: int):
    """A function returning microseconds per call of one timed batch (after two warm-ups)."""
    jax.block_until_ready(fn(x, sets))
    jax.block_until_ready(fn(x, sets))

    def once() -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            out = fn(x, sets)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / (repeat * calls) * 1e6
    return once


def op(implementation: str, config: tj.TwELLConfig | None = None):
    return lambda x, *w: tj.feed_forward(x, tj.FFNWeights(*w), implementation=implementation,
                                         config=config)


def plain_dense(x, w_gate, w_up, w_down):
    """The dense FFN as bf16 ``nnx.Linear`` layers compute it (bf16 outputs, float32
    accumulation inside), on the [F, D] weights: XLA reads them transposed for free."""
    rows = lambda a, w: jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())))
    return jnp.dot(jax.nn.relu(rows(x, w_gate)) * rows(x, w_up), w_down)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8", help="comma list of M")
    parser.add_argument("--nnz", default="28", help="comma list of mean active units per row")
    parser.add_argument("--heavy", action="store_true", help="also heavy-tailed rows")
    parser.add_argument("--trained", action="store_true",
                        help="also rows drawn from the trained model's counts")
    parser.add_argument("--variant", action="append", default=[],
                        help="field=value,... overrides of the default config (repeatable)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=5632)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="runs/probe_decode_scan.jsonl")
    parser.add_argument("--profile", action="store_true",
                        help="also trace each variant's unrolled calls: GPU time per kernel")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of the script: interpret mode, one loop step, M 2")
    args = parser.parse_args(argv)
    xla_flags.use_device_conditionals()  # before the first computation starts the backends
    if args.smoke:
        args.rows, args.nnz, args.heavy, args.reps = "2", "28", False, 1
        args.variant = args.variant or ["group=2"]
    elif jax.default_backend() != "gpu":
        parser.error("needs a GPU (interpret-mode timings mean nothing); --smoke checks the "
                     "script on a CPU")
    steps, layers, n_sets = ((SMOKE_STEPS, SMOKE_SETS, SMOKE_SETS) if args.smoke
                             else (LOOP_STEPS, LOOP_LAYERS, UNROLLED_SETS))
    variants = [("default", DEFAULT_CONFIGS)]
    for text in args.variant:
        try:
            variants.append((text, parse_variant(text)))
            for config in variants[-1][1][:3]:  # a bad field or value fails here
                config(1, args.d_model, args.d_ff)
            variants[-1][1][4](1, args.d_model, 128)
        except (TypeError, ValueError) as e:
            parser.error(f"--variant {text}: {e}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as out:
        return _measure(args, variants, out, steps, layers, n_sets)


def _errors(variants, x, weights) -> dict[str, float]:
    """Each variant's relative Frobenius error against the FFN in float64 (host numpy) on one
    weight set: a wrong kernel is caught before its time is read."""
    x64 = np.asarray(x, np.float64)
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in weights)
    ref = (np.maximum(x64 @ w_gate.T, 0.0) * (x64 @ w_up.T)) @ w_down
    errors = {}
    for name, configs in variants:
        twell = use_configs(configs)
        y = np.asarray(jax.jit(op("pallas", twell))(x, *weights), np.float64)
        errors[name] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    use_configs(variants[0][1])
    return errors


def _measure(args, variants, out, steps: int, layers: int, n_sets: int) -> list[dict]:
    """Times every case, one JSON line each to ``out`` after a header."""
    out.write(json.dumps(cli.header(" ".join(sys.argv))) + "\n")
    rows = []
    cases = [("uniform", float(n), None) for n in args.nnz.split(",")]
    if args.heavy:
        cases.append(("heavy_tailed", 60.0, 580.0))
    if args.trained:
        cases.append(("trained", trained_mean(args.d_ff), None))
    print(f"{'M':>3} {'rows':12} {'nnz':>6}  {'variant':40} {'loop us':>8} {'unrolled us':>11}",
          flush=True)
    for m in (int(r) for r in args.rows.split(",")):
        for pattern, nnz, p99 in cases:
            case = Case(f"m{m}_{pattern}_{nnz:g}", m, args.d_model, args.d_ff, pattern, nnz, p99)
            x = make_case_inputs(case)[0]
            sets = [tuple(tj.prepare_weights(*make_case_inputs(case, seed=s)[1:]))
                    for s in range(max(layers, n_sets))]
            row = {"m": m, "pattern": pattern, "nnz": nnz,
                   "rel_error_float64": _errors(variants, x, sets[0])}
            for mode, make, weights, calls, repeat in (
                    ("loop", lambda fn: decode_loop(fn, steps), sets[:layers], steps * layers, 3),
                    ("unrolled", unrolled_calls, sets[:n_sets], n_sets, 60)):
                repeat = 1 if args.smoke else repeat
                timers = {}
                for name, configs in variants:
                    twell = use_configs(configs)
                    timers[name] = timer(make(op("pallas", twell)), calls, x, weights, repeat)
                use_configs(variants[0][1])
                timers["dense"] = timer(make(op("xla")), calls, x, weights, repeat)
                timers["plain"] = timer(make(plain_dense), calls, x, weights, repeat)
                times = {name: [] for name in timers}
                for _ in range(args.reps):  # interleaved, so drift hits every variant alike
                    for name, once in timers.items():
                        times[name].append(once())
                row[mode] = {name: {"median_us": float(np.median(t)), "all_us": t}
                             for name, t in times.items()}
            if args.profile:
                row["kernels_us"] = _kernel_times(variants, x, sets[:n_sets])
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
            for name in [n for n, _ in variants] + ["dense", "plain"]:
                error = row["rel_error_float64"].get(name)
                print(f"{m:3d} {pattern:12} {nnz:6g}  {name[:40]:40} "
                      f"{row['loop'][name]['median_us']:8.2f} "
                      f"{row['unrolled'][name]['median_us']:11.2f}"
                      + ("" if error is None else f"  err {error:.1e}"), flush=True)
                for kernel, us in row.get("kernels_us", {}).get(name, {}).items():
                    print(f"{'':28} {us:8.2f} us  {kernel[:60]}", flush=True)
    return rows


def _kernel_times(variants, x, sets, runs: int = 3) -> dict[str, dict[str, float]]:
    """Per variant (and the two dense FFNs), the GPU time of each kernel of the unrolled
    calls, in us per call (``gpu_trace.profile``: CUPTI's own kernel times), "busy" first
    (the union of the kernels' intervals): which stage a slow variant loses in."""
    per_call = 1e3 / len(sets)
    tables = {}
    for name, configs in [*variants, ("dense", None), ("plain", None)]:
        if configs is not None:
            fn = op("pallas", use_configs(configs))  # the kernels' configs, from the trace on
        else:
            fn = op("xla") if name == "dense" else plain_dense
        program = unrolled_calls(fn)
        result = profile(lambda: program(x, sets), runs)
        tables[name] = {"busy": result["busy_ms"] * per_call,
                        **{k["name"]: k["ms"] * per_call for k in result["kernels"]}}
        use_configs(variants[0][1])
    return tables


if __name__ == "__main__":
    main()
