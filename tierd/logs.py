"""tierd's loggers: quiet in someone else's process until logging is configured.

structlog, left unconfigured, prints every line at every level (debug included) to the
terminal. That suits a program that owns its output, not a library: an application that
opens a chain in-process (``tierd.open``) and never configured structlog would see
tierd's info and debug lines on its console. So tierd's modules take their loggers from
:func:`get_logger`, which, while structlog is unconfigured, drops everything below
WARNING and changes nothing globally; once anybody calls ``structlog.configure`` (the
daemon does, from the config's ``logging`` section; an application may), every line
goes through that configuration as usual. structlog itself is imported at a logger's
first line, not with this module: a client command (``tierd stats``) that never logs
never pays for it (with rich installed, structlog's import takes longer than the rest of
the command).

:func:`debug_enabled` answers once whether debug lines would be written, so that a hot
path can test a plain boolean instead of going through structlog for every request.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["TierdLogger", "debug_enabled", "get_logger"]


class TierdLogger:
    """A logger named ``name``: structlog's configured one, or a WARNING filter while
    structlog is unconfigured (decided at each call, so configuring later takes effect)."""

    __slots__ = ("_configured", "_is_configured", "_quiet", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._configured: Any = None  # with the others, at the first line logged

    def _target(self) -> Any:
        if self._configured is None:
            import structlog

            self._quiet: Any = structlog.wrap_logger(
                None,
                wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                logger_factory_args=(self.name,),
            )
            self._is_configured = structlog.is_configured
            self._configured = structlog.get_logger(self.name)  # last: the others are set
        return self._configured if self._is_configured() else self._quiet

    def __getattr__(self, method: str) -> Any:
        # debug, info, warning, error, exception, bind, ...: the chosen logger's method.
        return getattr(self._target(), method)


def get_logger(name: str) -> Any:
    """The logger for tierd module ``name`` (see the module's docstring)."""
    return TierdLogger(name)


def debug_enabled(logger: Any) -> bool:
    """Whether ``logger`` (from :func:`get_logger` or structlog) writes debug lines now.
    Loggers without a level check (a custom wrapper class) count as not enabled."""
    bound = logger.bind()
    check = getattr(bound, "is_enabled_for", None)
    if check is None:
        check = getattr(bound, "isEnabledFor", None)
    return bool(check(logging.DEBUG)) if callable(check) else False
