"""The PNG of ``tierd simulate TRACE --curve --out FILE.png``: the LRU hit ratio against
the capacity (log scale, in blocks), with each tier of a config marked at its cumulative
capacity (tier 1 at its own size, tier 2 at the sum of both, ...): the hit ratio one LRU
tier of that much room gets, a guide to what the tiers down to that one hold together.

matplotlib (the ``plots`` extra) is imported only here, on the Agg canvas, as in
:mod:`tierd.workload.plots`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierd.workload.curve import HitRatioCurve
from tierd.workload.plots import _matplotlib

__all__ = ["TierMark", "tier_marks", "write_curve_plot"]

_DPI = 100
_POINTS = 800  # capacities drawn, spread evenly on the log axis


@dataclass(frozen=True, slots=True)
class TierMark:
    """A tier of a config on the curve: its own size and the sum up to it (blocks), and
    the hit ratio there (``None`` below the curve's first capacity)."""

    name: str
    blocks: int
    cumulative: int
    hit_ratio: float | None


def tier_marks(curve: HitRatioCurve, tiers: Sequence[tuple[str, int]]) -> list[TierMark]:
    """Marks for ``(name, blocks)`` tiers, fastest first."""
    marks = []
    total = 0
    for name, blocks in tiers:
        total += blocks
        ratio = curve.hit_ratio(total) if total >= curve.min_capacity else None
        marks.append(TierMark(name, blocks, total, ratio))
    return marks


def write_curve_plot(
    curve: HitRatioCurve, path: Path, marks: Sequence[TierMark] = (), title: str = ""
) -> Path:
    """Draw the curve (and ``marks``) into the PNG at ``path``; raises
    :class:`RuntimeError` without matplotlib and :class:`OSError` if it cannot be
    written."""
    FigureCanvasAgg, Figure = _matplotlib()
    low, high = curve.min_capacity, curve.unique_blocks
    right = max([high, *(m.cumulative for m in marks)])
    xs = _log_spaced(low, right)
    ys = [100 * curve.hit_ratio(x) for x in xs]
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(xs, ys, color="tab:blue", label="LRU")
    ax.set_xscale("log")
    ax.set_xlim(low, right * 1.05)
    ax.set_ylim(0, max(5.0, max(ys) * 1.15))
    ax.set_xlabel("capacity (blocks, log scale)")
    ax.set_ylabel("block hit ratio (%)")
    ax.set_title(title or "LRU hit ratio by capacity")
    ax.grid(alpha=0.3, which="both")
    ax.axvline(high, color="grey", linestyle=":", linewidth=1)
    ax.annotate(
        f"{high:,} unique blocks",
        (high, 0.02),
        xycoords=("data", "axes fraction"),
        rotation=90,
        ha="right",
        va="bottom",
        color="grey",
        fontsize=8,
    )
    for index, mark in enumerate(marks):
        if mark.hit_ratio is None:
            continue
        color = f"C{(index + 1) % 10}"
        ax.axvline(mark.cumulative, color=color, linestyle="--", linewidth=1)
        ax.plot([mark.cumulative], [100 * mark.hit_ratio], "o", color=color)
        ax.annotate(
            f"{mark.name}: {mark.cumulative:,} blocks, {mark.hit_ratio:.3f}",
            (mark.cumulative, 100 * mark.hit_ratio),
            textcoords="offset points",
            xytext=(4, -12 - 12 * index),
            color=color,
            fontsize=9,
        )
    fig.text(
        0.99,
        0.01,
        f"{curve.requests:,} requests, {curve.block_accesses:,} block accesses",
        ha="right",
        va="bottom",
        fontsize=8,
        color="grey",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=_DPI)
    return path


def _log_spaced(low: int, high: int) -> list[int]:
    """Up to :data:`_POINTS` distinct capacities from ``low`` to ``high``, both included,
    evenly spaced on a log scale."""
    if high <= low:
        return [low]
    ratio = (high / low) ** (1 / (_POINTS - 1))
    return sorted({low, high, *(min(high, int(low * ratio**i)) for i in range(_POINTS))})
