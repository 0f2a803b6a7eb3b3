"""Sample text from a TwELL decoder: a train.py run, a preset with random weights, or a Hugging
Face Llama folder.

    .venv/bin/python experiments/train.py       # writes runs/tiny-reference-l1_0.01/
    .venv/bin/python experiments/generate.py --checkpoint runs/tiny-reference-l1_0.01 \\
        --prompt "def " --max-new-tokens 120  # ~15 s on 2 CPU cores, most of it compiling
    .venv/bin/python experiments/generate.py --hf path/to/llama-folder --prompt "Hello"

The prompt is prefilled into a KV cache, then a jitted ``lax.while_loop`` decodes ``--chunk``
tokens per call (``twell_jax.model.generate_chunks``): the completion is printed chunk by chunk.
Both programs are compiled (and run once) before the timed run, so the closing lines give
steady-state tokens/s of prefill and decode, and the mean active FFN units per token per layer.
Greedy by default; ``--temperature`` > 0 samples (with ``--top-k`` / ``--top-p``) from
``--seed``. Generation stops at the end-of-text token (an --hf folder's ``eos_token_id``, else
the tokenizer's separator: byte 0, or its end-of-text token) unless ``--no-stop``, and is cut
to fit the model's max_seq_len (there is no sliding window).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from twell_jax import checkpoints, data
from twell_jax import cli
from twell_jax.cli import flag, flag_parser

from twell_jax import model as model_lib
from twell_jax.backends import IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """Every knob of a sampling run; each field is a command-line flag (``--max-new-tokens`` ...)."""

    prompt: str = flag("def ", "the text to continue")
    max_new_tokens: int = flag(128, "tokens to generate (fewer if the stop token comes)")
    model: str = flag("", "model preset with random weights (default tiny); with --checkpoint "
                           "it must match the run's", choices=("",) + tuple(model_lib.CONFIGS))
    checkpoint: str = flag("", "a train.py run folder (runs/<name>): its config.json and "
                                "newest checkpoint under ckpt/")
    hf: str = flag("", "a Hugging Face Llama folder: config.json, *.safetensors and (unless "
                        "--tokenizer) tokenizer.json")
    implementation: str = flag("", "FFN implementation; default the run's, else xla",
                                choices=("",) + IMPLEMENTATIONS)
    temperature: float = flag(0.0, "0: greedy; else sample from softmax(logits / T)")
    top_k: int = flag(0, "sample among the k most likely tokens (0: all)")
    top_p: float = flag(1.0, "nucleus sampling: the most likely tokens up to mass p (1: all)")
    seed: int = flag(0, "PRNG seed of the sampling (and of a preset's random weights)")
    tokenizer: str = flag("", "'bytes' or a tokenizer.json; default the run's, the --hf "
                               "folder's tokenizer.json, else bytes")
    chunk: int = flag(16, "decode steps per jitted call (each chunk is printed as it comes)")
    stop: bool = flag(True, "stop at the end-of-text token (the --hf config's eos_token_id, "
                             "else the tokenizer's separator)")
    compile_cache: str = flag(cli.DEFAULT_COMPILE_CACHE, "folder that keeps the compiled "
                              "prefill and decode loop, so a rerun skips compiling ('' for none)")


def parse_args(argv: Sequence[str] | None) -> GenerateConfig:
    parser = flag_parser(GenerateConfig, __doc__.split("\n")[0])
    cfg = GenerateConfig(**vars(parser.parse_args(argv)))
    if cfg.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.chunk < 1:
        parser.error(f"--chunk must be >= 1, got {cfg.chunk}")
    if cfg.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {cfg.temperature}")
    if cfg.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {cfg.top_k}")
    if not 0 < cfg.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.hf and cfg.checkpoint:
        parser.error("give --checkpoint or --hf, not both")
    if cfg.hf and cfg.model:
        parser.error("--model is a preset; an --hf folder brings its own config")
    return cfg


def load(cfg: GenerateConfig):
    """(model, tokenizer, stop token ids, description) for ``cfg``."""
    eos = None
    if cfg.hf:
        try:
            model = model_lib.from_hf(cfg.hf, implementation=cfg.implementation or "xla")
        except (ValueError, FileNotFoundError) as e:  # unsupported or broken: say why
            raise SystemExit(f"--hf {cfg.hf}: {e}") from e
        eos = json.loads((Path(cfg.hf) / "config.json").read_text()).get("eos_token_id")
        tokenizer_spec = cfg.tokenizer or str(Path(cfg.hf) / "tokenizer.json")
        what = f"Hugging Face folder {cfg.hf}"
    elif cfg.checkpoint:
        run = Path(cfg.checkpoint)
        if not (run / "config.json").is_file() or not (run / "ckpt").is_dir():
            raise SystemExit(f"--checkpoint {run}: not a train.py run folder "
                             "(config.json and ckpt/ expected)")
        try:
            run_cfg = json.loads((run / "config.json").read_text())
            model_name = run_cfg["model"]
            if model_name not in model_lib.CONFIGS:
                raise ValueError(f"unknown model {model_name!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--checkpoint {run}: config.json is not a train.py run's "
                             f"({type(e).__name__}: {e})") from None
        if cfg.model and cfg.model != model_name:
            raise SystemExit(f"--model {cfg.model} differs from the run's {model_name}")
        model = model_lib.build(model_name,
                                implementation=cfg.implementation or run_cfg.get(
                                    "implementation", "xla"))
        manager = checkpoints.checkpoint_manager(run)
        try:
            step = checkpoints.restore_checkpoint(manager, model)
        except ValueError as e:
            raise SystemExit(f"--checkpoint {run}: {e}") from None
        finally:
            manager.close()
        if not step:
            raise SystemExit(f"--checkpoint {run}: no checkpoint under {run / 'ckpt'}")
        tokenizer_spec = cfg.tokenizer or run_cfg.get("tokenizer", "bytes")
        what = f"{run_cfg['model']} from {run} at step {step}"
    else:
        model = model_lib.build(cfg.model or "tiny", seed=cfg.seed,
                                implementation=cfg.implementation or "xla")
        tokenizer_spec = cfg.tokenizer or "bytes"
        what = f"{cfg.model or 'tiny'} with random weights"
    tokenizer = data.make_tokenizer(tokenizer_spec)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise SystemExit(f"the tokenizer has {tokenizer.vocab_size} tokens, the model's "
                         f"vocabulary {model.cfg.vocab_size}")
    stop = [tokenizer.separator] if eos is None else eos if isinstance(eos, list) else [eos]
    description = f"{what}, FFN {model.cfg.implementation}, tokenizer {tokenizer_spec}"
    return model, tokenizer, tuple(int(s) for s in stop), description


class _Printer:
    """Prints the decoded completion as tokens arrive. Decodes everything so far each time (a
    token can end inside a UTF-8 character or merge with the next one) and holds back a
    trailing replacement character until the next chunk completes it."""

    def __init__(self, tokenizer, quiet: bool):
        self.tokenizer, self.quiet = tokenizer, quiet
        self.tokens: list[int] = []
        self.printed = ""

    def add(self, tokens, final: bool = False) -> None:
        self.tokens += [int(t) for t in tokens]
        text = self.tokenizer.decode(self.tokens)
        if not final:
            text = text.rstrip("\ufffd")
        if text.startswith(self.printed) and not self.quiet:
            print(text[len(self.printed):], end="", flush=True)
        self.printed = text


def main(argv: Sequence[str] | None = None, *, quiet: bool = False) -> dict:
    """Runs the command line; returns a summary (text, tokens, timings, FFN activity)."""
    cfg = parse_args(argv)
    cli.use_compile_cache(cfg.compile_cache)
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    model, tokenizer, stop, description = load(cfg)
    log(f"model: {description}")
    prompt = tokenizer.encode(cfg.prompt.encode()).astype(np.int32)
    # No sliding window: prompt and completion must fit max_seq_len (the last token is never
    # fed back, hence + 1).
    room = model.cfg.max_seq_len - len(prompt) + 1
    if room < 1:
        raise SystemExit(f"the prompt has {len(prompt)} tokens, more than the model's "
                         f"max_seq_len={model.cfg.max_seq_len}")
    max_new_tokens = min(cfg.max_new_tokens, room)
    if max_new_tokens < cfg.max_new_tokens:
        log(f"max_new_tokens {cfg.max_new_tokens} -> {max_new_tokens}: {len(prompt)} prompt "
            f"tokens and the completion must fit max_seq_len={model.cfg.max_seq_len}")
    stop = stop if cfg.stop else ()
    kwargs = dict(max_new_tokens=max_new_tokens, chunk_size=cfg.chunk,
                  temperature=cfg.temperature, top_k=cfg.top_k or None,
                  top_p=cfg.top_p if cfg.top_p < 1 else None, key=jax.random.key(cfg.seed),
                  stop_tokens=stop)
    try:
        # Compile (and run once) the prefill and the decode loop, so the timings below are
        # steady state; every later chunk reuses the one compiled loop.
        start = time.perf_counter()
        for _ in zip(range(2), model_lib.generate_chunks(model, [prompt], **kwargs)):
            pass
        compile_s = time.perf_counter() - start
        printer = _Printer(tokenizer, quiet)
        if not quiet:
            print(cfg.prompt, end="", flush=True)
        seconds, nnz, stopped = [], [], False
        start = time.perf_counter()
        for tokens, chunk_nnz in model_lib.generate_chunks(model, [prompt], **kwargs):
            now = time.perf_counter()
            seconds.append(now - start)
            start = now
            nnz.append(chunk_nnz)
            row = [t for t in tokens[0] if t != model_lib.PAD_TOKEN]
            stopped |= bool(stop) and bool(row) and row[-1] in stop
            printer.add(row[:-1] if stopped else row)
    except ValueError as e:  # bad prompt or lengths: a message, not a traceback
        raise SystemExit(f"generate: {e}") from e
    printer.add([], final=True)
    log("")
    generated = sum(len(n) for n in nnz)
    nnz = np.concatenate(nnz)
    decode_s, decode_n = sum(seconds[1:]), generated - 1
    summary = {
        "text": printer.printed,
        "tokens": printer.tokens,
        "stopped": stopped,
        "compile_s": round(compile_s, 3),
        "prefill_tokens": len(prompt),
        "prefill_tokens_per_s": len(prompt) / seconds[0],
        "decode_tokens": decode_n,
        "decode_tokens_per_s": decode_n / decode_s if decode_n else None,
        "nnz_prefill": nnz[0].tolist(),
        "nnz_decode": nnz[1:].mean(axis=0).tolist() if decode_n else None,
        "d_ff": model.cfg.d_ff,
    }
    log(f"prefill: {len(prompt)} tokens in {seconds[0] * 1e3:.1f} ms "
        f"({summary['prefill_tokens_per_s']:,.0f} tokens/s); decode: {decode_n} tokens in "
        f"{decode_s:.3f} s ({summary['decode_tokens_per_s'] or 0:,.1f} tokens/s); compile and "
        f"warm-up {compile_s:.1f} s" + ("; stopped at the end-of-text token" if stopped else ""))
    per_layer = lambda values: "[" + ", ".join(f"{v:.1f}" for v in values) + "]"
    log(f"active FFN units per token by layer (of {model.cfg.d_ff}): prefill "
        f"{per_layer(summary['nnz_prefill'])}"
        + (f", decode {per_layer(summary['nnz_decode'])}" if decode_n else ""))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
