"""docs/architecture.md's layer table is the import-linter contract that ``lint-imports``
(``scripts/check``) enforces: the same modules, in the same order, so the map cannot go
untrue while the check passes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def contract_layers() -> list[set[str]]:
    """The ``tierd layers`` contract's layers, lowest first, as sets of module names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (layers,) = [
        c["layers"]
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and "containers" not in c
    ]
    return [
        {m.strip().removeprefix("tierd.") for m in layer.split("|")} for layer in reversed(layers)
    ]


def documented_layers() -> list[set[str]]:
    """The table's rows, lowest first: each row's modules are the names it opens with,
    before any parenthesis (what follows explains them)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", text, flags=re.MULTILINE)
    layers = []
    for number, cells in rows:
        assert int(number) == len(layers), f"layer {number} out of order"
        named = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", cells)
        layers.append({m.rstrip("/") for m in re.findall(r"`([a-z_]+/?)`", named)})
    return layers


def test_the_layer_table_is_the_contract() -> None:
    assert documented_layers() == contract_layers()


def test_every_package_is_on_the_map() -> None:
    """Every module and package of ``tierd`` is in the layer table or named as a leaf."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    mapped = set().union(*documented_layers())
    leaves = set(
        re.findall(
            r"`([a-z_]+)/?`",
            text.split("are leaves any layer may use")[0].rsplit("Modules outside it", 1)[1],
        )
    )
    names = {p.stem for p in (ROOT / "tierd").glob("*.py")} | {
        p.name for p in (ROOT / "tierd").iterdir() if (p / "__init__.py").exists()
    }
    names -= {"__init__", "__main__"}
    assert names <= mapped | leaves, sorted(names - mapped - leaves)
