"""The documentation's promises: its runnable examples run, and no prose points outside the
repository or at numbered experiment runs.

(a) Every code block whose info string is ``python runnable`` in README.md and docs/*.md is
    executed on the CPU in a fresh namespace (each block is self-contained).
(b) No comment or docstring in the library code cites an experiment run by number (the word
    "run" or "runs", then a number): the dated log under benchmarks/ holds that history, and
    code states the reason itself.
(c) Every relative link in README.md and docs/ resolves to a file or folder inside the
    repository, and every Markdown file they name in backticks exists in it.
(d) No code, script, document or saved run configuration names a path outside the repository
    (the raw benchmark records keep the command lines they ran with).
(e) Every raw result file the documents and the log name in full (``2026-...jsonl``) is in
    benchmarks/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = [ROOT / "twell_jax", ROOT / "pallas_kernels"]

_FENCE = re.compile(r"^```python runnable[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_RUN_CITATION = re.compile(r"\bruns? \d+", re.IGNORECASE)
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_MARKDOWN_NAME = re.compile(r"`([\w./-]+\.md)`")
# Written in pieces so that this file does not match itself.
_OUTSIDE_PATH = re.compile("|".join([r"\.\./" + "shared", r"(?<![\w.])/" + "tmp/", r"/" + "work/"]))
_TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".json", ".cfg", ".txt", ".yml", ".yaml"}


def runnable_blocks() -> list[tuple[str, str]]:
    """(label, code) of every ``python runnable`` block, in file order."""
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = runnable_blocks()


def test_docs_have_runnable_blocks():
    assert (ROOT / "docs").is_dir()
    assert BLOCKS, "no ```python runnable blocks found in README.md or docs/"


@pytest.mark.parametrize("code", [code for _, code in BLOCKS],
                         ids=[label for label, _ in BLOCKS])
def test_runnable_block(code):
    namespace = {"__name__": "__docs__"}
    exec(compile(code, "<docs block>", "exec"), namespace)


def test_no_run_citations_in_library_code():
    offenders = []
    for folder in CODE_DIRS:
        for path in sorted(folder.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _RUN_CITATION.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "experiment runs cited in code:\n" + "\n".join(offenders)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_reference_nothing_outside_the_repository(path):
    text = path.read_text()
    bad = []
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (path.parent / target).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            bad.append(f"link {target}")
    markdown_files = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    for name in _MARKDOWN_NAME.findall(text):
        if not ((path.parent / name).exists() or (ROOT / name).exists()
                or Path(name).name in markdown_files):
            bad.append(f"file {name}")
    assert not bad, f"{path.relative_to(ROOT)} points outside the repository: {bad}"


def test_nothing_names_a_path_outside_the_repository():
    folders = ["twell_jax", "pallas_kernels", "experiments", "tools", "tests", "docs", "results",
               ".ci"]
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "benchmarks" / "LOG.md"]
    for folder in folders:
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.is_file() and (p.suffix in _TEXT_SUFFIXES or p.parent.name == ".ci")]
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in files if "__pycache__" not in path.parts
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 if _OUTSIDE_PATH.search(line)]
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


_RAW_FILE = re.compile(r"`(\d{4}-\d\d-\d\d_[\w.-]+\.(?:jsonl|png|log))`")


@pytest.mark.parametrize("path", [*DOCS, ROOT / "benchmarks" / "LOG.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_named_raw_results_exist(path):
    missing = sorted({name for name in _RAW_FILE.findall(path.read_text())
                      if not (ROOT / "benchmarks" / name).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names results not in benchmarks/: {missing}"
