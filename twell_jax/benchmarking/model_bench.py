"""The model benchmark's settings and helpers: gate-bias calibration to a target activity,
timing with power samples, the AdamW step, memory readings."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from twell_jax import cli, xla_flags
from twell_jax.cli import flag

from twell_jax import inputs
from twell_jax import model as model_lib
from twell_jax.backends import Implementation
from twell_jax.benchmarking.power import ENERGY_WINDOW_S, PowerSampler
from twell_jax.config import TwELLConfig


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
    scan_layers: bool = flag(True, "run the blocks of large calls under one scan "
                             "(ModelConfig.scan_layers); --no-scan-layers: a Python loop")
    hot_units: int = flag(TwELLConfig().hot_units, "TwELLConfig.hot_units of the sparse "
                          "model's layers (0: no hot units)")
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
    timing = {**cli.summarize_ms(samples), "runs": runs}
    if sampler is None:
        return timing
    if not sampler.available:  # no NVML (a CPU run): no energy, no window of calls
        return {**timing, "energy_j": None, "energy_note": sampler.error}
    calls = max(runs, math.ceil(energy_window_s * 1e3 / max(timing["median_ms"], 1e-3)))

    def loop():
        for _ in range(calls):
            jax.block_until_ready(fn())

    return {**timing, **sampler.measure(loop), "energy_calls": calls}


BACK_TO_BACK_STEPS = 5
"""Steps per sample of ``time_back_to_back``."""


def time_back_to_back(step: Callable, runs: int, steps: int = BACK_TO_BACK_STEPS) -> dict:
    """Median ms per call of ``step()`` issued back to back, as a training loop issues its
    steps (each dispatched while the previous one runs; one wait per ``steps`` calls), over
    ``runs`` samples after two warm-up calls. ``time_call`` waits for every call, so it also
    counts the time the GPUs sit idle between a call's end and the next one's first kernel
    (H100 x 2, the sparse 0.5b step data parallel: 98-100 ms synchronised against ~95 ms
    back to back; the dense one within 1 ms either way)."""
    jax.block_until_ready(step())
    jax.block_until_ready(step())
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / steps)
    return {**cli.summarize_ms(samples), "runs": runs, "steps_per_sample": steps}


def last_logits(model: model_lib.Transformer, tokens: jax.Array,
                stacked: nnx.State | None = None) -> jax.Array:
    """The last position's logits [B, V] float32 of tokens [B, T]: what generation needs.
    ``stacked``: ``model.stack_for_inference()``, made once (a server's way: both models then
    read their weights where they lie instead of stacking them per call)."""
    return model.logits(model.features(tokens, inference=True, stacked=stacked)[:, -1])


def timing_optimizer() -> optax.GradientTransformation:
    """AdamW whose learning rate is 0, held in the optimizer state (a traced value, so XLA
    cannot fold the update away): every timed step computes the whole AdamW update, but the
    weights do not move. With a real rate the timed steps train the model, and that moves its
    sparsity away from the calibrated one while it is measured (H100, 1.5b: some deep
    layers' FFN calls ended on the dense path)."""
    return optax.inject_hyperparams(optax.adamw)(learning_rate=0.0)


def adamw_step(model, optimizer, tokens: jax.Array, l1_coeff: float, profiled_steps: int = 0,
               compiler_options: dict[str, str] | None = None):
    """One training step on ``tokens`` [B, T + 1] (loss with the L1 term, backward, the
    optimizer's update) as one ``jax.jit`` over the split (model, optimizer) state, donated and
    carried from call to call, compiled once here, as ``experiments/train.py`` runs it. Under
    ``jax.set_mesh`` (call it there) the state keeps its shardings. Returns (step() -> (loss,
    {"nnz_mean": [L], "dense_fallback": layers sent dense}), the step's ``Compiled``, sync():
    writes the state back into model and optimizer, whose own arrays were donated, compile
    seconds).

    ``profiled_steps`` > 0: as ``train.py`` with ``--pgle-steps``, the step runs through
    ``jax.jit`` under ``xla_flags.profile_guided_scheduling``; its profiled calls and the
    second compilation run here (steps of the optimizer: with a learning rate above 0, unlike
    ``timing_optimizer``'s, they move the weights) and count in the compile seconds. The
    ``Compiled`` returned is then the schedule without profile (for its memory figures).
    ``compiler_options``: XLA options for the step's compilations, as ``train.py`` passes
    them (``xla_flags.step_compiler_options`` of the mesh)."""
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0, compiler_options=compiler_options or None)
    def train_step(state, tokens):
        m, opt = nnx.merge(graphdef, state)
        grad_fn = nnx.value_and_grad(model_lib.loss_fn, has_aux=True)
        (loss, metrics), grads = grad_fn(m, tokens, l1_coeff)
        opt.update(m, grads)
        stats = {k: metrics[k] for k in ("nnz_mean", "dense_fallback")}
        return nnx.state((m, opt)), (loss, stats)

    # Compiled once and called as such: a later ``train_step(...)`` call would compile the
    # step again (the 2b sparse step takes minutes to compile).
    compiled, compile_s = compile_timed(train_step, state, tokens)
    carry = {"state": state}

    def step():
        if profiled_steps > 0:
            with xla_flags.profile_guided_scheduling(profiled_steps):
                carry["state"], out = train_step(carry["state"], tokens)
        else:
            carry["state"], out = compiled(carry["state"], tokens)
        return out

    if profiled_steps > 0:
        start = time.perf_counter()
        for _ in range(profiled_steps + 1):  # the profiled calls, then the second compilation
            jax.block_until_ready(step())
        compile_s += time.perf_counter() - start
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
    58.8 GB on the H100)."""
    try:
        if hasattr(compiled, "compile"):  # not compiled yet (nnx.jit's is no jax.stages.Lowered)
            compiled = compiled.compile()
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:
        return None


def build_model(preset: str, implementation: str, cfg: BenchConfig, *, remat: bool = False):
    """The preset with gate biases and ``remat`` (``bench_model.py`` builds it off and sets it
    per training measurement)."""
    return model_lib.build(preset, implementation=implementation, gate_bias=True, seed=cfg.seed,
                           scan_layers=cfg.scan_layers, remat=remat,
                           twell=TwELLConfig(hot_units=cfg.hot_units))


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
