"""PNG plots of a replay summary (the dict of ``ReplaySummary.to_dict()``).

:func:`write_plots` draws three figures into a folder:

- ``hit_ratio.png``: the cumulative hit ratio per medium and in total over time, and the
  same between consecutive samples (a windowed view that shows warm-up and phase changes);
- ``load_latency.png``: the ECDF of load latency per source medium (log-x, in ms), with
  p50 and p99 marked;
- ``occupancy.png``: each tier's used share of its capacity over time.

:func:`write_compare_plot` draws several replays of one trace (``tierd replay --compare``)
on the same axes: the cumulative hit ratio over the requests replayed, one line per
config, and the final hit ratio per medium, one bar per config.

A figure without data (an empty timeline, one sample for the windowed panel, no loads)
still comes out, as a valid PNG that says "no data", so a report never has a hole.

matplotlib is an optional extra (``pip install 'tierd[plots]'``) and is imported only when
plots are drawn; figures are built with the object API on the Agg canvas, never pyplot,
so drawing keeps no global state and works in any thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["MISSING_MATPLOTLIB", "CompareSeries", "write_compare_plot", "write_plots"]

MISSING_MATPLOTLIB = "matplotlib is needed for plots: pip install 'tierd[plots]'"

_DPI = 100
_MIN_MS = 1e-4  # a zero latency still needs a place on a log axis


def write_plots(summary: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write ``hit_ratio.png``, ``load_latency.png`` and ``occupancy.png`` for ``summary``
    into ``out_dir`` (created if missing); returns their paths in that order.

    Raises :class:`RuntimeError` when matplotlib is not installed."""
    FigureCanvasAgg, Figure = _matplotlib()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timeline = list(summary.get("timeline") or [])
    drawings = [
        ("hit_ratio.png", _hit_ratio_figure(Figure, summary, timeline)),
        ("load_latency.png", _latency_figure(Figure, summary.get("load_latency_samples") or {})),
        ("occupancy.png", _occupancy_figure(Figure, summary, timeline)),
    ]
    paths = []
    for name, figure in drawings:
        path = out_dir / name
        FigureCanvasAgg(figure)  # Agg explicitly: no display, no pyplot backend switch
        figure.savefig(path, format="png", dpi=_DPI)
        paths.append(path)
    return paths


def _matplotlib() -> tuple[Any, type[Figure]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(MISSING_MATPLOTLIB) from exc
    return FigureCanvasAgg, Figure


# -- several replays on the same axes ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompareSeries:
    """What :func:`write_compare_plot` drew: per run, (requests replayed, cumulative hit
    ratio in %) points, and the final hit ratio (0-1) per medium."""

    hit_ratio: dict[str, list[tuple[int, float]]]
    by_medium: dict[str, dict[str, float]]


def write_compare_plot(runs: Mapping[str, Mapping[str, Any]], path: Path) -> CompareSeries:
    """Draw every run (name -> replay summary dict) on the same axes into the PNG at
    ``path``; returns the series drawn. Raises :class:`RuntimeError` without matplotlib."""
    FigureCanvasAgg, Figure = _matplotlib()
    series = CompareSeries(
        hit_ratio={name: _cumulative_points(run) for name, run in runs.items()},
        by_medium={name: dict(run.get("hit_ratio_by_medium") or {}) for name, run in runs.items()},
    )
    fig = Figure(figsize=(12, 5), layout="constrained")
    over_time, bars = fig.subplots(1, 2, width_ratios=(3, 2))
    fig.suptitle(f"{' vs '.join(runs)}: block hit ratio")
    over_time.set_title("Cumulative hit ratio over the requests replayed")
    drawn = 0
    for name, points in series.hit_ratio.items():
        if points:
            xs, ys = zip(*points, strict=True)
            over_time.plot(xs, ys, label=name, marker="o" if len(points) < 30 else None)
            drawn += 1
    if drawn:
        over_time.set_xlabel("requests replayed")
        over_time.set_ylabel("hit ratio (%)")
        over_time.set_ylim(0, 100)
        over_time.grid(alpha=0.3)
        over_time.legend(loc="best", title="config")
    else:
        _no_data(over_time, "no block accesses in the timelines")
    _draw_medium_bars(bars, series.by_medium)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=_DPI)
    return series


def _cumulative_points(run: Mapping[str, Any]) -> list[tuple[int, float]]:
    points = []
    for sample in run.get("timeline") or []:
        accesses = int(sample.get("accesses", 0))
        if accesses > 0:
            hits = sum(int(n) for n in (sample.get("hits") or {}).values())
            points.append((int(sample.get("requests", 0)), 100 * hits / accesses))
    return points


def _draw_medium_bars(ax: Axes, by_medium: dict[str, dict[str, float]]) -> None:
    ax.set_title("Final hit ratio by medium")
    media = list(dict.fromkeys(m for ratios in by_medium.values() for m in ratios))
    if not media:
        _no_data(ax, "no hits by medium")
        return
    width = 0.8 / len(by_medium)
    for index, (name, ratios) in enumerate(by_medium.items()):
        xs = [i + (index - (len(by_medium) - 1) / 2) * width for i in range(len(media))]
        ax.bar(xs, [100 * ratios.get(m, 0.0) for m in media], width, label=name)
    ax.set_xticks(range(len(media)), media)
    ax.set_ylabel("hit ratio (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="best", title="config")


# -- hit ratio ---------------------------------------------------------------------------


def _hit_ratio_figure(
    figure_class: type[Figure], summary: Mapping[str, Any], timeline: list[Mapping[str, Any]]
) -> Figure:
    fig = figure_class(figsize=(9, 7), layout="constrained")
    cumulative, windowed = fig.subplots(2, 1)
    final = summary.get("hit_ratio")
    requests = summary.get("requests")
    headline = "Block hit ratio over time"
    if isinstance(final, int | float) and isinstance(requests, int):
        headline += f" (final {100 * final:.1f} % over {requests:,} requests)"
    fig.suptitle(headline)
    media = _media(summary, timeline)
    times = [float(s.get("t", 0.0)) for s in timeline]
    accesses = [int(s.get("accesses", 0)) for s in timeline]
    hits = {m: [int((s.get("hits") or {}).get(m, 0)) for s in timeline] for m in media}
    hits["total"] = [sum(hits[m][i] for m in media) for i in range(len(timeline))]
    _draw_cumulative(cumulative, times, accesses, hits)
    _draw_windowed(windowed, times, accesses, hits)
    return fig


def _media(summary: Mapping[str, Any], timeline: list[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = dict.fromkeys(summary.get("hit_ratio_by_medium") or {})
    for sample in timeline:
        seen.update(dict.fromkeys(sample.get("hits") or {}))
    return list(seen)


def _draw_cumulative(
    ax: Axes, times: list[float], accesses: list[int], hits: dict[str, list[int]]
) -> None:
    ax.set_title("Cumulative: hits / accesses since start")
    points = [i for i, n in enumerate(accesses) if n > 0]
    if not points:
        _no_data(ax, "no block accesses in the timeline")
        return
    for name, series in hits.items():
        ratio = [100 * series[i] / accesses[i] for i in points]
        ax.plot([times[i] for i in points], ratio, **_line_style(name, len(points)))
    _ratio_axes(ax)


def _draw_windowed(
    ax: Axes, times: list[float], accesses: list[int], hits: dict[str, list[int]]
) -> None:
    ax.set_title("Windowed: hits / accesses between consecutive samples")
    steps = [i for i in range(1, len(times)) if accesses[i] > accesses[i - 1]]
    if not steps:
        _no_data(ax, "needs two samples with accesses between them")
        return
    for name, series in hits.items():
        ratio = [100 * (series[i] - series[i - 1]) / (accesses[i] - accesses[i - 1]) for i in steps]
        ax.plot([times[i] for i in steps], ratio, **_line_style(name, len(steps)))
    ax.set_xlabel("time since start (s)")
    _ratio_axes(ax)


def _line_style(name: str, points: int) -> dict[str, Any]:
    style: dict[str, Any] = {"label": name, "marker": "o" if points < 30 else None}
    if name == "total":
        style.update(color="black", linewidth=2.0, linestyle="--")
    return style


def _ratio_axes(ax: Axes) -> None:
    ax.set_ylabel("hit ratio (%)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", title="served by")


# -- load latency ------------------------------------------------------------------------


def _latency_figure(figure_class: type[Figure], samples: Mapping[str, Sequence[float]]) -> Figure:
    fig = figure_class(figsize=(9, 5), layout="constrained")
    ax = fig.subplots()
    ax.set_title("Load latency by source medium (ECDF)")
    drawn = 0
    for medium, values in samples.items():
        if values:
            _draw_ecdf(ax, medium, sorted(max(1000 * float(v), _MIN_MS) for v in values))
            drawn += 1
    if not drawn:
        _no_data(ax, "no loads recorded")
        return fig
    ax.set_xscale("log")
    ax.set_xlabel("load latency (ms, log scale)")
    ax.set_ylabel("share of loads at or below (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right", title="source (o p50, ^ p99)")
    return fig


def _draw_ecdf(ax: Axes, medium: str, ms: list[float]) -> None:
    n = len(ms)
    share = [100 * (i + 1) / n for i in range(n)]
    p50, p99 = _percentile(ms, 0.50), _percentile(ms, 0.99)
    (line,) = ax.step(
        ms, share, where="post", label=f"{medium}: n={n}, p50 {p50:.3g} ms, p99 {p99:.3g} ms"
    )
    color = line.get_color()
    ax.plot([p50], [50], marker="o", color=color, linestyle="none")
    ax.plot([p99], [99], marker="^", color=color, linestyle="none")
    ax.axvline(p99, color=color, linestyle=":", alpha=0.6)


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted, non-empty list."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


# -- occupancy ---------------------------------------------------------------------------


def _occupancy_figure(
    figure_class: type[Figure], summary: Mapping[str, Any], timeline: list[Mapping[str, Any]]
) -> Figure:
    fig = figure_class(figsize=(9, 5), layout="constrained")
    ax = fig.subplots()
    ax.set_title("Tier occupancy over time")
    capacity = {
        str(t["name"]): int(t["capacity"])
        for t in summary.get("tiers") or []
        if "name" in t and int(t.get("capacity") or 0) > 0
    }
    drawn = 0
    for name, slots in capacity.items():
        points = [
            (float(s.get("t", 0.0)), 100 * int(s["occupancy"][name]) / slots)
            for s in timeline
            if name in (s.get("occupancy") or {})
        ]
        if points:
            times, used = zip(*points, strict=True)
            ax.plot(times, used, **_line_style(f"{name} ({slots:,} blocks)", len(points)))
            drawn += 1
    if not drawn:
        _no_data(ax, "no occupancy samples")
        return fig
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("used / capacity (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", title="tier")
    return fig


def _no_data(ax: Axes, why: str) -> None:
    ax.set_axis_off()
    ax.text(
        0.5,
        0.5,
        f"no data\n({why})",
        ha="center",
        va="center",
        fontsize=14,
        transform=ax.transAxes,
    )
