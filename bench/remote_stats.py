"""The statistics of ``scripts/bench_remote.py``: :class:`Figure` (one figure's per-run
values, their median and spread min-max, as the report writes them), and what the parts
share to measure with: the block keys (:func:`block_keys`) and ``KiB``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tierd.keys import BlockKey

KiB = 1 << 10


@dataclass
class Figure:
    """One figure's per-run values (each run's median)."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def text(self, scale: float = 1.0, digits: int = 3) -> str:
        lo, hi = min(self.runs) * scale, max(self.runs) * scale
        return f"{self.median * scale:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def block_keys(tag: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{tag}-{i}".encode()) for i in range(count)]
