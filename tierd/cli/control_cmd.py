"""Commands that talk to a running daemon over its control socket: ``tierd stats``,
``events``, ``flush``, ``clear`` and ``health``.

Every one finds the socket the same way, first match wins: ``--socket PATH``; the
``TIERD_SOCKET`` variable; the ``socket.path`` of the config named by ``-c FILE`` (else
``$TIERD_CONFIG``), read with the same layers as ``tierd serve``; the default path
(:func:`tierd.config.default_socket_path`). ``--json`` prints machine-readable output;
without it the output is for people and may change.

Exit status: 0 success; 1 an error reply (an unknown tier, say) or, for ``health``, a
daemon that is not ``ok``; 3 no daemon answers on the socket (missing, refused, not
allowed, or silent for :data:`CONNECT_TIMEOUT` seconds). Ctrl-C ends ``stats --watch``
and ``events`` with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE, Command, UsageError
from tierd.client import Client, DaemonError, Unreachable
from tierd.config import default_socket_path
from tierd.control.protocol import NAMESPACE_ID_BYTES
from tierd.settings import CONFIG_ENV, load_settings

__all__ = ["COMMANDS", "CONNECT_TIMEOUT", "SOCKET_ENV", "socket_path"]

SOCKET_ENV = "TIERD_SOCKET"
CONNECT_TIMEOUT = 10.0  # seconds for connect + hello; a live daemon answers in microseconds
_REFUSALS = ("not_allowed", "busy")  # error codes of a connection the daemon turned away
_CLEAR_SCREEN = "\x1b[H\x1b[2J"
_KEYS_SHOWN = 4

_T = TypeVar("_T")
Handler = Callable[[argparse.Namespace], int]


class _CannotReach(Exception):
    """No daemon to talk to at ``path``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot reach the daemon at {path}: {reason}")
        self.path, self.reason = path, reason


def socket_path(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """The control socket the command talks to (the order is in the module docstring)."""
    env = os.environ if environ is None else environ
    if args.socket is not None:
        return str(args.socket)
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV]
    config = args.config if args.config is not None else env.get(CONFIG_ENV) or None
    if config is not None:
        return str(load_settings(config, environ=env).socket.path)
    return str(default_socket_path(env))


def trusted_uids(args: argparse.Namespace) -> tuple[int, ...]:
    """The uids ``--trust-uid`` names: whose daemon to talk to besides this user's and
    root's (a daemon run by a service user)."""
    return tuple(getattr(args, "trust_uid", None) or ())


def add_socket_options(parser: argparse.ArgumentParser) -> None:
    """``--socket``, ``-c/--config`` and ``--trust-uid``: how a client command finds the
    daemon, and whose daemon it will talk to."""
    parser.add_argument(
        "--trust-uid",
        type=int,
        action="append",
        metavar="UID",
        help="talk to a daemon run by this uid too (default: only this user's or root's;"
        " a socket served by anyone else is refused, as a squatter's would be)",
    )
    parser.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help=f"the daemon's control socket (default: ${SOCKET_ENV}, else the config's)",
    )
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        metavar="FILE",
        help=f"take the socket path from this config (default: ${CONFIG_ENV}, if set)",
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_socket_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def _talks_to_daemon(handler: Handler) -> Handler:
    """Turn the ways a daemon conversation ends into exit statuses and messages."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except _CannotReach as exc:
            return _fail(str(exc), EXIT_UNREACHABLE)
        except DaemonError as exc:
            return _fail(str(exc), EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            return EXIT_OK
        # A reader that went away (``tierd events | head``) is handled once, in main.

    return run


def _with_client(
    args: argparse.Namespace,
    work: Callable[[Client], Awaitable[_T]],
    namespace: str | None = None,
) -> _T:
    """Connect to the daemon, run ``work`` on the client in a fresh event loop, close."""
    path = socket_path(args)

    async def main() -> _T:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                client = await Client.connect(
                    path, namespace=namespace, map_pool=False, server_uids=trusted_uids(args)
                )
        except TimeoutError:
            raise _CannotReach(path, f"no answer within {CONNECT_TIMEOUT:g} s") from None
        except DaemonError as exc:
            if exc.code in _REFUSALS:
                raise _CannotReach(path, str(exc)) from None
            raise
        async with client:
            return await work(client)

    try:
        return asyncio.run(main())
    except Unreachable as exc:
        cause = exc.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc)
        raise _CannotReach(path, reason) from None


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status


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


@_talks_to_daemon
def _run_stats(args: argparse.Namespace) -> int:
    if args.watch is None:
        if args.count is not None:
            raise UsageError("--count needs --watch")
        _emit(_stats_text(_with_client(args, Client.stats), args.json))
        return EXIT_OK
    if args.watch <= 0:
        raise UsageError(f"--watch takes a positive number of seconds, not {args.watch:g}")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, not {args.count}")
    _with_client(args, functools.partial(_watch, args=args))
    return EXIT_OK


async def _watch(client: Client, args: argparse.Namespace) -> None:
    terminal = sys.stdout.isatty() and not args.json
    frames = 0
    while True:
        text = _stats_text(await client.stats(), args.json)
        if not args.json:
            clock = time.strftime("%H:%M:%S")
            text = f"tierd stats at {clock} (every {args.watch:g} s; Ctrl-C to stop)\n\n{text}"
            text = _CLEAR_SCREEN + text if terminal else text + "\n"
        _emit(text)
        frames += 1
        if args.count is not None and frames >= args.count:
            return
        await asyncio.sleep(args.watch)


def _stats_text(stats: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(stats)
    parts = [_tier_table(stats["tiers"]), _route_table(stats["routes"])]
    if stats.get("tenant"):
        parts.insert(0, f"tenant {stats['tenant']} (its own tiers only)")
    tenants = stats.get("tenants") or {}
    if len(tenants) > 1:
        parts.insert(1, _tenant_table(tenants))
    chain = stats["chain"]
    looked_up = chain["hit_blocks"] + chain["miss_blocks"]
    parts.append(
        f"chain hit ratio {_ratio(chain['hit_blocks'], looked_up)} "
        f"({chain['hit_blocks']:,} of {looked_up:,} looked-up blocks)"
    )
    remote = stats.get("remote")
    if remote:
        parts.append(
            f"remote {remote['name']} (REMOTE) {remote['endpoint']}: breaker {remote['state']},"
            f" {remote['lookup_hits']:,} lookup hits, {remote['hits']:,} blocks read,"
            f" {remote['stores']:,} written, {remote['skipped']:,} skipped,"
            f" {remote['corrupt']:,} corrupt, {remote['timeouts']:,} timeouts,"
            f" {remote['errors']:,} errors, {remote['dropped']:,} dropped"
            + (f" (last error: {remote['last_error']})" if remote["last_error"] else "")
        )
    server = stats.get("server")
    if server is not None:
        errors = server["errors"]
        detail = ", ".join(f"{code} {n:,}" for code, n in sorted(errors.items()))
        parts.append(
            f"server: {server['connections']:,} connections, {server['leases']:,} leases, "
            f"{server['requests']:,} requests, {sum(errors.values()):,} errors"
            + (f" ({detail})" if detail else "")
        )
    return "\n\n".join(parts)


_TIER_COUNTERS = (
    "hits",
    "misses",
    "hit ratio",
    "stores",
    "evictions",
    "demotions",
    "promotions",
    "io_errors",
)


def _tier_table(tiers: list[dict[str, Any]]) -> str:
    header = ["tier", "medium", "used/capacity", *_TIER_COUNTERS]
    rows = []
    for tier in tiers:
        used, capacity = tier["used"], tier["capacity"]
        share = f"{used / capacity:.1%}" if capacity else "-"
        figures = {**tier, "hit ratio": _ratio(tier["hits"], tier["hits"] + tier["misses"])}
        rows.append(
            [
                tier["name"],
                tier["medium"],
                f"{used:,}/{capacity:,} ({share})",
                *(_number(figures[key]) for key in _TIER_COUNTERS),
            ]
        )
    return _table(header, rows, left=2)


def _tenant_table(tenants: dict[str, dict[str, Any]]) -> str:
    """Each tenant's share of each tier, and its leases."""
    names = [tier["name"] for tier in next(iter(tenants.values()))["tiers"]]
    rows = [
        [
            name,
            *(f"{t['used']:,}/{t['capacity']:,}" for t in snapshot["tiers"]),
            f"{snapshot['leases']['leases_held_blocks']:,}",
            f"{snapshot['leases']['leases_expired']:,}",
        ]
        for name, snapshot in tenants.items()
    ]
    return _table(["tenant", *names, "leased", "expired"], rows, left=1)


def _route_table(routes: list[dict[str, Any]]) -> str:
    if not routes:
        return "routes: no copies yet"
    rows = [[f"{r['src']}->{r['dst']}", f"{r['bytes']:,}", f"{r['gb_per_s']:.3f}"] for r in routes]
    return _table(["route", "bytes", "GB/s"], rows, left=1)


def _table(header: list[str], rows: list[list[str]], left: int) -> str:
    """Columns padded to their widest cell: the first ``left`` to the left, the rest
    (figures) to the right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _number(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


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


@_talks_to_daemon
def _run_events(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, not {args.count}")
    _with_client(args, functools.partial(_follow, args=args), args.namespace)
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
            _emit(_event_text(event, push["dropped"], batches, args.json, not args.namespace))
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


def _event_text(event: dict[str, Any], dropped: int, batch: int, as_json: bool, split: bool) -> str:
    """One line per event; ``split`` shows a key as ``<namespace id>:<client key>``. In
    JSON, ``batch`` numbers the pushes this reader received, from 1 (text mode prints a
    ``batch N (K events)`` line before each)."""
    if as_json:
        keys = [bytes(key).hex() for key in event["keys"]]
        return json.dumps({**event, "keys": keys, "dropped": dropped, "batch": batch})
    keys = [
        f"{key[:NAMESPACE_ID_BYTES].hex()}:{key[NAMESPACE_ID_BYTES:].hex()}"
        if split
        else bytes(key).hex()
        for key in event["keys"]
    ]
    shown = " ".join(keys[:_KEYS_SHOWN]) + (" ..." if len(keys) > _KEYS_SHOWN else "")
    count = f"{len(keys)} key{'s' if len(keys) != 1 else ''}"
    return f"{event['kind']} {event['medium']} {event['tier']} {count}: {shown}"


# -- tierd flush / clear / health -----------------------------------------------------------


@_talks_to_daemon
def _run_flush(args: argparse.Namespace) -> int:
    done = _with_client(args, Client.flush)
    if args.json:
        _emit(json.dumps(dataclasses.asdict(done)))
    elif done.dirty:
        _emit(f"copied {done.copied:,} blocks; {done.dirty:,} stayed dirty: {done.reason}")
    else:
        _emit(f"copied {done.copied:,} blocks; nothing left dirty")
    return EXIT_BAD_INPUT if done.dirty else EXIT_OK  # 1: the operation failed


def _configure_clear(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--tier", metavar="NAME", help="only this tier (default: every tier)")


@_talks_to_daemon
def _run_clear(args: argparse.Namespace) -> int:
    removed = _with_client(args, functools.partial(Client.clear, tier=args.tier))
    if args.json:
        _emit(json.dumps({"removed": removed, "tier": args.tier}))
    else:
        _emit(f"removed {removed:,} blocks")
    return EXIT_OK


@_talks_to_daemon
def _run_health(args: argparse.Namespace) -> int:
    try:
        health = _with_client(args, Client.health)
    except _CannotReach as exc:
        if not args.json:
            raise
        # A script asked for JSON: it gets JSON, whatever the answer.
        unreachable = {"ok": False, "error": "unreachable", "socket": exc.path}
        _emit(json.dumps({**unreachable, "detail": exc.reason}))
        return EXIT_UNREACHABLE
    if args.json:
        _emit(json.dumps({"ok": health["status"] == "ok", **health}))
    else:
        _emit(
            f"status       {health['status']}\n"
            f"version      {health['version']}\n"
            f"uptime       {_duration(health['uptime_s'])}\n"
            f"connections  {health['connections']:,}"
        )
    return EXIT_OK if health["status"] == "ok" else EXIT_BAD_INPUT


def _duration(seconds: float) -> str:
    """``42.1 s``, ``5m 03s``, ``2h 05m``, ``3d 04h``."""
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


COMMANDS: dict[str, Command] = {
    "stats": Command(
        "print the daemon's figures per tier, route and server", _configure_stats, _run_stats
    ),
    "events": Command(
        "print the blocks stored and removed in every tier as they happen",
        _configure_events,
        _run_events,
    ),
    "flush": Command("copy every dirty block down to the next tier", _add_common, _run_flush),
    "clear": Command("remove the blocks of every tier, or of one", _configure_clear, _run_clear),
    "health": Command(
        "check that the daemon answers and is not stopping", _add_common, _run_health
    ),
}
