"""twell_jax.cli: the commit a benchmark's header names; flags' help; the compile cache's
loads."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.utils import subprocess_env
from twell_jax import cli


def test_commit_names_head_and_says_when_the_tree_differs(tmp_path, monkeypatch):
    monkeypatch.delenv("TWELL_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *args: subprocess.run(["git", *args], cwd=repo, check=True, text=True,
                                       capture_output=True).stdout.strip()
    git("init", "-q")
    (repo / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    monkeypatch.chdir(repo)
    assert cli.commit() == head
    (repo / "notes.txt").write_text("untracked files do not count\n")
    assert cli.commit() == head
    (repo / "kernel.py").write_text("a = 2\n")
    assert cli.commit() == head + "+changes"
    monkeypatch.setenv("TWELL_COMMIT", "abc1234")
    assert cli.commit() == "abc1234"


def test_commit_outside_a_repository_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("TWELL_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cli.commit() == "unknown"


def test_help_prints_a_percent_sign_as_written():
    """A flag's help may say "%": ``--help`` prints it (argparse would otherwise read it as a
    format and fail), and the defaults are still shown."""
    import dataclasses

    @dataclasses.dataclass
    class Flags:
        densities: str = cli.flag("0.5,2", "active units, in % of F")

    text = cli.flag_parser(Flags, "test").format_help()
    assert "in % of F" in " ".join(text.split())
    assert "(default: 0.5,2)" in " ".join(text.split())


def test_cache_loads_counter_counts_programs_loaded_from_the_persistent_cache(tmp_path):
    """``cache_loads_counter``: a process that compiles its programs into an empty cache folder
    counts no load; a second process compiling the same programs loads them, and counts them.
    Fresh processes, as JAX decides at a process's first compilation whether it uses the
    cache. The header names the folder."""
    program = (
        "import json, jax, jax.numpy as jnp\n"
        "from twell_jax import cli\n"
        "loads = cli.cache_loads_counter()\n"
        "x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64)\n"
        "jax.jit(lambda a: jnp.sin(a) @ a.T)(x).block_until_ready()\n"
        "print(json.dumps([loads(), cli.compile_cache_dir(),\n"
        "                  cli.header('t')['compile_cache_dir']]))\n")
    cache = tmp_path / "cache"
    env = subprocess_env(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu",
                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                         JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (first, folder, named), (second, _, _) = runs
    assert first == 0 and folder == named == str(cache)
    entries = list(cache.iterdir())
    assert 1 <= second <= len(entries), (second, entries)
