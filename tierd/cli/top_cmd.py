"""``tierd top``: a live view of a running daemon, redrawn every ``--interval`` seconds.

Each frame comes from two consecutive ``stats`` snapshots (:func:`render_frame`, a pure
function): per tier its occupancy, hit ratio and counters; bytes per second on each copy
route and requests per second (differences between the snapshots over the time between
them); the chain's hit ratio; clients, leases and errors.

On a terminal the view is full-screen (curses) and ``q`` quits; with ``--plain``, or when
stdout is not a terminal, each frame is a block of plain lines followed by an empty line,
until Ctrl-C or ``--count`` frames. The socket is found as for the other client commands
(:func:`tierd.cli.control_cmd.socket_path`). Exit status: 0 on ``q``, Ctrl-C or after
``--count`` frames; 1 on an error reply; 3 when no daemon answers (at start or later).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE, Command, UsageError
from tierd.cli.control_cmd import CONNECT_TIMEOUT, add_socket_options, socket_path, trusted_uids
from tierd.client import Client, DaemonError, Unreachable

if TYPE_CHECKING:
    import curses

__all__ = ["COMMANDS", "render_frame"]

_QUIT_KEYS = frozenset(map(ord, "qQ"))
_REFUSALS = ("not_allowed", "busy")  # error codes of a connection the daemon turned away
_PIPE_WIDTH = 100  # line width of frames printed to a pipe or a file
_BAR_MIN, _BAR_MAX = 5, 40  # occupancy bar width, in characters
# (stats key, column label) of the per-tier counters table
_COUNTERS = (
    ("stores", "stores"),
    ("evictions", "evictions"),
    ("demotions", "demotions"),
    ("promotions", "promotions"),
    ("pinned", "pinned"),
    ("io_errors", "io errors"),
)


class _CannotReach(Exception):
    """No daemon to talk to at ``path`` (at the start, or any more)."""


# -- the command -----------------------------------------------------------------------------


def _configure(parser: argparse.ArgumentParser) -> None:
    add_socket_options(parser)
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="refresh every SECONDS"
    )
    parser.add_argument("--count", type=int, metavar="N", help="stop after N frames")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="print plain frames one after another (the default when stdout is not a terminal)",
    )
    parser.add_argument("--width", type=int, metavar="COLUMNS", help="line width of plain frames")


def _run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise UsageError(f"--interval takes a positive number of seconds, not {args.interval:g}")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, not {args.count}")
    if args.width is not None and args.width < 20:
        raise UsageError(f"--width must be at least 20, not {args.width}")
    path = socket_path(args)
    try:
        with asyncio.Runner() as runner:
            client = runner.run(_connect(path, trusted_uids(args)))
            try:
                _show(runner, _Feed(client), args)
            finally:
                runner.run(client.close())
    except _CannotReach as exc:
        return _fail(f"cannot reach the daemon at {path}: {exc}", EXIT_UNREACHABLE)
    except Unreachable as exc:
        return _fail(f"lost the daemon at {path}: {exc}", EXIT_UNREACHABLE)
    except DaemonError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


async def _connect(path: str, server_uids: tuple[int, ...] = ()) -> Client:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            return await Client.connect(path, map_pool=False, server_uids=server_uids)
    except TimeoutError:
        raise _CannotReach(f"no answer within {CONNECT_TIMEOUT:g} s") from None
    except Unreachable as exc:
        cause = exc.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc)
        raise _CannotReach(reason) from None
    except DaemonError as exc:
        if exc.code in _REFUSALS:
            raise _CannotReach(str(exc)) from None
        raise


def _show(runner: asyncio.Runner, feed: _Feed, args: argparse.Namespace) -> None:
    if args.plain or not sys.stdout.isatty():
        runner.run(_plain(feed, args))
        return
    import curses

    def view(screen: curses.window) -> None:
        runner.run(_live(screen, feed, args))

    curses.wrapper(view)


class _Feed:
    """Stats snapshots, each rendered against the one before."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.prev: dict[str, Any] | None = None
        self.taken = 0.0

    async def frame(self, width: int, interval: float) -> list[str]:
        cur = await self.client.stats()
        now = time.monotonic()
        lines = render_frame(self.prev, cur, now - self.taken, width)
        self.prev, self.taken = cur, now
        title = f"tierd top at {time.strftime('%H:%M:%S')}, every {interval:g} s"
        return [title[:width], *lines]


async def _plain(feed: _Feed, args: argparse.Namespace) -> None:
    width = args.width
    if width is None:
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else _PIPE_WIDTH
    frames = 0
    while True:
        # flushed: a reader at the other end of a pipe sees each frame as it comes
        print("\n".join(await feed.frame(width, args.interval)) + "\n", flush=True)
        frames += 1
        if args.count is not None and frames >= args.count:
            return
        await asyncio.sleep(args.interval)


async def _live(screen: curses.window, feed: _Feed, args: argparse.Namespace) -> None:
    import curses

    with contextlib.suppress(curses.error):
        curses.curs_set(0)
    screen.nodelay(True)
    loop = asyncio.get_running_loop()
    key_ready = asyncio.Event()
    # Woken by the terminal itself: no polling between frames.
    loop.add_reader(sys.stdin.fileno(), key_ready.set)
    try:
        frames = 0
        while True:
            height, width = screen.getmaxyx()
            lines = await feed.frame(max(1, width - 1), args.interval)
            _draw(screen, [*lines, "", "q quits"], height, width)
            frames += 1
            if args.count is not None and frames >= args.count:
                return
            if await _quit_before(screen, key_ready, loop.time() + args.interval):
                return
    finally:
        loop.remove_reader(sys.stdin.fileno())


async def _quit_before(screen: curses.window, key_ready: asyncio.Event, deadline: float) -> bool:
    """Wait until ``deadline`` (then False), a resize (False) or ``q`` (True)."""
    import curses

    while True:
        try:
            async with asyncio.timeout_at(deadline):
                await key_ready.wait()
        except TimeoutError:
            return False
        key_ready.clear()
        keys = set(iter(screen.getch, -1))
        if keys & _QUIT_KEYS:
            return True
        if curses.KEY_RESIZE in keys:
            return False


def _draw(screen: curses.window, lines: list[str], height: int, width: int) -> None:
    import curses

    screen.erase()
    for row, line in enumerate(lines[:height]):
        # The bottom-right cell cannot be written without curses complaining.
        with contextlib.suppress(curses.error):
            screen.addnstr(row, 0, line, max(0, width - 1))
    screen.refresh()


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status


# -- the frame (pure) ----------------------------------------------------------------------


def render_frame(
    prev: Mapping[str, Any] | None, cur: Mapping[str, Any], elapsed_s: float, width: int = 100
) -> list[str]:
    """The lines of one frame for the ``stats`` snapshot ``cur``, each at most ``width``
    characters. Rates (requests/s, route bytes/s) are the differences from ``prev``, taken
    ``elapsed_s`` seconds earlier; without ``prev`` (the first frame) they show ``-``."""
    rate_base = prev if prev is not None and elapsed_s > 0 else None
    # The header's figures are packed into as many lines as the width needs, never cut.
    header = [*_server_fields(rate_base, cur, elapsed_s), *_chain_fields(cur.get("chain") or {})]
    lines = [*_pack(header, width), ""]
    lines += _tier_lines(cur.get("tiers") or [], width)
    if cur.get("remote"):
        lines += ["", *_pack(_remote_fields(cur["remote"]), width)]
    lines += ["", *_route_lines(rate_base, cur.get("routes") or [], elapsed_s)]
    return [line[:width] for line in lines]


def _pack(fields: list[str], width: int) -> list[str]:
    """``fields`` two spaces apart, a new line whenever the next one would not fit (a
    field longer than the whole line is cut later, like any line)."""
    lines: list[str] = []
    line = ""
    for field in fields:
        if line and len(line) + 2 + len(field) > width:
            lines.append(line)
            line = field
        else:
            line = f"{line}  {field}" if line else field
    return [*lines, line]


def _server_fields(
    prev: Mapping[str, Any] | None, cur: Mapping[str, Any], elapsed_s: float
) -> list[str]:
    server = cur.get("server")
    if not server:
        return ["tierd (no server figures in this snapshot)"]
    requests = int(server.get("requests", 0))
    before = (prev or {}).get("server") or {}
    rate = _rate(requests - int(before["requests"]), elapsed_s) if "requests" in before else "-"
    errors: dict[str, int] = dict(server.get("errors") or {})
    detail = ", ".join(f"{code} {n:,}" for code, n in sorted(errors.items()))
    state = " (shutting down)" if server.get("shutting_down") else ""
    return [
        f"tierd {server.get('version', '?')}{state}",
        f"up {_duration(server.get('uptime_s', 0))}",
        f"clients {server.get('connections', 0):,}",
        f"leases {server.get('leases', 0):,}",
        f"subscribers {server.get('subscribers', 0):,}",
        f"requests {requests:,} ({rate}/s)",
        f"errors {sum(errors.values()):,}" + (f" ({detail})" if detail else ""),
    ]


def _chain_fields(chain: Mapping[str, Any]) -> list[str]:
    hit, miss = int(chain.get("hit_blocks", 0)), int(chain.get("miss_blocks", 0))
    return [
        f"chain hit ratio {_percent(hit, hit + miss)} ({hit:,} of {hit + miss:,} looked-up blocks)",
        f"lookups {int(chain.get('lookups', 0)):,}",
        f"events dropped {int(chain.get('events_dropped', 0)):,}",
    ]


def _tier_lines(tiers: list[Mapping[str, Any]], width: int) -> list[str]:
    """Two tables: occupancy and hit ratio (with a bar as wide as the line allows), then
    the counters."""
    if not tiers:
        return ["no tiers"]
    head = ["tier", "medium", "used/capacity", "use%", "hit%"]
    rows = [head, *(_occupancy_row(tier) for tier in tiers)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    # The bar takes what the other columns leave of the line, within bounds.
    bar = max(_BAR_MIN, min(_BAR_MAX, width - sum(widths) - 2 * len(widths) - 2))
    bars = [" " * (bar + 2)]
    bars += [_bar(int(t.get("used", 0)), int(t.get("capacity", 0)), bar) for t in tiers]
    occupancy = [[*row[:3], fill, *row[3:]] for row, fill in zip(rows, bars, strict=True)]
    counters = [["tier", *(label for _, label in _COUNTERS)]]
    counters += [
        [str(t.get("name", "?")), *(f"{int(t.get(key, 0)):,}" for key, _ in _COUNTERS)]
        for t in tiers
    ]
    return [*_table(occupancy, left=4), "", *_table(counters, left=1)]


def _remote_fields(remote: Mapping[str, Any]) -> list[str]:
    """The remote level in one packed paragraph: where, its breaker, its counters."""
    fields = [
        f"remote {remote.get('name', '?')} (REMOTE) {remote.get('endpoint', '?')}",
        f"breaker {remote.get('state', '?')}",
    ]
    for key in ("lookup_hits", "hits", "misses", "stores", "skipped", "corrupt", "timeouts"):
        fields.append(f"{key.replace('_', ' ')} {int(remote.get(key, 0)):,}")
    for key in ("errors", "dropped", "write_errors"):
        fields.append(f"{key.replace('_', ' ')} {int(remote.get(key, 0)):,}")
    if remote.get("last_error"):
        fields.append(f"last error: {remote['last_error']}")
    return fields


def _occupancy_row(tier: Mapping[str, Any]) -> list[str]:
    used, capacity = int(tier.get("used", 0)), int(tier.get("capacity", 0))
    hits, misses = int(tier.get("hits", 0)), int(tier.get("misses", 0))
    return [
        str(tier.get("name", "?")),
        str(tier.get("medium", "?")),
        f"{used:,}/{capacity:,}",
        _percent(used, capacity),
        _percent(hits, hits + misses),
    ]


def _table(rows: list[list[str]], *, left: int) -> list[str]:
    """Columns padded to their widest cell: the first ``left`` to the left, the rest
    (figures) to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _bar(used: int, capacity: int, width: int) -> str:
    filled = round(width * used / capacity) if capacity > 0 else 0
    filled = max(0, min(width, filled))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _route_lines(
    prev: Mapping[str, Any] | None, routes: list[Mapping[str, Any]], elapsed_s: float
) -> list[str]:
    if not routes:
        return ["routes: no copies yet"]
    before = (
        None
        if prev is None
        else {(r["src"], r["dst"]): int(r["bytes"]) for r in prev.get("routes") or []}
    )
    rows = [["route", "bytes/s", "total", "blocks", "failures", "in flight"]]
    for route in routes:
        moved = int(route.get("bytes", 0))
        rate = "-"
        if before is not None:
            # A route shows up in the stats with its first copy: absent before means 0 bytes.
            delta = max(0, moved - before.get((route["src"], route["dst"]), 0))
            rate = _size(delta / elapsed_s) + "/s"
        rows.append(
            [
                f"{route['src']}->{route['dst']}",
                rate,
                _size(moved),
                f"{int(route.get('blocks', 0)):,}",
                f"{int(route.get('failures', 0)):,}",
                _size(int(route.get("in_flight_bytes", 0))),
            ]
        )
    return _table(rows, left=1)


def _rate(delta: int, elapsed_s: float) -> str:
    return f"{max(0, delta) / elapsed_s:,.1f}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _size(amount: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if amount >= 1 << shift:
            return f"{amount / (1 << shift):.1f} {unit}"
    return f"{amount:.0f} B"


def _duration(seconds: float) -> str:
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f}s"


COMMANDS: dict[str, Command] = {
    "top": Command("a live view of a running daemon (q or Ctrl-C quits)", _configure, _run),
}
