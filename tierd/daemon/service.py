"""What a service manager sees of the daemon's process: ``sd_notify`` messages to
systemd, the pid file beside the socket, and where and how the logs are written
(structlog: JSON under a service manager, key-value on a terminal).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from tierd.config import LoggingConfig

__all__ = [
    "START_STEP_GRACE_S",
    "start_progress",
    "configure_logging",
    "remove_pid_file",
    "sd_notify",
    "write_pid_file",
]

log = structlog.get_logger("tierd")


def sd_notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``) to systemd's notify socket, if the
    service runs under one (``NOTIFY_SOCKET``); returns whether it was sent."""
    target = (os.environ if environ is None else environ).get("NOTIFY_SOCKET")
    if not target:
        return False
    address = "\0" + target[1:] if target.startswith("@") else target
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError as exc:
            log.warning("cannot notify systemd", socket=target, error=exc.strerror)
            return False
    return True


# Each piece of start-up progress (a GiB of the CPU pool allocated or pinned) buys this
# much more time from systemd (EXTEND_TIMEOUT_USEC): a start that keeps making progress
# is never killed by TimeoutStartSec=, one that hangs is, this long after its last step.
START_STEP_GRACE_S = 60


def start_progress(environ: dict[str, str] | None = None) -> Callable[[str, int, int], None]:
    """A progress callback for opening the tiers (``stage, done, total`` in bytes) that
    tells systemd the start is alive: ``EXTEND_TIMEOUT_USEC`` and a ``STATUS`` line."""

    def progress(stage: str, done: int, total: int) -> None:
        mib = 1 << 20
        status = f"STATUS={stage} the CPU pool: {done // mib:,} of {total // mib:,} MiB"
        sd_notify(f"EXTEND_TIMEOUT_USEC={START_STEP_GRACE_S * 1_000_000}\n{status}", environ)

    return progress


def configure_logging(cfg: LoggingConfig, stream: Any = None) -> None:
    """structlog to stderr: JSON under a service manager (or ``format: json``), key-value
    on a terminal."""
    stream = sys.stderr if stream is None else stream
    as_json = cfg.format == "json" or (cfg.format == "auto" and not stream.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(stream),
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        cache_logger_on_first_use=False,
    )


def write_pid_file(path: Path) -> None:
    """Write this process's pid to ``path`` (atomically, replacing a stale one: the caller
    holds the socket, so no live daemon owns it). The temporary file is created with
    ``O_EXCL|O_NOFOLLOW`` under a name nobody can guess (``mkstemp``), so a link planted
    in the directory is never written through; the rename replaces a link at ``path``
    itself rather than following it."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), 0o644)
            file.write(f"{os.getpid()}\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def remove_pid_file(path: Path) -> None:
    """Remove ``path`` if it still names this process (read without following a link:
    a link there is not ours)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as file:
            mine = file.read(32).strip() == str(os.getpid())
        if mine:
            path.unlink()
    except (OSError, ValueError):
        pass  # gone already, a link, or another daemon's now
