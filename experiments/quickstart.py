"""Quickstart: the TwELL sparse gated FFN layer, checked, timed and trained on a toy task.

    .venv/bin/python experiments/quickstart.py           # about a minute on a 2-core CPU
    .venv/bin/python experiments/quickstart.py --help    # every knob, with its default

1. Builds a ``twell_jax.nn.SparseGatedMLP`` whose gate is ~``--density`` active: x's last
   feature is 1 and the last row of ``w_gate`` is minus a per-unit threshold (no bias term), so
   ``relu(x @ w_gate)`` is non-zero for about 2% of units on Gaussian inputs.
2. Runs every implementation ("xla" dense, "reference" TwELL in jnp, "pallas" kernels; interpret
   mode without a GPU) on the same bf16 and float32 data and prints a table: relative and max
   absolute error against a float64 numpy reference (from the same rounded inputs), median time
   per jitted call, and the FFN statistics (non-zeros per token, heavy rows).
3. Trains the layer for ``--train-steps`` adamw steps on a toy regression target (a fixed random
   sparse teacher) with the L1 penalty ``coeff * stats.l1`` read from the sown intermediates,
   printing the loss and non-zeros per token as it goes.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from twell_jax.cli import flag, flag_parser

import twell_jax
from twell_jax import nn
from twell_jax.inputs import gaussian_rows, with_threshold_row


@dataclasses.dataclass(frozen=True, kw_only=True)
class Defaults:
    """Every knob of the quickstart; each field is a command-line flag (``--d-model`` ...)."""

    d_model: int = flag(256, "D, the model width")
    d_ff: int = flag(1024, "F, the FFN width")
    tokens: int = flag(512, "M, tokens per batch")
    density: float = flag(0.02, "target fraction of active gate units per token")
    implementations: tuple[str, ...] = flag(
        ("xla", "reference", "pallas"), "implementations to check and time",
        choices=twell_jax.IMPLEMENTATIONS)
    dtypes: tuple[str, ...] = flag(("bfloat16", "float32"), "compute dtypes to check and time",
                                    choices=("bfloat16", "float32"))
    timing_runs: int = flag(5, "timed calls per implementation (median reported), after warm-up")
    train_steps: int = flag(20, "adamw steps of the toy training run (0 skips it)")
    train_implementation: str = flag("reference", "implementation used for training",
                                      choices=twell_jax.IMPLEMENTATIONS)
    train_dtype: str = flag("bfloat16", "compute dtype of the training run",
                             choices=("bfloat16", "float32"))
    learning_rate: float = flag(3e-3, "adamw learning rate")
    l1_coeff: float = flag(1e-3, "coefficient of the L1 penalty coeff * stats.l1")
    log_every: int = flag(5, "print a training line every this many steps")
    seed: int = flag(0, "random seed (parameters and data)")
    jsonl: str = flag("", "if set, append one JSON object per table row and train log line here")


def parse_args(argv: Sequence[str] | None) -> Defaults:
    parser = flag_parser(Defaults, __doc__.split("\n")[0])
    args = vars(parser.parse_args(argv))
    cfg = Defaults(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
    for name in ("d_model", "d_ff", "tokens", "timing_runs", "log_every"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.d_model < 2:
        parser.error(f"--d-model must be >= 2 (the last feature carries the threshold), "
                     f"got {cfg.d_model}")
    if not 0.0 < cfg.density < 1.0:
        parser.error(f"--density must be in (0, 1), got {cfg.density}")
    return cfg


# ------------------------------------------------------------------------------------------
# Data and layers.


def build_layer(cfg: Defaults, implementation: str, seed: int) -> nn.SparseGatedMLP:
    """The same parameters for a given seed, whatever the implementation."""
    layer = nn.SparseGatedMLP(cfg.d_model, cfg.d_ff, implementation=implementation,
                              rngs=nnx.Rngs(seed))
    # About cfg.density of the units active on gaussian_rows inputs (the bias trick; the
    # layer stores w_gate [F, D], one row per unit, so the threshold is its last column).
    layer.w_gate[...] = with_threshold_row(layer.w_gate[...].T, cfg.density).T
    return layer


def numpy_reference(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray,
                    w_down: np.ndarray) -> np.ndarray:
    """The gated FFN in float64 numpy, on the layer's weights (each [F, D])."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    return (np.maximum(x @ w_gate.T, 0.0) * (x @ w_up.T)) @ w_down


def _forward_fn(layer: nnx.Module):
    """A jitted pure function (state, x) -> (y, FFNStats) for ``layer``."""
    graphdef, state = nnx.split(layer)

    @jax.jit
    def forward(state, x):
        y, intermediates = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(x)
        (stats,) = nn.sown_stats(intermediates)
        return y, stats

    return forward, state


# ------------------------------------------------------------------------------------------
# 1 + 2: check and time every implementation.


def check_and_time(cfg: Defaults, log) -> list[dict]:
    x32 = gaussian_rows(jax.random.key(cfg.seed + 1), cfg.tokens, cfg.d_model)
    rows = []
    for dtype_name in cfg.dtypes:
        dtype = jnp.dtype(dtype_name)
        x = x32.astype(dtype)
        for implementation in cfg.implementations:
            layer = build_layer(cfg, implementation, cfg.seed)
            # The float64 reference sees exactly the rounded values the layer computes with.
            weights = [np.asarray(w[...].astype(dtype).astype(jnp.float32))
                       for w in (layer.w_gate, layer.w_up, layer.w_down)]
            ref = numpy_reference(np.asarray(x.astype(jnp.float32)), *weights)
            forward, state = _forward_fn(layer)
            y, stats = jax.block_until_ready(forward(state, x))  # compile + warm-up
            diff = np.asarray(y, np.float64) - ref
            # A second warm-up: the first Pallas call in a process registers a JAX config value
            # (pallas_fuser_disable_nested_fuse) in the tracing context, so a function traced
            # before it re-traces and recompiles once on its next call.
            jax.block_until_ready(forward(state, x))
            times = []
            for _ in range(cfg.timing_runs):
                start = time.perf_counter()
                jax.block_until_ready(forward(state, x))
                times.append(time.perf_counter() - start)
            row = dict(
                implementation=implementation, dtype=dtype_name, tokens=cfg.tokens,
                d_model=cfg.d_model, d_ff=cfg.d_ff, device=jax.devices()[0].device_kind,
                rel_err=float(np.linalg.norm(diff) / np.linalg.norm(ref)),
                max_abs_err=float(np.max(np.abs(diff))),
                ms_median=1e3 * statistics.median(times), ms_min=1e3 * min(times),
                ms_max=1e3 * max(times),
                nnz_mean=float(stats.nnz_mean), nnz_max=int(stats.nnz_max),
                heavy_rows=int(stats.heavy_rows), dense_fallback=bool(stats.dense_fallback),
            )
            if not np.isfinite(row["rel_err"]):
                raise FloatingPointError(f"{implementation} {dtype_name}: non-finite output")
            rows.append(row)
            log({"kind": "check", **row})
    print_table(rows, cfg)
    return rows


def print_table(rows: list[dict], cfg: Defaults) -> None:
    print(f"\nSparseGatedMLP forward: M={cfg.tokens} D={cfg.d_model} F={cfg.d_ff}, target density "
          f"{cfg.density:.1%}, device {jax.devices()[0].device_kind}; error vs float64 numpy; "
          f"time = median [min, max] of {cfg.timing_runs} jitted calls")
    header = (f"{'implementation':<14} {'dtype':<9} {'rel err':>9} {'max abs':>9} "
              f"{'ms/call':>9} {'[min, max]':>17} {'nnz mean':>9} {'nnz max':>8} "
              f"{'heavy':>6} {'dense':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        spread = f"[{r['ms_min']:.2f}, {r['ms_max']:.2f}]"
        print(f"{r['implementation']:<14} {r['dtype']:<9} {r['rel_err']:>9.2e} "
              f"{r['max_abs_err']:>9.2e} {r['ms_median']:>9.2f} {spread:>17} "
              f"{r['nnz_mean']:>9.1f} {r['nnz_max']:>8d} {r['heavy_rows']:>6d} "
              f"{str(r['dense_fallback']):>6}")
    print()


# ------------------------------------------------------------------------------------------
# 3: train with the L1 penalty read from the sown statistics.


def train(cfg: Defaults, log) -> list[dict]:
    dtype = jnp.dtype(cfg.train_dtype)
    x = gaussian_rows(jax.random.key(cfg.seed + 2), cfg.tokens, cfg.d_model).astype(dtype)
    teacher = build_layer(cfg, "xla", cfg.seed + 3)
    target = teacher(x.astype(jnp.float32))
    target_power = jnp.mean(target**2)
    model = build_layer(cfg, cfg.train_implementation, cfg.seed)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, target):
        def loss_fn(model):
            y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
            mse = jnp.mean((y.astype(jnp.float32) - target) ** 2) / target_power
            l1 = nn.l1_penalty(intermediates)
            (stats,) = nn.sown_stats(intermediates)
            return mse + cfg.l1_coeff * l1, (mse, stats)

        (loss, (mse, stats)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, mse, stats

    print(f"Training SparseGatedMLP ({cfg.train_implementation}, {cfg.train_dtype}) on a toy "
          f"regression target: loss = mse / mean(target^2) + {cfg.l1_coeff:g} * stats.l1")
    history = []
    # disable=None: the bar shows on a terminal only; the log lines below always print.
    bar = tqdm(range(1, cfg.train_steps + 1), desc="train", unit="step", leave=False,
               disable=None)
    for step in bar:
        loss, mse, stats = train_step(model, optimizer, x, target)
        rec = dict(step=step, loss=float(loss), mse=float(mse), l1=float(stats.l1),
                   nnz_mean=float(stats.nnz_mean), heavy_rows=int(stats.heavy_rows))
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.4f}", nnz=f"{rec['nnz_mean']:.1f}")
        if step == 1 or step % cfg.log_every == 0 or step == cfg.train_steps:
            tqdm.write(f"step {step:4d}  loss {rec['loss']:.4f}  mse {rec['mse']:.4f}  "
                       f"l1 {rec['l1']:.3f}  nnz/token {rec['nnz_mean']:.1f} of {cfg.d_ff}  "
                       f"heavy rows {rec['heavy_rows']}")
            log({"kind": "train", **rec})
    bar.close()
    if history:
        first, last = history[0]["loss"], history[-1]["loss"]
        print(f"loss {first:.4f} -> {last:.4f} over {len(history)} steps")
    return history


def main(argv: Sequence[str] | None = None) -> dict:
    cfg = parse_args(argv)
    sink = open(cfg.jsonl, "a") if cfg.jsonl else None

    def log(record: dict) -> None:
        if sink:
            sink.write(json.dumps(record) + "\n")

    try:
        rows = check_and_time(cfg, log)
        history = train(cfg, log) if cfg.train_steps > 0 else []
    finally:
        if sink:
            sink.close()
    return {"rows": rows, "history": history}


if __name__ == "__main__":
    main(sys.argv[1:])
