"""Where a model's GPU time goes: every kernel of a jitted call, from a JAX profiler trace.

For each preset and implementation it profiles up to three programs of the real model, with
gate biases calibrated to ``--mean-nnz`` active units per token as in ``bench_model.py``:

- prefill: the last position's logits of ``--prefill`` (B x T) tokens, as ``bench_model.py``;
- train (``--train``): one training step (loss with the L1 term, backward, AdamW) as
  ``bench_model.py`` times it, remat as ``--remat``; with ``--mesh`` (e.g. ``data=2``) on
  every visible GPU, ``--train`` tokens per device, and each GPU's collective (NCCL) time and
  the part of it no other kernel ran beside (collectives the program failed to hide), in all
  and per NCCL kernel name (the operation and dtype: which collectives wait);
- decode: ``model.generation_steps`` (generate's jitted loop) for ``--decode-steps`` steps at
  batch ``--decode-batch`` after a prompt of ``--context`` minus those steps (bf16 parameters,
  no statistics, as ``bench_generate.py`` times it).

and, with ``--ffn CASES`` (``bench_ffn.py`` case names), one FFN layer alone on that case's
inputs: ``ffn_forward`` (no statistics) and ``ffn_fwd_bwd`` (all four gradients and the L1
term, as ``bench_ffn.py --backward`` times them). Each kernel of these is named with the source
op XLA compiled it from (``src``: e.g. a cast in the route switch's branch, a weight
transpose), as are the model programs' with ``--hlo-dir``.

It reports, per program and run: the wall time (synchronised), the time some kernel was running
on the GPU (the union of the kernels' intervals: "busy"), the kernels' summed time and count, and
a table of kernels by name and by kind (collectives, twell kernels, GEMMs, attention, XLA
fusions, copies).
Wall minus busy is time the GPU sat idle: launches, host work, synchronisation. The trace's
kernel times are the GPU's own (CUPTI), so they need no on-device loop.

    python experiments/profile_kernels.py --presets 0.5b --out runs/profile.jsonl
    python experiments/profile_kernels.py --presets '' --ffn m16k_uniform28 --runs 5
    python experiments/profile_kernels.py --presets 0.5b --prefill '' --decode-batch 0 \
        --train 8x2048 --mesh data=2

One JSON line per program (with every kernel) goes to ``--out``; a short table is printed last.
On a CPU there are no GPU kernels: the rows carry wall times only (used by the tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.benchmarking import ffn_cases
from twell_jax.benchmarking.gpu_trace import profile
from twell_jax import cli
from twell_jax.cli import flag
from twell_jax.benchmarking.model_bench import (adamw_step, calibrate, jit_over_state, last_logits,
                         timing_optimizer)

import twell_jax as tj
from twell_jax import model as model_lib
from twell_jax import sharding, xla_flags


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    presets: str = flag("0.5b", "comma list of model presets")
    implementations: str = flag("xla,pallas", "comma list of implementations")
    mean_nnz: float = flag(28.0, "mean active FFN units per token at F = 5632 (scaled to F)")
    prefill: str = flag("8x2048", "prefill shape BxT ('' to skip)")
    train: str = flag("", "training step shape BxT ('' to skip)")
    l1_coeff: float = flag(1e-4, "L1 coefficient of the training loss")
    remat: bool = flag(False, "recompute each block in the training step's backward")
    mesh: str = flag("", "profile the training step on a device mesh (twell_jax.sharding's "
                         "parse_mesh text, e.g. data=2 or fsdp=2; --train is per device): each "
                         "GPU's collective time, alone and beside other kernels; '' for one "
                         "device")
    scan_layers: bool = flag(True, "run the blocks of large calls under one scan "
                             "(ModelConfig.scan_layers); --no-scan-layers: a Python loop")
    decode_batch: int = flag(1, "sequences in the decode loop (0 to skip decode)")
    context: int = flag(2048, "prompt + decode steps of the decode program")
    decode_steps: int = flag(32, "decode steps per profiled loop")
    ffn: str = flag("", "comma list of bench_ffn.py cases: one FFN layer alone, forward and "
                        "forward + backward ('' to skip)")
    runs: int = flag(3, "profiled repetitions per program")
    top: int = flag(12, "kernels listed per program in the printed table")
    seed: int = flag(0, "seed of the weights and tokens")
    hlo_dir: str = flag("", "folder for each program's optimized HLO ('' for none): the "
                            "kernels' names are its fusions' names")
    out: str = flag("runs/profile.jsonl", "JSON-lines output")


def fusion_sources(hlo: str) -> dict[str, str]:
    """Kernel name (as the trace writes it: the HLO instruction's name, dots as underscores)
    -> the JAX op it was compiled from (the ``op_name`` of the fusion or custom call, else of
    the last instruction of its fused computation that has one)."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split(" ")[0].lstrip("%")
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)

    def op_name(text: str) -> str | None:
        found = re.search(r'op_name="([^"]+)"', text)
        return found.group(1) if found else None

    sources = {}
    for line in hlo.splitlines():
        if " fusion(" not in line and " custom-call(" not in line:
            continue
        name = line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%")
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = bodies.get(called.group(1), []) if called else []
        source = op_name(line) or next(filter(None, map(op_name, reversed(body))), None)
        if source:
            sources[name.replace(".", "_")] = source
    return sources


# ------------------------------------------------------------------------------------------
# The programs.


def _model(preset: str, impl: str, cfg: ProfileConfig, biases: np.ndarray | None,
           param_dtype=jnp.float32) -> model_lib.Transformer:
    model = model_lib.build(preset, implementation=impl, gate_bias=True, param_dtype=param_dtype,
                            remat=cfg.remat, scan_layers=cfg.scan_layers, seed=cfg.seed)
    if biases is not None:
        for block, bias in zip(model.blocks, biases):
            block.ffn.b_gate[...] = jnp.asarray(bias, block.ffn.b_gate[...].dtype)
    return model


def _tokens(vocab: int, b: int, t: int, seed: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed + 1), (b, t), 0, vocab, jnp.int32)


def prefill_program(model, tokens):
    """(call, hlo): the last position's logits of ``tokens``, as bench_model times them (the
    blocks' parameters stacked once, before the calls)."""
    call, jitted, state = jit_over_state(last_logits, model)
    stacked = model.stack_for_inference()
    return (lambda: call(tokens, stacked),
            lambda: jitted.lower(state, tokens, stacked).compile().as_text())


def train_program(model, tokens, l1_coeff: float, mesh: jax.sharding.Mesh | None = None):
    """(call, hlo): one AdamW training step on ``tokens`` [B, T + 1], as bench_model times it
    (one jit over the split, donated model + optimizer state); with a ``mesh``, the state and
    the batch sharded over it (``twell_jax.sharding``), as ``experiments/train.py --mesh``
    runs it: with the mesh's compiler options (``xla_flags.step_compiler_options``) and, on
    several GPUs, compiled again from the costs of profiled steps (its default
    ``--pgle-steps``), while the HLO returned is the step's program before that."""
    optimizer = nnx.Optimizer(model, timing_optimizer(), wrt=nnx.Param)
    if mesh is None:
        step, compiled, _, _ = adamw_step(model, optimizer, tokens, l1_coeff)
        return step, compiled.as_text
    for obj in (model, optimizer):
        sharding.shard_state(obj, mesh)
    tokens = sharding.shard_batch(np.asarray(tokens), mesh)
    pgle_steps = xla_flags.profiled_steps(-1, mesh.size, jax.default_backend())
    with jax.set_mesh(mesh):
        step, compiled, _, _ = adamw_step(model, optimizer, tokens, l1_coeff, pgle_steps,
                                          xla_flags.step_compiler_options(mesh.shape))
    return step, compiled.as_text


def decode_program(model, prompts, steps: int, context: int):
    """(call, hlo): ``steps`` decode steps of ``generation_steps`` after a prefill."""
    graphdef, state = nnx.split(model)
    b = prompts.shape[0]
    lengths = jnp.full((b,), prompts.shape[1], jnp.int32)
    stop = jnp.zeros((model.cfg.vocab_size,), bool)
    sampling = model_lib.Sampling()
    decode_state, _, _, _ = model_lib.generation_start(graphdef, state, prompts, lengths,
                                                       jax.random.key(0), stop,
                                                       sampling=sampling, cache_len=context,
                                                       stats=False)
    args = (graphdef, state, decode_state, jnp.int32(steps))
    kwargs = dict(sampling=sampling, chunk=steps, stats=False)
    return (lambda: model_lib.generation_steps(*args, **kwargs),
            lambda: model_lib.generation_steps.lower(*args, **kwargs).compile().as_text())


def ffn_programs(case_name: str, implementation: str, l1_coeff: float):
    """[(program, call, hlo)]: one FFN layer on ``bench_ffn`` case ``case_name``'s inputs,
    forward (no statistics) and forward + backward (the four gradients, the L1 term), on the
    public op with its weights stored [F, D] (``prepare_weights``, made once: no call
    transposes a weight), as the layers and the map call it."""
    x, *weights = ffn_cases.make_case_inputs(ffn_cases.CASES[case_name])
    weights = tuple(tj.prepare_weights(*weights))
    dy = jax.random.normal(jax.random.key(5), x.shape, x.dtype)
    f32 = lambda a: a.astype(jnp.float32)

    def ffn(x, *w, return_stats=False):
        return tj.feed_forward(x, tj.FFNWeights(*w), implementation=implementation,
                               return_stats=return_stats)

    def loss(x, *w):
        y, stats = ffn(x, *w, return_stats=True)
        return jnp.sum(f32(y) * f32(dy)) + l1_coeff * stats.l1

    forward = jax.jit(ffn)
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return [(name, lambda fn=fn: fn(x, *weights),
             lambda fn=fn: fn.lower(x, *weights).compile().as_text())
            for name, fn in (("ffn_forward", forward), ("ffn_fwd_bwd", fwd_bwd))]


def _profile_row(preset: str, program: str, impl: str, call, hlo, cfg: ProfileConfig,
                 sources: bool) -> dict:
    """One program profiled; its kernels named with their source ops when ``sources`` or
    ``cfg.hlo_dir`` (the HLO is compiled again for that), and the HLO kept under hlo_dir."""
    row = {"kind": "profile", "preset": preset, "program": program, "implementation": impl,
           "runs": cfg.runs, **profile(call, cfg.runs)}
    if sources or cfg.hlo_dir:
        text = hlo()
        names = fusion_sources(text)
        for k in row["kernels"]:
            k["src"] = names.get(k["name"], "")
        if cfg.hlo_dir:
            os.makedirs(cfg.hlo_dir, exist_ok=True)
            with open(os.path.join(cfg.hlo_dir, f"{preset}_{program}_{impl}.hlo.txt"), "w") as f:
                f.write(text)
    return row


def run(cfg: ProfileConfig, emit: Callable[[dict], None]) -> list[dict]:
    rows = []
    impls = [s for s in cfg.implementations.split(",") if s]
    for case_name in filter(None, cfg.ffn.split(",")):
        if case_name not in ffn_cases.CASES:
            raise ValueError(f"unknown --ffn case {case_name!r}; have {sorted(ffn_cases.CASES)}")
        for impl in impls:
            for program, call, hlo in ffn_programs(case_name, impl, cfg.l1_coeff):
                row = _profile_row(case_name, program, impl, call, hlo, cfg, sources=True)
                emit(row)
                rows.append(row)
    mesh = sharding.make_mesh(sharding.parse_mesh(cfg.mesh)) if cfg.mesh else None
    for preset in filter(None, cfg.presets.split(",")):
        mcfg = model_lib.CONFIGS[preset]
        target = cfg.mean_nnz * mcfg.d_ff / 5632
        programs = []
        if cfg.prefill:
            b, t = (int(v) for v in cfg.prefill.lower().split("x"))
            tokens = _tokens(mcfg.vocab_size, b, min(t, mcfg.max_seq_len), cfg.seed)
            programs.append(("prefill", jnp.float32, tokens,
                             lambda m, tok=tokens: prefill_program(m, tok)))
        if cfg.train:
            b, t = (int(v) for v in cfg.train.lower().split("x"))
            b *= 1 if mesh is None else mesh.size  # --train is per device
            tokens = _tokens(mcfg.vocab_size, b, min(t, mcfg.max_seq_len) + 1, cfg.seed)
            programs.append(("train", jnp.float32, tokens[:, :-1],
                             lambda m, tok=tokens: train_program(m, tok, cfg.l1_coeff, mesh)))
        if cfg.decode_batch:
            steps = min(cfg.decode_steps, cfg.context - 1)
            prompts = _tokens(mcfg.vocab_size, cfg.decode_batch, cfg.context - steps, cfg.seed)
            programs.append(("decode", jnp.bfloat16, prompts,
                             lambda m, p=prompts, s=steps: decode_program(m, p, s, cfg.context)))
        for program, param_dtype, calibration_tokens, make in programs:
            calibrated = _model(preset, "xla", cfg, None, param_dtype)
            biases = np.stack(calibrate(calibrated, calibration_tokens, target, "uniform",
                                        lambda _: None))
            del calibrated
            for impl in impls:
                model = _model(preset, impl, cfg, biases, param_dtype)
                call, hlo = make(model)
                row = _profile_row(preset, program, impl, call, hlo, cfg, sources=False)
                if program == "decode":
                    row.update(decode_batch=cfg.decode_batch, context=cfg.context,
                               decode_steps=min(cfg.decode_steps, cfg.context - 1))
                if program == "train" and mesh is not None:
                    row.update(mesh=dict(mesh.shape))
                emit(row)
                rows.append(row)
                del model
    return rows


def print_table(rows: list[dict], top: int) -> None:
    for r in rows:
        per = r.get("decode_steps", 1)
        unit = "per step" if per > 1 else "per call"
        print(f"\n{r['preset']} {r['program']} {r['implementation']} ({unit}): wall "
              f"{r['wall_ms'] / per:.3f} ms (profiled {r['profiled_wall_ms'] / per:.3f}), "
              f"busy {r['busy_ms'] / per:.3f}, kernels {r['kernel_ms'] / per:.3f} ms in "
              f"{r['launches'] / per:.0f} launches; by kind: "
              + ", ".join(f"{k} {v / per:.3f}" for k, v in
                          sorted(r["kinds"].items(), key=lambda kv: -kv[1])))
        for device, d in r.get("devices", {}).items():
            if d["collective_ms"]:
                print(f"  {device}: busy {d['busy_ms'] / per:.3f} ms, collectives "
                      f"{d['collective_ms'] / per:.3f} ms, of which alone "
                      f"{d['collective_alone_ms'] / per:.3f} ms")
                for name, ms in list(d.get("collective_alone_by_kernel_ms", {}).items())[:top]:
                    if ms > 0:
                        print(f"    alone {ms / per:9.4f} ms  {name[:70]}")
        for k in r["kernels"][:top]:
            src = f"  <- {k['src'][-70:]}" if k.get("src") else ""
            print(f"  {k['ms'] / per:9.4f} ms {k['calls'] / per:6.1f}x  {k['kind']:9s} "
                  f"{k['name'][:60]}{src}")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = cli.flag_parser(ProfileConfig, __doc__)
    cfg = ProfileConfig(**vars(parser.parse_args(argv)))
    if cfg.mesh:
        if not cfg.train:
            parser.error("--mesh profiles the training step: give --train BxT (per device)")
        try:
            sharding.parse_mesh(cfg.mesh)
        except ValueError as e:
            parser.error(f"--mesh: {e}")
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "a") as f:
        def emit(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
        command = sys.argv if argv is None else ["profile_kernels.py", *argv]
        emit(cli.header(" ".join(command), **dataclasses.asdict(cfg)))
        rows = run(cfg, emit)
    print_table(rows, cfg.top)
    return rows


if __name__ == "__main__":
    main()
