"""``scripts/bench``, the one command of the benchmarks: ``list`` names every entry bench
of bench/ (not its helper modules) with a description, an unknown name is a one-line error
with exit 2, and a cheap bench runs end to end through it and writes its fragment."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ROOT / "scripts" / "bench"
PACKAGE = ROOT / "bench"


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(COMMAND), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )


def helper_names() -> set[str]:
    """bench.HELPERS, read from the source as a set of string literals."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "HELPERS":
            return {n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant)}
    raise LookupError("bench/__init__.py has no HELPERS")


def test_list_names_every_entry_bench_and_no_helper() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    helpers = helper_names()
    assert helpers < modules, helpers - modules
    done = run("list")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert set(listed) == modules - helpers
    for name, line in listed.items():
        assert len(line.split()) > 1, f"{name} has no description"
        source = (PACKAGE / f"{name}.py").read_text(encoding="utf-8")
        assert "def main(argv: list[str] | None = None) -> int:" in source, name


def test_an_unknown_name_is_a_one_line_error_with_status_2() -> None:
    done = run("nosuch")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "nosuch" in lines[0] and "io" in lines[0]
    assert "Traceback" not in done.stderr


def test_the_io_bench_runs_through_the_command_and_writes_its_fragment(tmp_path: Path) -> None:
    out = tmp_path / "io.md"
    done = run("io", "--quick", "--parts", "memory", "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text(encoding="utf-8")
    assert "| case | block | engine GB/s | baseline GB/s | ratio |" in text
    assert "cpu -> memory" in text
