"""The SGLang backend's log lines, written where SGLang writes its own.

SGLang configures Python's standard ``logging`` (its root logger: INFO by default, its
own format, or ``SGLANG_LOGGING_CONFIG_PATH``) and never structlog, under which tierd's
loggers drop everything below WARNING (``tierd.logs``): the backend's start-up facts and
its answer to a clear would never show. So the SGLang backend writes through the
standard logger ``tierd.integrations.sglang``, and SGLang's handlers, format and level
apply to its lines. A line is the event, then its fields as ``key=value``.

:class:`Faults` reports errors of the backend's own code (a bug, not a daemon that
failed): each kind once with its traceback, then a count at most once a minute, so a
bug on every call neither hides as a miss nor floods SGLang's log.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["Faults", "EngineLog"]

# Kinds of fault told apart (type and where it was raised); past this many, one more.
_KINDS_MAX = 64
_REPEAT_EVERY_S = 60.0


class EngineLog:
    """structlog's calling style (``log.info("event", key=value)``) over a standard
    logger named ``name``."""

    __slots__ = ("_logger",)

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log(logging.ERROR, event, fields)

    def failure(self, event: str, exc: BaseException, **fields: Any) -> None:
        """``event`` at ERROR, with the traceback of ``exc``."""
        self._log(logging.ERROR, event, fields, exc)

    def _log(
        self, level: int, event: str, fields: dict[str, Any], exc: BaseException | None = None
    ) -> None:
        if not self._logger.isEnabledFor(level):
            return
        if not fields:
            self._logger.log(level, "%s", event, exc_info=exc)
            return
        text = " ".join(f"{key}={value}" for key, value in fields.items())
        self._logger.log(level, "%s: %s", event, text, exc_info=exc)


class Faults:
    """Errors of the backend's own code, counted and logged: the first of each kind (the
    exception's type and the line that raised it) at ERROR with its traceback, later
    ones of that kind as one WARNING line at most every ``every_s``, with how many came
    meanwhile. Thread-safe (SGLang's storage threads call the backend at once)."""

    def __init__(self, log: EngineLog, every_s: float = _REPEAT_EVERY_S) -> None:
        self._log = log
        self._every_s = every_s
        self._lock = threading.Lock()
        self._kinds: dict[str, _Seen] = {}
        self.count = 0

    def report(self, event: str, exc: BaseException, **fields: Any) -> None:
        kind = _kind(exc)
        now = time.monotonic()
        with self._lock:
            self.count += 1
            if kind not in self._kinds and len(self._kinds) >= _KINDS_MAX:
                kind = "other"
            seen = self._kinds.get(kind)
            if seen is None:
                self._kinds[kind] = _Seen(now)
                first, since = True, 0
            elif now - seen.logged >= self._every_s:
                first, since = False, seen.unlogged + 1
                seen.logged, seen.unlogged = now, 0
            else:
                seen.unlogged += 1
                return
        if first:
            self._log.failure(event, exc, error=f"{type(exc).__name__}: {exc}", **fields)
        else:
            self._log.warning(
                f"{event} again", error=f"{type(exc).__name__}: {exc}", times=since, **fields
            )


@dataclass(slots=True)
class _Seen:
    """One kind of fault: when it was last logged, and how many came since."""

    logged: float
    unlogged: int = 0


def _kind(exc: BaseException) -> str:
    """The exception's type and the place that raised it (its innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__qualname__}@{where}"
