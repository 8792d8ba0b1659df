"""What every remote level's calls keep of their faults: the circuit breaker, the counts
of calls that timed out, failed or found the pool full, and the note of the last failure
(logged at a bounded rate, so a dead server cannot flood the log).

Writes have a breaker of their own (``write_breaker``): a server can answer every read and
refuse every write (a read-only key, a full server, a bucket policy). A read answered closes
the call breaker, so writes that all fail would never open it; the write breaker opens after
``breaker_failures`` write batches in a row of which no block landed, and while it is open
writes are dropped at once (reads go on). After the back-off one write batch is let through;
one that lands a block closes it.

:class:`~tierd.remote.calls.RemoteCalls` (Redis) and :class:`~tierd.remote.s3_calls.S3Calls`
(S3) both keep them through :class:`CallNotes`, so that ``tierd stats`` and the metrics
read the same fields from either.
"""

from __future__ import annotations

import time
from typing import Protocol

from tierd.breaker import BreakerState, CircuitBreaker
from tierd.logs import get_logger

__all__ = ["CallNotes", "LevelSettings"]

log = get_logger("tierd.remote")

_LOG_EVERY_S = 10.0  # a dead server must not flood the log
_MAX_NOTE = 300  # characters of a failure's message kept in last_error


class LevelSettings(Protocol):
    """What the notes read of a level's settings (Redis's and S3's both have it)."""

    @property
    def name(self) -> str: ...
    @property
    def breaker_failures(self) -> int: ...
    @property
    def breaker_backoff_s(self) -> float: ...
    @property
    def breaker_max_backoff_s(self) -> float: ...


class CallNotes:
    """The breaker and the fault counts of one level's calls."""

    def __init__(self, settings: LevelSettings) -> None:
        self.name = settings.name
        self.breaker = CircuitBreaker(
            failures=settings.breaker_failures,
            backoff_s=settings.breaker_backoff_s,
            max_backoff_s=settings.breaker_max_backoff_s,
        )
        self.write_breaker = CircuitBreaker(
            failures=settings.breaker_failures,
            backoff_s=settings.breaker_backoff_s,
            max_backoff_s=settings.breaker_max_backoff_s,
        )
        self.writes_failed = 0  # write batches in a row of which no block landed
        self.timeouts = 0  # calls past the deadline
        self.errors = 0  # calls that failed (connection, error reply)
        self.busy = 0  # calls whose deadline passed while every pooled connection was in use
        self.last_error = ""
        self.last_error_at = 0.0  # wall-clock time of last_error (0: none yet)
        self.last_ok_at = 0.0  # wall-clock time of the last call answered
        self._last_logged = 0.0

    def record_error(self, text: str) -> None:
        """Note ``text`` as the last error, with its time (stats say how long ago, and
        whether calls were answered since)."""
        self.last_error, self.last_error_at = text, time.time()

    def answered(self) -> None:
        """A call was answered: the breaker closes, and stats may say the level works."""
        self.breaker.answered()
        self.last_ok_at = time.time()

    def note(self, exc: BaseException, what: str) -> None:
        """Note a failed call (``what``: "timed out", "unreachable", ...) and log it, at
        most once per ten seconds."""
        # The first line only, bounded: a client library's message may carry a whole
        # response body and a debug dump.
        text = str(exc).strip().split("\n", 1)[0][:_MAX_NOTE]
        self.record_error(f"{what}: {text}" if text else what)
        now = time.monotonic()
        if now - self._last_logged >= _LOG_EVERY_S:
            self._last_logged = now
            log.warning(
                "remote level call failed",
                remote=self.name,
                error=self.last_error,
                breaker=str(self.breaker.state),
            )

    def write_ended(self, landed: int, failed: int) -> None:
        """A write batch the write breaker let through ended: ``landed`` blocks written or
        found on the server, ``failed`` not (refused, unanswered). One that landed nothing
        and failed some is a failure of the write breaker; any other closes it."""
        if failed and not landed:
            self.writes_failed += 1
            was = self.write_breaker.state
            self.write_breaker.failed()
            if was is BreakerState.CLOSED and self.write_breaker.state is BreakerState.OPEN:
                log.warning(
                    "remote level refuses writes",
                    remote=self.name,
                    batches=self.writes_failed,
                    error=self.last_error,
                    retry_in_s=round(self.write_breaker.retry_in_s, 3),
                )
        else:
            self.writes_failed = 0
            self.write_breaker.answered()

    def problems(self) -> list[str]:
        """What keeps the level from working, in words (empty: nothing): an open breaker,
        writes that all fail."""
        out = []
        error = f" (last error: {self.last_error})" if self.last_error else ""
        if self.breaker.state is not BreakerState.CLOSED:
            out.append(f"breaker {self.breaker.state}: calls are refused{error}")
        if self.write_breaker.state is not BreakerState.CLOSED:
            out.append(
                f"writes refused: {self.writes_failed} write batches in a row landed no"
                f" block, write breaker {self.write_breaker.state}{error}"
            )
        return out

    def fault_stats(self) -> dict[str, object]:
        """The fields of ``stats()`` these notes own."""
        breaker = self.breaker
        return {
            "state": str(breaker.state),
            "breaker_opened": breaker.opened,
            "refused": breaker.refused,
            "write_state": str(self.write_breaker.state),
            "write_breaker_opened": self.write_breaker.opened,
            "writes_refused": self.write_breaker.refused,
            "busy": self.busy,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "last_error": self.last_error,
            "last_error_at": round(self.last_error_at, 3),
            # a call answered after the last error: the level works again
            "recovered": bool(self.last_error) and self.last_ok_at > self.last_error_at,
        }
