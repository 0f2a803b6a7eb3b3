"""The toolkit the experiment scripts share: dataclass flags, the run header, JAX's compile
cache (its folder, and the programs loaded from it), the timer summary and the main/worker
dispatch of the benchmarks that run one subprocess per measurement.

Importing it sets the XLA flag the sparse FFN's route switches want (``twell_jax.xla_flags``),
so a script imports it before its first computation.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Callable, Sequence

import jax
import numpy as np

from twell_jax import xla_flags

# Before any computation: the sparse FFN's route switches run on the device, not through a
# host round trip each (``twell_jax.xla_flags``). Worker subprocesses inherit it.
xla_flags.use_device_conditionals()


# The scripts' default --compile-cache; the environment's TWELL_COMPILE_CACHE replaces it
# ('' turns the cache off: the test suite's setting, tests/conftest.py).
DEFAULT_COMPILE_CACHE = os.environ.get("TWELL_COMPILE_CACHE", "~/.cache/twell_jax/jax")


def use_compile_cache(path: str) -> None:
    """Keeps the programs XLA compiles from now on in the folder ``path`` ('' to not), so a
    rerun, or a run resumed after an interruption, loads them instead of compiling again (JAX's
    persistent compilation cache; programs that compile in under a second are not kept). The
    sparse models compile slowly: the 2b training step took 211-269 s to compile on the H100.
    Call it before the first computation: JAX decides at its
    first compilation whether a process uses the cache."""
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))


# The event JAX records each time it loads a program from its persistent compilation cache.
CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_hits"
_cache_loads = 0
_counting_cache_loads = False


def _count_cache_load(event: str, **_) -> None:
    global _cache_loads
    if event == CACHE_LOAD_EVENT:
        _cache_loads += 1


def cache_loads_counter() -> Callable[[], int]:
    """A function returning how many programs this process has loaded from JAX's persistent
    compilation cache since this call. A benchmark records it because a loaded program is not
    always as fast as the same one compiled in the process (a batched decode loop loaded from
    the cache ran 5-6% slower on an H200: the same kernels, more idle time between them)."""
    global _counting_cache_loads
    if not _counting_cache_loads:
        jax.monitoring.register_event_listener(_count_cache_load)
        _counting_cache_loads = True
    start = _cache_loads
    return lambda: _cache_loads - start


def flag(default, help: str, **kwargs) -> dataclasses.Field:
    """A dataclass field that ``flag_parser`` turns into ``--field-name`` (kwargs such as
    ``choices`` go to ``add_argument``). The help is plain text: a ``%`` in it is printed as
    written (argparse would read it as a format)."""
    return dataclasses.field(default=default,
                             metadata={"help": help.replace("%", "%%"), **kwargs})


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Flag defaults in the help, the epilog's line breaks kept."""


def flag_parser(config_cls, description: str, *, underscore_aliases: bool = False,
                epilog: str | None = None) -> argparse.ArgumentParser:
    """A parser with one flag per field of a dataclass of defaults (fields made by ``flag``):
    ``--field-name``, typed by the default; bools get ``--x / --no-x``; tuples take one or more
    values (parsed back as lists). ``underscore_aliases`` also accepts ``--field_name``;
    ``epilog`` is printed after the flags, as written."""
    parser = argparse.ArgumentParser(description=description, epilog=epilog,
                                     formatter_class=_HelpFormatter)
    for field in dataclasses.fields(config_cls):
        flags = ["--" + field.name.replace("_", "-")]
        if underscore_aliases and "_" in field.name:
            flags.append("--" + field.name)
        kwargs = dict(field.metadata, dest=field.name, default=field.default)
        if isinstance(field.default, bool):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
        elif isinstance(field.default, tuple):
            parser.add_argument(*flags, nargs="+", **{**kwargs, "default": list(field.default)})
        else:
            parser.add_argument(*flags, type=type(field.default), **kwargs)
    return parser


def commit() -> str:
    """TWELL_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git),
    else git's HEAD, with "+changes" when tracked files differ from it (a result from an
    uncommitted tree says so)."""
    if os.environ.get("TWELL_COMMIT"):
        return os.environ["TWELL_COMMIT"]
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        changed = git("diff", "--quiet", "HEAD").returncode == 1
        return head.stdout.strip() + ("+changes" if changed else "")
    except OSError:
        return "unknown"


def header(command: str, **fields) -> dict:
    """The first JSON-lines row of a run: date, device, jax version, commit, command line,
    XLA_FLAGS (they change what XLA compiles), JAX's persistent compilation cache folder (None:
    none; programs loaded from one may run slower, ``cache_loads_counter``), then ``fields`` (a
    script's config, ...)."""
    return {"kind": "header", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "commit": commit(), "command": command, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "compile_cache_dir": compile_cache_dir(), **fields}


def compile_cache_dir() -> str | None:
    """The folder of JAX's persistent compilation cache (``jax_compilation_cache_dir``, or the
    JAX_COMPILATION_CACHE_DIR environment variable), None when there is none."""
    return jax.config.jax_compilation_cache_dir or None


def summarize_ms(samples: Sequence[float]) -> dict:
    """Median and spread (10th, 90th percentile) of timings in ms."""
    samples = np.asarray(samples)
    return {"median_ms": float(np.median(samples)), "p10_ms": float(np.percentile(samples, 10)),
            "p90_ms": float(np.percentile(samples, 90))}


# ------------------------------------------------------------------------------------------
# One subprocess per measurement: the driver runs ``script --worker SPEC`` and collects the
# lines it prints as ``RESULT {json}``.


def parse_driver_args(config_cls, description: str, argv: Sequence[str] | None):
    """``flag_parser``'s flags plus the internal ``--worker SPEC``: returns ``(config, worker
    spec or None, parser)`` (the parser for the script's own checks and errors)."""
    parser = flag_parser(config_cls, description)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: JSON spec
    args = vars(parser.parse_args(argv))
    worker = args.pop("worker")
    return config_cls(**args), worker, parser


def main_or_worker(argv: Sequence[str] | None, parse_args: Callable,
                   tasks: dict[str, Callable], drive: Callable) -> list[dict]:
    """A driver script's main: with ``--worker SPEC`` runs that task (``run_task``) and returns
    []; else ``drive(cfg, argv)``. ``parse_args(argv)`` -> ``(cfg, worker spec or None)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, worker = parse_args(argv)
    if worker is not None:
        run_task(worker, cfg, tasks)
        return []
    return drive(cfg, argv)


def run_task(worker: str, cfg, tasks: dict[str, Callable]) -> None:
    """Inside a worker: runs ``tasks[spec["task"]](spec, cfg, emit)`` for the JSON ``worker``
    spec, ``emit`` printing each result row for the driver."""
    spec = json.loads(worker)
    emit = lambda row: print("RESULT " + json.dumps(row), flush=True)
    tasks[spec["task"]](spec, cfg, emit)


def progress(text: str) -> None:
    """Inside a worker: a line the driver logs as it arrives, with the worker's elapsed time
    (where a long worker is, should it run out of time)."""
    print("PROGRESS " + text, flush=True)


def run_worker(script: str, spec: dict, argv: Sequence[str], log) -> list[dict]:
    """Runs one worker subprocess of ``script``; returns its result rows (an error row if it
    failed). Result rows and calibration lines are logged as they arrive."""
    cmd = [sys.executable, os.path.abspath(script), *argv, "--worker", json.dumps(spec)]
    # The worker imports the twell_jax the driver runs: a checkout's goes on its path (an
    # installed package is on it already).
    env = dict(os.environ)
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(checkout, "pyproject.toml")):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    rows, tail = [], []
    for line in proc.stdout:
        if line.startswith("RESULT "):
            rows.append(json.loads(line[len("RESULT "):]))
            log(json.dumps(rows[-1]))
        else:
            tail = (tail + [line.rstrip()])[-20:]
            if line.startswith("  calibrated"):
                log(line.rstrip())
            elif line.startswith("PROGRESS "):
                log(f"  [{time.perf_counter() - t0:.0f} s] {line[len('PROGRESS '):].rstrip()}")
    if proc.wait() != 0:
        rows.append({"kind": "error", **spec, "returncode": proc.returncode,
                     "output_tail": "\n".join(tail)})
        log(f"worker failed ({proc.returncode}):\n" + "\n".join(tail))
    what = [spec["task"], spec["preset"], spec.get("implementation", ""), spec.get("label", "")]
    log(f"[{time.perf_counter() - t0:.0f} s] " + " ".join(filter(None, what)))
    return rows


def run_specs(script: str, specs: list[dict], argv: Sequence[str], out, run_commit: str,
              log) -> list[dict]:
    """Runs the workers of ``specs`` in order, appending their rows (stamped with the run's
    commit) to the open JSON-lines file ``out``; stops after a failed calibration (the
    measurements need its biases). Returns the rows."""
    rows = []
    for spec in specs:
        new = run_worker(script, spec, argv, log)
        for row in new:
            out.write(json.dumps({**row, "commit": run_commit}) + "\n")
        out.flush()
        rows += new
        if spec["task"] == "calibrate" and any(r["kind"] == "error" for r in new):
            break
    return rows
