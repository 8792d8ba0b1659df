"""The shipped systemd unit (``config/tierd.service``) and a parser for its sections."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "config" / "tierd.service"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), with continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        sections[section][key.strip()].append(value.strip())
    return sections
