"""The SGLang backend's log lines, written where SGLang writes its own.

SGLang configures Python's standard ``logging`` (its root logger: INFO by default, its
own format, or ``SGLANG_LOGGING_CONFIG_PATH``) and never structlog, under which tierd's
loggers drop everything below WARNING (``tierd.logs``): the backend's start-up facts and
its answer to a clear would never show. So the SGLang backend writes through the
standard logger ``tierd.integrations.sglang``, and SGLang's handlers, format and level
apply to its lines. A line is the event, then its fields as ``key=value``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["SglangLog"]


class SglangLog:
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

    def _log(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if not self._logger.isEnabledFor(level):
            return
        if not fields:
            self._logger.log(level, "%s", event)
            return
        text = " ".join(f"{key}={value}" for key, value in fields.items())
        self._logger.log(level, "%s: %s", event, text)
