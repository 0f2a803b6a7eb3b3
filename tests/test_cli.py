"""twell_jax.cli: the commit a benchmark's header names; flags' help."""

from __future__ import annotations

import subprocess

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
