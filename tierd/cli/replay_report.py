"""What ``tierd replay`` prints and writes: the table of one replay, the side-by-side
table of ``--compare``, and the ``--out`` folder (``summary.json`` and PNG plots; with
``--compare`` one folder per config, ``compare.json`` and ``compare.png``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tierd.cli.progress import interrupted_line
from tierd.workload.backends import SETTLE_S
from tierd.workload.replayer import ReplaySummary

__all__ = [
    "compare_table",
    "cut_short_line",
    "describe",
    "repeats_line",
    "start_line",
    "write_compare_out",
    "write_out",
]


def write_out(out: Path, data: dict[str, Any]) -> None:
    """``summary.json`` and the plots of one replay into ``out``."""
    from tierd.workload.plots import write_plots  # matplotlib loads only for plots

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(data, indent=2))
    try:
        paths = write_plots(data, out)
    except RuntimeError as exc:  # matplotlib is an optional extra
        print(f"tierd: warning: no plots: {exc}", file=sys.stderr)
        return
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)


def write_compare_out(out: Path, trace: str, names: list[str], runs: list[dict[str, Any]]) -> None:
    """Each run's folder (``0-a``, ``1-b``...), ``compare.json``, and ``compare.png``
    with every run on the same axes."""
    from tierd.workload.plots import write_compare_plot

    for index, (name, run) in enumerate(zip(names, runs, strict=False)):
        write_out(out / f"{index}-{Path(name).stem}", {"trace": trace, **run})
    (out / "compare.json").write_text(json.dumps({"trace": trace, "runs": runs}))
    try:
        write_compare_plot(dict(zip(names, runs, strict=False)), out / "compare.png")
    except RuntimeError as exc:
        print(f"tierd: warning: no plots: {exc}", file=sys.stderr)
        return
    print(f"wrote {out / 'compare.png'}", file=sys.stderr)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:9.3f}"


def describe(summary: ReplaySummary, trace: str) -> str:
    """The table of one replay (for people; ``--json`` is for scripts)."""
    cfg = summary.config
    pace = "max rate" if cfg["speed"] == "max" else f"speed {cfg['speed']:g}"
    where = cfg.get("socket", cfg.get("path"))
    tput = summary.throughput
    lines = []
    if summary.cut_short is not None:
        lines.append(cut_short_line(summary.requests, summary.planned_requests, summary.cut_short))
    elif summary.interrupted:
        lines.append(interrupted_line(summary.requests, summary.planned_requests))
    lines += [
        f"trace           {trace}",
        f"backend         {cfg['backend']} {where}, {cfg['clients']} client(s), {pace}",
        start_line(summary),
        repeats_line(summary),
        f"requests        {summary.requests:,} ({tput['requests_per_s']:,.1f}/s, "
        f"{summary.seconds:.3f} s)",
        f"block accesses  {summary.block_accesses:,}",
        f"hit ratio       {summary.hit_ratio:.4f} ({summary.hits:,} block hits)",
    ]
    if summary.late_requests:
        lines.append(
            f"fell behind     {summary.late_requests:,} requests started late, up to"
            f" {summary.behind_s:.3f} s behind the trace clock at speed {cfg['speed']:g}"
            " (the clients or the cache cannot keep this pace)"
        )
    for medium, ratio in summary.hit_ratio_by_medium.items():
        lines.append(f"  from {medium:<9} {ratio:.4f} ({summary.hits_by_medium[medium]:,})")
    lines.append(f"latency (ms)    {'p50':>9} {'p90':>9} {'p99':>9}")
    rows = [("lookup", summary.latency["lookup"])]
    rows += [(f"load {m}", lat) for m, lat in summary.latency["load"].items()]
    rows.append(("store", summary.latency["store"]))
    for name, lat in rows:
        lines.append(f"  {name:<13} {_ms(lat['p50'])} {_ms(lat['p90'])} {_ms(lat['p99'])}")
    lines += [
        f"store           {tput['store_gb_s']:.3f} GB/s ({summary.stored_blocks:,} blocks; "
        f"{tput['store_call_gb_s']:.3f} GB/s per call)",
        f"load            {tput['load_gb_s']:.3f} GB/s ({summary.loaded_blocks:,} blocks; "
        f"{tput['load_call_gb_s']:.3f} GB/s per call)",
        f"shortfall       {summary.load_shortfalls:,} load(s) found a block evicted since "
        "its lookup",
        f"errors          {_errors(summary.errors)}",
        f"wrong bytes     {summary.wrong_bytes:,}",
    ]
    return "\n".join(lines)


def start_line(summary: ReplaySummary) -> str:
    """What the tiers held when the replay started: figures repeat from the same start."""
    used = summary.timeline[0]["occupancy"] if summary.timeline else {}
    line = "start           " + ", ".join(f"{tier} {n:,}" for tier, n in used.items())
    line += " blocks used"
    if any(used.values()):
        line += (
            " (not empty: the figures depend on these blocks; a fresh daemon, "
            "`tierd clear`, or a what-if without --warm starts empty)"
        )
    return line


def repeats_line(summary: ReplaySummary) -> str:
    """Whether the same command from the same start gives the same figures, and why."""
    if not summary.config.get("ordered"):
        return (
            "repeats         no: --unordered (the clients' calls overlap, and no call waits "
            "for the copies behind earlier stores)"
        )
    if summary.unsettled_stores:
        return (
            f"repeats         no: the cache was not seen at rest after "
            f"{summary.unsettled_stores:,} store(s) (a daemon that does not report its "
            f"write-behind backlog, or still copying after {SETTLE_S:g} s)"
        )
    return (
        "repeats         yes, from the same start: calls in turns, each store's background "
        f"copies awaited ({summary.settle_s:.3f} s in all)"
    )


def cut_short_line(done: int, total: int, reason: str) -> str:
    """The mark on the results of a replay whose cache went away under it."""
    return f"cut short after {done:,} of {total:,} requests: {reason}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{kind}={count:,}" for kind, count in errors.items()) or "none"


def compare_table(names: list[str], summaries: list[ReplaySummary]) -> str:
    """One column per config; configs not run (after an interruption) are left out."""
    media = list(dict.fromkeys(m for s in summaries for m in s.hits_by_medium))
    loads = list(dict.fromkeys(m for s in summaries for m in s.latency["load"]))
    rows: list[tuple[str, list[str]]] = [
        ("requests", [f"{s.requests:,}" for s in summaries]),
        ("block accesses", [f"{s.block_accesses:,}" for s in summaries]),
        ("hit ratio", [f"{s.hit_ratio:.4f}" for s in summaries]),
    ]
    for m in media:
        rows.append(
            (f"  from {m}", [f"{s.hit_ratio_by_medium.get(m, 0.0):.4f}" for s in summaries])
        )
    for q in ("p50", "p99"):
        rows.append((f"lookup {q} ms", [_ms(s.latency["lookup"][q]).strip() for s in summaries]))
    for m in loads:
        for q in ("p50", "p99"):
            rows.append(
                (f"load {m} {q} ms", [_lat(s.latency["load"].get(m), q) for s in summaries])
            )
    rows.append(("store p50 ms", [_ms(s.latency["store"]["p50"]).strip() for s in summaries]))
    for key, label in (("store_gb_s", "store GB/s"), ("load_gb_s", "load GB/s")):
        rows.append((label, [f"{s.throughput[key]:.3f}" for s in summaries]))
    rows.append(("requests/s", [f"{s.throughput['requests_per_s']:,.1f}" for s in summaries]))
    rows.append(("shortfall", [f"{s.load_shortfalls:,}" for s in summaries]))
    rows.append(("errors", [_errors(s.errors) for s in summaries]))
    rows.append(("wrong bytes", [f"{s.wrong_bytes:,}" for s in summaries]))
    shown = names[: len(summaries)]
    width = max(len(label) for label, _ in rows) + 2
    columns = [max(len(n), *(len(cells[i]) for _, cells in rows)) for i, n in enumerate(shown)]
    out = [" " * width + "  ".join(n.rjust(w) for n, w in zip(shown, columns, strict=True))]
    for label, cells in rows:
        out.append(
            label.ljust(width) + "  ".join(c.rjust(w) for c, w in zip(cells, columns, strict=True))
        )
    cut = next((i for i, s in enumerate(summaries) if s.interrupted), None)
    if cut is not None:
        run = summaries[cut]
        mark = f"{interrupted_line(run.requests, run.planned_requests)} ({names[cut]})"
        skipped = names[cut + 1 :]
        out.append(mark + (f"; not run: {', '.join(skipped)}" if skipped else ""))
    return "\n".join(out)


def _lat(lat: dict[str, Any] | None, q: str) -> str:
    return "-" if lat is None else _ms(lat[q]).strip()
