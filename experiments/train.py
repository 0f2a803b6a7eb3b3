"""Train a TwELL decoder (``twell_jax.model``) with the L1 sparsity penalty on its FFNs.

    .venv/bin/python experiments/train.py          # tiny model, stdlib bytes, ~2 min on 2 cores
    .venv/bin/python experiments/train.py --help   # every knob, with its default

The default run trains the "tiny" preset (148k parameters) for 1000 steps of 32 x 128 bytes of
the Python standard library's own source files (5% of files held out by a hash of their path)
with the TwELL "reference" FFN (the sparse algorithm in plain jnp: packed gate, sparse up/down,
dense backup for heavy rows, sparse backward) and L1 coefficient 0.01. Measured on a 2-core CPU
(~2-2.5 min, ~30-40k tokens/s): cross-entropy 4.63 -> 1.52 (held-out 1.58), active FFN units per
token 124 -> 6.7 and 4.1 of 256 (layers 0, 1); most of the drop comes in the first 100 steps.
L1 0.002 keeps ~31 units (held-out 1.44), 0.005 ~14 (1.49).

Everything lands in ``--out-dir`` (default ``runs/<name>``): ``metrics.jsonl`` (one JSON object
per logged step and per evaluation), ``metrics.png`` (loss and non-zeros per token over steps),
``config.json`` and Orbax checkpoints under ``ckpt/``.

``--resume`` continues from the newest checkpoint in ``--out-dir``: batches come from a sampler
seeded by (seed, step), so a resumed run sees the same data and follows the same loss curve.

Several devices (``twell_jax.sharding``): ``--mesh data=N,fsdp=M`` lays the visible devices out
as an N x M mesh (default: all on ``data``); the batch is split over both axes (``--batch-size``
is the global batch, a multiple of N * M) and the parameters with their AdamW moments over
``fsdp``. Checkpoints hold whole arrays: a run saved on one mesh resumes on another (any
device count); on the same mesh ``--resume`` stays exact. ``--distributed`` first calls
``jax.distributed.initialize()`` for a multi-host run (one process per host, see docs/guide.md
and below).

Stopping, exit statuses, resuming, several processes
----------------------------------------------------
SIGTERM or SIGINT (Ctrl-C) while training: the current step finishes, a checkpoint of it is
written, one line names it ("stopped by SIGTERM after step 37: checkpoint step 37 in
runs/x/ckpt/37 ...") and the process exits with 128 + the signal's number: 143 for SIGTERM,
130 for SIGINT. Further signals while that checkpoint is written are ignored. SIGKILL cannot
be caught, but checkpoints are written to a temporary folder and renamed, so a kill at any
moment leaves the previous checkpoint whole. With several processes the stop is agreed at
each step boundary (a tiny all-gather), so all save the same step, each its own shards.

Exit statuses: 0 done, or the run had already finished; 143 / 130 stopped by SIGTERM / SIGINT
after saving; 2 a bad flag (argparse); 1 any other expected failure, as one line on stderr
and no traceback: a non-finite loss (the line names the step and the last good checkpoint,
which is never one written after the loss went bad), a missing folder, a checkpoint that does
not fit the model or the mesh, a --resume whose flags differ from the run's.

``--resume`` restores the newest checkpoint in ``--out-dir``; with the same flags the losses
that follow equal, bit for bit, those of an uninterrupted run. A finished run says so in one
line (step, held-out loss, train cross-entropy) and exits 0. The schedule-defining flags
(--model --steps --lr --warmup --weight-decay --grad-clip --l1-coeff --batch-size --seq-len
--seed --data --tokenizer --heldout-fraction) must equal those in the run's config.json, else
the run refuses with one line naming each difference (flag: old -> new);
``--allow-config-change`` goes on and appends ``{"step", "flag", "old", "new"}`` to
config.json's "changes" list. The other flags may change freely (recorded the same way):
--implementation and --remat compute the same math up to rounding, --mesh only places the
arrays, and the intervals of evaluation, logging and checkpoints do not touch the weights.
metrics.jsonl keeps the records up to the restored step: replayed steps replace theirs.

``--distributed`` passes ``--coordinator`` / ``--num-processes`` / ``--process-id`` to
``jax.distributed.initialize``, each defaulting to the environment's JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID; with none of them set it calls it without arguments (jax
detects SLURM, Open MPI, Cloud TPU ...). ``--heartbeat-timeout`` (or TWELL_HEARTBEAT_TIMEOUT)
sets how many seconds without a heartbeat mark a process as dead: jax then aborts the others
(SIGABRT, a log line naming the task that "stopped sending heartbeats") instead of leaving them
waiting in a collective; restart them all with ``--resume``. With several processes the stop
decision costs one small all-gather per step (the host waits for each step's result).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from twell_jax import cli, multihost, preemption, xla_flags
from twell_jax.cli import flag, flag_parser

from twell_jax import model as model_lib
from twell_jax import sharding
from twell_jax.backends import IMPLEMENTATIONS
from twell_jax.data import (Corpus, EVAL_STREAM, TRAIN_STREAM, load_corpus, make_tokenizer,
                            sample_batch)
from twell_jax.checkpoints import (checkpoint_manager, restore_checkpoint, save_checkpoint)
from twell_jax.config import TwELLConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every knob of a training run; each field is a command-line flag (``--l1-coeff`` ...)."""

    name: str = flag("", "run name; default <model>-<implementation>-l1_<l1_coeff>")
    model: str = flag("tiny", "model preset (twell_jax.model.CONFIGS)",
                       choices=tuple(model_lib.CONFIGS))
    # "reference" exercises the TwELL algorithm (pack, sparse up/down, backup, sparse backward)
    # and was not slower than dense on the tiny preset (2-core CPU, 16 x 128 tokens, 200 steps
    # at L1 0.05: reference 43k tokens/s, xla 35k). "pallas" runs its kernels in interpret
    # mode without a GPU: correct but far slower.
    implementation: str = flag("reference", "FFN implementation", choices=IMPLEMENTATIONS)
    remat: bool = flag(False, "recompute each block in the backward pass (keeps FFN outputs)")
    hot_units: int = flag(0, "TwELLConfig.hot_units: units firing on many tokens computed by a "
                          "small dense GEMM (0: off; the per-layer count moved is logged)")
    backup_rows: int = flag(-1, "TwELLConfig.backup_rows: rows of the dense backup for heavy "
                                "rows (-1: sizes from M/64 to M/2, the smallest that holds "
                                "them; N: one size, which compiles faster; 0: none); more "
                                "heavy rows than it holds send the batch dense")
    l1_coeff: float = flag(0.01, "coefficient of the L1 penalty on the FFN hidden activations")
    steps: int = flag(1000, "optimizer steps")
    batch_size: int = flag(32, "sequences per batch")
    seq_len: int = flag(128, "tokens per sequence (at most the preset's max_seq_len)")
    lr: float = flag(3e-3, "peak learning rate")
    warmup: int = flag(50, "linear warm-up steps, then cosine decay to lr / 10")
    weight_decay: float = flag(0.1, "AdamW weight decay (matrices only, not norm scales)")
    grad_clip: float = flag(1.0, "clip gradients to this global norm")
    eval_every: int = flag(250, "evaluate held-out loss every this many steps (0: at the end)")
    eval_batches: int = flag(4, "held-out batches per evaluation (the same ones each time)")
    ckpt_every: int = flag(250, "save a checkpoint every this many steps (0: only at the end)")
    log_every: int = flag(10, "write a metrics.jsonl line every this many steps")
    out_dir: str = flag("", "output folder; default runs/<name>")
    seed: int = flag(0, "seed of the parameters and of the batch sampler")
    data: str = flag("", "a folder of text files, or a .npy / .bin (uint16) token file; "
                          "default: the Python standard library's .py files")
    tokenizer: str = flag("bytes", "'bytes' (UTF-8 bytes, vocabulary 256) or the path of a "
                                    "Hugging Face tokenizer.json (needs the tokenizers package)")
    heldout_fraction: float = flag(0.05, "fraction of files (or of a token file's tail) held out")
    resume: bool = flag(False, "continue from the newest checkpoint in --out-dir")
    mesh: str = flag("", "device mesh, e.g. data=2,fsdp=2: batch split over both axes, "
                          "parameters and optimizer state over fsdp; default: all on data")
    allow_config_change: bool = flag(False, "with --resume: continue although schedule-defining "
                                             "flags differ from the run's config.json (the "
                                             "change is recorded there)")
    distributed: bool = flag(False, "call jax.distributed.initialize() first (one process per "
                                     "host); see --coordinator, --num-processes, --process-id")
    coordinator: str = flag("", "with --distributed: the coordinator's host:port (default "
                                 "$JAX_COORDINATOR_ADDRESS, else cluster auto-detection)")
    num_processes: int = flag(0, "with --distributed: the number of processes (default "
                                  "$JAX_NUM_PROCESSES, else auto-detection)")
    process_id: int = flag(-1, "with --distributed: this process's id, 0 .. count - 1 (default "
                                "$JAX_PROCESS_ID, else auto-detection)")
    heartbeat_timeout: int = flag(0, "with --distributed: seconds without a heartbeat after "
                                      "which a process counts as dead and jax aborts the others "
                                      "(default $TWELL_HEARTBEAT_TIMEOUT, else jax's 100)")
    compile_cache: str = flag(cli.DEFAULT_COMPILE_CACHE, "folder that keeps the compiled "
                              "steps, so a rerun or --resume skips compiling ('' for none)")
    pgle_steps: int = flag(-1, "steps profiled before the training step is compiled again "
                                "with XLA's scheduler given their measured costs (-1: "
                                f"{xla_flags.PROFILED_STEPS} on a GPU mesh of several "
                                "devices, else 0; 0: off)")

    @property
    def run_name(self) -> str:
        return self.name or f"{self.model}-{self.implementation}-l1_{self.l1_coeff:g}"

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir or os.path.join("runs", self.run_name))


def parse_args(argv: Sequence[str] | None) -> TrainConfig:
    epilog = __doc__[__doc__.index("Stopping, exit statuses"):]
    parser = flag_parser(TrainConfig, __doc__.split("\n")[0], epilog=epilog)
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    for name in ("steps", "batch_size", "seq_len", "eval_batches", "log_every"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup", "eval_every", "ckpt_every"):
        if getattr(cfg, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    max_len = model_lib.CONFIGS[cfg.model].max_seq_len
    if cfg.seq_len > max_len:
        parser.error(f"--seq-len {cfg.seq_len} exceeds the {cfg.model!r} preset's "
                     f"max_seq_len {max_len}")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        parser.error(f"--heldout-fraction must be in (0, 1), got {cfg.heldout_fraction}")
    if cfg.l1_coeff < 0:
        parser.error(f"--l1-coeff must be >= 0, got {cfg.l1_coeff}")
    for name in ("pgle_steps", "backup_rows"):
        if getattr(cfg, name) < -1:
            parser.error(f"--{name.replace('_', '-')} must be >= -1, got {getattr(cfg, name)}")
    return cfg


# ------------------------------------------------------------------------------------------
# Data: tokenized files concatenated with a separator; random windows seeded by step.


# ------------------------------------------------------------------------------------------
# Model, optimizer, steps.


def build_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (matrices decayed, norm scales not) after global-norm clipping, warm-up + cosine."""
    return _optimizer(cfg.lr, cfg.warmup, cfg.steps, cfg.weight_decay, cfg.grad_clip)


@functools.lru_cache(maxsize=8)
def _optimizer(lr: float, warmup: int, steps: int, weight_decay: float, grad_clip: float):
    # Cached: nnx.Optimizer keeps the transformation as static data, so an equal but new one
    # would make jit compile the train step again for every run in a process (the graphdef,
    # a static argument, holds it).
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=lr / 10)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


def build(cfg: TrainConfig, vocab_size: int, mesh: jax.sharding.Mesh | None = None):
    """The model and its optimizer, their state placed on ``mesh`` (default: ``cfg.mesh`` over
    every visible device) as ``twell_jax.sharding.shard_state`` splits it."""
    preset = model_lib.CONFIGS[cfg.model]
    twell = dataclasses.replace(preset.twell or TwELLConfig(), hot_units=cfg.hot_units)
    if cfg.backup_rows >= 0:
        twell = dataclasses.replace(twell, backup_rows=cfg.backup_rows)
    mcfg = dataclasses.replace(preset, implementation=cfg.implementation, remat=cfg.remat,
                               twell=twell)
    if vocab_size > mcfg.vocab_size:
        raise ValueError(f"the tokenizer/data have {vocab_size} tokens but the {cfg.model!r} "
                         f"preset's vocabulary is {mcfg.vocab_size}")
    model = model_lib.Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, build_optimizer(cfg), wrt=nnx.Param)
    # Committed, sharded placement, as restored checkpoints have: jit keys its cache on it, so
    # a fresh and a resumed run in one process share the compiled step.
    mesh = sharding.make_mesh(sharding.parse_mesh(cfg.mesh)) if mesh is None else mesh
    for obj in (model, optimizer):
        sharding.shard_state(obj, mesh)
    return model, optimizer


def _train_step(graphdef, state, tokens, l1_coeff):
    model, optimizer = nnx.merge(graphdef, state)
    grad_fn = nnx.value_and_grad(model_lib.loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(model, tokens, l1_coeff)
    optimizer.update(model, grads)
    metrics["grad_norm"] = optax.global_norm(grads)
    return nnx.state((model, optimizer)), metrics


def _jit_train_step(compiler_options: dict[str, str] | None = None):
    return jax.jit(_train_step, static_argnums=0, donate_argnums=1,
                   compiler_options=compiler_options)


_jitted_train_step = _jit_train_step()  # shared by every step without compiler options


class TrainStep:
    """The training step as one ``jax.jit`` over the split (model, optimizer) state, which is
    donated and carried from step to step. ``nnx.jit`` would walk both objects' graphs in
    Python on every call: on the H100 the 0.5b step (8 x 2048 tokens) was 12.8 (dense) and
    24.9 (sparse) ms slower through ``nnx.jit``, with the same model code otherwise. The
    objects hold stale (donated) arrays between ``sync`` calls: call it before reading them
    (evaluation, checkpoints).

    ``pgle_steps`` > 0: the first steps run profiled and the step is then compiled again with
    XLA's scheduler given their costs (``xla_flags.profile_guided_scheduling``; on a mesh of
    several GPUs the gradient all-reduces overlap more of the backward). Only this step is
    profiled, not the evaluation's. ``compiler_options``: XLA options for this step's
    compilations (``xla_flags.step_compiler_options`` of the mesh)."""

    def __init__(self, model, optimizer, pgle_steps: int = 0,
                 compiler_options: dict[str, str] | None = None):
        self.objects = (model, optimizer)
        self.graphdef, self.state = nnx.split(self.objects)
        self.pgle_steps = pgle_steps
        self._step = _jit_train_step(compiler_options) if compiler_options else _jitted_train_step

    def __call__(self, tokens, l1_coeff) -> dict:
        """One step on ``tokens`` [B, T + 1]; returns its metrics (device arrays)."""
        if not self.pgle_steps:
            self.state, metrics = self._step(self.graphdef, self.state, tokens, l1_coeff)
            return metrics
        with xla_flags.profile_guided_scheduling(self.pgle_steps):
            self.state, metrics = self._step(self.graphdef, self.state, tokens, l1_coeff)
        return metrics

    def lower(self, tokens, l1_coeff):
        """The step's ``jax.stages.Lowered`` (to inspect its program)."""
        return self._step.lower(self.graphdef, self.state, tokens, l1_coeff)

    def sync(self) -> None:
        """Writes the current state back into the model and the optimizer."""
        nnx.update(self.objects, self.state)


def train_step(model, optimizer, tokens, l1_coeff) -> dict:
    """One training step on the objects themselves (``TrainStep`` for a loop)."""
    step = TrainStep(model, optimizer)
    metrics = step(tokens, l1_coeff)
    step.sync()
    return metrics


@nnx.jit
def eval_step(model, tokens):
    _, metrics = model_lib.loss_fn(model, tokens, 0.0)
    return (metrics["ce"], *model_lib.activity_and_token_nnz(model, tokens[:, :-1]))


def nnz_distribution(histograms: np.ndarray) -> dict:
    """Per-layer summary of per-token active-unit counts from histograms [n_layers, F + 1]
    (histograms[l, n] = tokens with n active units in layer l), trimmed at the largest count."""
    layers = []
    for hist in histograms:
        counts = np.arange(len(hist))
        cdf = np.cumsum(hist) / hist.sum()
        quantile = lambda q: int(np.searchsorted(cdf, q))  # nearest rank
        top = int(np.nonzero(hist)[0].max())
        layers.append({"mean": round(float((hist * counts).sum() / hist.sum()), 3),
                       "p50": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99),
                       "max": top, "histogram": hist[: top + 1].astype(int).tolist()})
    return {"tokens": int(histograms[0].sum()), "layers": layers}


def evaluate(model, corpus: Corpus, cfg: TrainConfig, mesh: jax.sharding.Mesh) -> dict:
    """Held-out cross-entropy over ``eval_batches`` fixed batches, the dead-unit fraction per
    layer (units never active over those batches' tokens) and the per-token distribution of
    active units per layer (``nnz_distribution``)."""
    ces, active, histograms = [], None, 0
    for i in range(cfg.eval_batches):
        batch = sample_batch(corpus.heldout, cfg.batch_size, cfg.seq_len, cfg.seed, i, EVAL_STREAM)
        ce, act, nnz = sharding.to_host(eval_step(model, sharding.shard_batch(batch, mesh)))
        ces.append(float(ce))
        active = act if active is None else active | act
        d_ff = act.shape[1]
        histograms = histograms + np.stack(
            [np.bincount(row, minlength=d_ff + 1) for row in np.asarray(nnz)])
    dead = 1.0 - np.asarray(active, np.float64).mean(axis=-1)
    distribution = nnz_distribution(histograms)
    return {"eval_loss": float(np.mean(ces)), "dead_frac": [round(float(d), 5) for d in dead],
            "eval_nnz_p99": [layer["p99"] for layer in distribution["layers"]],
            "nnz_distribution": distribution}


# ------------------------------------------------------------------------------------------
# Checkpoints, logs, plot.


def _jsonable(value):
    if isinstance(value, (np.ndarray, jax.Array)):
        value = np.asarray(value)
        return value.tolist() if value.ndim else value.item()
    return value


def read_metrics(path: Path, up_to_step: int | None = None) -> list[dict]:
    """The records of a metrics.jsonl file (those of steps <= ``up_to_step`` when given). A
    last line cut short (the process killed while appending it) is dropped."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}, line {i + 1}: not JSON: {line[:80]!r}") from None
    return [r for r in records if up_to_step is None or r["step"] <= up_to_step]


def _write_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, then renames it over ``path``: a
    process killed meanwhile leaves the old file whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "ce" in r]
    evals = [r for r in records if "eval_loss" in r]
    fig, (ax_loss, ax_nnz) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        steps = [r["step"] for r in train]
        ax_loss.plot(steps, [r["ce"] for r in train], label="train cross-entropy")
        ax_loss.plot(steps, [r["loss"] for r in train], label="train loss (with L1)", alpha=0.6)
        nnz = np.asarray([r["nnz_mean"] for r in train])
        for layer in range(nnz.shape[1]):
            ax_nnz.plot(steps, nnz[:, layer], label=f"layer {layer}")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                     label="held-out cross-entropy")
    ax_loss.set(xlabel="step", ylabel="nats / token", title="loss")
    ax_nnz.set(xlabel="step", ylabel="active FFN units / token", yscale="log",
               title="FFN non-zeros per token")
    for ax in (ax_loss, ax_nnz):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# The loop.


def train(cfg: TrainConfig, *, stop_after: int | None = None, corpus: Corpus | None = None,
          quiet: bool = False) -> dict:
    """Runs (or resumes) training; returns the final summary.

    ``stop_after`` ends the run after that step (saving a checkpoint), as if it were killed
    there: tests use it to check that ``--resume`` continues exactly. ``corpus`` skips loading.
    """
    cli.use_compile_cache(cfg.compile_cache)
    if cfg.distributed:
        try:
            multihost.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                                 cfg.heartbeat_timeout)
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"--distributed: {e} (set --coordinator, --num-processes and "
                             f"--process-id, or {multihost.ENV_COORDINATOR}, "
                             f"{multihost.ENV_NUM_PROCESSES} and {multihost.ENV_PROCESS_ID})"
                             ) from None
    try:
        mesh = sharding.make_mesh(sharding.parse_mesh(cfg.mesh))
    except ValueError as e:
        raise SystemExit(f"--mesh: {e}") from None
    n_batch = math.prod(mesh.shape[axis] for axis in sharding.batch_axes_of(mesh))
    if cfg.batch_size % n_batch:
        raise SystemExit(f"--batch-size {cfg.batch_size} must be a multiple of the mesh's "
                         f"{n_batch} devices ({sharding.describe(mesh)})")
    # Several hosts: every process runs the same steps; only the first one logs and writes files.
    primary = jax.process_index() == 0
    quiet = quiet or not primary
    with jax.set_mesh(mesh):
        return _train(cfg, mesh, primary, stop_after, corpus, quiet)


class _Records:
    """The run's metric records, appended to ``metrics.jsonl`` as they come (by the primary
    process only)."""

    def __init__(self, path: Path, records: list[dict], primary: bool):
        self.path, self.records, self.primary = path, records, primary
        if primary:  # drop the lines past the checkpoint: replayed steps replace them
            _write_atomically(path, "".join(json.dumps(r) + "\n" for r in records))

    def append(self, record: dict) -> None:
        self.records.append(record)
        if self.primary:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class _Clock:
    """Accumulates wall time between start() and stop(), and a token count."""

    def __init__(self):
        self.seconds, self.tokens, self._since = 0.0, 0, None
        self._logged_seconds, self._logged_tokens = 0.0, 0
        self._rate = float("nan")

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def rate_since_last(self) -> float:
        """Tokens/s over the time counted since the previous call (the previous rate when no
        time was counted; NaN before any)."""
        if self.seconds > self._logged_seconds:
            self._rate = ((self.tokens - self._logged_tokens)
                          / (self.seconds - self._logged_seconds))
        self._logged_seconds, self._logged_tokens = self.seconds, self.tokens
        return self._rate


# Flags that define the optimization: a --resume that changes one would not continue the same
# run (refused without --allow-config-change).
SCHEDULE_FLAGS = ("model", "steps", "lr", "warmup", "weight_decay", "grad_clip", "l1_coeff",
                  "batch_size", "seq_len", "seed", "data", "tokenizer", "heldout_fraction")
# Flags of one invocation, not of the run: neither compared nor recorded.
INVOCATION_FLAGS = ("name", "out_dir", "resume", "allow_config_change", "compile_cache",
                    "distributed", "coordinator", "num_processes", "process_id",
                    "heartbeat_timeout", "pgle_steps")


def config_changes(saved: dict, cfg: TrainConfig) -> list[dict]:
    """``{"flag", "old", "new"}`` for each run flag of ``cfg`` that differs from the saved
    config.json ``saved`` (flags it lacks, from an older version, are skipped)."""
    changes = []
    for field in dataclasses.fields(cfg):
        if field.name in INVOCATION_FLAGS or field.name not in saved:
            continue
        new = getattr(cfg, field.name)
        if saved[field.name] != new:
            changes.append({"flag": field.name, "old": saved[field.name], "new": new})
    return changes


def _describe(change: dict) -> str:
    return f"--{change['flag'].replace('_', '-')}: {change['old']!r} -> {change['new']!r}"


def _read_run_config(run_dir: Path) -> dict | None:
    path = run_dir / "config.json"
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not JSON ({e})") from None
    if not isinstance(saved, dict):
        raise SystemExit(f"{path}: not a JSON object")
    return saved


def _check_resume(cfg: TrainConfig, run_dir: Path, saved: dict | None) -> list[dict]:
    """The flag changes of a --resume against the run's config.json; SystemExit naming the
    schedule-defining ones unless --allow-config-change."""
    changes = [] if saved is None else config_changes(saved, cfg)
    refused = [c for c in changes if c["flag"] in SCHEDULE_FLAGS]
    if refused and not cfg.allow_config_change:
        raise SystemExit(f"--resume: flags differ from {run_dir / 'config.json'}: "
                         + "; ".join(_describe(c) for c in refused)
                         + " (pass the run's values, or --allow-config-change to go on)")
    return changes


def _finished(cfg: TrainConfig, run_dir: Path, step: int) -> dict:
    """The summary of a run whose newest checkpoint is at or past --steps, from its records."""
    records = read_metrics(run_dir / "metrics.jsonl", up_to_step=step)
    last_eval = next((r for r in reversed(records) if "eval_loss" in r), {})
    last = next((r for r in reversed(records) if "ce" in r), {})
    return {"step": step, "finished": True, "eval_loss": last_eval.get("eval_loss"),
            "eval_step": last_eval.get("step"), "dead_frac": last_eval.get("dead_frac"),
            "train_ce": last.get("ce"), "nnz_mean": last.get("nnz_mean"),
            "out_dir": str(run_dir)}


def _finished_line(summary: dict, steps: int) -> str:
    parts = [f"{summary['out_dir']} already finished: checkpoint at step {summary['step']} "
             f"of --steps {steps}"]
    if summary["eval_loss"] is not None:
        parts.append(f"held-out loss {summary['eval_loss']:.4f} at step {summary['eval_step']}")
    else:
        parts.append("no held-out evaluation recorded")
    if summary["train_ce"] is not None:
        parts.append(f"train cross-entropy {summary['train_ce']:.4f}")
    if summary["nnz_mean"] is not None:
        parts.append(f"nnz per token by layer {_fmt(summary['nnz_mean'])}")
    return "; ".join(parts) + "; nothing to do (a larger --steps needs --allow-config-change)"


def _start_run(cfg: TrainConfig, run_dir: Path, model, optimizer, primary: bool, log,
               mesh: jax.sharding.Mesh):
    """The checkpoint manager, the step to start from (restored with ``--resume``) and the
    metric records up to it; writes the run's config.json (with the changes of a resume)."""
    manager = checkpoint_manager(run_dir, writer=True)
    start, changes = 0, []
    saved = _read_run_config(run_dir)
    if cfg.resume:
        latest = manager.latest_step()
        changes = _check_resume(cfg, run_dir, saved) if latest is not None else []
        try:
            start = restore_checkpoint(manager, model, optimizer)
        except ValueError as e:
            raise SystemExit(f"--resume: {e} (this run: --model {cfg.model}, mesh "
                             f"{sharding.describe(mesh)})") from None
        log(f"resumed from step {start}" if start else "no checkpoint found: starting fresh")
    elif manager.latest_step() is not None:
        raise SystemExit(f"{run_dir / 'ckpt'} holds checkpoints; pass --resume to continue, "
                         "or choose another --out-dir")
    metrics_path = run_dir / "metrics.jsonl"
    records = _Records(metrics_path, read_metrics(metrics_path, up_to_step=start) if start else [],
                       primary)
    if primary:
        config = dataclasses.asdict(cfg)
        history = list(saved.get("changes", [])) if (saved and start) else []
        history += [{"step": start, **c} for c in changes]
        if history:
            config["changes"] = history
        _write_atomically(run_dir / "config.json", json.dumps(config, indent=2) + "\n")
    return manager, start, records


def _log_metrics(metrics, done: int, clock: _Clock, records: _Records, bar) -> None:
    """Records one step's training metrics and the throughput since the previous record."""
    metrics = sharding.to_host(metrics)
    clock.stop()
    tokens_per_s = clock.rate_since_last()
    clock.start()
    record = {"step": done, **{k: _jsonable(v) for k, v in metrics.items()},
              "tokens_per_s": None if math.isnan(tokens_per_s) else round(tokens_per_s, 1)}
    records.append(record)
    bar.set_postfix(loss=f"{record['ce']:.3f}", nnz=f"{np.mean(record['nnz_mean']):.1f}",
                    tok_s=f"{tokens_per_s:,.0f}")


def _check_finite(metrics, done: int, manager) -> None:
    """SystemExit naming the step and the newest checkpoint when the loss or the gradient norm
    of step ``done`` is not finite (called before any checkpoint is written, so the newest one
    is good)."""
    loss, grad_norm = (float(np.asarray(sharding.to_host(metrics[k])))
                       for k in ("loss", "grad_norm"))
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    good = manager.latest_step()
    where = (f"the last good checkpoint is step {good} in {Path(manager.directory) / str(good)} "
             "(continue from it with --resume, e.g. with a lower --lr and "
             "--allow-config-change)" if good is not None else "no checkpoint was written")
    raise SystemExit(f"loss {loss}, gradient norm {grad_norm} at step {done}: stopping; {where}")


def _evaluate_and_record(model, corpus: Corpus, cfg: TrainConfig, mesh, done: int,
                         records: _Records, run_dir: Path, bar, quiet: bool) -> dict:
    """Held-out evaluation at step ``done``: recorded, the nnz distribution and the plot
    written; returns the evaluation (without the distribution)."""
    evaluation = evaluate(model, corpus, cfg, mesh)
    distribution = evaluation.pop("nnz_distribution")
    records.append({"step": done, **evaluation})
    if records.primary:
        (run_dir / "nnz_distribution.json").write_text(json.dumps(
            {"step": done, "d_ff": model.cfg.d_ff, "source": "held-out batches",
             **distribution}) + "\n")
        write_plot(records.records, run_dir / "metrics.png", cfg.run_name)
    if not quiet:
        bar.write(f"step {done}: held-out loss {evaluation['eval_loss']:.4f}, "
                  f"dead units by layer {evaluation['dead_frac']}")
    return evaluation


def _summarize(cfg: TrainConfig, end: int, records: list[dict], last_eval: dict, clock: _Clock,
               run_dir: Path, d_ff: int, log) -> dict:
    """The run's summary (last training record, last evaluation, throughput), logged."""
    last = next((r for r in reversed(records) if "ce" in r), {})
    summary = {
        "step": end,
        "eval_loss": last_eval.get("eval_loss"),
        "dead_frac": last_eval.get("dead_frac"),
        "train_ce": last.get("ce"),
        "nnz_mean": last.get("nnz_mean"),
        "nnz_p99": last.get("nnz_p99"),
        "nnz_max": last.get("nnz_max"),
        "heavy_rows": last.get("heavy_rows"),
        "tokens_per_s": round(clock.tokens / clock.seconds, 1) if clock.seconds else None,
        "out_dir": str(run_dir),
    }
    first = next((r for r in records if "ce" in r), {})
    held_out = (f"held-out loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None
                else "no held-out evaluation yet")
    log(f"done: step {end}/{cfg.steps}; train cross-entropy {first.get('ce', float('nan')):.3f} "
        f"-> {summary['train_ce'] or float('nan'):.3f}; {held_out}")
    log(f"  nnz per token by layer: {_fmt(first.get('nnz_mean'))} -> {_fmt(summary['nnz_mean'])} "
        f"of {d_ff} (p99 {summary['nnz_p99']}, max {summary['nnz_max']}); heavy rows {summary['heavy_rows']}")
    log(f"  dead units by layer: {summary['dead_frac']}; {summary['tokens_per_s']} tokens/s; "
        f"logs {run_dir / 'metrics.jsonl'}, plot {run_dir / 'metrics.png'}")
    return summary


def _train(cfg: TrainConfig, mesh: jax.sharding.Mesh, primary: bool, stop_after: int | None,
           corpus: Corpus | None, quiet: bool) -> dict:
    run_dir = cfg.run_dir
    if cfg.resume and not run_dir.is_dir():
        raise SystemExit(f"--resume: {run_dir} does not exist (no run to continue)")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    if cfg.resume:  # a finished run: say so before loading anything
        probe = checkpoint_manager(run_dir)
        latest = probe.latest_step()
        probe.close()
        if latest is not None and latest >= cfg.steps:
            _check_resume(cfg, run_dir, _read_run_config(run_dir))
            summary = _finished(cfg, run_dir, latest)
            log(_finished_line(summary, cfg.steps))
            return summary
    if corpus is None:
        try:
            corpus = load_corpus(cfg.data, make_tokenizer(cfg.tokenizer), cfg.heldout_fraction)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(str(e)) from None
    log(f"data: {corpus.description}")
    log(f"mesh: {sharding.describe(mesh)}")
    try:
        model, optimizer = build(cfg, corpus.vocab_size, mesh)
    except ValueError as e:
        raise SystemExit(f"--model {cfg.model}: {e}") from None
    log(f"model: {cfg.model} ({model.cfg.param_count():,} parameters), FFN "
        f"{cfg.implementation}, L1 {cfg.l1_coeff:g}, out {run_dir}")
    manager, start, records = _start_run(cfg, run_dir, model, optimizer, primary, log, mesh)

    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    l1_coeff = jnp.float32(cfg.l1_coeff)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=quiet,
               dynamic_ncols=True, desc=cfg.run_name)
    # Training time excludes the steps that compile (the first; with profile-guided scheduling
    # also the profiled ones and the one compiled again after them), evaluations and
    # checkpoints.
    clock = _Clock()
    last_eval: dict = {}
    train_step = TrainStep(model, optimizer,
                           xla_flags.profiled_steps(cfg.pgle_steps, mesh.size,
                                                    jax.default_backend()),
                           xla_flags.step_compiler_options(mesh.shape))
    saved_step, stop_signal, done = start, None, start
    # From here SIGTERM / SIGINT only ask to stop: acted on between steps (twell_jax.preemption).
    with preemption.StopSignals() as signals:
        for step in bar:
            batch = sharding.shard_batch(sample_batch(corpus.train, cfg.batch_size, cfg.seq_len,
                                                      cfg.seed, step, TRAIN_STREAM), mesh)
            metrics = train_step(batch, l1_coeff)
            done = step + 1
            if step - start <= train_step.pgle_steps:
                jax.block_until_ready(metrics)
                clock.start()
            else:
                clock.tokens += tokens_per_step
            if done % cfg.log_every == 0 or done == end:
                _log_metrics(metrics, done, clock, records, bar)
                _check_finite(metrics, done, manager)
            at_eval = (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps
            at_ckpt = (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == end
            # The stop decision, agreed between processes; not after the last step (done).
            stop_signal = signals.agreed() if done < end else None
            at_ckpt = at_ckpt or stop_signal is not None
            if at_eval or at_ckpt:
                jax.block_until_ready(metrics)
                clock.stop()
                train_step.sync()  # the model and the optimizer as of this step
            if at_eval:
                last_eval = _evaluate_and_record(model, corpus, cfg, mesh, done, records,
                                                 run_dir, bar, quiet)
            if at_ckpt:
                _check_finite(metrics, done, manager)  # never save a step gone bad
                save_checkpoint(manager, done, model, optimizer)
                saved_step = done
            if stop_signal is not None:
                break
            if at_eval or at_ckpt:
                clock.start()
    bar.close()
    manager.close()
    if stop_signal is not None:
        name = signal.Signals(stop_signal).name
        status = preemption.exit_status(stop_signal)
        if primary:
            print(f"stopped by {name} after step {done}: checkpoint step {saved_step} in "
                  f"{Path(manager.directory) / str(saved_step)}; exit status {status} "
                  "(continue with --resume)", flush=True)
        raise SystemExit(status)
    if primary:
        write_plot(records.records, run_dir / "metrics.png", cfg.run_name)
    return _summarize(cfg, end, records.records, last_eval, clock, run_dir, model.cfg.d_ff, log)


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in values) + "]" if values else "?"


def main(argv: Sequence[str] | None = None) -> dict:
    cfg = parse_args(argv)
    try:
        return train(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the first step (later ones stop at a step)
        print("interrupted before training started: nothing saved", file=sys.stderr)
        raise SystemExit(preemption.exit_status(signal.SIGINT)) from None


if __name__ == "__main__":
    main(sys.argv[1:])
