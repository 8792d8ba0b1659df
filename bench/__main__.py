"""The one command of the benchmarks: ``list`` names every entry bench with its
description; ``NAME [ARGS...]`` runs ``bench.NAME.main(ARGS)``. Descriptions are read
from the sources, so listing imports no bench (some need another venv)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

from bench import HELPERS

HERE = Path(__file__).resolve().parent


def entry_names() -> list[str]:
    """Every module of bench/ that is an entry bench, sorted."""
    names = (p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_"))
    return sorted(n for n in names if n not in HELPERS)


def description(name: str) -> str:
    """The first sentence of the module's docstring, read without importing it."""
    tree = ast.parse((HERE / f"{name}.py").read_text(encoding="utf-8"))
    paragraph = (ast.get_docstring(tree) or "").strip().split("\n\n")[0]
    text = " ".join(paragraph.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def list_benches() -> int:
    names = entry_names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {description(name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "list"):
        if not args or args[0] != "list":
            print("usage: scripts/bench list | scripts/bench NAME [ARGS...]")
            return 0 if args else 2
        return list_benches()
    name, rest = args[0], args[1:]
    if name not in entry_names():
        known = ", ".join(entry_names())
        print(f"scripts/bench: no bench named {name!r}; the benches: {known}", file=sys.stderr)
        return 2
    sys.argv = [f"scripts/bench {name}", *rest]
    module = importlib.import_module(f"bench.{name}")
    status = module.main(rest)
    return int(status or 0)


if __name__ == "__main__":
    raise SystemExit(main())
