"""How a client command finds the daemon and talks to it: the socket path, the uids
trusted to serve it, one connection per command, and the ways a conversation ends turned
into exit statuses.

The socket, first match wins: ``--socket PATH``; the ``TIERD_SOCKET`` variable; the
``socket.path`` of the config named by ``-c FILE`` (else ``$TIERD_CONFIG``), read with the
same layers as ``tierd serve`` (so ``TIERD_SOCKET__PATH`` overrides the file's); the
``TIERD_SOCKET__PATH`` variable, which moves the daemon's socket; the default path
(:func:`tierd.config.default_socket_path`). Past ``TIERD_SOCKET``, that is the socket
``tierd serve`` would bind in the same environment. No daemon answering on it (missing,
refused, not allowed, or silent for :data:`CONNECT_TIMEOUT` seconds) is exit status 3; an
error reply is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TypeVar

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNREACHABLE
from tierd.client import Client, DaemonError, Unreachable
from tierd.control.socketfile import (
    CONFIG_ENV,
    SOCKET_PATH_ENV,
    default_socket_path,
    socket_path_setting,
)

__all__ = [
    "CONNECT_TIMEOUT",
    "SOCKET_ENV",
    "CannotReach",
    "Handler",
    "add_socket_options",
    "socket_path",
    "talks_to_daemon",
    "trusted_uids",
    "unreachable_reason",
    "with_client",
]

SOCKET_ENV = "TIERD_SOCKET"
CONNECT_TIMEOUT = 10.0  # seconds for connect + hello; a live daemon answers in microseconds
_REFUSALS = ("not_allowed", "busy")  # error codes of a connection the daemon turned away

_T = TypeVar("_T")
Handler = Callable[[argparse.Namespace], int]


class CannotReach(Exception):
    """No daemon to talk to at ``path``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot reach the daemon at {path}: {reason}")
        self.path, self.reason = path, reason


def socket_path(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """The control socket the command talks to (the order is in the module docstring)."""
    env = os.environ if environ is None else environ
    if args.socket is not None:
        return str(args.socket)
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV]
    config = args.config if args.config is not None else env.get(CONFIG_ENV) or None
    if config is not None:
        from tierd.settings import load_settings  # the config models: only when named

        return str(load_settings(config, environ=env).socket.path)
    return socket_path_setting(env) or str(default_socket_path(env))


def trusted_uids(args: argparse.Namespace) -> tuple[int, ...]:
    """The uids ``--trust-uid`` names: whose daemon to talk to besides this user's and
    root's (a daemon run by a service user)."""
    return tuple(getattr(args, "trust_uid", None) or ())


def add_socket_options(parser: argparse.ArgumentParser) -> None:
    """``--socket``, ``-c/--config`` and ``--trust-uid``: how a client command finds the
    daemon, and whose daemon it will talk to."""
    parser.add_argument(
        "--trust-uid",
        type=int,
        action="append",
        metavar="UID",
        help="talk to a daemon run by this uid too (default: only this user's or root's;"
        " a socket served by anyone else is refused, as a squatter's would be)",
    )
    parser.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help=f"the daemon's control socket (default: ${SOCKET_ENV}, else the config's,"
        f" else ${SOCKET_PATH_ENV}, else the default path)",
    )
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        metavar="FILE",
        help=f"take the socket path from this config (default: ${CONFIG_ENV}, if set)",
    )


def talks_to_daemon(handler: Handler) -> Handler:
    """Turn the ways a daemon conversation ends into exit statuses and messages."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except CannotReach as exc:
            return _fail(str(exc), EXIT_UNREACHABLE)
        except DaemonError as exc:
            return _fail(str(exc), EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            return EXIT_OK
        # A reader that went away (``tierd events | head``) is handled once, in main.

    return run


def with_client(
    args: argparse.Namespace,
    work: Callable[[Client], Awaitable[_T]],
    namespace: str | None = None,
) -> _T:
    """Connect to the daemon, run ``work`` on the client in a fresh event loop, close."""
    path = socket_path(args)

    async def main() -> _T:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                client = await Client.connect(
                    path, namespace=namespace, map_pool=False, server_uids=trusted_uids(args)
                )
        except TimeoutError:
            raise CannotReach(path, f"no answer within {CONNECT_TIMEOUT:g} s") from None
        except DaemonError as exc:
            if exc.code in _REFUSALS:
                raise CannotReach(path, str(exc)) from None
            raise
        async with client:
            return await work(client)

    try:
        return asyncio.run(main())
    except Unreachable as exc:
        raise CannotReach(path, unreachable_reason(exc)) from None


def unreachable_reason(exc: BaseException) -> str:
    """Why a connection failed, said for the person at the terminal: a missing socket
    and a socket nobody listens on are told apart, with what to do about each."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    number = cause.errno if isinstance(cause, OSError) else None
    if number == errno.ENOENT:
        return (
            "no socket there: no daemon serves this path (start one with `tierd serve`,"
            f" or name the socket of a running one with --socket or ${SOCKET_ENV})"
        )
    if number == errno.ECONNREFUSED:
        return (
            "the socket is there but no daemon listens on it (connection refused: a"
            " daemon that was killed leaves its socket behind; `tierd serve` replaces it)"
        )
    if number in (errno.EACCES, errno.EPERM):
        return "permission denied (socket.mode and the tenants decide who may connect)"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(exc)


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status
