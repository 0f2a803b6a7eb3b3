"""End-to-end benchmark: the sparse model ("pallas") against the same model dense ("xla").

On the H100 (the numbers in benchmarks/LOG.md; about 4 minutes for 0.5b, 9 for 1.5b):

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
implementation measures (each its own process, so ``memory_stats()``' peak is its own):
prefill (last-position logits of B x T tokens), decode-sized forwards (n sequences of one token,
no KV cache: the FFN and projections of a decode step, not its attention over a cache), a
training step (loss with the L1 term, backward, AdamW) under each ``--remat`` setting (on: each
block recomputed in the backward, the FFN outputs and the sparse lists kept; off: nothing
recomputed; a setting that does not fit is reported as ``oom``), the FFN and attention
sublayers alone (for the time breakdown), peak device memory and energy per token (the
driver's energy counter over at least ``ENERGY_WINDOW_S`` of repeated calls after the timed
ones, with NVML's board power, SM clock and power-limit reasons sampled every few ms beside
it). Median over ``--runs`` synchronised repetitions after two warm-up calls.
One JSON line per measurement goes to ``--out``; a table of xla / pallas ratios is printed last,
training compared per setting and fastest against fastest (the honest baseline: the dense
model trained as fast as it fits).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (flags, header, timer summary, worker dispatch)
from common import flag  # noqa: E402

from twell_jax import inputs  # noqa: E402
from twell_jax import model as model_lib  # noqa: E402
from twell_jax.backends import Implementation  # noqa: E402

MEASURED: tuple[Implementation, ...] = ("xla", "pallas")  # the dense baseline and the kernels


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    presets: str = flag("0.5b,1.5b", "comma list of model presets (twell_jax.model.CONFIGS)")
    implementations: str = flag("xla,pallas", "models to measure: xla (the dense baseline) "
                                "and pallas; one alone has no ratio (for a run split over "
                                "device calls: compare within one machine)")
    target_nnz: float = flag(28.0, "mean active FFN units per token at F = 5632 (scaled to F)")
    pattern: str = flag("uniform", "per-unit firing rates: uniform or heavy (Zipf-like)")
    prefill: str = flag("8x2048,64x2048", "prefill shapes BxT, comma separated")
    train_batch: str = flag("8x2048", "training micro-batch BxT ('' to skip training)")
    decode: str = flag("1,8,64", "decode-sized forwards: sequences of one token")
    runs: int = flag(10, "timed repetitions per measurement (median reported)")
    remat: str = flag("on,off", "training remat settings to time (ModelConfig.remat), comma "
                      "list of on/off; the table compares each model's fastest that fits")
    l1_coeff: float = flag(1e-4, "L1 coefficient in the training loss")
    seed: int = flag(0, "seed of the weights and the token batches")
    time_budget: float = flag(0.0, "seconds; later presets are skipped and reported (0: none)")
    out: str = flag("runs/bench_model.jsonl", "JSON-lines file the measurements are appended to")
    plot: str = flag("", "PNG of the pallas / xla ratios ('' for none)")


def parse_shapes(text: str, what: str) -> list[tuple[int, int]]:
    shapes = []
    for item in filter(None, text.split(",")):
        try:
            b, t = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"{what}: expected BxT like 8x2048, got {item!r}") from None
        if b <= 0 or t <= 0:
            raise ValueError(f"{what}: sizes must be positive, got {item!r}")
        shapes.append((b, t))
    return shapes


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, str | None]:
    cfg, worker, parser = common.parse_driver_args(BenchConfig, __doc__.split("\n")[0], argv)
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


def calibrate(model: model_lib.Transformer, tokens: jax.Array, mean_nnz: float,
              pattern: str, log: Callable) -> list[np.ndarray]:
    """Sets every layer's ``b_gate`` so unit j fires on ~p_j of ``tokens``; returns them."""
    gates = nnx.jit(model_lib.gate_preactivations)
    q = jnp.asarray(1.0 - inputs.firing_rates(model.cfg.d_ff, mean_nnz, pattern), jnp.float32)
    biases = []
    for layer, block in enumerate(model.blocks):
        g = gates(model, tokens)[layer]  # this layer's input reflects the biases set so far
        bias = -np.asarray(_per_unit_quantile(g, q))
        block.ffn.b_gate[...] = jnp.asarray(bias, block.ffn.b_gate[...].dtype)
        biases.append(bias)
        log(f"  calibrated layer {layer + 1}/{model.cfg.n_layers}")
    return biases


@jax.jit
def _per_unit_quantile(g: jax.Array, q: jax.Array) -> jax.Array:
    """[F]: the q_j-quantile of column j of g [N, F] (nearest rank)."""
    n = g.shape[0]
    index = jnp.clip(jnp.round(q * (n - 1)).astype(jnp.int32), 0, n - 1)
    return jnp.take_along_axis(jnp.sort(g, axis=0), index[None, :], axis=0)[0]


# ------------------------------------------------------------------------------------------
# Measuring: time, memory, energy.


ENERGY_WINDOW_S = 3.0
"""Energy is measured over at least this long of repeated calls: NVML's board power on the
H100 is a one-second average, and the driver's energy counter moves in steps, so a loop of a
few short calls (0.3-0.5 s for the 0.5b model's training steps) reads them wrong, both ways."""

# NVML clock event reasons (nvmlClocksEventReason*): the board holding its power limit.
_POWER_CAP_REASONS = 0x4 | 0x80  # SW power cap, HW power brake


class PowerSampler:
    """Board power, SM clock and clock event reasons from NVML (ctypes; no package needed),
    sampled in a thread; energy from the driver's counter, the power samples integrated beside
    it as a cross-check."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.error = None
        try:
            self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self._check(self.nvml.nvmlInit_v2())
            self.handle = ctypes.c_void_p()
            self._check(self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)))
        except Exception as e:  # no NVIDIA driver (CPU runs): energy is reported as null
            self.nvml, self.error = None, f"NVML unavailable: {e}"

    @property
    def available(self) -> bool:
        return self.nvml is not None

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"NVML error {status}")

    def _uint(self, name: str, *args) -> int:
        value = ctypes.c_uint()
        self._check(getattr(self.nvml, name)(self.handle, *args, ctypes.byref(value)))
        return value.value

    def power_w(self) -> float:
        return self._uint("nvmlDeviceGetPowerUsage") / 1e3

    def energy_mj(self) -> int:
        mj = ctypes.c_ulonglong()
        self._check(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)))
        return mj.value

    def sm_clock_mhz(self) -> int:
        """The SM clock (MHz; 0 where the driver does not report it)."""
        try:
            return self._uint("nvmlDeviceGetClockInfo", 1)  # NVML_CLOCK_SM
        except RuntimeError:
            return 0

    def limits(self) -> dict:
        """The board's power limit (W) and the SM clock's maximum (MHz), where reported."""
        try:
            return {"power_limit_w": self._uint("nvmlDeviceGetEnforcedPowerLimit") / 1e3,
                    "sm_clock_max_mhz": self._uint("nvmlDeviceGetMaxClockInfo", 1)}
        except RuntimeError:
            return {}

    def clock_reasons(self) -> int:
        """The clock event reasons' bit mask (0 where the driver does not report them)."""
        reasons = ctypes.c_ulonglong()
        for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                     "nvmlDeviceGetCurrentClocksThrottleReasons"):  # the older name
            fn = getattr(self.nvml, name, None)
            if fn is not None and fn(self.handle, ctypes.byref(reasons)) == 0:
                return reasons.value
        return 0

    def sample(self) -> tuple[float, float, int, int]:
        """(time s, power W, SM clock MHz, clock event reasons)."""
        return time.perf_counter(), self.power_w(), self.sm_clock_mhz(), self.clock_reasons()

    def measure(self, fn: Callable[[], None]) -> dict:
        """Runs fn while sampling; returns the energy counter's difference (``energy_j``), the
        power samples integrated (``energy_sampled_j``, trapezoid), mean watts and SM clock,
        and the fraction of samples in which the board held its power limit."""
        if not self.available:
            fn()
            return {"energy_j": None, "energy_note": self.error}
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                samples.append(self.sample())
                time.sleep(self.period_s)

        thread = threading.Thread(target=sample, daemon=True)
        counter0 = self.energy_mj()
        thread.start()
        fn()
        stop.set()
        thread.join()
        counter1 = self.energy_mj()
        return summarize_power(samples, (counter1 - counter0) / 1e3, self.limits())


def summarize_power(samples: Sequence[tuple[float, float, int, int]], counter_j: float,
                    limits: dict) -> dict:
    """The energy fields of ``PowerSampler.measure`` from its samples (time s, power W, SM
    clock MHz, clock event reasons) and the energy counter's difference in joules."""
    t, w, clock, reasons = (np.asarray(a) for a in zip(*samples)) if len(samples) > 1 else (
        np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2, np.int64))
    capped = (reasons.astype(np.int64) & _POWER_CAP_REASONS) != 0
    return {"energy_j": counter_j,
            "energy_sampled_j": float(np.sum((w[1:] + w[:-1]) / 2 * np.diff(t))),
            "mean_power_w": float(np.mean(w)), "mean_sm_clock_mhz": float(np.mean(clock)),
            "power_capped_fraction": float(np.mean(capped)), "power_samples": len(samples),
            **limits}


def time_call(fn: Callable, runs: int, sampler: PowerSampler | None = None,
              energy_window_s: float = ENERGY_WINDOW_S) -> dict:
    """Median ms of ``fn()`` (synchronised) over ``runs`` after two warm-up calls; with a
    sampler, then the energy of ``energy_calls`` more synchronised calls, enough for
    ``energy_window_s`` seconds (``ENERGY_WINDOW_S``; at least ``runs``)."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - t0) * 1e3)
    timing = {**common.summarize_ms(samples), "runs": runs}
    if sampler is None:
        return timing
    if not sampler.available:  # no NVML (a CPU run): no energy, no window of calls
        return {**timing, "energy_j": None, "energy_note": sampler.error}
    calls = max(runs, math.ceil(energy_window_s * 1e3 / max(timing["median_ms"], 1e-3)))

    def loop():
        for _ in range(calls):
            jax.block_until_ready(fn())

    return {**timing, **sampler.measure(loop), "energy_calls": calls}


def last_logits(model: model_lib.Transformer, tokens: jax.Array) -> jax.Array:
    """The last position's logits [B, V] float32 of tokens [B, T]: what generation needs."""
    return model.logits(model.features(tokens)[:, -1])


def timing_optimizer() -> optax.GradientTransformation:
    """AdamW whose learning rate is 0, held in the optimizer state (a traced value, so XLA
    cannot fold the update away): every timed step computes the whole AdamW update, but the
    weights do not move. With a real rate the timed steps train the model, and that moves its
    sparsity away from the calibrated one while it is measured (H100, 1.5b: some deep
    layers' FFN calls ended on the dense path, benchmarks/LOG.md run 31)."""
    return optax.inject_hyperparams(optax.adamw)(learning_rate=0.0)


def adamw_step(model, optimizer, tokens: jax.Array, l1_coeff: float):
    """One training step on ``tokens`` [B, T + 1] (loss with the L1 term, backward, the
    optimizer's update) as one ``jax.jit`` over the split (model, optimizer) state, donated and
    carried from call to call, compiled once here. Returns (step() -> loss, the step's
    ``Compiled``, sync(): writes the state back into model and optimizer, whose own arrays were
    donated, compile seconds)."""
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, tokens):
        m, opt = nnx.merge(graphdef, state)
        grad_fn = nnx.value_and_grad(model_lib.loss_fn, has_aux=True)
        (loss, _), grads = grad_fn(m, tokens, l1_coeff)
        opt.update(m, grads)
        return nnx.state((m, opt)), loss

    # Compiled once and called as such: a later ``train_step(...)`` call would compile the
    # step again (the 2b sparse step takes minutes to compile).
    compiled, compile_s = compile_timed(train_step, state, tokens)
    carry = {"state": state}

    def step():
        carry["state"], loss = compiled(carry["state"], tokens)
        return loss

    return step, compiled, lambda: nnx.update((model, optimizer), carry["state"]), compile_s


def compile_timed(jitted, *args):
    """(``jitted.lower(*args).compile()``, seconds it took: tracing, lowering, XLA)."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - start


def jit_over_state(fn: Callable, module: nnx.Module):
    """``fn(module, *args)`` as one ``jax.jit`` over the module's split state, as a serving or
    training loop calls it: ``nnx.jit`` walks the module's graph in Python on every call
    (measured on the H100, 0.5b prefill: 34.0 / 39.1 ms per call for xla / pallas through
    ``nnx.jit``, 29.1 / 27.8 ms this way). Returns (call(*args), the jitted function of
    (state, *args), state)."""
    graphdef, state = nnx.split(module)
    jitted = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
    return (lambda *args: jitted(state, *args)), jitted, state


def device_bytes_limit() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def compiled_bytes(compiled) -> int | None:
    """Static estimate from XLA: temporaries + arguments + outputs of a compiled function
    (a lowered one, ``jax.jit``'s or ``nnx.jit``'s, is compiled first), less the outputs that
    reuse a donated argument's buffer (counted once: a training step donates its whole state;
    counting it twice called the 1.5b dense step without remat 77.2 GB, while it peaked at
    58.8 GB on the H100, run 30)."""
    try:
        if hasattr(compiled, "compile"):  # not compiled yet (nnx.jit's is no jax.stages.Lowered)
            compiled = compiled.compile()
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------
# The worker: one process per (preset, implementation) or for the calibration.


def build_model(preset: str, implementation: str, cfg: BenchConfig):
    """The preset with gate biases, remat off (training sets it per measurement)."""
    return model_lib.build(preset, implementation=implementation, gate_bias=True, seed=cfg.seed)


def token_batch(mcfg, cfg: BenchConfig, b: int, t: int) -> jax.Array:
    """[b, t] random tokens: the top-left corner of one fixed token array, so every batch of
    the run shares its first sequences with the calibration batch.

    Why: a random model's deep-layer activations are strongly correlated within a sequence,
    so biases calibrated on some sequences set a different rate on others (measured on the
    H100: layers 20-28 of 1.5b rose from 28 to ~240 active units per token on fresh tokens).
    The calibration batch is the training batch and the first prefill batch, so those are
    exactly at the target; other batches report their own statistics."""
    shapes = parse_shapes(cfg.prefill, "") + parse_shapes(cfg.train_batch, "")
    b_all = max([b] + [s[0] for s in shapes] + [int(n) for n in filter(None, cfg.decode.split(","))])
    t_all = max([t] + [s[1] + 1 for s in shapes])
    every = jax.random.randint(jax.random.key(cfg.seed + 1), (b_all, t_all), 0, mcfg.vocab_size,
                               jnp.int32)
    return every[:b, :t]


def calibration_tokens(mcfg, cfg: BenchConfig) -> jax.Array:
    """The training batch's inputs (else the first prefill batch)."""
    b, t = (parse_shapes(cfg.train_batch, "") or parse_shapes(cfg.prefill, ""))[0]
    return token_batch(mcfg, cfg, b, min(t, mcfg.max_seq_len))


def layer_statistics(model, tokens) -> dict:
    """Per-layer FFN statistics of one forward pass (what the layers sow)."""
    @nnx.jit
    def run(model, tokens):
        _, inter = nnx.capture(model, nnx.Intermediate)(tokens)
        stats = model_lib.layer_stats(inter, model.cfg.n_layers)
        return {name: jnp.stack([jnp.asarray(getattr(s, name)) for s in stats])
                for name in ("nnz_mean", "nnz_p99", "nnz_max", "heavy_rows", "dense_fallback")}

    out = jax.device_get(run(model, tokens))
    return {k: np.asarray(v).tolist() for k, v in out.items()}


def worker_calibrate(spec: dict, cfg: BenchConfig, emit: Callable) -> None:
    model = build_model(spec["preset"], "xla", cfg)
    mcfg = model.cfg
    tokens = calibration_tokens(mcfg, cfg)
    target = cfg.target_nnz * mcfg.d_ff / 5632
    t0 = time.perf_counter()
    biases = calibrate(model, tokens, target, cfg.pattern, lambda m: print(m, flush=True))
    np.save(spec["bias_file"], np.stack(biases))
    stats = layer_statistics(model, tokens)
    emit({"kind": "calibration", "preset": spec["preset"], "pattern": cfg.pattern,
          "target_nnz": target, "tokens": int(tokens.size), "seconds": time.perf_counter() - t0,
          **stats})


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
        if timing.get("energy_j") is not None:
            row["mj_per_token"] = timing["energy_j"] * 1e3 / (tokens_per_call
                                                              * timing["energy_calls"])
        emit(row)

    _, prefill_jitted, state = jit_over_state(last_logits, model)
    for b, t in parse_shapes(cfg.prefill, ""):
        tokens = token_batch(mcfg, cfg, b, t)
        stats = layer_statistics(model, tokens)
        common.progress(f"compiling prefill {b}x{t}")
        prefill, compile_s = compile_timed(prefill_jitted, state, tokens)
        record("prefill", [b, t], b * t,
               time_call(lambda: prefill(state, tokens), cfg.runs, sampler),
               compiled_bytes=compiled_bytes(prefill), compile_s=compile_s, **stats)
    for n in (int(v) for v in filter(None, cfg.decode.split(","))):
        tokens = token_batch(mcfg, cfg, n, 1)
        decode, compile_s = compile_timed(prefill_jitted, state, tokens)
        record("decode", [n, 1], n, time_call(lambda: decode(state, tokens), cfg.runs),
               compile_s=compile_s)
    emit({"kind": "memory", **base, "phase": "inference", "peak_bytes": peak_bytes()})

    for b, t in parse_shapes(cfg.train_batch, ""):
        tokens = token_batch(mcfg, cfg, b, t + 1)
        common.progress("timing layer 0's FFN and attention alone")
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
    common.progress(f"compiling the training step {b}x{t}, remat {'on' if remat else 'off'}")
    step, compiled, sync, compile_s = adamw_step(model, optimizer, tokens, cfg.l1_coeff)
    step_bytes = compiled_bytes(compiled)
    limit = device_bytes_limit()
    oom = {"kind": "oom", **base, "mode": "train", "shape": [b, t], "remat": remat,
           "compiled_bytes": step_bytes, "bytes_limit": limit}
    if step_bytes is not None and limit is not None and step_bytes > limit:
        emit({**oom, "reason": "the compiled step needs more than the device holds"})
        return True  # nothing ran: the state is intact
    try:
        common.progress(f"compiled in {compile_s:.0f} s; timing")
        loss = float(step())
        timing = time_call(step, cfg.runs, sampler)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        emit({**oom, "reason": str(e).splitlines()[0][:300]})
        return False
    record("train", [b, t], b * t, timing, loss=loss, remat=remat, compiled_bytes=step_bytes,
           compile_s=compile_s)
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
    return common.main_or_worker(argv, parse_args, {"calibrate": worker_calibrate,
                                                    "measure": worker_measure}, drive)


def drive(cfg: BenchConfig, argv: list[str]) -> list[dict]:
    """The driver: one worker subprocess per calibration and measurement."""
    start = time.perf_counter()
    header = common.header(" ".join(["bench_model.py", *argv]), config=dataclasses.asdict(cfg))
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
            rows += common.run_specs(__file__, specs, argv, out, header["commit"], log)
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
