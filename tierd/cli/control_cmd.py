"""Commands that talk to a running daemon over its control socket: ``tierd stats``,
``events``, ``flush``, ``clear``, ``health`` and ``sizes``.

Every one finds the socket as :mod:`tierd.cli.connection` says (``--socket``,
``TIERD_SOCKET``, the config's ``socket.path``, ``TIERD_SOCKET__PATH``, the default path)
and prints what :mod:`tierd.cli.control_text` renders. ``--json`` prints machine-readable
output; without it the output is for people and may change.

Exit status: 0 success; 1 an error reply (an unknown tier, say) or, for ``health``, a
daemon that is not ``ok``; 3 no daemon answers on the socket (missing, refused, not
allowed, or silent for :data:`~tierd.cli.connection.CONNECT_TIMEOUT` seconds). Ctrl-C
ends ``stats --watch`` and ``events`` with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import sys
import time

from tierd.cli.base import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    Command,
    UsageError,
    size_argument,
)
from tierd.cli.connection import (
    CannotReach,
    add_socket_options,
    talks_to_daemon,
    with_client,
)
from tierd.cli.control_text import duration, event_text, stats_text
from tierd.client import Client, Unreachable

__all__ = ["COMMANDS"]

_CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_socket_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def _emit(text: str) -> None:
    print(text, flush=True)  # flushed: a pipe reader sees each frame or event as it comes


# -- tierd stats ----------------------------------------------------------------------------


def _configure_stats(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    parser.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N frames")


@talks_to_daemon
def _run_stats(args: argparse.Namespace) -> int:
    if args.watch is None:
        if args.count is not None:
            raise UsageError("--count needs --watch")
        stats = with_client(args, functools.partial(Client.stats, namespaces=True))
        _emit(stats_text(stats, args.json))
        return EXIT_OK
    if args.watch <= 0:
        raise UsageError(f"--watch takes a positive number of seconds, not {args.watch:g}")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, not {args.count}")
    with_client(args, functools.partial(_watch, args=args))
    return EXIT_OK


async def _watch(client: Client, args: argparse.Namespace) -> None:
    terminal = sys.stdout.isatty() and not args.json
    frames = 0
    while True:
        text = stats_text(await client.stats(namespaces=True), args.json)
        if not args.json:
            clock = time.strftime("%H:%M:%S")
            text = f"tierd stats at {clock} (every {args.watch:g} s; Ctrl-C to stop)\n\n{text}"
            text = _CLEAR_SCREEN + text if terminal else text + "\n"
        _emit(text)
        frames += 1
        if args.count is not None and frames >= args.count:
            return
        await asyncio.sleep(args.watch)


# -- tierd events ---------------------------------------------------------------------------


def _configure_events(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep printing events until Ctrl-C (the default; accepted for clarity)",
    )
    parser.add_argument("--count", type=int, metavar="N", help="stop after N batches of events")
    parser.add_argument(
        "--namespace",
        metavar="NS",
        help="only this namespace's blocks, keys without its prefix "
        "(default: every namespace, keys with their 8-byte namespace id)",
    )


@talks_to_daemon
def _run_events(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, not {args.count}")
    with_client(args, functools.partial(_follow, args=args), args.namespace)
    return EXIT_OK


async def _follow(client: Client, args: argparse.Namespace) -> None:
    """Print events until ``args.count`` batches came (or Ctrl-C)."""
    # Subscribe before announcing it on stderr, so a script that waits for the line knows
    # that what the daemon stores next will be printed; pushes wait in the client until
    # ``events()`` reads them.
    await client.subscribe()
    where = f" of namespace {args.namespace}" if args.namespace else ""
    print(f"tierd: following events{where} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    batches = dropped = 0
    async for push in client.events():
        batches += 1
        if not args.json:
            count = len(push["events"])
            _emit(f"batch {batches} ({count} event{'s' if count != 1 else ''})")
        for event in push["events"]:
            _emit(event_text(event, push["dropped"], batches, args.json, not args.namespace))
        if push["dropped"] > dropped and not args.json:
            print(
                f"tierd: warning: {push['dropped'] - dropped:,} events dropped "
                "(this reader fell behind the daemon's queue)",
                file=sys.stderr,
            )
        dropped = push["dropped"]
        if args.count is not None and batches >= args.count:
            return
    raise Unreachable("the daemon closed the connection")


# -- tierd flush / clear / health -----------------------------------------------------------


@talks_to_daemon
def _run_flush(args: argparse.Namespace) -> int:
    done = with_client(args, Client.flush)
    if args.json:
        _emit(json.dumps(dataclasses.asdict(done)))
    else:
        if done.dirty:
            line = f"copied {done.copied:,} blocks; {done.dirty:,} stayed dirty: {done.reason}"
        else:
            line = f"copied {done.copied:,} blocks; nothing left dirty"
        if done.remote_missed:
            line += (
                f"; {done.remote_missed:,} of {done.remote_sent:,} blocks sent to the remote"
                f" level did not land: {done.remote_reason}"
            )
        elif done.remote_sent:
            line += f"; {done.remote_sent:,} blocks sent to the remote level, all landed"
        _emit(line)
    return EXIT_BAD_INPUT if done.failed else EXIT_OK  # 1: the operation failed


def _configure_clear(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--tier", metavar="NAME", help="only this tier (default: every tier)")


@talks_to_daemon
def _run_clear(args: argparse.Namespace) -> int:
    removed = with_client(args, functools.partial(Client.clear, tier=args.tier))
    if args.json:
        _emit(json.dumps({"removed": removed, "tier": args.tier}))
    else:
        _emit(f"removed {removed:,} blocks")
    return EXIT_OK


def _configure_sizes(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--tenant", metavar="NAME", help="only this tenant (default: every one)")
    parser.add_argument(
        "--give-back",
        metavar="BYTES",
        type=size_argument,
        help="give this block size back first: its blocks are dropped, its share freed"
        " (not the configured block_bytes, not a size in use; --tenant when there are several)",
    )


@talks_to_daemon
def _run_sizes(args: argparse.Namespace) -> int:
    call = functools.partial(Client.sizes, tenant=args.tenant, give_back=args.give_back)
    tenants = with_client(args, call)
    if args.json:
        _emit(json.dumps(tenants))
        return EXIT_OK
    lines = []
    for name, report in tenants.items():
        lines.append(f"tenant {name}: {len(report['open'])} of {report['limit']} block sizes open")
        for size, figures in report["open"].items():
            unused = figures["unused_s"]
            use = (
                f"{figures['connections']} connections"
                if unused is None
                else (f"unused for {duration(unused)}")
            )
            mark = " (configured)" if figures["configured"] else ""
            lines.append(f"  {int(size):>12,} bytes{mark}: {use}")
    _emit("\n".join(lines))
    return EXIT_OK


@talks_to_daemon
def _run_health(args: argparse.Namespace) -> int:
    try:
        health = with_client(args, Client.health)
    except CannotReach as exc:
        if not args.json:
            raise
        # A script asked for JSON: it gets JSON, whatever the answer.
        unreachable = {"ok": False, "error": "unreachable", "socket": exc.path}
        _emit(json.dumps({**unreachable, "detail": exc.reason}))
        return EXIT_UNREACHABLE
    if args.json:
        _emit(json.dumps({"ok": health["status"] == "ok", **health}))
    else:
        lines = [
            f"status       {health['status']}",
            f"version      {health['version']}",
            f"uptime       {duration(health['uptime_s'])}",
            f"connections  {health['connections']:,}",
        ]
        for level in health.get("remote", ()):
            says = "ok" if level["ok"] else "unhealthy: " + "; ".join(level["problems"])
            if level["notes"]:
                says += " (" + "; ".join(level["notes"]) + ")"
            lines.append(f"remote       {level['name']}: {says}")
        _emit("\n".join(lines))
    return EXIT_OK if health["status"] == "ok" else EXIT_BAD_INPUT


COMMANDS: dict[str, Command] = {
    "stats": Command(
        "print the daemon's figures per tier, route and server", _configure_stats, _run_stats
    ),
    "events": Command(
        "print the blocks stored and removed in every tier as they happen",
        _configure_events,
        _run_events,
    ),
    "flush": Command(
        "copy every dirty block down to the next tier (and to the remote level)",
        _add_common,
        _run_flush,
    ),
    "clear": Command("remove the blocks of every tier, or of one", _configure_clear, _run_clear),
    "health": Command(
        "check that the daemon answers, is not stopping and its remote levels work",
        _add_common,
        _run_health,
    ),
    "sizes": Command(
        "list each tenant's block sizes, or give one back", _configure_sizes, _run_sizes
    ),
}
