"""``tierd replay``: drive a live daemon (or in-process chains) with a trace, verifying
every byte that comes back.

::

    tierd replay TRACE [--socket PATH | --config FILE] [--clients N [--unordered]] [--speed X]
                       [--block-bytes B] [--limit N] [--namespace NS] [--out DIR] [--json]
                       [--warm DIR] [--progress | --no-progress]
    tierd replay TRACE --compare A.yaml B.yaml [...] [--warm DIR]

Without ``--config`` or ``--compare`` the replay talks to the daemon at ``--socket`` (else
``$TIERD_SOCKET``, else ``$TIERD_SOCKET__PATH``, else the default path), in a namespace of
its own, fresh for every run (``replay-<random>``) so that no run finds what an earlier
one stored; ``--namespace NS`` names one to reuse. ``--config`` opens the chain of a config
file in this process instead; ``--compare`` does that for each file in turn and prints the
results side by side. Such a what-if starts cold, its disk tiers in a private temporary
directory, unless ``--warm DIR`` keeps them there between runs (:mod:`tierd.cli.whatif`).
``--out DIR`` writes ``summary.json`` (the :class:`~tierd.workload.replayer.ReplaySummary`
as JSON) and PNG plots; with ``--compare``, also ``compare.png`` with every config on the
same axes.

``--clients N`` workers each have a request under way; their calls to the cache take
turns in a fixed rotation, and each store waits, in its turn, for the copies the cache
makes behind it (``write_behind``, queued remote writes) to end, so the same command from
the same start (the ``start`` line: a fresh daemon, or ``tierd clear``, starts empty) gives
the same figures every time; the ``repeats`` line says whether this run does. With
``--unordered`` the calls overlap and nothing waits for those copies: more throughput,
figures that vary a little from run to run. Requests go as fast as the workers take
them, unless ``--speed X`` follows the trace's own clock, X times faster (``--max-rate``,
the default, is kept for older scripts). A progress bar goes to stderr when it is a
terminal (``--progress`` / ``--no-progress``).
Ctrl-C stops the replay after the requests under way and prints the results so far,
marked ``interrupted after N of M requests`` (a second Ctrl-C stops at once). A daemon
that stops (or a connection lost) during the replay ends it too: the results so far are
printed, marked ``cut short after N of M requests`` with the reason (``cut_short`` in
``--json``), and the same line goes to stderr.

Exit status: 0 every byte checked out; 1 some block came back with wrong bytes, the
daemon answered an error that ends the replay, or the trace is unusable; 2 a usage error
(a block size that does not match the daemon's, say); 3 no daemon answers on the socket,
or the daemon went away during the replay (results printed, cut short; wrong bytes among
them are still 1); 78 an invalid config; 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tierd.cli.base import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    Command,
    UsageError,
    count_argument,
    require_config_file,
    size_argument,
)
from tierd.cli.connection import CONNECT_TIMEOUT, SOCKET_ENV, unreachable_reason
from tierd.cli.disk_notice import announce, chain_disks, daemon_disks
from tierd.cli.offline import load_trace
from tierd.cli.progress import EXIT_INTERRUPTED, Bar, add_progress_option, make_bar, stop_flag
from tierd.cli.replay_report import (
    compare_table,
    cut_short_line,
    describe,
    write_compare_out,
    write_out,
)
from tierd.cli.whatif import add_warm_option, what_if_config
from tierd.client import DaemonError, Unreachable
from tierd.config import ChainConfig, default_socket_path, load_config
from tierd.control.socketfile import socket_path_setting
from tierd.workload.backends import chain_backends, daemon_backends
from tierd.workload.replayer import ReplayBackend, ReplayProgress, ReplaySummary, replay
from tierd.workload.trace import Trace

__all__ = ["COMMANDS"]

Stop = Callable[[], bool]

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
    parser.add_argument(
        "--clients",
        type=count_argument,
        default=1,
        help="workers, each with requests under way; their calls take turns in a fixed "
        "order and each store waits for the copies the cache makes behind it, so the same "
        "command from the same start gives the same figures",
    )
    parser.add_argument(
        "--unordered",
        action="store_true",
        help="let the clients' calls overlap, and wait for no copy behind a store: more "
        "throughput, but the interleaving and the disk's timing (and so the hit figures) "
        "vary from run to run",
    )
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument(
        "--speed",
        type=_speed,
        metavar="X",
        help="follow the trace's timestamps, X times faster (1 = real time); "
        "default: as fast as the clients go",
    )
    pace.add_argument(
        "--max-rate", action="store_true", help="ignore timestamps (the default; kept for scripts)"
    )
    parser.add_argument(
        "--block-bytes", type=size_argument, help="must match the daemon's (default: the daemon's)"
    )
    parser.add_argument("--limit", type=count_argument, help="replay only the first N requests")
    parser.add_argument(
        "--namespace",
        help="the daemon namespace to use (default: a fresh one per run, so it finds none "
        "of its blocks; the daemon's tiers may still hold other namespaces' blocks, which "
        "the start line shows)",
    )
    add_warm_option(parser)
    parser.add_argument("--out", type=Path, metavar="DIR", help="write summary.json and plots")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_option(parser)


def _speed(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


# -- running ---------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    for path in [args.config, *(args.compare or [])]:
        if path is not None:
            require_config_file(path)
    if args.warm is not None and args.config is None and not args.compare:
        raise UsageError("--warm applies to --config and --compare (a daemon keeps its own tiers)")
    if args.compare and args.warm is not None:
        stems = [path.stem for path in args.compare]
        if len(set(stems)) != len(stems):
            raise UsageError(f"with --warm, the compared files need distinct names, got {stems}")
    if args.out is not None and args.out.suffix.lower() == ".png":
        raise UsageError(
            f"--out names a directory (summary.json and the plots go in it), not {args.out}"
        )
    if args.namespace is None:
        args.namespace = f"replay-{secrets.token_hex(4)}"
    trace = load_trace(args.trace)
    try:
        if args.compare:
            return _run_compare(args, trace)
        return _run_one(args, trace)
    except KeyboardInterrupt:  # the second Ctrl-C: no results to show
        print("tierd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_one(args: argparse.Namespace, trace: Trace) -> int:
    bar = make_bar(args.progress, _planned(args, trace))
    try:
        with stop_flag() as stop:
            if args.config is not None:
                summary = asyncio.run(_replay_chain(args, args.config, trace, bar, stop))
            else:
                summary = asyncio.run(_replay_daemon(args, _socket(args), trace, bar, stop))
    except Unreachable as exc:
        reason = unreachable_reason(exc)
        return _fail(f"cannot reach the daemon at {_socket(args)}: {reason}", EXIT_UNREACHABLE)
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
    if args.config is None:
        data["namespace"] = args.namespace
    if args.out is not None:
        write_out(args.out, data)
    if args.json:
        print(json.dumps(data))
    else:
        print(describe(summary, str(args.trace)))
        if args.config is None:
            print(f"namespace       {args.namespace}")
    status = _verdict(summary)
    if summary.cut_short is not None:
        line = cut_short_line(summary.requests, summary.planned_requests, summary.cut_short)
        print(f"tierd: error: {line}", file=sys.stderr)
        return status if status != EXIT_OK else EXIT_UNREACHABLE
    return EXIT_INTERRUPTED if summary.interrupted else status


def _run_compare(args: argparse.Namespace, trace: Trace) -> int:
    names = [path.name for path in args.compare]
    summaries: list[ReplaySummary] = []
    for path in args.compare:
        bar = make_bar(args.progress, _planned(args, trace), label=path.name)
        try:
            with stop_flag() as stop:
                summaries.append(asyncio.run(_replay_chain(args, path, trace, bar, stop)))
        finally:
            if bar is not None:
                bar.close()
        if summaries[-1].interrupted:
            break  # Ctrl-C: the configs after this one are not run
    runs = [s.to_dict() for s in summaries]
    interrupted = summaries[-1].interrupted
    if args.out is not None:
        write_compare_out(args.out, str(args.trace), names, runs)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "runs": runs, "interrupted": interrupted}))
    else:
        print(compare_table(names, summaries))
    status = max(_verdict(s) for s in summaries)
    return EXIT_INTERRUPTED if interrupted else status


def _planned(args: argparse.Namespace, trace: Trace) -> int:
    return len(trace) if args.limit is None else min(len(trace), args.limit)


def _socket(args: argparse.Namespace) -> str:
    if args.socket is not None:
        return str(args.socket)
    return (
        os.environ.get(SOCKET_ENV)
        or socket_path_setting(os.environ)
        or str(default_socket_path(os.environ))
    )


def _speed_of(args: argparse.Namespace) -> float | None:
    return None if args.max_rate or args.speed is None else float(args.speed)


def _ticks(bar: Bar | None) -> Callable[[ReplayProgress], None] | None:
    """The replay's progress hook drawing ``bar``: requests, and the hit ratio so far."""
    if bar is None:
        return None

    def tick(progress: ReplayProgress) -> None:
        ratio = progress.hits / progress.accesses if progress.accesses else 0.0
        bar(progress.done, progress.total, f"hit ratio {ratio:.3f}")

    return tick


async def _replay_daemon(
    args: argparse.Namespace, socket: str, trace: Trace, bar: Bar | None, stop: Stop
) -> ReplaySummary:
    opening = daemon_backends(
        socket,
        args.clients,
        namespace=args.namespace,
        block_bytes=args.block_bytes,
        connect_timeout=CONNECT_TIMEOUT,
    )
    async with opening as backends:
        found = daemon_disks(backends[0].client.info, socket)
        announce(trace, args.limit, backends[0].block_bytes, found)
        return await _replay_with(args, trace, backends, bar, stop)


async def _replay_with(
    args: argparse.Namespace,
    trace: Trace,
    backends: Sequence[ReplayBackend],
    bar: Bar | None,
    stop: Stop,
) -> ReplaySummary:
    """Replay ``trace`` through ``backends`` with the pacing, limit and bar ``args`` ask."""
    return await replay(
        trace,
        backends,
        speed=_speed_of(args),
        limit=args.limit,
        progress=_ticks(bar),
        stop=stop,
        ordered=not args.unordered,
    )


async def _replay_chain(
    args: argparse.Namespace, path: Path, trace: Trace, bar: Bar | None, stop: Stop
) -> ReplaySummary:
    from tierd.library import open_chain  # the stores (and torch) load only when needed

    cfg = load_config(path, ChainConfig)
    if args.block_bytes is not None and args.block_bytes != cfg.block_bytes:
        raise UsageError(
            f"--block-bytes {args.block_bytes} does not match {path}'s block_bytes "
            f"{cfg.block_bytes}"
        )
    announce(trace, args.limit, cfg.block_bytes, chain_disks(cfg, path.stem, args.warm))
    with what_if_config(cfg, path.stem, args.warm) as private:
        async with open_chain(private) as chain:
            backends = chain_backends(chain, args.clients, target=str(path))
            return await _replay_with(args, trace, backends, bar, stop)


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
