"""``tierd simulate TRACE --curve``: the LRU hit ratio at every capacity in one pass.

Prints a table (the capacity in blocks and as a share of the trace's unique blocks at
1/5/10/25/50/100 %), or one JSON object with ``--json``; with ``--config FILE`` each tier
of that config is marked at its cumulative capacity (tier 1 at its size, tier 2 at the
sum of both, ...); with ``--out FILE.png`` the curve is drawn (the ``plots`` extra).
The figures equal ``tierd simulate --policy lru --capacity N`` for every ``N`` from the
largest request (in blocks) up; see :mod:`tierd.workload.curve`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tierd.cli.base import EXIT_OK, UsageError, require_config_file
from tierd.config import ChainConfig, load_config
from tierd.errors import TierdError
from tierd.workload.curve import HitRatioCurve, lru_curve
from tierd.workload.curve_plot import TierMark, tier_marks
from tierd.workload.trace import Trace

__all__ = ["check_curve_args", "run_curve"]


class PlotError(TierdError):
    """The curve's PNG could not be drawn (no matplotlib) or written."""


def check_curve_args(args: argparse.Namespace) -> None:
    """Usage errors, found before the trace is read."""
    if not args.curve:
        if args.out is not None:
            raise UsageError("--out draws the curve: use it with --curve")
        return
    if args.policy != "lru":
        raise UsageError(f"--curve computes LRU's hit ratio only, not {args.policy!r}")
    if args.out is not None and args.out.suffix.lower() != ".png":
        if args.out.suffix and not args.out.is_dir():
            message = "--out writes a PNG: give a file name ending in .png, or a directory"
            raise UsageError(f"{message}, not {args.out}")
        args.out = args.out / "curve.png"  # a directory, as for replay's --out
    if args.config is not None:
        require_config_file(args.config)


def run_curve(args: argparse.Namespace, trace: Trace) -> int:
    tiers: list[tuple[str, int]] = []
    if args.config is not None:
        cfg = load_config(args.config, ChainConfig)  # ConfigError: exit status 78
        tiers = [(t.name, t.num_blocks(cfg.block_bytes)) for t in cfg.tiers]
    curve = lru_curve(trace)
    marks = tier_marks(curve, tiers)
    plot = _draw(curve, marks, args.out, trace) if args.out is not None else None
    if args.json:
        document = {
            "trace": str(args.trace),
            **curve.to_dict(),
            "tiers": [
                {
                    "name": m.name,
                    "capacity": m.blocks,
                    "cumulative_capacity": m.cumulative,
                    "hit_ratio": m.hit_ratio,
                }
                for m in marks
            ],
            "plot": None if plot is None else str(plot),
        }
        print(json.dumps(document))
    else:
        print(_describe(curve, marks, plot))
    return EXIT_OK


def _draw(curve: HitRatioCurve, marks: list[TierMark], out: Path, trace: Trace) -> Path:
    from tierd.workload.curve_plot import write_curve_plot

    title = f"LRU hit ratio by capacity: {Path(trace.source).name}"
    try:
        return write_curve_plot(curve, out, marks, title=title)
    except RuntimeError as exc:  # matplotlib is missing
        raise PlotError(str(exc)) from None
    except OSError as exc:
        raise PlotError(f"cannot write {out}: {exc.strerror or exc}") from None


def _describe(curve: HitRatioCurve, marks: list[TierMark], plot: Path | None) -> str:
    lines = [
        f"LRU hit ratio by capacity ({curve.requests:,} requests, "
        f"{curve.block_accesses:,} block accesses, {curve.unique_blocks:,} unique blocks)",
        f"{'capacity':>12}  {'share':>6}  hit ratio",
    ]
    for point in curve.points():
        lines.append(f"{point.capacity:>12,}  {point.share:>5g}%  {point.hit_ratio:.4f}")
    for mark in marks:
        ratio = (
            f"{mark.hit_ratio:.4f}"
            if mark.hit_ratio is not None
            else f"not on the curve (it starts at {curve.min_capacity:,} blocks)"
        )
        lines.append(
            f"tier {mark.name:<10} {mark.blocks:>10,} blocks, {mark.cumulative:>10,} with "
            f"the tiers above: hit ratio {ratio}"
        )
    lines.append(
        f"exact for every capacity from {curve.min_capacity:,} blocks (the largest request) "
        f"up; computed in {curve.seconds:.2f} s"
    )
    if plot is not None:
        lines.append(f"plot written to {plot}")
    return "\n".join(lines)
