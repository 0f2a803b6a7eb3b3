"""Tests of experiments/train.py: data loading, checkpoints, exact resume and the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from tests.utils import load_experiment, subprocess_env
from twell_jax import data, xla_flags


@pytest.fixture(scope="module")
def train():
    with load_experiment("train") as module:
        yield module


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """40 small text files (some in a subfolder) and one binary file that must be skipped."""
    root = tmp_path_factory.mktemp("texts")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sparse", "tile", "ell", "jax", "\n"]
    for i in range(40):
        folder = root / "sub" if i % 3 == 0 else root
        folder.mkdir(exist_ok=True)
        text = " ".join(rng.choice(words, size=200)) + f" file {i}\n"
        (folder / f"doc{i:02d}.txt").write_text(text)
    (root / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (root / ".hidden.txt").write_text("never read")
    return root


# Tiny runs: 4 sequences of 32 bytes, the reference FFN. The same --steps everywhere: the
# optimizer (its schedule) is static in the jitted train step, so every test reuses one compile.
# One backup size (64 of the 128 token rows, the largest default one): the program holds one
# backup branch instead of eight, so the steps trace and compile faster.
TINY_FLAGS = ["--steps", "4", "--model", "tiny", "--implementation", "reference",
              "--batch-size", "4", "--seq-len", "32", "--warmup", "2", "--eval-batches", "2",
              "--log-every", "1", "--l1-coeff", "0.01", "--backup-rows", "64"]


# ------------------------------------------------------------------------------------------
# Data.


def test_corpus_split(train, text_dir):
    tok = data.ByteTokenizer()
    corpus = data.load_corpus(str(text_dir), tok, heldout_fraction=0.2)
    files = sorted(p for p in text_dir.rglob("doc*.txt"))
    held = [p for p in files if data.is_heldout(p.relative_to(text_dir).as_posix(), 0.2)]
    assert 0 < len(held) < len(files)
    total = sum(p.stat().st_size + 1 for p in files)  # + 1 separator per file
    assert len(corpus.train) + len(corpus.heldout) == total
    assert len(corpus.heldout) == sum(p.stat().st_size + 1 for p in held)
    for stream in (corpus.train, corpus.heldout):
        assert stream.dtype == np.uint8
        assert b"never read" not in stream.tobytes()
        assert b"\x01\x02" not in stream.tobytes()  # the binary file was skipped
    # The held-out stream is the held-out files' bytes, in order, each followed by byte 0.
    assert corpus.heldout.tobytes() == b"".join(p.read_bytes() + b"\0" for p in held)
    again = data.load_corpus(str(text_dir), tok, heldout_fraction=0.2)
    np.testing.assert_array_equal(again.train, corpus.train)


def test_sample_batch_deterministic(train, text_dir):
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    a = train.sample_batch(corpus.train, 3, 16, seed=7, step=5)
    b = train.sample_batch(corpus.train, 3, 16, seed=7, step=5)
    assert a.shape == (3, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, train.sample_batch(corpus.train, 3, 16, seed=7, step=6))
    assert not np.array_equal(a, train.sample_batch(corpus.train, 3, 16, seed=8, step=5))
    assert not np.array_equal(a, train.sample_batch(corpus.train, 3, 16, 7, 5, stream=1))
    stream = corpus.train.tobytes()
    for row in a:  # every window is a contiguous piece of the stream
        assert bytes(row.astype(np.uint8)) in stream
    with pytest.raises(ValueError, match="need more than"):
        train.sample_batch(corpus.train[:10], 1, 16, 0, 0)


def test_token_files(train, tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 300
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.bin"):
        corpus = data.load_corpus(str(tmp_path / name), data.ByteTokenizer(), 0.1)
        np.testing.assert_array_equal(corpus.train, tokens[:900])
        np.testing.assert_array_equal(corpus.heldout, tokens[900:])
        assert corpus.vocab_size == 300
    # 300 token ids do not fit the byte-level tiny preset.
    cfg = train.parse_args(TINY_FLAGS)
    with pytest.raises(ValueError, match="vocabulary is 256"):
        train.build(cfg, 300)


def test_default_corpus_is_stdlib(train):
    files = data._text_files(data.default_data_dir(), default=True)
    names = {p.name for p in files}
    assert {"os.py", "argparse.py"} <= names
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


def test_hf_tokenizer_missing(train, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(SystemExit, match="tokenizers"):
        train.make_tokenizer("tokenizer.json")


# ------------------------------------------------------------------------------------------
# Flags.


def test_every_flag_has_help(train):
    for field in dataclasses.fields(train.TrainConfig):
        assert field.metadata.get("help"), field.name


def test_parse_args(train):
    cfg = train.parse_args(TINY_FLAGS + ["--resume", "--steps", "7"])
    assert cfg.resume and cfg.steps == 7 and cfg.seq_len == 32  # the last flag wins
    assert cfg.run_dir == pathlib.Path("runs") / "tiny-reference-l1_0.01"
    defaults = train.parse_args([])
    assert defaults == train.TrainConfig()
    with pytest.raises(SystemExit):
        train.parse_args(["--seq-len", "4096"])  # longer than the tiny preset's 128
    with pytest.raises(SystemExit):
        train.parse_args(["--implementation", "cuda"])
    with pytest.raises(SystemExit):
        train.parse_args(["--pgle-steps", "-2"])
    with pytest.raises(SystemExit):
        train.parse_args(["--backup-rows", "-2"])


@pytest.mark.parametrize("flag, backup_rows", [(None, None), ("0", 0), ("64", 64)])
def test_backup_rows_flag_sets_the_layers_config(train, flag, backup_rows):
    cfg = train.parse_args([] if flag is None else ["--backup-rows", flag])
    model, _ = train.build(cfg, 256)
    assert model.cfg.twell.backup_rows == backup_rows


# ------------------------------------------------------------------------------------------
# Checkpoints and resume.


def _states_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # the fast tier's resume tests restore checkpoints
def test_checkpoint_round_trip(train, text_dir, tmp_path):
    cfg = train.parse_args(TINY_FLAGS + ["--out-dir", str(tmp_path)])
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    model, optimizer = train.build(cfg, corpus.vocab_size)
    batch = train.sample_batch(corpus.train, 4, 32, 0, 0)
    train.train_step(model, optimizer, batch, np.float32(0.01))
    manager = train.checkpoint_manager(tmp_path)
    train.save_checkpoint(manager, 1, model, optimizer)
    fresh_model, fresh_opt = train.build(dataclasses.replace(cfg, seed=1), corpus.vocab_size)
    assert train.restore_checkpoint(manager, fresh_model, fresh_opt) == 1
    _states_equal(nnx.state(fresh_model), nnx.state(model))
    _states_equal(nnx.state(fresh_opt), nnx.state(optimizer))
    assert int(fresh_opt.step[...]) == 1
    manager.close()


def test_train_step_compiles_with_its_compiler_options(train, text_dir):
    """``TrainStep``'s compiler options reach XLA: a value XLA does not know fails the
    step's compilation (the real option is checked against XLA in test_xla_flags)."""
    cfg = train.parse_args(TINY_FLAGS)
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    model, optimizer = train.build(cfg, corpus.vocab_size)
    batch = train.sample_batch(corpus.train, 4, 32, 0, 0)
    (name,) = xla_flags.PIPELINED_ALL_REDUCE
    step = train.TrainStep(model, optimizer, compiler_options={name: "NOT_A_MODE"})
    with pytest.raises(Exception, match=name):
        step(batch, np.float32(0.01))


@pytest.mark.slow  # fast tier: test_sigterm_in_process_saves_and_resumes_exactly resumes exactly
def test_exact_resume(train, text_dir, tmp_path):
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    flags = TINY_FLAGS + ["--ckpt-every", "2", "--eval-every", "0"]
    full = train.parse_args(flags + ["--out-dir", str(tmp_path / "full")])
    split = train.parse_args(flags + ["--out-dir", str(tmp_path / "split")])
    train.train(full, corpus=corpus, quiet=True)
    train.train(split, corpus=corpus, quiet=True, stop_after=2)  # "killed" after step 2
    with pytest.raises(SystemExit, match="--resume"):
        train.train(split, corpus=corpus, quiet=True)
    train.train(dataclasses.replace(split, resume=True), corpus=corpus, quiet=True)
    a = [r for r in train.read_metrics(tmp_path / "full" / "metrics.jsonl") if "loss" in r]
    b = [r for r in train.read_metrics(tmp_path / "split" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-6), ra["step"]
        assert ra["nnz_mean"] == pytest.approx(rb["nnz_mean"], rel=1e-6)
    assert a[-1]["loss"] < a[0]["loss"]


@pytest.mark.slow  # two training runs
def test_profile_guided_steps_train_the_same(train, text_dir, tmp_path):
    """With --pgle-steps the step is compiled again after its profiled steps (on the CPU
    without costs: the mechanism alone); the run's losses are the same as without, and the
    setting ends with the run."""
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    flags = TINY_FLAGS + ["--ckpt-every", "0", "--eval-every", "0"]
    losses = []
    for steps in (0, 2):
        cfg = train.parse_args(flags + ["--pgle-steps", str(steps),
                                        "--out-dir", str(tmp_path / str(steps))])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # no GPU: JAX's profile is empty
            train.train(cfg, corpus=corpus, quiet=True)
        assert not jax.config.jax_enable_pgle
        records = train.read_metrics(tmp_path / str(steps) / "metrics.jsonl")
        losses.append([(r["step"], r["loss"]) for r in records if "loss" in r])
    assert [s for s, _ in losses[0]] == [1, 2, 3, 4]
    assert losses[0] == losses[1]


@pytest.mark.slow  # a second training subprocess
def test_compile_cache_keeps_the_compiled_step(tmp_path):
    """--compile-cache DIR: the run leaves its compiled training step in DIR (JAX's persistent
    cache), which a rerun or --resume loads instead of compiling. A fresh process, as the
    cache is decided at a process's first compilation."""
    cache = tmp_path / "cache"
    script = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "train.py"
    done = subprocess.run([sys.executable, str(script), *TINY_FLAGS, "--steps", "2",
                           "--eval-every", "0", "--ckpt-every", "0", "--out-dir",
                           str(tmp_path / "run"), "--compile-cache", str(cache)],
                          capture_output=True, text=True, timeout=600,
                          env=subprocess_env(TWELL_COMPILE_CACHE=""))
    assert done.returncode == 0, done.stderr[-2000:]
    entries = [p.name for p in cache.iterdir()] if cache.is_dir() else []
    assert any(name.startswith("jit__train_step") for name in entries), entries


def test_main_smoke(train, text_dir, tmp_path, capsys):
    out = tmp_path / "run"
    summary = train.main(TINY_FLAGS + ["--eval-every", "3", "--ckpt-every", "2",
                                       "--data", str(text_dir), "--heldout-fraction", "0.2",
                                       "--out-dir", str(out)])
    records = train.read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "ce" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [3, 4]
    for key in ("loss", "ce", "l1", "nnz_mean", "nnz_max", "heavy_rows", "tokens_per_s",
                "grad_norm"):
        assert key in steps[-1], key
    assert len(steps[-1]["nnz_mean"]) == 2 and len(evals[-1]["dead_frac"]) == 2
    assert "nnz_p99" in steps[-1] and len(evals[-1]["eval_nnz_p99"]) == 2
    # The per-token distribution of the last evaluation: histograms over every held-out token.
    dist = json.loads((out / "nnz_distribution.json").read_text())
    assert dist["step"] == 4 and dist["d_ff"] == 256 and len(dist["layers"]) == 2
    for layer, p99 in zip(dist["layers"], evals[-1]["eval_nnz_p99"]):
        hist = np.asarray(layer["histogram"])
        assert hist.sum() == dist["tokens"] > 0 and len(hist) == layer["max"] + 1
        assert layer["p50"] <= layer["p90"] <= layer["p99"] == p99 <= layer["max"]
        mean = (hist * np.arange(len(hist))).sum() / hist.sum()
        assert layer["mean"] == pytest.approx(mean, abs=1e-3)
    assert (out / "metrics.png").stat().st_size > 1000
    assert json.loads((out / "config.json").read_text())["steps"] == 4
    assert sorted(int(p.name) for p in (out / "ckpt").iterdir() if p.name.isdigit()) == [2, 4]
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    text = capsys.readouterr().out
    assert "held-out loss" in text and "nnz per token" in text


# ------------------------------------------------------------------------------------------
# Stopping, honest resume, errors a person reads.


def _losses(path: pathlib.Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in train_module_read(path) if "loss" in r]


def train_module_read(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_in_process_saves_and_resumes_exactly(train, text_dir, tmp_path, monkeypatch,
                                                      capsys):
    """SIGTERM (and a second signal) arriving during step 2: the step finishes, a checkpoint
    of it is written, one line names it, SystemExit(143); --resume then matches a run that was
    never stopped (the subprocess version: tests/test_preemption.py)."""
    import signal

    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    flags = TINY_FLAGS + ["--ckpt-every", "0", "--eval-every", "0"]
    full = train.parse_args(flags + ["--out-dir", str(tmp_path / "full")])
    stopped = train.parse_args(flags + ["--out-dir", str(tmp_path / "stopped")])
    train.train(full, corpus=corpus, quiet=True)
    sample = train.sample_batch

    def sample_and_signal(*args, **kwargs):
        if args[4] == 1:  # the batch of step 2: the signals arrive while it runs
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
        return sample(*args, **kwargs)

    monkeypatch.setattr(train, "sample_batch", sample_and_signal)
    capsys.readouterr()
    # (SIGINT is ignored where the tests run as a shell script's background job.)
    handler_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as info:
        train.train(stopped, corpus=corpus, quiet=True)
    assert info.value.code == 143
    lines = capsys.readouterr().out.strip().splitlines()
    ckpt = tmp_path / "stopped" / "ckpt" / "2"
    assert lines == [f"stopped by SIGTERM after step 2: checkpoint step 2 in {ckpt}; exit "
                     "status 143 (continue with --resume)"]
    assert ckpt.is_dir()
    assert signal.getsignal(signal.SIGINT) is handler_before  # handlers restored
    monkeypatch.setattr(train, "sample_batch", sample)
    train.train(dataclasses.replace(stopped, resume=True), corpus=corpus, quiet=True)
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "full")
    assert [s for s, _ in _losses(tmp_path / "full")] == [1, 2, 3, 4]


def test_resume_replays_steps_finished_run_and_config_changes(train, text_dir, tmp_path,
                                                              capsys):
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    out = tmp_path / "run"
    cfg = train.parse_args(TINY_FLAGS + ["--ckpt-every", "2", "--eval-every", "0",
                                         "--out-dir", str(out)])
    train.train(cfg, corpus=corpus, quiet=True)
    reference = _losses(out)
    # As if killed after step 4's records but before its checkpoint: steps 3, 4 are replayed
    # and replace their records (one per step), with the same losses.
    import shutil
    shutil.rmtree(out / "ckpt" / "4")
    resume = dataclasses.replace(cfg, resume=True)
    train.train(resume, corpus=corpus, quiet=True)
    assert _losses(out) == reference and [s for s, _ in reference] == [1, 2, 3, 4]
    evals = [r for r in train_module_read(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4]
    # Resuming the finished run: one line with the final metrics, no "None", returns.
    capsys.readouterr()
    summary = train.train(resume, corpus=corpus, quiet=False)
    text = capsys.readouterr().out.strip()
    assert summary["finished"] and summary["eval_loss"] == evals[0]["eval_loss"]
    assert len(text.splitlines()) == 1 and "None" not in text, text
    assert f"already finished: checkpoint at step 4 of --steps 4; held-out loss " \
           f"{evals[0]['eval_loss']:.4f} at step 4; train cross-entropy" in text, text
    # Changed schedule flags: refused, each named with its old and new value.
    changed = dataclasses.replace(resume, l1_coeff=0.5, seed=3, steps=6)
    with pytest.raises(SystemExit, match="flags differ from .*config.json") as info:
        train.train(changed, corpus=corpus, quiet=True)
    for part in ("--l1-coeff: 0.01 -> 0.5", "--steps: 4 -> 6", "--seed: 0 -> 3",
                 "--allow-config-change"):
        assert part in str(info.value), info.value
    # Non-schedule flags may change (recorded); --allow-config-change continues and records.
    shutil.rmtree(out / "ckpt" / "4")
    allowed = dataclasses.replace(resume, l1_coeff=0.02, log_every=2, allow_config_change=True)
    train.train(allowed, corpus=corpus, quiet=True)
    config = json.loads((out / "config.json").read_text())
    assert config["l1_coeff"] == 0.02 and config["changes"] == [
        {"step": 2, "flag": "l1_coeff", "old": 0.01, "new": 0.02},
        {"step": 2, "flag": "log_every", "old": 1, "new": 2}]
    assert [s for s, _ in _losses(out)] == [1, 2, 4]


def test_nonfinite_loss_names_step_and_last_good_checkpoint(train, text_dir, tmp_path):
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    out = tmp_path / "run"
    cfg = train.parse_args(TINY_FLAGS + ["--ckpt-every", "2", "--eval-every", "0",
                                         "--out-dir", str(out)])
    train.train(cfg, corpus=corpus, quiet=True, stop_after=2)
    # A NaN L1 coefficient (a traced argument: the compiled step is reused) poisons step 3.
    bad = dataclasses.replace(cfg, resume=True, l1_coeff=float("nan"), allow_config_change=True)
    with pytest.raises(SystemExit) as info:
        train.train(bad, corpus=corpus, quiet=True)
    message = str(info.value.code)
    assert message.startswith("loss nan, gradient norm nan at step 3: stopping; the last "
                              f"good checkpoint is step 2 in {out / 'ckpt' / '2'}"), message
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.isdigit()) == ["2"]


@pytest.mark.slow  # the refusals; resuming itself is in the fast tier
def test_resume_another_model_or_missing_run(train, text_dir, tmp_path):
    corpus = data.load_corpus(str(text_dir), data.ByteTokenizer(), 0.2)
    out = tmp_path / "run"
    cfg = train.parse_args(TINY_FLAGS + ["--eval-every", "0", "--out-dir", str(out)])
    train.train(cfg, corpus=corpus, quiet=True, stop_after=1)
    other = dataclasses.replace(cfg, model="25m", resume=True)
    with pytest.raises(SystemExit, match="--model: 'tiny' -> '25m'"):
        train.train(other, corpus=corpus, quiet=True)
    with pytest.raises(SystemExit, match="checkpoint of step 1 in .* does not fit the model"):
        train.train(dataclasses.replace(other, allow_config_change=True), corpus=corpus,
                    quiet=True)
    with pytest.raises(SystemExit, match="does not exist"):
        train.train(dataclasses.replace(cfg, resume=True, out_dir=str(tmp_path / "none")),
                    corpus=corpus, quiet=True)


@pytest.mark.parametrize("script, args, message", [
    ("train", ["--resume", "--out-dir", "/nonexistent/run"], "--resume: /nonexistent/run does "
     "not exist"),
    ("train", ["--data", "/nonexistent/texts", "--out-dir", "{tmp}/r"], "--data "
     "/nonexistent/texts does not exist"),
    ("generate", ["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: not a train.py "
     "run folder"),
    ("generate", ["--hf", "{tmp}"], "config.json not found"),
])
def test_scripts_fail_with_one_line(tmp_path, script, args, message):
    """Expected failures end with one line on stderr, exit status 1, no traceback."""
    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / f"{script}.py"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(TWELL_COMPILE_CACHE=""))
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [l for l in done.stderr.splitlines() if l.strip() and "WARNING" not in l]
    assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
