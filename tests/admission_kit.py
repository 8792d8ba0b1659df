"""Admission tests' inputs: a request trace written as Mooncake JSON lines and a chain config
(CPU over disk) that admits by a given rule."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# CPU holds 2 blocks. Key 1 is used by requests 1 and 2, key 2 by request 1 only; request
# 3 pushes both down to disk; requests 4 and 5 ask for them again.
REQUESTS = [[1, 2], [1], [3, 4], [1], [2]]


def write_trace(path: Path, requests: Sequence[Sequence[int]] = REQUESTS) -> Path:
    lines = [
        json.dumps({"timestamp": t, "input_length": 1, "output_length": 1, "hash_ids": ids})
        for t, ids in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def chain_yaml(tmp_path: Path, admission: str, cpu: int = 2, disk: int = 8) -> Path:
    """A chain of ``cpu`` blocks over ``disk`` blocks that admits by ``admission``."""
    directory = tmp_path / "disk"
    directory.mkdir(exist_ok=True)
    path = tmp_path / "chain.yaml"
    path.write_text(
        "block_bytes: 4096\n"
        "tiers:\n"
        f"  - {{name: cpu, kind: cpu, capacity: {cpu}}}\n"
        f"  - {{name: disk, kind: disk, capacity: {disk}, directories: ['{directory}'],"
        f" admission: '{admission}'}}\n"
    )
    return path
