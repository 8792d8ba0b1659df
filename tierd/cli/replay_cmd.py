"""``tierd replay``: drive a live daemon (or in-process chains) with a trace, verifying
every byte that comes back.

::

    tierd replay TRACE [--socket PATH | --config FILE] [--clients N] [--speed X | --max-rate]
                       [--block-bytes B] [--limit N] [--namespace NS] [--out DIR] [--json]
    tierd replay TRACE --compare A.yaml B.yaml [...]

Without ``--config`` or ``--compare`` the replay talks to the daemon at ``--socket`` (else
``$TIERD_SOCKET``, else the default path), in its own namespace. ``--config`` opens the
chain of a config file in this process instead; ``--compare`` does that for each file in
turn and prints the results side by side. ``--out DIR`` writes ``summary.json`` (the
:class:`~tierd.workload.replayer.ReplaySummary` as JSON) and PNG plots.

Exit status: 0 every byte checked out; 1 some block came back with wrong bytes, or the
daemon answered an error that ends the replay; 2 a usage error (a block size that does not
match the daemon's, say); 3 no daemon answers on the socket; 78 an invalid config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE, Command, UsageError
from tierd.cli.control_cmd import CONNECT_TIMEOUT, SOCKET_ENV
from tierd.cli.offline import ProgressBar
from tierd.client import DaemonError, Unreachable
from tierd.config import ChainConfig, default_socket_path, load_config
from tierd.units import parse_size
from tierd.workload.backends import DEFAULT_NAMESPACE, chain_backends, daemon_backends
from tierd.workload.replayer import ReplayProgress, ReplaySummary, replay
from tierd.workload.trace import Trace, read_trace

__all__ = ["COMMANDS"]

EXIT_INTERRUPTED = 130
_REFUSALS = ("not_allowed", "busy")  # a connection the daemon turned away


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="a Mooncake-format JSONL trace")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", type=Path, metavar="PATH", help="the daemon's socket")
    where.add_argument(
        "--config", type=Path, metavar="FILE", help="replay through this config's chain, here"
    )
    where.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="replay through each config's chain in turn and compare them side by side",
    )
    parser.add_argument("--clients", type=_positive, default=1, help="concurrent workers")
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument(
        "--speed", type=_speed, default=1.0, help="times the trace's own clock (default 1.0)"
    )
    pace.add_argument("--max-rate", action="store_true", help="ignore timestamps: full speed")
    parser.add_argument(
        "--block-bytes", type=_size, help="must match the daemon's (default: the daemon's)"
    )
    parser.add_argument("--limit", type=_positive, help="replay only the first N requests")
    parser.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="the daemon namespace to use"
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="write summary.json and plots")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _speed(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


# -- running ---------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    if not args.trace.is_file():
        raise UsageError(f"trace file not found: {args.trace}")
    for path in [args.config, *(args.compare or [])]:
        if path is not None and not path.is_file():
            raise UsageError(f"config file not found: {path}")
    trace = read_trace(args.trace)
    try:
        if args.compare:
            return _run_compare(args, trace)
        return _run_one(args, trace)
    except KeyboardInterrupt:
        print("tierd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_one(args: argparse.Namespace, trace: Trace) -> int:
    bar = _ReplayBar(sys.stderr) if sys.stderr.isatty() and not args.json else None
    try:
        if args.config is not None:
            summary = asyncio.run(_replay_chain(args, args.config, trace, bar))
        else:
            summary = asyncio.run(_replay_daemon(args, _socket(args), trace, bar))
    except Unreachable as exc:
        return _fail(f"cannot reach the daemon: {exc}", EXIT_UNREACHABLE)
    except DaemonError as exc:
        if exc.code == "block_size_mismatch":
            raise UsageError(str(exc)) from None
        if exc.code in _REFUSALS:
            return _fail(f"the daemon refused the connection: {exc}", EXIT_UNREACHABLE)
        return _fail(str(exc), EXIT_BAD_INPUT)
    finally:
        if bar is not None:
            bar.close()
    data = {"trace": str(args.trace), **summary.to_dict()}
    if args.out is not None:
        _write_out(args.out, data)
    print(json.dumps(data) if args.json else _describe(summary, str(args.trace)))
    return _verdict(summary)


def _run_compare(args: argparse.Namespace, trace: Trace) -> int:
    summaries: list[ReplaySummary] = []
    for path in args.compare:
        bar = _ReplayBar(sys.stderr, label=path.name) if sys.stderr.isatty() else None
        try:
            summaries.append(asyncio.run(_replay_chain(args, path, trace, bar)))
        finally:
            if bar is not None:
                bar.close()
    runs = [s.to_dict() for s in summaries]
    if args.out is not None:
        for index, (path, run) in enumerate(zip(args.compare, runs, strict=True)):
            _write_out(args.out / f"{index}-{path.stem}", {"trace": str(args.trace), **run})
        (args.out / "compare.json").write_text(json.dumps({"trace": str(args.trace), "runs": runs}))
    if args.json:
        print(json.dumps({"trace": str(args.trace), "runs": runs}))
    else:
        print(_compare_table([p.name for p in args.compare], summaries))
    return max(_verdict(s) for s in summaries)


def _socket(args: argparse.Namespace) -> str:
    if args.socket is not None:
        return str(args.socket)
    return os.environ.get(SOCKET_ENV) or str(default_socket_path())


def _speed_of(args: argparse.Namespace) -> float | None:
    return None if args.max_rate else float(args.speed)


async def _replay_daemon(
    args: argparse.Namespace, socket: str, trace: Trace, bar: _ReplayBar | None
) -> ReplaySummary:
    opening = daemon_backends(
        socket,
        args.clients,
        namespace=args.namespace,
        block_bytes=args.block_bytes,
        connect_timeout=CONNECT_TIMEOUT,
    )
    async with opening as backends:
        return await replay(trace, backends, speed=_speed_of(args), limit=args.limit, progress=bar)


async def _replay_chain(
    args: argparse.Namespace, path: Path, trace: Trace, bar: _ReplayBar | None
) -> ReplaySummary:
    from tierd.library import open_chain  # the stores (and torch) load only when needed

    cfg = load_config(path, ChainConfig)
    if args.block_bytes is not None and args.block_bytes != cfg.block_bytes:
        raise UsageError(
            f"--block-bytes {args.block_bytes} does not match {path}'s block_bytes "
            f"{cfg.block_bytes}"
        )
    async with open_chain(cfg) as chain:
        backends = chain_backends(chain, args.clients, target=str(path))
        return await replay(trace, backends, speed=_speed_of(args), limit=args.limit, progress=bar)


def _verdict(summary: ReplaySummary) -> int:
    if summary.wrong_bytes == 0:
        return EXIT_OK
    keys = ", ".join(summary.wrong_bytes_keys[:4]) + (", ..." if summary.wrong_bytes > 4 else "")
    print(
        f"tierd: error: WRONG BYTES: {summary.wrong_bytes:,} block(s) came back with bytes "
        f"that differ from what was stored (keys: {keys})",
        file=sys.stderr,
    )
    return EXIT_BAD_INPUT


def _write_out(out: Path, data: dict[str, Any]) -> None:
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


# -- output ----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:9.3f}"


def _describe(summary: ReplaySummary, trace: str) -> str:
    cfg = summary.config
    pace = "max rate" if cfg["speed"] == "max" else f"speed {cfg['speed']:g}"
    where = cfg.get("socket", cfg.get("path"))
    tput = summary.throughput
    lines = [
        f"trace           {trace}",
        f"backend         {cfg['backend']} {where}, {cfg['clients']} client(s), {pace}",
        f"requests        {summary.requests:,} ({tput['requests_per_s']:,.1f}/s, "
        f"{summary.seconds:.3f} s)",
        f"block accesses  {summary.block_accesses:,}",
        f"hit ratio       {summary.hit_ratio:.4f} ({summary.hits:,} block hits)",
    ]
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
        f"errors          {_errors(summary.errors)}",
        f"wrong bytes     {summary.wrong_bytes:,}",
    ]
    return "\n".join(lines)


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{kind}={count:,}" for kind, count in errors.items()) or "none"


def _compare_table(names: list[str], summaries: list[ReplaySummary]) -> str:
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
    rows.append(("errors", [_errors(s.errors) for s in summaries]))
    rows.append(("wrong bytes", [f"{s.wrong_bytes:,}" for s in summaries]))
    width = max(len(label) for label, _ in rows) + 2
    columns = [max(len(n), *(len(cells[i]) for _, cells in rows)) for i, n in enumerate(names)]
    out = [" " * width + "  ".join(n.rjust(w) for n, w in zip(names, columns, strict=True))]
    for label, cells in rows:
        out.append(
            label.ljust(width) + "  ".join(c.rjust(w) for c, w in zip(cells, columns, strict=True))
        )
    return "\n".join(out)


def _lat(lat: dict[str, Any] | None, q: str) -> str:
    return "-" if lat is None else _ms(lat[q]).strip()


class _ReplayBar:
    """A one-line progress bar with the request rate and the running hit ratio, redrawn in
    place at most ten times a second (meant for a terminal)."""

    def __init__(self, stream: TextIO, width: int = 30, label: str = "") -> None:
        self._bar = ProgressBar(stream, width, label)
        self._last = 0.0

    def __call__(self, tick: ReplayProgress) -> None:
        now = time.monotonic()
        if tick.done < tick.total and now - self._last < 0.1:
            return
        self._last = now
        rate = tick.done / tick.seconds if tick.seconds > 0 else 0.0
        ratio = tick.hits / tick.accesses if tick.accesses else 0.0
        self._bar(tick.done, tick.total, f"  {rate:,.0f}/s  hit ratio {ratio:.3f}")

    def close(self) -> None:
        self._bar.close()


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status


COMMANDS: dict[str, Command] = {
    "replay": Command(
        "drive a daemon (or in-process chains) with a trace, verifying every byte",
        _configure,
        _run,
    ),
}
