"""``tierd top``: a live view of a running daemon, redrawn every ``--interval`` seconds.

Each frame comes from two consecutive ``stats`` snapshots
(:func:`tierd.cli.top_frame.render_frame`, a pure function): per tier its occupancy, hit
ratio and counters; bytes per second on each copy route and requests per second
(differences between the snapshots over the time between them); the chain's hit ratio;
clients, leases and errors. This module owns the command: connecting, and the curses and
plain loops that draw the frames.

On a terminal the view is full-screen (curses) and ``q`` quits; with ``--plain``, or when
stdout is not a terminal, each frame is a block of plain lines followed by an empty line,
until Ctrl-C or ``--count`` frames. The socket is found as for the other client commands
(:func:`tierd.cli.connection.socket_path`).

A daemon that goes away later (stopped, restarted, crashed) is waited for: top says so,
tries to connect again every ``--interval`` seconds until Ctrl-C, says when it is back
and goes on (its counters start again; ``--count`` counts frames of stats only). Exit
status: 0 on ``q``, Ctrl-C or after ``--count`` frames; 1 on an error reply; 3 when no
daemon answers at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE, Command, UsageError
from tierd.cli.connection import (
    CONNECT_TIMEOUT,
    add_socket_options,
    socket_path,
    trusted_uids,
    unreachable_reason,
)
from tierd.cli.top_frame import render_frame
from tierd.client import Client, DaemonError, Unreachable

if TYPE_CHECKING:
    import curses

__all__ = ["COMMANDS"]

_QUIT_KEYS = frozenset(map(ord, "qQ"))
_REFUSALS = ("not_allowed", "busy")  # error codes of a connection the daemon turned away
_PIPE_WIDTH = 100  # line width of frames printed to a pipe or a file


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
            feed = _Feed(client, path, trusted_uids(args))
            try:
                _show(runner, feed, args)
            finally:
                runner.run(feed.close())
    except _CannotReach as exc:
        return _fail(f"cannot reach the daemon at {path}: {exc}", EXIT_UNREACHABLE)
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
        raise _CannotReach(unreachable_reason(exc)) from None
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
    """Stats snapshots, each rendered against the one before; a daemon that went away is
    waited for (``say`` shows the notes meanwhile), and its frames start afresh."""

    def __init__(self, client: Client, path: str, server_uids: tuple[int, ...]) -> None:
        self.client: Client | None = client
        self.path, self.server_uids = path, server_uids
        self.prev: dict[str, Any] | None = None
        self.taken = 0.0
        self.back = ""  # the note that the daemon came back, for the next frame
        self.say: Callable[[list[str]], None] = lambda lines: None

    async def frame(self, width: int, interval: float) -> list[str]:
        cur = await self._stats(interval)
        now = time.monotonic()
        lines = render_frame(self.prev, cur, now - self.taken, width)
        self.prev, self.taken = cur, now
        title = f"tierd top at {time.strftime('%H:%M:%S')}, every {interval:g} s"
        notes, self.back = ([self.back[:width]] if self.back else []), ""
        return [title[:width], *notes, *lines]

    async def _stats(self, interval: float) -> dict[str, Any]:
        """The next snapshot, from this daemon or, once it went away, the next one."""
        while True:
            if self.client is None:
                self.client = await self._come_back(interval)
            try:
                return await self.client.stats()
            except (Unreachable, DaemonError) as exc:
                if isinstance(exc, DaemonError) and exc.code != "shutting_down":
                    raise
                await self.close()
                self.say(
                    [
                        f"{time.strftime('%H:%M:%S')} the daemon at {self.path} went away"
                        f" ({exc}); waiting for it to come back (Ctrl-C quits)"
                    ]
                )

    async def _come_back(self, interval: float) -> Client:
        """Connect again every ``interval`` seconds until a daemon answers."""
        while True:
            try:
                client = await _connect(self.path, self.server_uids)
            except _CannotReach:
                # Another process's socket: nothing to wait on but trying again.
                await asyncio.sleep(interval)
                continue
            self.prev = None  # a new daemon's counters start again
            self.back = f"{time.strftime('%H:%M:%S')} the daemon is back; its counters start again"
            return client

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()


async def _plain(feed: _Feed, args: argparse.Namespace) -> None:
    width = args.width
    if width is None:
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else _PIPE_WIDTH
    feed.say = lambda lines: print("\n".join(lines) + "\n", flush=True)
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
    feed.say = lambda lines: _draw(screen, lines, *screen.getmaxyx())
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


COMMANDS: dict[str, Command] = {
    "top": Command("a live view of a running daemon (q or Ctrl-C quits)", _configure, _run),
}
