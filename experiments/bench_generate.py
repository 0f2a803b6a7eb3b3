"""Decode benchmark: generation with the sparse FFN ("pallas") against the dense one ("xla").

On the H100 (bf16 parameters, gate biases calibrated to ~28 of 5632 active units per token):

    python experiments/bench_generate.py --presets 0.5b,1.5b --batches 1,8 --context 2048 \\
        --new-tokens 128 --out runs/bench_generate.jsonl

On a CPU (interpret mode, the tiny model, well under a minute):

    python experiments/bench_generate.py --presets tiny --batches 2 --context 48 \\
        --new-tokens 8 --runs 2

Per (preset, implementation, batch B), with prompts of P = context - new_tokens random tokens
and a KV cache of ``context`` positions (bf16, the compute dtype):

- time to first token: ``model.generation_start`` (what ``generate`` runs first: allocate the
  cache, prefill the B x P prompt batch, sample the first token; no statistics), one
  jitted call, median over ``--runs`` after two warm-up calls. The blocks' parameters are
  stacked once beforehand (``model.stack_for_inference()``, as a server holding the model
  would pass ``generate(..., stacked=...)``); a prefill of at least 4096 prompt tokens reads
  that stack instead of stacking them in every call (the stack's memory counts in the peak).
- decode: ``model.generation_steps`` (``generate``'s loop: one ``lax.while_loop`` of
  N = new_tokens - 1 greedy decode steps, no host round trip per token, without the FFN
  statistics, as ``generate`` runs unless asked) from the state the prefill left; one more
  call with statistics gives the active units per step. One call is timed whole, from
  dispatch to the tokens being ready, median over ``--runs``; step time = call time / N,
  tokens/s = B * N / call time.
  The call's fixed costs (dispatch, copying the non-donated KV cache into the loop once) are
  included, not subtracted: they are what a caller of ``generate`` pays. Beside it, the same
  compiled loop stopped after one step (``decode_one_step_call_ms``) and the marginal step
  time (T(N) - T(1)) / (N - 1), which leaves the fixed costs out.
- floors per decode step, at ``--hbm-bytes-per-s`` (the H100 SXM's 3.35e12 B/s): the weight
  bytes one step reads (every parameter; the embedding only when it is also the output head,
  since otherwise only B rows of it are gathered), the KV-cache bytes it reads (decode
  attention reads the whole [B, context, Nkv, H] cache of every layer, masked), and
  step time / (weights + KV floor). ``weight_bytes_sparse_ffn``: the weights a sparse step
  would need at the measured activity (w_gate whole, only active rows of w_up / w_down,
  B * nnz of them at most per layer), for comparison.
- peak device memory (``memory_stats``; each case runs in its own process), energy per
  generated token (the driver's energy counter over ~3 s of decode calls after the timed
  ones, ``bench_model.time_call``; null without NVML),
  active FFN units per token during decode (the loop's own statistics: each step's mean; each
  decode token's mean, p99 and max per layer from one pass over the generated sequences), the
  path the "pallas" FFN takes for the decode step and for the prefill (``ffn.path_for``:
  "decode", the list-free decode kernel, for steps of at most ``TwELLConfig.decode_rows``
  rows; "dense" where its cost model runs a small call dense outright on a GPU, e.g. a prefill
  of ~2k tokens, unless ``--force-sparse``; "lists" otherwise, which may still switch to dense
  GEMMs at run time), the generated tokens (greedy, no stop token), and how many of the
  case's programs JAX loaded from its persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``;
  a batched decode loop loaded from it ran 5-6% slower than compiled on an H200, so the
  driver says when any were).

``tools/decode_hlo.py`` lists the weight-sized transposes and casts inside the compiled
decode loop.

One JSON line per measurement goes to ``--out`` (a header first); a table of pallas / xla
ratios (decode tokens/s, time to first token, energy) is printed last.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import cli
from twell_jax.benchmarking.model_bench import calibrate, peak_bytes, time_call
from twell_jax.benchmarking.power import PowerSampler

from twell_jax import ffn as ffn_lib
from twell_jax import model as model_lib
from twell_jax.config import TwELLConfig

IMPLEMENTATIONS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class GenBenchConfig:
    presets: str = cli.flag("0.5b,1.5b", "comma list of model presets (twell_jax.model.CONFIGS)")
    batches: str = cli.flag("1,8", "comma list of batch sizes (sequences decoded together)")
    context: int = cli.flag(2048, "cache length; prompts have context - new_tokens tokens")
    new_tokens: int = cli.flag(128, "tokens generated per sequence (1 from the prefill, the "
                                       "rest decoded)")
    mean_nnz: float = cli.flag(28.0, "mean active FFN units per token at F = 5632 (scaled to F)")
    token_spread: float = cli.flag(0.0, "spread of the active units per token: a direction "
                                        "shared by every unit's gate weights, this many times "
                                        "each unit's own weight norm, so some tokens fire many "
                                        "units and most few (0: every token about the mean)")
    runs: int = cli.flag(5, "timed repetitions per measurement (median reported)")
    hbm_bytes_per_s: float = cli.flag(3.35e12, "memory bandwidth of the floors (H100 SXM)")
    force_sparse: bool = cli.flag(False, "pallas: never switch to the dense FFN (TwELLConfig("
                                      "dense_fallback_density=1.0)), as on a CPU")
    subprocess: bool = cli.flag(True, "each case in its own process (its own peak memory)")
    seed: int = cli.flag(0, "seed of the weights and the prompts")
    out: str = cli.flag("runs/bench_generate.jsonl",
                           "JSON-lines file the records are appended to")


def parse_args(argv: Sequence[str] | None) -> tuple[GenBenchConfig, str | None]:
    """(config, the internal --worker spec or None); exits with a message on a bad flag."""
    cfg, worker, parser = cli.parse_driver_args(GenBenchConfig, __doc__.split("\n")[0], argv)
    try:
        for name in presets_of(cfg):
            if name not in model_lib.CONFIGS:
                raise ValueError(f"unknown preset {name!r}; have {sorted(model_lib.CONFIGS)}")
            if cfg.context > model_lib.CONFIGS[name].max_seq_len:
                raise ValueError(f"--context {cfg.context} exceeds {name}'s max_seq_len "
                                 f"{model_lib.CONFIGS[name].max_seq_len}")
        if not batches_of(cfg) or min(batches_of(cfg)) < 1:
            raise ValueError("--batches must be positive ints")
        if cfg.new_tokens < 2 or cfg.context - cfg.new_tokens < 1:
            raise ValueError("need --new-tokens >= 2 (one decode step) and a prompt of >= 1 "
                             "token (--context > --new-tokens)")
        if cfg.runs < 1 or cfg.mean_nnz <= 0 or cfg.hbm_bytes_per_s <= 0:
            raise ValueError("--runs, --mean-nnz and --hbm-bytes-per-s must be positive")
        if not 0 <= cfg.token_spread <= 10:
            raise ValueError(f"--token-spread must be in [0, 10], got {cfg.token_spread}")
    except ValueError as e:
        parser.error(str(e))
    return cfg, worker


def presets_of(cfg: GenBenchConfig) -> list[str]:
    return [p for p in cfg.presets.split(",") if p]


def batches_of(cfg: GenBenchConfig) -> list[int]:
    return [int(b) for b in cfg.batches.split(",") if b]


# ------------------------------------------------------------------------------------------
# The cases.


def build_model(preset: str, implementation: str, cfg: GenBenchConfig) -> model_lib.Transformer:
    """The preset with bf16 parameters (what a user serves) and per-unit gate biases, its gate
    weights spread by ``--token-spread`` (``spread_token_counts``)."""
    twell = TwELLConfig(dense_fallback_density=1.0) if cfg.force_sparse else None
    model = model_lib.build(preset, implementation=implementation, gate_bias=True,
                            param_dtype=jnp.bfloat16, twell=twell, seed=cfg.seed)
    if cfg.token_spread:
        spread_token_counts(model, cfg.token_spread, cfg.seed)
    return model


def spread_token_counts(model: model_lib.Transformer, spread: float, seed: int) -> None:
    """Adds ``spread * |w_j| * u`` to every unit j's gate weights w_j [D] (u: a random unit
    vector per layer, from ``seed``), in place.

    A random model's tokens each fire about the mean count; a trained model's do not (its
    counts have a p99 several times the mean). The shared direction shifts all of a token's
    pre-activations together, each by ``spread`` times its own typical size times the token's
    component along u, so a token far along u fires many units and the rest few; the per-unit
    biases, calibrated afterwards, still set each unit's rate."""
    for layer, block in enumerate(model.blocks):
        w = block.ffn.w_gate[...]  # [F, D]
        u = jax.random.normal(jax.random.fold_in(jax.random.key(seed + 2), layer),
                              (w.shape[1],), jnp.float32)
        u = u / jnp.linalg.norm(u)
        w32 = w.astype(jnp.float32)
        norms = jnp.linalg.norm(w32, axis=1, keepdims=True)
        block.ffn.w_gate[...] = (w32 + spread * norms * u[None, :]).astype(w.dtype)


def prompt_batch(mcfg: model_lib.ModelConfig, cfg: GenBenchConfig, batch: int) -> np.ndarray:
    """[batch, context - new_tokens] int32 random prompts: the first rows of one fixed array,
    so every batch's prompts are among the calibration batch's (a random model's biases set
    the target rate on the tokens they were calibrated on, not on fresh ones)."""
    every = jax.random.randint(jax.random.key(cfg.seed + 1),
                               (max(batches_of(cfg)), cfg.context - cfg.new_tokens), 0,
                               mcfg.vocab_size, jnp.int32)
    return np.asarray(every[:batch])


def parameter_bytes(model: model_lib.Transformer) -> dict[str, int]:
    """Bytes of the parameters one decode step reads, by group: ``"ffn_up_down"`` (w_up and
    w_down of every layer), ``"ffn_gate"`` (w_gate, b_gate), ``"embedding"`` (0 when untied: a
    step gathers only B of its rows), ``"other"`` (attention, norms, an untied lm_head)."""
    groups = {"ffn_up_down": 0, "ffn_gate": 0, "embedding": 0, "other": 0}
    params = nnx.state(model, nnx.Param).to_pure_dict()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        nbytes = int(leaf.nbytes)
        if names[-1] == "embedding":
            groups["embedding"] += nbytes if model.cfg.tie_embeddings else 0
        elif "ffn" in names and names[-1] in ("w_up", "w_down"):
            groups["ffn_up_down"] += nbytes
        elif "ffn" in names:
            groups["ffn_gate"] += nbytes
        else:
            groups["other"] += nbytes
    return groups


def kv_bytes_per_step(mcfg: model_lib.ModelConfig, batch: int, context: int) -> int:
    """Bytes of K and V one decode step reads: every layer's [B, context, Nkv, H] caches
    (``decode_attention`` masks positions past the query but reads them), compute dtype."""
    itemsize = jnp.dtype(mcfg.dtype).itemsize
    return 2 * mcfg.n_layers * batch * context * mcfg.kv_heads * mcfg.head_dim * itemsize


def decode_token_counts(model: model_lib.Transformer, prompts: jax.Array, tokens: np.ndarray,
                        rows_per_pass: int = 8) -> np.ndarray:
    """[n_layers, B, steps] int32: the active FFN units of each decode step's token, layer by
    layer. The decode loop's own statistics keep only each step's mean over the batch; these
    come from one forward pass over each sequence as generated (prompt, then the generated
    tokens but the last, which no step consumed), ``rows_per_pass`` sequences at a time,
    read at the positions the decode steps ran (step i consumed ``tokens[:, i]``)."""
    prompt_len, steps = prompts.shape[1], tokens.shape[1] - 1
    sequences = jnp.concatenate([prompts, jnp.asarray(tokens[:, :-1], prompts.dtype)], axis=1)
    count = nnx.jit(model_lib.token_nnz)
    parts = []
    for start in range(0, sequences.shape[0], rows_per_pass):
        rows = sequences[start:start + rows_per_pass]
        nnz = np.asarray(count(model, rows)).reshape(-1, rows.shape[0], rows.shape[1])
        parts.append(nnz[:, :, prompt_len:prompt_len + steps])
    return np.concatenate(parts, axis=1)


def first_call_seconds(fn: Callable[[], object]) -> float:
    """Seconds of the first (compiling) call of ``fn``, synchronised."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def worker_calibrate(spec: dict, cfg: GenBenchConfig, emit: Callable[[dict], None]) -> None:
    """Calibrates the gate biases on the largest prompt batch and saves them [L, F]."""
    model = build_model(spec["preset"], "xla", cfg)
    tokens = jnp.asarray(prompt_batch(model.cfg, cfg, max(batches_of(cfg))))
    target = cfg.mean_nnz * model.cfg.d_ff / 5632
    t0 = time.perf_counter()
    biases = calibrate(model, tokens, target, "uniform", lambda m: print(m, flush=True))
    np.save(spec["bias_file"], np.stack(biases))
    emit({"kind": "calibration", "preset": spec["preset"], "target_nnz": target,
          "tokens": int(tokens.size), "seconds": time.perf_counter() - t0})


def worker_measure(spec: dict, cfg: GenBenchConfig, emit: Callable[[dict], None]) -> None:
    """Times prefill (first token) and the decode loop of one (preset, implementation, B)."""
    preset, impl, batch = spec["preset"], spec["implementation"], spec["batch"]
    cache_loads = cli.cache_loads_counter()
    model = build_model(preset, impl, cfg)
    mcfg = model.cfg
    for block, bias in zip(model.blocks, np.load(spec["bias_file"])):
        block.ffn.b_gate[...] = jnp.asarray(bias, block.ffn.b_gate[...].dtype)
    prompts = jnp.asarray(prompt_batch(mcfg, cfg, batch))
    lengths = jnp.full((batch,), prompts.shape[1], jnp.int32)
    steps = cfg.new_tokens - 1
    graphdef, state = nnx.split(model)
    sampling = model_lib.Sampling()  # greedy
    key = jax.random.key(cfg.seed)
    stop = jnp.zeros((mcfg.vocab_size,), bool)  # no stop token: every sequence runs every step

    stacked = model.stack_for_inference()  # made once, as a server holding the model would

    def first_token():  # as generate runs it: no statistics
        return model_lib.generation_start(graphdef, state, prompts, lengths, key, stop,
                                          sampling=sampling, cache_len=cfg.context, stats=False,
                                          stacked=stacked)

    ttft_compile_s = first_call_seconds(first_token)
    ttft = time_call(first_token, cfg.runs)
    decode_state, first, prefill_nnz, prefill_p99 = first_token()
    # As generate decides: the decode loop runs the FFN dense if the prefill's activity says so.
    dense_ffn = bool(model_lib.decode_runs_dense(mcfg, prefill_nnz, batch, prefill_p99))

    def decode(n: int = steps, stats: bool = False):
        # n is traced and chunk static: every n runs the same compiled loop. Timed without
        # statistics, as generate runs unless asked for them.
        return model_lib.generation_steps(graphdef, state, decode_state, jnp.int32(n),
                                          sampling=sampling, chunk=steps, stats=stats,
                                          dense_ffn=dense_ffn)

    decode_compile_s = first_call_seconds(decode)
    sampler = PowerSampler()
    timing = time_call(decode, cfg.runs, sampler)
    # The same loop stopped after one step: its fixed costs (dispatch, copying the cache into
    # the loop, the output buffers) plus one step, so (T(N) - T(1)) / (N - 1) is the
    # marginal step time with the fixed costs taken out.
    one_step = time_call(lambda: decode(1), cfg.runs)
    _, tokens, nnz = decode(stats=True)
    tokens = np.concatenate([np.asarray(first)[:, None], np.asarray(tokens)], axis=1)  # [B, new]
    nnz = np.asarray(nnz)  # [steps, L]
    peak = peak_bytes()  # before the pass below, which the loop does not run
    step_counts = decode_token_counts(model, prompts, tokens)  # [L, B, steps]

    step_s = timing["median_ms"] / 1e3 / steps
    weights = parameter_bytes(model)
    weight_bytes = sum(weights.values())
    kv_bytes = kv_bytes_per_step(mcfg, batch, cfg.context)
    itemsize = jnp.dtype(mcfg.param_dtype).itemsize
    active_rows = min(mcfg.d_ff, batch * float(nnz.mean()))  # per layer, no overlap assumed
    sparse_bytes = (weight_bytes - weights["ffn_up_down"]
                    + mcfg.n_layers * 2 * mcfg.d_model * active_rows * itemsize)
    floor_s = (weight_bytes + kv_bytes) / cfg.hbm_bytes_per_s
    def path(tokens: int) -> str:
        # The path "pallas" takes at this many tokens per call (ffn.path_for): "decode" (the
        # list-free decode kernel), "lists" or "dense".
        return ffn_lib.path_for("pallas", tokens, mcfg.d_model, mcfg.d_ff, mcfg.dtype,
                                mcfg.twell or TwELLConfig())

    row = {
        "kind": "generate", "preset": preset, "implementation": impl, "batch": batch,
        "device": str(jax.devices()[0].device_kind), "context": cfg.context,
        "prompt_len": int(prompts.shape[1]), "new_tokens": cfg.new_tokens, "decode_steps": steps,
        "param_dtype": jnp.dtype(mcfg.param_dtype).name, "force_sparse": cfg.force_sparse,
        "decode_dense_ffn": dense_ffn, "token_spread": cfg.token_spread,
        # The prefill's per-layer activity that choice read (None where not recorded).
        "decode_choice_nnz_mean": [None if np.isnan(v) else float(v)
                                   for v in np.asarray(prefill_nnz)],
        "decode_choice_nnz_p99": [None if np.isnan(v) else float(v)
                                  for v in np.asarray(prefill_p99)],
        "ttft_ms": ttft["median_ms"], "ttft_p10_ms": ttft["p10_ms"],
        "ttft_p90_ms": ttft["p90_ms"], "prefill_tokens_per_s": batch * prompts.shape[1]
        / (ttft["median_ms"] / 1e3),
        "decode_call_ms": timing["median_ms"], "decode_call_p10_ms": timing["p10_ms"],
        "decode_call_p90_ms": timing["p90_ms"], "runs": cfg.runs,
        "step_ms": step_s * 1e3, "decode_tokens_per_s": batch / step_s,
        "decode_one_step_call_ms": one_step["median_ms"],
        "marginal_step_ms": (timing["median_ms"] - one_step["median_ms"]) / max(steps - 1, 1),
        "ttft_compile_s": ttft_compile_s, "decode_compile_s": decode_compile_s,
        "weight_bytes": weight_bytes, "weight_bytes_by_group": weights,
        "weight_bytes_sparse_ffn": int(sparse_bytes), "kv_bytes": kv_bytes,
        "weight_floor_ms": weight_bytes / cfg.hbm_bytes_per_s * 1e3,
        "kv_floor_ms": kv_bytes / cfg.hbm_bytes_per_s * 1e3,
        "step_over_floor": step_s / floor_s, "hbm_bytes_per_s": cfg.hbm_bytes_per_s,
        "pallas_path": path(batch) if impl == "pallas" else None,
        "pallas_path_prefill": (path(batch * int(prompts.shape[1]))
                                       if impl == "pallas" else None),
        "nnz_decode_mean": float(nnz.mean()), "nnz_decode_by_layer": nnz.mean(0).tolist(),
        # Each decode token's count, recomputed in one pass over the generated sequences:
        # the tail the loop's per-step means hide.
        "nnz_decode_token_mean_by_layer": step_counts.mean(axis=(1, 2)).tolist(),
        "nnz_decode_token_p99_by_layer": np.percentile(
            step_counts.reshape(step_counts.shape[0], -1), 99, axis=1).tolist(),
        "nnz_decode_token_max_by_layer": step_counts.max(axis=(1, 2)).tolist(),
        "peak_bytes": peak,
        # Programs of this case JAX loaded from its persistent compilation cache instead of
        # compiling (a loaded batched decode loop can run slower: docs/performance.md).
        "programs_loaded_from_cache": cache_loads(),
        **{k: timing.get(k) for k in ("energy_j", "energy_sampled_j", "energy_calls",
                                      "mean_power_w", "mean_sm_clock_mhz",
                                      "power_capped_fraction", "power_limit_w",
                                      "energy_note")},
        "mj_per_token": None if timing.get("energy_j") is None
        else timing["energy_j"] * 1e3 / (batch * steps * timing["energy_calls"]),
        "tokens": tokens.tolist(),
    }
    emit(row)


# ------------------------------------------------------------------------------------------
# The driver.


def run_case(spec: dict, cfg: GenBenchConfig, argv: Sequence[str],
             log: Callable[[str], None]) -> list[dict]:
    """Runs one worker, in a subprocess with ``cfg.subprocess``; returns its rows (an error
    row if it failed)."""
    if cfg.subprocess:
        return cli.run_worker(__file__, spec, argv, log)
    rows: list[dict] = []
    TASKS[spec["task"]](spec, cfg, rows.append)
    return rows


def device_kind(cfg: GenBenchConfig) -> str:
    """The device's name, from a subprocess when cases run in subprocesses (so this process
    never opens the GPU: JAX would preallocate most of its memory here)."""
    if not cfg.subprocess:
        return str(jax.devices()[0].device_kind)
    try:
        return subprocess.check_output(
            [sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"],
            text=True, stderr=subprocess.DEVNULL).strip()
    except subprocess.CalledProcessError:
        return "unknown"


TASKS = {"calibrate": worker_calibrate, "measure": worker_measure}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return cli.main_or_worker(argv, parse_args, TASKS, drive)


def drive(cfg: GenBenchConfig, argv: Sequence[str]) -> list[dict]:
    """Calibrates each preset, measures every (implementation, batch), writes the rows and the
    ratio table."""
    header = {"kind": "header", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": device_kind(cfg), "jax": jax.__version__, "commit": cli.commit(),
              "compile_cache_dir": cli.compile_cache_dir(),
              "command": " ".join(["bench_generate.py", *argv]),
              "config": dataclasses.asdict(cfg)}
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    rows = [header]
    log = lambda text: print(text, flush=True)
    with open(cfg.out, "a") as out, tempfile.TemporaryDirectory() as tmp:
        out.write(json.dumps(header) + "\n")
        for preset in presets_of(cfg):
            bias_file = os.path.join(tmp, f"{preset}_bias.npy")
            specs = [{"task": "calibrate", "preset": preset, "bias_file": bias_file}]
            specs += [{"task": "measure", "preset": preset, "implementation": impl,
                       "batch": batch, "bias_file": bias_file}
                      for batch in batches_of(cfg) for impl in IMPLEMENTATIONS]
            for spec in specs:
                new = run_case(spec, cfg, argv, log)
                for row in new:
                    out.write(json.dumps({**row, "commit": header["commit"]}) + "\n")
                out.flush()
                rows += new
                if spec["task"] == "calibrate" and any(r["kind"] == "error" for r in new):
                    break
        table = ratio_table(rows)
        for row in table:
            out.write(json.dumps({"kind": "ratio", **row, "commit": header["commit"]}) + "\n")
    rows += [{"kind": "ratio", **row} for row in table]
    print_table(table)
    loaded = sum(r.get("programs_loaded_from_cache", 0) for r in rows if r["kind"] == "generate")
    if loaded:
        print(f"note: {loaded} programs came from JAX's compilation cache "
              f"({header['compile_cache_dir']}); a batched decode loop loaded from it ran 5-6% "
              "slower than compiled on an H200: unset JAX_COMPILATION_CACHE_DIR to time "
              "compiled programs")
    return rows


def ratio_table(rows: list[dict]) -> list[dict]:
    """One row per (preset, batch): both implementations' decode tokens/s, time to first token,
    step / floor, mJ per token, and pallas / xla of each; ``tokens_agree``: the fraction of
    generated tokens that are equal (greedy; bf16 rounding may split them late)."""
    cases = {(r["preset"], r["batch"], r["implementation"]): r for r in rows
             if r["kind"] == "generate"}
    table = []
    for preset, batch in dict.fromkeys((p, b) for p, b, _ in cases):
        xla, pallas = cases.get((preset, batch, "xla")), cases.get((preset, batch, "pallas"))
        if xla is None or pallas is None:
            continue

        def ratio(name):
            a, b = pallas.get(name), xla.get(name)
            return None if a is None or not b else a / b

        agree = float(np.mean(np.asarray(pallas["tokens"]) == np.asarray(xla["tokens"])))
        table.append({
            "preset": preset, "batch": batch,
            "decode_tokens_per_s": [xla["decode_tokens_per_s"], pallas["decode_tokens_per_s"]],
            "decode_ratio": ratio("decode_tokens_per_s"),
            "ttft_ms": [xla["ttft_ms"], pallas["ttft_ms"]], "ttft_ratio": ratio("ttft_ms"),
            "step_over_floor": [xla["step_over_floor"], pallas["step_over_floor"]],
            "mj_per_token": [xla["mj_per_token"], pallas["mj_per_token"]],
            "energy_ratio": ratio("mj_per_token"),
            "peak_bytes_ratio": ratio("peak_bytes"),
            "pallas_path": pallas["pallas_path"], "tokens_agree": agree,
        })
    return table


def print_table(table: list[dict]) -> None:
    """Prints the ratio table: per (preset, B), xla / pallas values and pallas / xla."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"\n{'preset':<7} {'B':>3} {'decode tok/s xla':>16} {'pallas':>10} {'ratio':>6} "
          f"{'TTFT ms xla':>12} {'pallas':>10} {'ratio':>6} {'step/floor x,p':>15} "
          f"{'mJ/tok ratio':>12} {'path':>6} {'agree':>6}")
    for r in table:
        (dx, dp), (tx, tp), (fx, fp) = r["decode_tokens_per_s"], r["ttft_ms"], r["step_over_floor"]
        print(f"{r['preset']:<7} {r['batch']:>3} {dx:>16,.1f} {dp:>10,.1f} "
              f"{fmt(r['decode_ratio'], '.3f'):>6} {tx:>12.2f} {tp:>10.2f} "
              f"{fmt(r['ttft_ratio'], '.3f'):>6} {f'{fx:.2f}, {fp:.2f}':>15} "
              f"{fmt(r['energy_ratio'], '.3f'):>12} {str(r['pallas_path']):>6} "
              f"{r['tokens_agree']:>6.2f}")
    print("ratio = pallas / xla (decode tokens/s: higher is better for pallas; TTFT, mJ: lower); "
          "step/floor = decode step time / (weight + KV bytes at the HBM rate)")


if __name__ == "__main__":
    main()
