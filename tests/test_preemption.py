"""experiments/train.py under fire: killed with SIGKILL at random points and resumed, it ends
with the parameters and per-step losses of an uninterrupted run (bit for bit: the same
programs on the same inputs from the same state, loaded from the same compile cache), one
metrics record per step; stopped with SIGTERM, it saves, names the checkpoint in one line and
exits with 143.

Each run is a subprocess sharing one compile cache, so only the first compiles."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.utils import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "train.py"
STEPS = 200
CKPT_EVERY = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A small text corpus, a shared compile cache and the uninterrupted reference run."""
    root = tmp_path_factory.mktemp("preemption")
    texts = root / "texts"
    texts.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sparse", "tile", "ell", "jax", "\n"]
    for i in range(20):
        (texts / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=300)) + "\n")
    flags = ["--model", "tiny", "--implementation", "reference", "--steps", str(STEPS),
             "--batch-size", "4", "--seq-len", "32", "--warmup", "10", "--eval-every", "0",
             "--eval-batches", "1", "--ckpt-every", str(CKPT_EVERY), "--log-every", "1",
             "--data", str(texts), "--heldout-fraction", "0.2",
             "--compile-cache", str(root / "cache")]
    reference = root / "reference"
    proc = start(flags, reference)
    assert proc.wait(timeout=600) == 0, output(reference)
    return {"root": root, "flags": flags, "reference": reference}


def start(flags: list[str], out: pathlib.Path, *extra: str) -> subprocess.Popen:
    """train.py in a subprocess, its output (the progress bar too) into out.log: a pipe
    nobody reads would fill up and stop it."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "a")
    env = subprocess_env(JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, str(SCRIPT), *flags, "--out-dir", str(out), *extra],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def output(out: pathlib.Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")


def last_step(out: pathlib.Path) -> int:
    """The newest step in metrics.jsonl (0 if none), tolerating a line being written."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass
    return max(steps)


def wait_for_step(proc: subprocess.Popen, out: pathlib.Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while last_step(out) < step:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n" + output(out)[-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached:\n" + output(out)[-3000:]
        time.sleep(0.02)


def records(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_parameters(out: pathlib.Path) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp
    import jax

    state = ocp.StandardCheckpointer().restore((out / "ckpt" / str(STEPS) / "model").absolute())
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def assert_same_run(out: pathlib.Path, reference: pathlib.Path) -> None:
    """Per-step losses (one record per step) and final parameters equal, bit for bit."""
    ours, theirs = records(out), records(reference)
    train = [r for r in ours if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in ("loss", "ce", "l1", "grad_norm", "nnz_mean"):
        assert [r[key] for r in train] == [r[key] for r in theirs if "loss" in r], key
    evals = lambda rs: [(r["step"], r["eval_loss"]) for r in rs if "eval_loss" in r]
    assert evals(ours) == evals(theirs) and evals(ours)[-1][0] == STEPS
    a, b = final_parameters(out), final_parameters(reference)
    assert sorted(a) == sorted(b) and a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow  # subprocesses: a reference run and three killed ones; in-process: test_train
def test_sigkill_at_three_random_points_then_resume_matches(setup):
    out = setup["root"] / "chaos"
    rng = np.random.default_rng(1234)
    # One kill in each third of the run, at a random step, then a random delay.
    thirds = np.linspace(3, STEPS - 3, 4).astype(int)
    targets = [int(rng.integers(lo, hi)) for lo, hi in zip(thirds[:-1], thirds[1:])]
    for i, target in enumerate(targets):
        proc = start(setup["flags"], out, *(["--resume"] if i else []))
        wait_for_step(proc, out, target, timeout=300)
        time.sleep(float(rng.uniform(0, 0.05)))  # land anywhere in a step or a save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    proc = start(setup["flags"], out, "--resume")
    assert proc.wait(timeout=300) == 0, output(out)[-3000:]
    assert_same_run(out, setup["reference"])
    # A save cut short leaves a temporary folder: the next run removed it.
    assert not [p.name for p in (out / "ckpt").iterdir() if "tmp" in p.name]
    # Then a resume of the finished run: one line, exit 0.
    proc = start(setup["flags"], out, "--resume")
    assert proc.wait(timeout=300) == 0
    assert "already finished: checkpoint at step 200" in output(out)


@pytest.mark.slow  # the reference run and 2 more processes; in-process: tests/test_train.py
def test_sigterm_saves_names_the_checkpoint_and_exits_143(setup):
    out = setup["root"] / "sigterm"
    proc = start(setup["flags"], out)
    wait_for_step(proc, out, 33, timeout=300)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # a second signal, during the step or the save: ignored
    assert proc.wait(timeout=120) == 143, output(out)[-3000:]
    lines = [l for l in output(out).splitlines() if l.startswith("stopped by")]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM after step "), lines
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert step >= 33 and f"checkpoint step {step} in {out / 'ckpt' / str(step)}" in lines[0]
    assert (out / "ckpt" / str(step)).is_dir() and "exit status 143" in lines[0]
    proc = start(setup["flags"], out, "--resume")
    assert proc.wait(timeout=300) == 0, output(out)[-3000:]
    assert f"resumed from step {step}" in output(out)
    assert_same_run(out, setup["reference"])


def test_the_first_signal_to_arrive_wins_when_both_are_pending():
    """Python runs pending handlers in signal-number order (SIGINT before SIGTERM); the stop
    signal is the first to arrive, read from the wakeup fd: here SIGTERM, then SIGINT, written
    as the C-level handler writes them, and the handlers run in Python's order."""
    from twell_jax.preemption import StopSignals

    # SIGINT handled on entry, as in a foreground process (a background job of a shell script
    # starts with it ignored, which StopSignals keeps: the next test).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as signals:
            os.write(signals._pipe[1], bytes([signal.SIGTERM, signal.SIGINT]))
            signals._record(signal.SIGINT, None)
            signals._record(signal.SIGTERM, None)
            assert signals.received[0] == signal.SIGTERM
            assert signals.agreed() == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGINT)  # a real signal while installed: recorded
            time.sleep(0.05)
            assert signals.received[-1] == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_signal_ignored_on_entry_stays_ignored():
    """A process started with SIGINT ignored (a background job of a shell without job
    control): StopSignals leaves it ignored, still records SIGTERM, and restores both."""
    from twell_jax.preemption import StopSignals

    before_term = signal.getsignal(signal.SIGTERM)
    before_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)  # ignored: not recorded, nothing raised
            time.sleep(0.05)
            assert signals.received == [] and signals.agreed() is None
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert signals.received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is before_term
    finally:
        signal.signal(signal.SIGINT, before_int)
