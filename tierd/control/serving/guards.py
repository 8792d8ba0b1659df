"""What one connection may hold of the daemon, and for how long.

The server's connections share these guards (``docs/RELIABILITY.md`` lists the bounds):

- :class:`PartialFrames`: the bytes buffered for frames that have not arrived whole,
  summed over every connection, under one budget. A connection whose unfinished frame
  would take the sum past it is closed (``busy``), so a few slow senders cannot hold the
  daemon's memory.
- :class:`Deadline`: a one-shot timer a connection arms and disarms: the hello deadline
  (a connection must say hello within ``limits.hello_timeout_s``), the frame deadline (a
  frame that has started must complete within ``limits.frame_deadline_s`` while the
  daemon reads) and the output stall (replies left unread for ``limits.output_stall_s``).
- :class:`RateLimitedLog`: one log line per reason per interval for events an attacker
  can repeat at will (refused connections, closed ones); the rest are counted in the
  line that follows and, always, in the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["Deadline", "PartialFrames", "RateLimitedLog"]


class PartialFrames:
    """Bytes of unfinished frames held for all connections, under ``budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0

    def change(self, before: int, after: int) -> bool:
        """Account a connection going from ``before`` to ``after`` buffered bytes.
        Returns False (and accounts nothing) when growing would pass the budget."""
        grown = after - before
        if grown > 0 and self.held + grown > self.budget:
            return False
        self.held += grown
        return True


class Deadline:
    """Calls ``expired`` ``seconds`` after :meth:`arm`, unless disarmed first."""

    def __init__(self, seconds: float, expired: Callable[[], None]) -> None:
        self.seconds = seconds
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self) -> None:
        """Start the countdown (again, from now)."""
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(self.seconds, self._fire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._expired()


class RateLimitedLog:
    """Warnings of one kind at most once per ``interval_s`` per reason, each saying how
    many of that reason went unlogged since the last one."""

    def __init__(self, logger: Any, event: str, interval_s: float = 10.0) -> None:
        self._log = logger
        self._event = event
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(self, reason: str, **fields: Any) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self._interval:
            self._suppressed[reason] += 1
            return
        self._last[reason] = now
        suppressed = self._suppressed.pop(reason, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        self._log.warning(self._event, reason=reason, **fields)
