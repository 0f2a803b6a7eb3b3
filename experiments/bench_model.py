"""End-to-end benchmark: the sparse model ("pallas") against the same model dense ("xla").

On the H100 (presets 0.5b and 1.5b, bf16 compute; about 7-8 minutes with the budget below):

    python experiments/bench_model.py --presets 0.5b,1.5b --time-budget 450 \\
        --out runs/bench_model.jsonl --plot runs/bench_model.png

On a CPU (interpret mode, the tiny preset, well under a minute):

    python experiments/bench_model.py --presets tiny --target-nnz 224 --calib-batch 8x64 \\
        --prefill 2x16 --train-batch 2x16 --decode 1,2 --runs 2

Sparsity without a trained checkpoint: every FFN gets a per-unit gate bias
(``ModelConfig.gate_bias``), calibrated layer by layer on one batch of random tokens (layer l's
bias changes layer l + 1's input) so that unit j fires on a fraction p_j of the tokens:
``b_gate[j] = -(the (1 - p_j) quantile of x @ w_gate[:, j])`` (bf16 inputs, float32
accumulation, as the layer computes it). ``--pattern uniform``: p_j = target / F for every unit.
``--pattern heavy``: Zipf-like p_j (rank^-zipf over randomly placed units, capped at 0.5) with
the same mean, so a few units fire often and some tokens overflow a tile into the dense backup.
The target is given at F = 5632 (the paper's 28 of 5632) and scaled to the preset's F. The
achieved per-layer statistics are reported (mean / p99 / max active units per token from a gate
recomputation, heavy rows from the format rule, and the ``FFNStats`` the layers sow). The dense
model gets the same weights and biases: only ``implementation`` differs.

Processes: the driver never touches the accelerator. Per preset it runs, each in its own
subprocess (so ``memory_stats()``' cumulative peak belongs to one measurement group):
``prepare`` (calibration, statistics, and the per-layer breakdown: one layer's FFN alone,
``twell_jax.gated_mlp`` on its captured input, forward and forward + backward, for both
implementations, and the attention sublayer alone), then ``infer`` for xla and pallas (decode-
sized forwards first, then prefill from the smallest shape up, peak memory after each), then
``train`` for xla and pallas (forward + backward + AdamW on a micro-batch; remat on for the
paper-sized presets). Prefill is the last position's logits of B x T tokens
(``features(tokens)[:, -1] @ embedding.T``); "decode" is a forward of n sequences of ONE token
with NO KV cache (the projections and FFNs of a decode step, not attention over a cache).

Each measured function is jitted and compiled once per shape (``lower().compile()``, which also
gives XLA's static memory estimate), called ``--warmup`` times, then timed: ``--runs``
synchronised calls (more while the loop is shorter than ``--min-time`` seconds, so the power
readings cover it); the median is reported. Energy: board power from NVML (ctypes, no package)
sampled every ``--power-period-ms`` in a thread during the timed loop and integrated
(trapezoid), with the driver's energy counter difference as a cross-check; null without NVML.

Output: one JSON line per measurement in ``--out`` (each with date, device, commit, jax version,
preset, implementation, shapes), the calibration statistics, the pallas / xla logits agreement,
and a ``skipped`` line for every planned measurement that did not run (``--time-budget``, a
failed or killed worker): nothing is dropped silently. A table (rows preset x metric; columns
xla, pallas, pallas / xla) is printed last; ``--plot`` draws the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import twell_jax
from twell_jax import model as model_lib
from twell_jax.config import TwELLConfig
from twell_jax.format import heavy_rows

IMPLEMENTATIONS = ("xla", "pallas")
PAPER_F = 5632  # --target-nnz is given at this FFN width and scaled to the preset's
KILL_GRACE_S = 60.0  # a worker still running this long after the time budget is killed
_F32 = jnp.float32


def _flag(default, help: str, **kwargs):
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Every knob of a benchmark run; each field is a command-line flag (``--target-nnz`` ...)."""

    presets: str = _flag("0.5b,1.5b", "comma list of model presets (twell_jax.model.CONFIGS)")
    pattern: str = _flag("uniform", "per-unit firing rates", choices=("uniform", "heavy"))
    target_nnz: float = _flag(28.0, f"mean active FFN units per token at F = {PAPER_F}; "
                                    "scaled to the preset's F (28 -> 1.27 of 256 for tiny)")
    zipf: float = _flag(0.6, "--pattern heavy: p_j proportional to rank^-zipf (0.6: the first "
                             "128-column tile expects ~5.6 of the 28 units per token)")
    placement: str = _flag("clustered", "--pattern heavy: hot units in the first columns "
                           "(clustered: some tokens overflow a tile into the dense backup) or "
                           "scattered at random", choices=("clustered", "random"))
    calib_batch: str = _flag("", "BxT random tokens for the calibration; '' = the training "
                                 "micro-batch (else the first prefill shape)")
    prefill: str = _flag("8x2048,64x2048", "prefill shapes BxT, comma separated ('' = none)")
    train_batch: str = _flag("8x2048", "training micro-batch BxT ('' = no training step)")
    decode: str = _flag("1,8,64", "decode-sized forwards: n sequences of one token, comma "
                                  "separated ('' = none); no KV cache")
    runs: int = _flag(10, "timed calls per measurement (median reported)")
    warmup: int = _flag(2, "untimed calls after the compile")
    min_time: float = _flag(1.0, "seconds: the timed loop runs at least this long (more calls "
                                 "than --runs if needed) so power samples cover it")
    power_period_ms: float = _flag(5.0, "NVML power sampling period")
    remat: str = _flag("auto", "recompute blocks in the backward: on, off, or auto (on for "
                               "presets with d_model >= 2048)", choices=("auto", "on", "off"))
    l1_coeff: float = _flag(1e-4, "L1 coefficient in the training loss (model.loss_fn)")
    lr: float = _flag(1e-6, "AdamW learning rate of the timed steps (small: the sparsity "
                            "should not drift while timing)")
    dense_fallback_density: float = _flag(-1.0, "pallas: TwELLConfig.dense_fallback_density; "
                                                "< 0 = None (the cost model decides)")
    breakdown: bool = _flag(True, "time one layer's FFN and attention sublayers alone")
    seed: int = _flag(0, "seed of the weights, the token batches and the calibration")
    time_budget: float = _flag(0.0, "seconds from the start; no measurement starts after it "
                                    "(each is reported as skipped) and a worker still running "
                                    f"{KILL_GRACE_S:.0f} s later is killed; 0 = no limit")
    out: str = _flag("runs/bench_model.jsonl", "JSON-lines file the rows are appended to")
    plot: str = _flag("", "PNG bar chart of the pallas / xla ratios ('' = none)")

    # ---- parsed views ----
    def preset_list(self) -> list[str]:
        return [p for p in self.presets.split(",") if p]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        return sorted(parse_shapes(self.prefill, "--prefill"), key=lambda s: (s[0] * s[1], s))

    def train_shapes(self) -> list[tuple[int, int]]:
        return parse_shapes(self.train_batch, "--train-batch")

    def decode_sizes(self) -> list[int]:
        return sorted({_positive_int(v, "--decode") for v in self.decode.split(",") if v})

    def calib_shape(self) -> tuple[int, int]:
        shapes = (parse_shapes(self.calib_batch, "--calib-batch") or self.train_shapes()
                  or self.prefill_shapes())
        if not shapes:
            raise ValueError("nothing to calibrate on: give --calib-batch, --train-batch or "
                             "--prefill")
        return shapes[0]

    def use_remat(self, mcfg: model_lib.ModelConfig) -> bool:
        return self.remat == "on" or (self.remat == "auto" and mcfg.d_model >= 2048)

    def twell(self) -> TwELLConfig | None:
        if self.dense_fallback_density < 0:
            return None
        return TwELLConfig(dense_fallback_density=self.dense_fallback_density)


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what}: expected an integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{what}: sizes must be positive, got {value}")
    return value


def parse_shapes(text: str, what: str) -> list[tuple[int, int]]:
    """'8x2048,64x2048' -> [(8, 2048), (64, 2048)]."""
    shapes = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        parts = item.lower().split("x")
        if len(parts) != 2:
            raise ValueError(f"{what}: expected BxT like 8x2048, got {item!r}")
        shapes.append((_positive_int(parts[0], what), _positive_int(parts[1], what)))
    return shapes


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, dict | None]:
    """The flags as a BenchConfig (clear errors for bad values) and the internal worker spec."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="See the module docstring for the method.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field in dataclasses.fields(BenchConfig):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=field.default, **field.metadata)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default,
                                **field.metadata)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal JSON spec
    args = vars(parser.parse_args(argv))
    worker = args.pop("worker")
    cfg = BenchConfig(**args)
    try:
        if not cfg.preset_list():
            raise ValueError("--presets is empty")
        for name in cfg.preset_list():
            if name not in model_lib.CONFIGS:
                raise ValueError(f"--presets: unknown preset {name!r}; choose from "
                                 f"{sorted(model_lib.CONFIGS)}")
        cfg.prefill_shapes(), cfg.train_shapes(), cfg.decode_sizes(), cfg.calib_shape()
        for name in cfg.preset_list():
            max_len = model_lib.CONFIGS[name].max_seq_len
            for b, t in cfg.prefill_shapes() + cfg.train_shapes() + [cfg.calib_shape()]:
                if t > max_len:
                    raise ValueError(f"sequence length {t} exceeds preset {name!r}'s "
                                     f"max_seq_len {max_len}")
        for name in ("runs", "target_nnz", "power_period_ms"):
            if not getattr(cfg, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for name in ("warmup", "min_time", "time_budget", "l1_coeff", "lr"):
            if getattr(cfg, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if cfg.zipf <= 0:
            raise ValueError("--zipf must be positive")
        if cfg.dense_fallback_density > 1:
            raise ValueError("--dense-fallback-density must be <= 1 (or < 0 for the cost model)")
        for name in cfg.preset_list():
            if cfg.target_nnz * model_lib.CONFIGS[name].d_ff / PAPER_F > 0.5 * \
                    model_lib.CONFIGS[name].d_ff:
                raise ValueError("--target-nnz above half of F: not a sparse model")
    except ValueError as e:
        parser.error(str(e))
    return cfg, None if worker is None else json.loads(worker)


# ------------------------------------------------------------------------------------------
# Calibration: per-unit gate biases that set each unit's firing rate.


def firing_rates(d_ff: int, mean_nnz: float, pattern: str, *, zipf: float = 0.6,
                 placement: str = "clustered", seed: int = 0) -> np.ndarray:
    """[F] firing probabilities p_j with sum_j p_j = mean_nnz (active units per token).

    ``"heavy"``: p_j proportional to rank_j^-zipf (capped at 0.5). ``placement="clustered"``
    puts the units in rank order (the hottest in the first columns, so the first tiles hold
    several hot units and some tokens overflow a tile's S slots); ``"random"`` scatters them
    (a tile then rarely overflows: per-token counts stay near the uniform case's).
    """
    if pattern == "uniform":
        return np.full(d_ff, mean_nnz / d_ff)
    if pattern != "heavy":
        raise ValueError(f"unknown pattern {pattern!r}")
    if placement == "clustered":
        rank = np.arange(1, d_ff + 1, dtype=np.float64)
    elif placement == "random":
        rank = np.random.default_rng(seed).permutation(d_ff) + 1.0
    else:
        raise ValueError(f"unknown placement {placement!r}")
    p = rank ** -zipf
    p *= mean_nnz / p.sum()
    for _ in range(100):  # cap at 0.5, handing the excess to the others (keeps the sum)
        over = p > 0.5
        if not over.any():
            break
        excess = float((p[over] - 0.5).sum())
        p[over] = 0.5
        p[~over] += excess * p[~over] / p[~over].sum()
    return p


@jax.jit
def _thresholds(gate: jax.Array, k: jax.Array) -> jax.Array:
    """[F] thresholds t_j with exactly k_j of column j of ``gate`` [N, F] above t_j (no ties):
    halfway between the k_j-th and (k_j + 1)-th largest values."""
    n = gate.shape[0]
    s = jnp.sort(gate, axis=0)  # ascending: the k-th largest is s[n - k]
    k = jnp.clip(k, 0, n - 1)
    kth = jnp.take_along_axis(s, jnp.minimum(n - k, n - 1)[None, :], axis=0)[0]
    next_ = jnp.take_along_axis(s, (n - 1 - k)[None, :], axis=0)[0]
    top = s[-1]
    return jnp.where(k == 0, top + 1.0 + jnp.abs(top), (kth + next_) / 2)


def _token_stats(active: jax.Array, twell: TwELLConfig) -> dict:
    """Per-token active-unit statistics of one layer's [N, F] bool activity."""
    n, f = active.shape
    nnz = active.sum(axis=1, dtype=jnp.int32)
    tiles = twell.num_tiles(f)
    padded = jnp.pad(active, ((0, 0), (0, tiles * twell.tile_width - f)))
    counts = padded.reshape(n, tiles, twell.tile_width).sum(-1, dtype=jnp.int32)
    return {"nnz_mean": jnp.mean(nnz.astype(_F32)),
            "nnz_p99": jnp.sort(nnz)[max(0, -(-99 * n // 100) - 1)],
            "nnz_max": jnp.max(nnz),
            "heavy_rows_rule": heavy_rows(counts, twell, f).sum(dtype=jnp.int32),
            "tiles_over_s": jnp.mean((counts > twell.slots_per_tile).astype(_F32))}


_token_stats_jit = jax.jit(_token_stats, static_argnums=1)


def _embed(model: model_lib.Transformer, tokens: jax.Array) -> jax.Array:
    cfg = model.cfg
    return (jnp.take(model.embedding[...], tokens, axis=0)
            * math.sqrt(cfg.d_model)).astype(cfg.dtype)


def _rope(cfg: model_lib.ModelConfig) -> tuple[jax.Array, jax.Array]:
    return tuple(jnp.asarray(a) for a in model_lib.rope_tables(cfg.max_seq_len, cfg.head_dim,
                                                               cfg.rope_theta))


class BlockFns:
    """A block's halves as jitted functions of its state (one compile for all layers)."""

    def __init__(self, model: model_lib.Transformer):
        self.graphdef, _ = nnx.split(model.blocks[0])
        self.cos, self.sin = _rope(model.cfg)
        cfg = model.cfg
        graphdef = self.graphdef

        def attn_half(state, x, cos, sin):  # Block.__call__ up to the FFN input
            block = nnx.merge(graphdef, state)
            x = x + block.attn(block.attn_norm(x), cos, sin)
            return x, block.ffn_norm(x)

        def gate(state, h):  # the gate pre-activation without bias, as the layer computes it
            block = nnx.merge(graphdef, state)
            h = h.reshape(-1, cfg.d_model).astype(cfg.dtype)
            return jnp.dot(h, block.ffn.w_gate[...].astype(cfg.dtype), preferred_element_type=_F32)

        def ffn_half(state, x, h):
            return x + nnx.merge(graphdef, state).ffn(h)

        self._attn, self._gate, self._ffn = (jax.jit(f) for f in (attn_half, gate, ffn_half))

    def attn_half(self, block, x):
        return self._attn(nnx.state(block), x, self.cos, self.sin)

    def gate(self, block, h):
        return self._gate(nnx.state(block), h)

    def ffn_half(self, block, x, h):
        return self._ffn(nnx.state(block), x, h)


def calibrate(model: model_lib.Transformer, tokens: jax.Array, rates: np.ndarray, *,
              seed: int = 0, log: Callable[[str], None] = lambda _: None,
              keep_layer: int | None = None) -> tuple[list[np.ndarray], list[dict], dict]:
    """Sets every layer's ``b_gate`` so that unit j fires on ~rates[j] of ``tokens``.

    One pass through the model, layer by layer: layer l's FFN input is computed with the biases
    of layers < l already set. The number of tokens unit j must fire on, rates[j] * N, is rounded
    up or down at random (expected value exact); the threshold sits halfway between the two
    order statistics around it. The bias is stored in the parameter dtype and applied after a
    cast to the compute dtype (as the layer does); the statistics use that rounded bias.

    Returns (biases [F] per layer, per-layer statistics from the recomputed gate, and the block
    input / FFN input of ``keep_layer`` for the breakdown, if asked).
    """
    cfg = model.cfg
    twell = cfg.twell or TwELLConfig()
    fns = BlockFns(model)
    n = int(np.prod(tokens.shape))
    rng = np.random.default_rng(seed + 12345)
    x = nnx.jit(_embed)(model, tokens)
    biases, stats, kept = [], [], {}
    for layer, block in enumerate(model.blocks):
        x_in = x
        x, h = fns.attn_half(block, x)
        g = fns.gate(block, h)
        k = np.floor(rates * n + rng.random(rates.shape)).astype(np.int32)
        bias = -_thresholds(g, jnp.asarray(k))
        block.ffn.b_gate[...] = bias.astype(block.ffn.b_gate[...].dtype)
        applied = block.ffn.b_gate[...].astype(cfg.dtype).astype(_F32)
        layer_stats = jax.device_get(_token_stats_jit(g + applied > 0, twell))
        stats.append({k: v.item() for k, v in layer_stats.items()})
        biases.append(np.asarray(block.ffn.b_gate[...]))
        if layer == keep_layer:
            kept = {"layer": layer, "x": x_in, "h": h}
        x = fns.ffn_half(block, x, h)
        del g
        log(f"layer {layer + 1}/{cfg.n_layers}: mean {stats[-1]['nnz_mean']:.2f}, p99 "
            f"{stats[-1]['nnz_p99']}, max {stats[-1]['nnz_max']}, heavy rows "
            f"{stats[-1]['heavy_rows_rule']}")
    return biases, stats, kept


def sown_stats(model: model_lib.Transformer, tokens: jax.Array) -> dict:
    """Per-layer ``FFNStats`` the layers sow in one forward pass (lists, layer order)."""

    @nnx.jit
    def run(model, tokens):
        _, inter = nnx.capture(model, nnx.Intermediate)(tokens)
        stats = model_lib.layer_stats(inter, model.cfg.n_layers)
        return {name: jnp.stack([jnp.asarray(getattr(s, name)) for s in stats])
                for name in ("nnz_mean", "nnz_p99", "nnz_max", "heavy_rows", "backup_overflow",
                             "dense_fallback")}

    return {k: np.asarray(v).tolist() for k, v in jax.device_get(run(model, tokens)).items()}


# ------------------------------------------------------------------------------------------
# Measuring: compile, time, memory, energy.


class PowerSampler:
    """GPU board power from NVML through ctypes (no package needed), sampled in a thread."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.error = None
        self.nvml = None
        if jax.default_backend() != "gpu":
            self.error = f"no NVML energy on backend {jax.default_backend()!r}"
            return
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self._check(nvml.nvmlInit_v2(), "nvmlInit_v2")
            self.handle = ctypes.c_void_p()
            index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
            self._check(nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)),
                        "nvmlDeviceGetHandleByIndex_v2")
            self.nvml = nvml
            self.power_w()
        except Exception as e:  # noqa: BLE001 - any failure means: no energy numbers
            self.nvml, self.error = None, f"NVML unavailable: {e}"

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned NVML error {status}")

    def power_w(self) -> float:
        milliwatts = ctypes.c_uint()
        self._check(self.nvml.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(milliwatts)),
                    "nvmlDeviceGetPowerUsage")
        return milliwatts.value / 1e3

    def counter_j(self) -> float | None:
        millijoules = ctypes.c_ulonglong()
        status = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle,
                                                               ctypes.byref(millijoules))
        return millijoules.value / 1e3 if status == 0 else None

    def measure(self, fn: Callable[[], Any]) -> dict:
        """Runs fn() while sampling power; returns joules (trapezoid), mean watts and the
        energy counter's difference."""
        if self.nvml is None:
            fn()
            return {"energy_j": None}
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                samples.append((time.perf_counter(), self.power_w()))
                stop.wait(self.period_s)

        counter0 = self.counter_j()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            fn()
        finally:
            stop.set()
            thread.join()
        samples.append((time.perf_counter(), self.power_w()))
        counter1 = self.counter_j()
        t, w = (np.asarray(v, np.float64) for v in zip(*samples))
        joules = float(np.sum((w[1:] + w[:-1]) / 2 * np.diff(t))) if len(t) > 1 else None
        return {"energy_j": joules, "mean_power_w": float(np.mean(w)),
                "power_samples": len(samples),
                "energy_counter_j": None if None in (counter0, counter1) else counter1 - counter0}


def compile_once(fn: Callable, args: tuple, donate: tuple[int, ...] = ()) -> tuple[Any, dict]:
    """jit + lower + compile (once, for these shapes); returns the executable and XLA's static
    memory estimate (temporaries + arguments + outputs - aliased)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    info = {"compile_s": time.perf_counter() - t0}
    try:
        m = compiled.memory_analysis()
        info["xla_memory"] = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in
                              ("temp", "argument", "output", "alias")}
        info["xla_memory_estimate_bytes"] = (info["xla_memory"]["temp"]
                                             + info["xla_memory"]["argument"]
                                             + info["xla_memory"]["output"]
                                             - info["xla_memory"]["alias"])
    except Exception as e:  # noqa: BLE001 - not every backend reports it
        info["xla_memory_estimate_bytes"] = None
        info["xla_memory_note"] = f"memory_analysis unavailable: {e}"
    return compiled, info


def time_calls(call: Callable[[], Any], cfg: BenchConfig,
               sampler: PowerSampler | None) -> dict:
    """Median ms of ``call()`` (each synchronised) after ``cfg.warmup`` calls; the timed loop
    runs ``cfg.runs`` calls and more while shorter than ``cfg.min_time``; with a sampler, the
    energy of the whole loop."""
    for _ in range(cfg.warmup):
        jax.block_until_ready(call())
    times = []

    def loop():
        start = time.perf_counter()
        while len(times) < cfg.runs or (time.perf_counter() - start < cfg.min_time
                                        and len(times) < 100 * cfg.runs):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times.append((time.perf_counter() - t0) * 1e3)

    energy = sampler.measure(loop) if sampler is not None else (loop() or {})
    ms = np.asarray(times)
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "calls": len(times),
            "loop_s": float(ms.sum() / 1e3), **energy}


def peak_bytes() -> int | None:
    """The process's peak device memory so far (None where the backend does not say)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


# ------------------------------------------------------------------------------------------
# Workers: each runs in its own process and prints "RESULT <json>" lines.


class Worker:
    def __init__(self, spec: dict, cfg: BenchConfig):
        self.spec, self.cfg = spec, cfg
        self.preset = spec["preset"]
        self.impl = spec.get("implementation")
        self.deadline = spec.get("deadline")
        self.t0 = time.perf_counter()
        self.device = str(jax.devices()[0].device_kind)

    def emit(self, row: dict) -> None:
        row = {"preset": self.preset, "implementation": self.impl, "pattern": self.cfg.pattern,
               "device": self.device, "backend": jax.default_backend(), "jax": jax.__version__,
               **row}
        print("RESULT " + json.dumps(row), flush=True)

    def log(self, text: str) -> None:
        print(f"PROGRESS [{time.perf_counter() - self.t0:6.1f} s] {text}", flush=True)

    def out_of_time(self, what: dict) -> bool:
        if self.deadline is not None and time.time() > self.deadline:
            self.emit({"kind": "skipped", **what, "reason": "time budget spent"})
            return True
        return False

    def guarded(self, what: dict, fn: Callable[[], None]) -> None:
        """Runs one measurement unless the budget is spent; an exception becomes an error
        row (the next measurement still runs)."""
        if self.out_of_time(what):
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported, not swallowed
            self.emit({"kind": "error", **what, "error": f"{type(e).__name__}: {e}"[:2000]})
            self.log(f"FAILED {what}: {type(e).__name__}: {str(e)[:300]}")

    def build(self, implementation: str) -> model_lib.Transformer:
        mcfg = model_lib.CONFIGS[self.preset]
        return model_lib.build(self.preset, seed=self.cfg.seed, implementation=implementation,
                               gate_bias=True, remat=self.cfg.use_remat(mcfg),
                               twell=self.cfg.twell())

    def load(self) -> model_lib.Transformer:
        model = self.build(self.impl)
        biases = np.load(self.spec["bias_file"])
        for block, bias in zip(model.blocks, biases, strict=True):
            block.ffn.b_gate[...] = jnp.asarray(bias, block.ffn.b_gate[...].dtype)
        return model


def random_tokens(shape: tuple[int, ...], vocab: int, seed: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


def target_for(cfg: BenchConfig, d_ff: int) -> float:
    return cfg.target_nnz * d_ff / PAPER_F


def run_prepare(w: Worker) -> None:
    """Calibration (saves the biases), statistics, and the breakdown of one layer."""
    cfg = w.cfg
    w.emit({"kind": "env", "devices": len(jax.devices()), "flax": _version("flax"),
            "optax": optax.__version__, "memory_bytes_limit": _bytes_limit(),
            "nvml": PowerSampler(cfg.power_period_ms).error or "ok"})
    model = w.build("xla")
    mcfg = model.cfg
    b, t = cfg.calib_shape()
    tokens = random_tokens((b, t), mcfg.vocab_size, cfg.seed + 1)
    target = target_for(cfg, mcfg.d_ff)
    rates = firing_rates(mcfg.d_ff, target, cfg.pattern, zipf=cfg.zipf,
                         placement=cfg.placement, seed=cfg.seed)
    w.log(f"calibrating {w.preset} ({mcfg.n_layers} layers, F {mcfg.d_ff}) on {b}x{t} tokens, "
          f"target {target:.2f} units/token, pattern {cfg.pattern}")
    t0 = time.perf_counter()
    middle = mcfg.n_layers // 2
    biases, stats, kept = calibrate(model, tokens, rates, seed=cfg.seed, log=w.log,
                                    keep_layer=middle)
    np.save(w.spec["bias_file"], np.stack(biases))
    per_layer = {k: [s[k] for s in stats] for k in stats[0]}
    w.emit({"kind": "calibration", "mode": "calibration", "implementation": None,
            "target_nnz": target, "target_nnz_at_5632": cfg.target_nnz, "shape": [b, t],
            "rate_max": float(rates.max()), "rate_min": float(rates.min()),
            "seconds": time.perf_counter() - t0, "source": "gate recomputation", **per_layer})
    w.log(f"calibrated in {time.perf_counter() - t0:.1f} s; mean nnz per layer "
          f"{[round(v, 2) for v in per_layer['nnz_mean']]}")

    def sown():
        t1 = time.perf_counter()
        st = sown_stats(model, tokens)
        w.emit({"kind": "ffn_stats", "mode": "ffn_stats", "implementation": "xla",
                "shape": [b, t], "source": "FFNStats sown by the layers (xla forward)",
                "seconds": time.perf_counter() - t1, **st})
        w.log(f"FFNStats (xla forward): heavy rows per layer {st['heavy_rows']}")

    w.guarded({"mode": "ffn_stats", "implementation": "xla"}, sown)
    if cfg.breakdown:
        breakdown(w, model, kept)


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return None


def _bytes_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
        return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
    except Exception:  # noqa: BLE001
        return None


def breakdown(w: Worker, model: model_lib.Transformer, kept: dict) -> None:
    """One layer's FFN (``twell_jax.gated_mlp`` on its captured input, both implementations)
    and attention sublayer (norm + attention + residual; the same code in both models) alone,
    forward and forward + backward against a fixed random cotangent."""
    cfg, mcfg = w.cfg, model.cfg
    layer, x, h = kept["layer"], kept["x"], kept["h"]
    # At the training micro-batch's token count where the calibration batch holds it (the
    # first t positions of a causal model do not depend on the rest), so shares line up.
    for b, t in cfg.train_shapes()[:1]:
        if b <= x.shape[0] and t <= x.shape[1]:
            x, h = x[:b, :t], h[:b, :t]
    block = model.blocks[layer]
    tokens = int(np.prod(x.shape[:-1]))
    ct = jax.random.normal(jax.random.key(cfg.seed + 7), x.shape, _F32).astype(mcfg.dtype)
    ffn_params = tuple(p[...] for p in (block.ffn.w_gate, block.ffn.w_up, block.ffn.w_down,
                                        block.ffn.b_gate))
    attn_graph, attn_state = nnx.split(block)
    cos, sin = _rope(mcfg)

    def ffn_fn(impl):
        def f(xx, wg, wu, wd, bg):
            dt = mcfg.dtype
            return twell_jax.gated_mlp(xx, wg.astype(dt), wu.astype(dt), wd.astype(dt),
                                       b_gate=bg, implementation=impl, config=mcfg.twell)
        return f

    def attn_fn(state, xx):
        blk = nnx.merge(attn_graph, state)
        return xx + blk.attn(blk.attn_norm(xx), cos, sin)

    def with_backward(f, argnums):
        def fb(*args):
            def scalar(*a):
                return jnp.sum(f(*a).astype(_F32) * ct.astype(_F32))
            return jax.grad(scalar, argnums=argnums)(*args)
        return fb

    cases = []
    for impl in IMPLEMENTATIONS:
        cases.append(("ffn", impl, "forward", ffn_fn(impl), (h, *ffn_params)))
        cases.append(("ffn", impl, "forward+backward",
                      with_backward(ffn_fn(impl), (0, 1, 2, 3, 4)), (h, *ffn_params)))
    cases.append(("attention", None, "forward", attn_fn, (attn_state, x)))
    cases.append(("attention", None, "forward+backward", with_backward(attn_fn, (0, 1)),
                  (attn_state, x)))
    for part, impl, pass_, fn, args in cases:
        what = {"mode": "breakdown", "part": part, "pass": pass_, "implementation": impl}

        def run(fn=fn, args=args, what=what, part=part, impl=impl, pass_=pass_):
            compiled, info = compile_once(fn, args)
            timing = time_calls(lambda: compiled(*args), cfg, None)
            w.emit({"kind": "breakdown", **what, "layer": layer, "tokens": tokens,
                    "n_layers": mcfg.n_layers, **info, **timing,
                    "all_layers_ms": timing["median_ms"] * mcfg.n_layers})
            w.log(f"breakdown {part} {impl or 'both'} {pass_}: {timing['median_ms']:.3f} ms "
                  f"per layer (compile {info['compile_s']:.1f} s)")

        w.guarded(what, run)


def _prefill_fn(graphdef):
    def prefill(state, tokens):
        """The last position's logits [B, V] float32: what generation needs from a prefill."""
        model = nnx.merge(graphdef, state)
        hidden = model.features(tokens)[:, -1]
        return jnp.dot(hidden, model.embedding[...].astype(hidden.dtype).T,
                       preferred_element_type=_F32)
    return prefill


def _pallas_dense_by_shape(mcfg, m: int, twell: TwELLConfig | None) -> bool | None:
    """Whether the pallas FFN runs the dense function for m tokens from the shapes alone (the
    cost model's fixed-cost rule at decode sizes); None if that rule is not available."""
    try:
        from twell_jax import ffn
        return bool(ffn._sparse_never_pays(m, mcfg.d_model, mcfg.d_ff, mcfg.dtype,
                                           twell or TwELLConfig()))
    except Exception:  # noqa: BLE001 - private rule; absent in other versions
        return None


def run_infer(w: Worker) -> None:
    """Decode-sized forwards, then prefill, smallest first (the process peak after each is
    then that measurement's peak unless an earlier, smaller one was larger)."""
    cfg = w.cfg
    model = w.load()
    mcfg = model.cfg
    graphdef, state = nnx.split(model)
    del model
    prefill = _prefill_fn(graphdef)
    sampler = PowerSampler(cfg.power_period_ms)
    work = [("decode", (n, 1)) for n in cfg.decode_sizes()]
    work += [("prefill", s) for s in cfg.prefill_shapes()]
    for mode, (b, t) in work:
        what = {"mode": mode, "shape": [b, t]}

        def run(mode=mode, b=b, t=t, what=what):
            seed = cfg.seed + (3 if mode == "decode" else 2)
            tokens = random_tokens((b, t), mcfg.vocab_size, seed)
            compiled, info = compile_once(prefill, (state, tokens))
            logits = compiled(state, tokens)
            timing = time_calls(lambda: compiled(state, tokens), cfg, sampler)
            row = {"kind": "time", **what, "tokens_per_call": b * t, **info, **timing,
                   "tokens_per_s": b * t / (timing["median_ms"] / 1e3),
                   "peak_bytes_so_far": peak_bytes()}
            if mode == "decode":
                row["note"] = "n sequences of one token, no KV cache"
                if w.impl == "pallas":
                    row["pallas_ffn_dense_by_shape"] = _pallas_dense_by_shape(
                        mcfg, b * t, cfg.twell())
            _add_energy(row, b * t, sampler)
            logits = np.asarray(jax.device_get(logits), np.float32)
            row["logits_finite"] = bool(np.isfinite(logits).all())
            np.save(os.path.join(w.spec["tmp"], _logits_name(w.preset, w.impl, mode, b, t)),
                    logits)
            w.emit(row)
            w.log(f"{mode} {b}x{t} {w.impl}: {timing['median_ms']:.3f} ms, "
                  f"{row['tokens_per_s']:,.0f} tokens/s (compile {info['compile_s']:.1f} s)")

        w.guarded(what, run)


def _logits_name(preset, impl, mode, b, t) -> str:
    return f"logits_{preset}_{impl}_{mode}_{b}x{t}.npy"


def _add_energy(row: dict, tokens_per_call: int, sampler: PowerSampler) -> None:
    if row.get("energy_j") is not None:
        row["mj_per_token"] = row["energy_j"] * 1e3 / (tokens_per_call * row["calls"])
        if row.get("energy_counter_j") is not None:
            row["mj_per_token_counter"] = (row["energy_counter_j"] * 1e3
                                           / (tokens_per_call * row["calls"]))
    else:
        row["mj_per_token"] = None
        row["energy_note"] = sampler.error


def run_train(w: Worker) -> None:
    """Forward + backward + AdamW steps on one micro-batch (model.loss_fn with the L1 term)."""
    cfg = w.cfg
    model = w.load()
    mcfg = model.cfg
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    tx = optax.adamw(cfg.lr)
    sampler = PowerSampler(cfg.power_period_ms)

    def step(params, opt_state, rest, tokens):
        def loss(params):
            return model_lib.loss_fn(nnx.merge(graphdef, params, rest), tokens, cfg.l1_coeff)

        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, metrics

    for b, t in cfg.train_shapes():
        what = {"mode": "train", "shape": [b, t]}

        def run(b=b, t=t, what=what):
            nonlocal params
            tokens = random_tokens((b, t + 1), mcfg.vocab_size, cfg.seed + 4)
            opt_state = jax.jit(tx.init)(params)
            compiled, info = compile_once(step, (params, opt_state, rest, tokens), donate=(0, 1))
            carry = [params, opt_state]

            def call():
                carry[0], carry[1], value, metrics = compiled(carry[0], carry[1], rest, tokens)
                return value, metrics

            loss, metrics = jax.device_get(call())
            timing = time_calls(call, cfg, sampler)
            params = carry[0]
            row = {"kind": "time", **what, "tokens_per_call": b * t, "remat": cfg.use_remat(mcfg),
                   "l1_coeff": cfg.l1_coeff, "loss": float(loss), **info, **timing,
                   "tokens_per_s": b * t / (timing["median_ms"] / 1e3),
                   "peak_bytes_so_far": peak_bytes(),
                   "ffn_stats": {k: np.asarray(metrics[k]).tolist() for k in
                                 ("nnz_mean", "nnz_p99", "nnz_max", "heavy_rows",
                                  "backup_overflow", "dense_fallback")}}
            _add_energy(row, b * t, sampler)
            w.emit(row)
            w.log(f"train {b}x{t} {w.impl}: {timing['median_ms']:.1f} ms, "
                  f"{row['tokens_per_s']:,.0f} tokens/s, loss {float(loss):.3f} "
                  f"(compile {info['compile_s']:.1f} s); layers on the dense path: "
                  f"{int(metrics['dense_fallback'])}")

        w.guarded(what, run)


WORKERS = {"prepare": run_prepare, "infer": run_infer, "train": run_train}


def planned(task: str, cfg: BenchConfig, preset: str) -> list[dict]:
    """The measurements a worker is expected to report (to report any that went missing)."""
    if task == "prepare":
        out = [{"mode": "calibration", "implementation": None},
               {"mode": "ffn_stats", "implementation": "xla"}]
        if cfg.breakdown:
            out += [{"mode": "breakdown", "part": "ffn", "pass": p, "implementation": i}
                    for i in IMPLEMENTATIONS for p in ("forward", "forward+backward")]
            out += [{"mode": "breakdown", "part": "attention", "pass": p, "implementation": None}
                    for p in ("forward", "forward+backward")]
        return out
    if task == "infer":
        return ([{"mode": "decode", "shape": [n, 1]} for n in cfg.decode_sizes()]
                + [{"mode": "prefill", "shape": list(s)} for s in cfg.prefill_shapes()])
    return [{"mode": "train", "shape": list(s)} for s in cfg.train_shapes()]


def _reported(plan_item: dict, rows: list[dict]) -> bool:
    """Whether some row reports the planned measurement (same mode, shape, part, pass and
    implementation, where the plan names them)."""
    keys = [k for k in ("mode", "shape", "part", "pass", "implementation") if k in plan_item]
    return any(r.get("kind") != "env" and all(r.get(k) == plan_item[k] for k in keys)
               for r in rows)


# ------------------------------------------------------------------------------------------
# The driver.


def _commit() -> str:
    """TWELL_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git),
    else git's HEAD."""
    if os.environ.get("TWELL_COMMIT"):
        return os.environ["TWELL_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:  # noqa: BLE001 - the GPU machine has no git
        return os.environ.get("TWELL_COMMIT", "unknown")


class Driver:
    def __init__(self, cfg: BenchConfig, argv: list[str]):
        self.cfg, self.argv = cfg, argv
        self.start = time.perf_counter()
        self.deadline = time.time() + cfg.time_budget if cfg.time_budget else None
        self.base = {"date": datetime.datetime.now(datetime.UTC).isoformat(),
                     "commit": _commit()}
        self.rows: list[dict] = []
        self.out = None  # the --out file, open while run() runs

    def log(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {text}", flush=True)

    def record(self, row: dict) -> None:
        row = {**self.base, **row}
        self.rows.append(row)
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()

    def run_worker(self, spec: dict) -> None:
        """Runs one worker subprocess, recording its rows as they come; every planned
        measurement it did not report is recorded as skipped, with the reason."""
        label = f"{spec['task']} {spec['preset']} {spec.get('implementation') or ''}".strip()
        base = {"preset": spec["preset"], "implementation": spec.get("implementation"),
                "pattern": self.cfg.pattern}
        plan = [{**base, **p} for p in planned(spec["task"], self.cfg, spec["preset"])]
        if self.deadline is not None and time.time() > self.deadline:
            for p in plan:
                self.record({"kind": "skipped", **p, "reason": "time budget spent"})
            self.log(f"{label}: skipped (time budget spent), {len(plan)} measurement(s)")
            return
        self.log(f"{label}: starting")
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), *self.argv,
               "--worker", json.dumps({**spec, "deadline": self.deadline})]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        got, tail = [], []

        def read():
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    row = json.loads(line[len("RESULT "):])
                    got.append(row)
                    self.record(row)
                elif line.startswith("PROGRESS "):
                    print(f"    {label}: {line[len('PROGRESS '):].rstrip()}", flush=True)
                else:
                    tail.append(line.rstrip())
                    del tail[:-40]

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        killed = False
        while proc.poll() is None:
            if self.deadline is not None and time.time() > self.deadline + KILL_GRACE_S:
                proc.kill()
                killed = True
            time.sleep(0.2)
        reader.join()
        if killed:
            reason = f"worker killed {KILL_GRACE_S:.0f} s after the time budget"
        elif proc.returncode != 0:
            reason = f"worker failed (exit code {proc.returncode})"
            self.record({"kind": "error", **base, "task": spec["task"],
                         "returncode": proc.returncode, "output_tail": "\n".join(tail)})
            print("\n".join(tail[-25:]), flush=True)
        else:
            reason = "not reported by the worker"
        for p in plan:
            if not _reported(p, got):
                self.record({"kind": "skipped", **p, "reason": reason})
        self.log(f"{label}: done in {time.perf_counter() - t0:.1f} s"
                 + (f" ({reason})" if killed or proc.returncode else ""))

    def compare_logits(self, preset: str, tmp: str) -> None:
        """pallas against xla last-position logits of the same calibrated model and tokens."""
        for mode, (b, t) in ([("prefill", s) for s in self.cfg.prefill_shapes()]
                             + [("decode", (n, 1)) for n in self.cfg.decode_sizes()]):
            files = [os.path.join(tmp, _logits_name(preset, i, mode, b, t))
                     for i in IMPLEMENTATIONS]
            if not all(os.path.exists(f) for f in files):
                continue
            xla, pallas = (np.load(f).astype(np.float64) for f in files)
            rel = float(np.linalg.norm(pallas - xla) / max(np.linalg.norm(xla), 1e-30))
            top1 = float(np.mean(np.argmax(pallas, -1) == np.argmax(xla, -1)))
            self.record({"kind": "check", "preset": preset, "pattern": self.cfg.pattern,
                         "mode": mode, "shape": [b, t], "logits_rel_err": rel,
                         "top1_agreement": top1})
            self.log(f"{preset} {mode} {b}x{t}: pallas vs xla logits relative error "
                     f"{rel:.2e}, top-1 agreement {top1:.3f}")

    def run(self) -> list[dict]:
        cfg = self.cfg
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.out, "a") as self.out, tempfile.TemporaryDirectory() as tmp:
            self.record({"kind": "header", "command": " ".join(["bench_model.py", *self.argv]),
                         "config": dataclasses.asdict(cfg),
                         "note": "decode = n sequences of one token, no KV cache; peak memory "
                                 "is each worker process's peak so far (measurements run "
                                 "smallest first); ratio = pallas / xla"})
            for preset in cfg.preset_list():
                self.run_preset(preset, tmp)
        table = ratio_table(self.rows)
        print_summary(self.rows, table)
        if cfg.plot:
            write_plot(table, cfg.plot)
            self.log(f"plot: {cfg.plot}")
        self.log(f"rows appended to {cfg.out}")
        return self.rows

    def run_preset(self, preset: str, tmp: str) -> None:
        cfg = self.cfg
        bias_file = os.path.join(tmp, f"bias_{preset}.npy")
        common = {"preset": preset, "bias_file": bias_file, "tmp": tmp}
        self.run_worker({"task": "prepare", **common})
        for task in ("infer", "train"):
            for impl in IMPLEMENTATIONS:
                if not planned(task, cfg, preset):
                    continue
                if not os.path.exists(bias_file):
                    for p in planned(task, cfg, preset):
                        self.record({"kind": "skipped", "preset": preset, "implementation": impl,
                                     "pattern": cfg.pattern, **p,
                                     "reason": "no calibrated biases"})
                    continue
                self.run_worker({"task": task, "implementation": impl, **common})
        self.compare_logits(preset, tmp)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, spec = parse_args(argv)
    if spec is not None:
        worker = Worker(spec, cfg)
        WORKERS[spec["task"]](worker)
        return []
    return Driver(cfg, argv).run()


# ------------------------------------------------------------------------------------------
# The summary table and the plot.


def _shape(row: dict) -> str:
    return "x".join(map(str, row["shape"]))


def ratio_table(rows: list[dict]) -> list[dict]:
    """Rows (preset, metric) with the xla and pallas values and pallas / xla."""
    values: dict[tuple[str, str], dict] = {}

    def put(preset, metric, impl, value):
        values.setdefault((preset, metric), {})[impl] = value

    times = {}
    for r in rows:
        if r.get("kind") == "time":
            shape = _shape(r)
            times[(r["preset"], r["implementation"], r["mode"], shape)] = r
            put(r["preset"], f"{r['mode']} {shape} tokens/s", r["implementation"],
                r["tokens_per_s"])
            if r["mode"] != "decode":
                put(r["preset"], f"{r['mode']} {shape} ms", r["implementation"], r["median_ms"])
                put(r["preset"], f"{r['mode']} {shape} mJ/token", r["implementation"],
                    r.get("mj_per_token"))
                peak = r.get("peak_bytes_so_far")
                put(r["preset"], f"{r['mode']} {shape} peak GiB", r["implementation"],
                    None if peak is None else peak / 2**30)
                est = r.get("xla_memory_estimate_bytes")
                put(r["preset"], f"{r['mode']} {shape} XLA estimate GiB", r["implementation"],
                    None if est is None else est / 2**30)
    parts = {}
    for r in rows:
        if r.get("kind") == "breakdown":
            impls = IMPLEMENTATIONS if r["implementation"] is None else (r["implementation"],)
            for impl in impls:
                put(r["preset"], f"{r['part']} {r['pass']} ms/layer", impl, r["median_ms"])
                parts[(r["preset"], impl, r["part"], r["pass"])] = r
    # Shares: one layer's sublayer time x layers over the whole model's time, same token count.
    for (preset, impl, part, pass_), r in parts.items():
        if part not in ("ffn", "attention"):
            continue
        for mode in ("prefill", "train"):
            whole = [v for (p, i, m, _), v in times.items()
                     if (p, i, m) == (preset, impl, mode)
                     and v["tokens_per_call"] == r["tokens"]]
            if not whole:
                continue
            if mode == "prefill" and pass_ == "forward":
                ms = r["median_ms"]
            elif mode == "train" and pass_ == "forward+backward":
                ms = r["median_ms"]
                fwd = parts.get((preset, impl, part, "forward"))
                if whole[0].get("remat") and fwd is not None:
                    ms += fwd["median_ms"]  # remat recomputes the forward in the backward
            else:
                continue
            put(preset, f"{part} share of {mode} {_shape(whole[0])}", impl,
                ms * r["n_layers"] / whole[0]["median_ms"])
    table = []
    for (preset, metric), v in values.items():
        xla, pallas = v.get("xla"), v.get("pallas")
        ratio = pallas / xla if xla and pallas is not None else None
        table.append({"preset": preset, "metric": metric, "xla": xla, "pallas": pallas,
                      "ratio": ratio})
    return table


def _fmt(v) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def print_summary(rows: list[dict], table: list[dict]) -> None:
    print("\nCalibration (per layer, from a gate recomputation on the calibration batch):")
    for r in rows:
        if r.get("kind") == "calibration":
            print(f"  {r['preset']} {r['pattern']}: target {r['target_nnz']:.2f}/token; mean "
                  f"{min(r['nnz_mean']):.2f}-{max(r['nnz_mean']):.2f}, p99 up to "
                  f"{max(r['nnz_p99'])}, max up to {max(r['nnz_max'])}; heavy rows (format "
                  f"rule) per layer {r['heavy_rows_rule']} of {r['shape'][0] * r['shape'][1]} "
                  "tokens")
        elif r.get("kind") == "ffn_stats":
            print(f"  {r['preset']} FFNStats sown (xla forward): heavy_rows {r['heavy_rows']}, "
                  f"dense_fallback {r['dense_fallback']}")
        elif r.get("kind") == "time" and r.get("mode") == "train" and r.get("ffn_stats"):
            s = r["ffn_stats"]
            print(f"  {r['preset']} train step FFNStats ({r['implementation']}): nnz mean "
                  f"{min(s['nnz_mean']):.2f}-{max(s['nnz_mean']):.2f}, heavy_rows "
                  f"{s['heavy_rows']}, layers on the dense path {s['dense_fallback']}")
        elif r.get("kind") == "check":
            print(f"  {r['preset']} {r['mode']} {_shape(r)}: pallas vs xla logits rel. error "
                  f"{r['logits_rel_err']:.2e}, top-1 agreement {r['top1_agreement']:.3f}")
    notes = {r["energy_note"] for r in rows if r.get("energy_note")}
    for note in notes:
        print(f"Energy: null ({note})")
    skipped = [r for r in rows if r.get("kind") in ("skipped", "error")]
    if skipped:
        print(f"\nNot measured ({len(skipped)}):")
        for r in skipped:
            what = " ".join(str(r[k]) for k in ("preset", "implementation", "mode", "part",
                                                  "pass") if r.get(k) is not None)
            shape = f" {_shape(r)}" if r.get("shape") else ""
            print(f"  {r['kind']}: {what}{shape}: {r.get('reason') or r.get('error', '')[:200]}")
    print("\nDecode = n sequences of ONE token with no KV cache. Ratio = pallas / xla "
          "(tokens/s: >1 is faster; ms, mJ, GiB, share: <1 is less).")
    print(f"{'preset':<7} {'metric':<40} {'xla':>12} {'pallas':>12} {'ratio':>8}")
    for r in table:
        print(f"{r['preset']:<7} {r['metric']:<40} {_fmt(r['xla']):>12} "
              f"{_fmt(r['pallas']):>12} {_fmt(r['ratio']):>8}")


def write_plot(table: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if r["ratio"] is not None and " ms" not in r["metric"]]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.5))
    labels = [f"{r['preset']} {r['metric']}" for r in rows]
    colors = ["tab:green" if "tokens/s" in r["metric"] else "tab:blue" for r in rows]
    ax.barh(labels, [r["ratio"] for r in rows], color=colors)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("pallas / xla (green, tokens/s: higher is better; blue: lower is better)")
    ax.invert_yaxis()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
