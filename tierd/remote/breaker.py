"""A circuit breaker: after a few failed calls in a row, stop calling for a while.

A shared server that is down, full of timeouts or losing a cluster node must cost a
lookup at most one deadline, and then nothing: while the breaker is open every call is
refused at once (a miss). After the back-off one call is let through as a probe; if it
succeeds the breaker closes, if not it opens again for twice as long, up to a ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    PROBING = "probing"


class CircuitBreaker:
    """Counts consecutive failures; opens after ``failures`` of them."""

    def __init__(
        self,
        *,
        failures: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("need failures >= 1 and 0 < backoff_s <= max_backoff_s")
        self._threshold = failures
        self._initial = backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._failures = 0
        self._backoff = backoff_s
        self._open_until = 0.0
        self.state = BreakerState.CLOSED
        self.opened = 0  # how many times it opened
        self.refused = 0  # calls refused while open

    def allow(self) -> bool:
        """Whether a call may go ahead now; a refused call is counted."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() >= self._open_until:
            self.state = BreakerState.PROBING  # this caller is the probe
            return True
        self.refused += 1
        return False

    def success(self) -> None:
        self._failures = 0
        self._backoff = self._initial
        self.state = BreakerState.CLOSED

    def failure(self) -> None:
        self._failures += 1
        if self.state is BreakerState.PROBING:
            self._backoff = min(self._backoff * 2, self._max)
            self._open()
        elif self.state is BreakerState.CLOSED and self._failures >= self._threshold:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._open_until = self._clock() + self._backoff
        self.opened += 1

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe (0 unless open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._open_until - self._clock())
