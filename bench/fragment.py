"""The one way a bench hands back its markdown fragment: printed, and written to its file
(by default docs/bench/<name>.md, the fragment docs/BENCHMARKS.md links to)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "bench"


def default_out(name: str) -> Path:
    """Where bench ``name`` writes its fragment unless told otherwise."""
    return DOCS / f"{name}.md"


def write_fragment(text: str, out: Path | str | None, *, show: bool = True) -> None:
    """Print ``text`` (unless ``show`` is false) and, where ``out`` is given, write it there
    (its folder made), saying so on stderr."""
    if show:
        print(text)
    if out is None:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
