"""``tierd serve``: run the daemon in the foreground until it is stopped; ``tierd stop``:
stop the daemon that serves a socket, and wait until its process is gone.

The config comes from the same layers as ``tierd config show`` (defaults < file <
``TIERD_*`` environment < ``--set``); an invalid one, or one whose tiers do not fit this
machine (see :mod:`tierd.preflight`), raises :class:`~tierd.errors.ConfigError` before
anything starts (exit status 78). Logging is reconfigured from the config's ``logging``
section by :func:`tierd.daemon.run_daemon`, replacing the command line's warnings-only
default. The exit status is the daemon's: 0 after a clean stop, 1 after a forced one (a
second signal), when another daemon already serves the socket, or when a store cannot be
opened.

``tierd stop`` sends the ``stop`` operation (the daemon drains, writes back and exits, as
on SIGTERM), then polls until the process is gone, for at most ``--timeout`` seconds.
Exit status: 0 stopped; 1 still running at the deadline, or the daemon refused; 3 no
daemon answers on the socket.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE, Command, add_sets
from tierd.cli.connection import (
    CONNECT_TIMEOUT,
    add_socket_options,
    socket_path,
    trusted_uids,
    unreachable_reason,
)
from tierd.client import Client, DaemonError, Unreachable
from tierd.control.socketfile import CONFIG_ENV
from tierd.errors import AlreadyRunning, StoreIOError
from tierd.share import shipped

__all__ = ["COMMANDS", "process_gone", "serve_config_file"]

EXIT_INTERRUPTED = 130  # Ctrl-C before the daemon installed its own signal handlers
STOP_TIMEOUT = 60.0  # default --timeout: the default grace (10 s) plus a slow write-back
_POLL_S = 0.05


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        help="the YAML config file (default: $TIERD_CONFIG, else the shipped tierd.yaml)",
    )
    add_sets(parser)


def serve_config_file(path: Path | None) -> Path | None:
    """The file ``tierd serve -c PATH`` runs: ``path``; else ``$TIERD_CONFIG`` (None: the
    settings read it); else the shipped default chain (a CPU pool over a disk tier in the
    XDG state directory)."""
    if path is None and not os.environ.get(CONFIG_ENV):
        return shipped("tierd.yaml")
    return path


def _run(args: argparse.Namespace) -> int:
    path = serve_config_file(args.config)
    if path is not None and args.config is None:
        print(
            f"tierd serve: no -c and no ${CONFIG_ENV}: running the default {path}", file=sys.stderr
        )
    # The config models, then the daemon's module with the stores (and torch): loaded only
    # to serve, not for `tierd stop` (nor `tierd config show`, which uses this module).
    from tierd.settings import load_settings

    cfg = load_settings(path, sets=args.sets)
    from tierd.daemon import run_daemon

    try:
        # A reload reads the same file again (the shipped one too, when none was named).
        return run_daemon(cfg, load=lambda: load_settings(path, sets=args.sets))
    except (AlreadyRunning, StoreIOError) as exc:  # a slab in use, say: already clear
        return _fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:  # the socket's directory is missing or not writable, say
        return _fail(f"cannot start the daemon: {exc}", EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _configure_stop(parser: argparse.ArgumentParser) -> None:
    add_socket_options(parser)
    parser.add_argument(
        "--timeout",
        type=float,
        default=STOP_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for the daemon to exit (default: {STOP_TIMEOUT:g})",
    )


def _run_stop(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        return _fail(f"--timeout must be positive, got {args.timeout:g}", EXIT_BAD_INPUT)
    path = socket_path(args)
    try:
        pid = asyncio.run(_send_stop(path, trusted_uids(args)))
    except TimeoutError:
        reason = f"no answer within {CONNECT_TIMEOUT:g} s"
        return _fail(f"cannot reach the daemon at {path}: {reason}", EXIT_UNREACHABLE)
    except (Unreachable, ConnectionError) as exc:
        reason = unreachable_reason(exc)
        return _fail(f"cannot reach the daemon at {path}: {reason}", EXIT_UNREACHABLE)
    except DaemonError as exc:
        if exc.code in ("not_allowed", "busy"):
            return _fail(f"cannot reach the daemon at {path}: {exc}", EXIT_UNREACHABLE)
        return _fail(str(exc), EXIT_BAD_INPUT)
    deadline = time.monotonic() + args.timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            message = f"the daemon (pid {pid}) is still running after {args.timeout:g} s"
            return _fail(message, EXIT_BAD_INPUT)
        time.sleep(_POLL_S)  # another process's exit: nothing to wait on but polling
    print(f"stopped the daemon at {path} (pid {pid})")
    return EXIT_OK


async def _send_stop(path: str, server_uids: tuple[int, ...] = ()) -> int:
    async with asyncio.timeout(CONNECT_TIMEOUT):
        client = await Client.connect(path, map_pool=False, server_uids=server_uids)
        async with client:
            reply = await client.request("stop")
    return int(reply["pid"])


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie waiting for its parent counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True  # gone between the two looks


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status


COMMANDS: dict[str, Command] = {
    "serve": Command("run the daemon in the foreground", _configure, _run),
    "stop": Command(
        "stop the daemon (drain, write back, exit) and wait until it is gone",
        _configure_stop,
        _run_stop,
    ),
}
