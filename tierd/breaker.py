"""The one circuit breaker, and the one backoff of connection attempts.

**The breaker**: after a few failed calls in a row, stop calling for a while.

A server that does not answer (the daemon, for an engine; Redis or S3, for the daemon's
remote levels) must cost a call at most one deadline, and then nothing: while the
breaker is open every call is refused at once, unsent, and counted.

- **closed** (the normal state): calls go ahead (:meth:`CircuitBreaker.allow`). Each
  failure counts (:meth:`~CircuitBreaker.failed`); an answer, even an error answer,
  resets the count (:meth:`~CircuitBreaker.answered`).
- **open**: after ``failures`` consecutive failures, or at once when a call failed for
  want of an answer although nothing at all was answered since it was sent (a server
  connected but silent: stopped, frozen, swapped out).
- **leaving open**, one of two ways, chosen at construction:

  - ``backoff_s`` given: once it has passed, one call goes ahead as a probe
    (**probing**); its answer closes the breaker, its failure opens it again for twice
    as long, up to ``max_backoff_s``. The remote levels use this: their calls are the
    probes.
  - ``backoff_s=None``: it stays open until its owner, probing in the background, calls
    :meth:`~CircuitBreaker.close` on the first answer. An engine's link uses this, so no
    engine call is ever the probe.

``failures=0`` disables it (it never opens). The state is changed from several threads
(an engine's, and its link's loop), so every change holds a lock; reading
:attr:`~CircuitBreaker.is_open` takes none.

**The backoff** (:class:`Backoff`): after a failed connection attempt the next one waits,
twice as long each time up to a ceiling; a success, or a connection lost (rather than
refused), lets the next attempt go at once. Its owner holds the lock its threads share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Backoff", "BreakerSnapshot", "BreakerState", "CircuitBreaker"]

FIRST_BACKOFF_S = 0.05  # the wait after a first failed connection attempt


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    PROBING = "probing"


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """The breaker's figures: ``opened`` counts transitions to open since start,
    ``refused`` the calls refused while open."""

    is_open: bool
    consecutive_failures: int
    opened: int
    failures: int
    refused: int


class CircuitBreaker:
    """Counts consecutive failures; opens after ``failures`` of them or one silence."""

    def __init__(
        self,
        failures: int = 3,
        *,
        backoff_s: float | None = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 0:
            raise ValueError(f"breaker failures must be >= 0, not {failures}")
        if backoff_s is not None and not 0 < backoff_s <= max_backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")
        self.threshold = failures
        self._initial = backoff_s
        self._backoff = backoff_s or 0.0
        self._max = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._closed_event = threading.Event()
        self._closed_event.set()
        self._consecutive = 0
        self._open_until = 0.0
        self._last_answer = clock()
        self.state = BreakerState.CLOSED
        self.opened = 0  # how many times it opened
        self.refused = 0  # calls refused while open
        self.failures = 0  # failed calls, in all

    @property
    def is_open(self) -> bool:
        """Whether calls are refused (open, or a probe is under way)."""
        return self.state is not BreakerState.CLOSED

    @property
    def last_answer(self) -> float:
        """The clock's time of the latest answer to any call."""
        return self._last_answer

    def allow(self) -> bool:
        """Whether a call may go ahead now; a refused call is counted."""
        if self.state is BreakerState.CLOSED:
            return True
        with self._lock:
            if (
                self.state is BreakerState.OPEN
                and self._initial is not None
                and self._clock() >= self._open_until
            ):
                self.state = BreakerState.PROBING  # this caller is the probe
                return True
            self.refused += 1
            return False

    def answered(self) -> None:
        """A call was answered (an error answer included): the count starts again, and
        a probe's answer closes the breaker."""
        with self._lock:
            self._last_answer = self._clock()
            self._consecutive = 0
            if self.state is BreakerState.PROBING:
                self._close()

    def failed(self, *, silent_since: float | None = None) -> bool:
        """A call failed; ``silent_since`` is when it was sent if it failed for want of
        an answer. Returns whether the breaker opened now."""
        with self._lock:
            self.failures += 1
            self._consecutive += 1
            if self.state is BreakerState.PROBING:
                self._backoff = min(self._backoff * 2, self._max)
                return self._open()
            if self.state is BreakerState.OPEN or not self.threshold:
                return False
            silent = silent_since is not None and self._last_answer < silent_since
            if silent or self._consecutive >= self.threshold:
                return self._open()
            return False

    def close(self) -> bool:
        """The owner's probe got an answer: calls go ahead again. Whether it was open."""
        with self._lock:
            was_open = self.is_open
            self._last_answer = self._clock()
            self._close()
            return was_open

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the breaker is closed; whether it is."""
        return self._closed_event.wait(timeout_s)

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe may go (0 unless open with a back-off)."""
        if self.state is not BreakerState.OPEN or self._initial is None:
            return 0.0
        return max(0.0, self._open_until - self._clock())

    def snapshot(self) -> BreakerSnapshot:
        with self._lock:
            return BreakerSnapshot(
                self.is_open, self._consecutive, self.opened, self.failures, self.refused
            )

    def _open(self) -> bool:
        self.state = BreakerState.OPEN
        self._open_until = self._clock() + self._backoff
        self.opened += 1
        self._closed_event.clear()
        return True

    def _close(self) -> None:
        self.state = BreakerState.CLOSED
        self._consecutive = 0
        self._backoff = self._initial or 0.0
        self._closed_event.set()


class Backoff:
    """When the next connection attempt may be made."""

    def __init__(
        self,
        max_s: float,
        *,
        first_s: float = FIRST_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first = min(first_s, max_s)
        self._max = max_s
        self._clock = clock
        self._wait = self._first
        self._next = 0.0
        self._failed_at = 0.0

    def due(self, answered_at: float | None = None) -> bool:
        """Whether an attempt may be made now: its wait has passed, or the server
        answered (``answered_at``, on the same clock: another connection's answer, the
        breaker's :attr:`~CircuitBreaker.last_answer`) since the last attempt failed."""
        if answered_at is not None and answered_at > self._failed_at:
            return True
        return self._clock() >= self._next

    def failed(self) -> None:
        """An attempt failed: the next one waits, longer than the last."""
        self._failed_at = now = self._clock()
        self._next = now + self._wait
        self._wait = min(self._wait * 2, self._max)

    def hold_off(self) -> None:
        """The server answered but cannot serve us: the next attempt waits the longest,
        whatever it answers meanwhile."""
        self._failed_at = float("inf")
        self._next = self._clock() + self._max

    def succeeded(self) -> None:
        """An attempt succeeded: the waits start again from the first."""
        self._wait = self._first
        self._next = 0.0
        self._failed_at = 0.0

    def at_once(self) -> None:
        """A connection was lost, not refused: the next attempt may be made now."""
        self._next = 0.0
