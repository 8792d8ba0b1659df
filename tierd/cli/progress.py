"""What every long command shares: a progress bar on stderr, and Ctrl-C as a request to
stop early with the results so far.

The bar (tqdm) is drawn only when stderr is a terminal, unless ``--progress`` forces it
or ``--no-progress`` turns it off. The first Ctrl-C (SIGINT) asks the work to stop after
the requests already under way; the command then prints what it measured so far, marked
as interrupted, and exits :data:`EXIT_INTERRUPTED`. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped

__all__ = [
    "EXIT_INTERRUPTED",
    "Bar",
    "add_progress_option",
    "interrupted_line",
    "make_bar",
    "stop_flag",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: a bar when stderr is a terminal)."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: only when stderr is a terminal)",
    )


class Bar:
    """A tqdm bar on stderr, moved to absolute positions. A bar of seconds (``unit="s"``)
    shows no rate (it would say 1 s/s)."""

    def __init__(self, total: int, label: str, unit: str) -> None:
        timed = "{l_bar}{bar}| {n}/{total} s [{elapsed}<{remaining}{postfix}]"
        self._bar = tqdm(
            total=total,
            desc=label or None,
            unit=unit,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.1,
            bar_format=timed if unit == "s" else None,
        )

    def __call__(self, done: int, total: int, note: str = "") -> None:
        """Show ``done`` of ``total`` (the signature of the workloads' progress hooks)."""
        if total != self._bar.total:
            self._bar.total = total
        if done > self._bar.n:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(done - self._bar.n)
        elif note and note != self._bar.postfix:
            self._bar.set_postfix_str(note)  # no step, but news: draw it now

    def close(self) -> None:
        self._bar.close()


def make_bar(flag: bool | None, total: int, *, label: str = "", unit: str = "req") -> Bar | None:
    """A bar when ``flag`` (the ``--progress`` option) says so, or, when it is ``None``,
    when stderr is a terminal; else ``None``."""
    wanted = sys.stderr.isatty() if flag is None else flag
    return Bar(total, label, unit) if wanted else None


@contextlib.contextmanager
def stop_flag() -> Iterator[Callable[[], bool]]:
    """Yields a callable that turns true at the first Ctrl-C; a second Ctrl-C raises
    :class:`KeyboardInterrupt`. A plain signal handler, not the event loop's, so the flag
    turns even while a coroutine runs without yielding; wrap ``asyncio.run`` in it.
    Outside the main thread (where signals cannot be handled) the flag never turns."""
    requested = False

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal requested
        if requested:
            raise KeyboardInterrupt
        requested = True

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield lambda: requested
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupted_line(done: int, total: int, what: str = "requests") -> str:
    """The mark on a partial result."""
    return f"interrupted after {done:,} of {total:,} {what}"
