"""A circuit breaker for calls an engine makes to the daemon (no engine imports).

An engine must never wait on a daemon that does not answer. Every call is bounded by a
deadline (:mod:`tierd.integrations.link`); this module decides when the daemon is to be
treated as gone without trying at all:

- **closed** (the normal state): calls are sent. Each failure (no answer within the
  deadline, the connection lost, nobody listening) counts; an answer, even an error
  answer such as ``capacity``, resets the count.
- **open**: after ``threshold`` consecutive failures, or at once when the daemon has
  answered nothing at all for a whole deadline although a call was waiting (connected
  but silent: stopped, frozen, swapped out), calls fail at once, unsent. The owner
  probes the daemon in the background; the first answer closes the breaker.

The state is read and changed from the engine's threads and the link's loop, so every
change holds a lock; reading :attr:`Breaker.is_open` takes none (one attribute load).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["Breaker", "BreakerSnapshot"]


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """The breaker's figures: ``opened`` counts transitions to open since start."""

    is_open: bool
    consecutive_failures: int
    opened: int
    failures: int
    fast_failures: int


class Breaker:
    """Counts consecutive failures; open after ``threshold`` of them or one silence.

    ``threshold`` of 0 disables the breaker (it never opens; every call is sent).
    """

    def __init__(self, threshold: int) -> None:
        if threshold < 0:
            raise ValueError(f"breaker threshold must be >= 0, not {threshold}")
        self.threshold = threshold
        self.is_open = False
        self._consecutive = 0
        self._opened = 0
        self._failures = 0
        self._fast_failures = 0
        self._last_answer = time.monotonic()
        self._lock = threading.Lock()
        self._closed_event = threading.Event()
        self._closed_event.set()

    @property
    def last_answer(self) -> float:
        """``time.monotonic()`` of the daemon's latest answer to any call."""
        return self._last_answer

    def answered(self) -> None:
        """The daemon answered a call (an error answer included)."""
        with self._lock:
            self._last_answer = time.monotonic()
            self._consecutive = 0

    def failed(self, *, silent_since: float | None = None) -> bool:
        """A call failed; ``silent_since`` is when it was sent if it failed for want of
        an answer. Returns whether the breaker opened now."""
        with self._lock:
            self._failures += 1
            self._consecutive += 1
            if self.is_open or not self.threshold:
                return False
            silent = silent_since is not None and self._last_answer < silent_since
            if silent or self._consecutive >= self.threshold:
                self.is_open = True
                self._opened += 1
                self._closed_event.clear()
                return True
            return False

    def refused(self) -> None:
        """A call failed at once because the breaker is open (counted, not sent)."""
        with self._lock:
            self._fast_failures += 1

    def close(self) -> bool:
        """The probe got an answer: calls are sent again. Returns whether it was open."""
        with self._lock:
            was_open = self.is_open
            self.is_open = False
            self._closed_event.set()
            self._consecutive = 0
            self._last_answer = time.monotonic()
            return was_open

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the breaker is closed; whether it is."""
        return self._closed_event.wait(timeout_s)

    def snapshot(self) -> BreakerSnapshot:
        with self._lock:
            return BreakerSnapshot(
                self.is_open, self._consecutive, self._opened, self._failures, self._fast_failures
            )
