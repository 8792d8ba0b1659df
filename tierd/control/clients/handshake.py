"""A client's way in: reaching the daemon, checking who it is, and the hello exchange.

Before a request is sent, :func:`open_socket` connects to the socket path and
:func:`check_server` requires the process serving it to run as this user, as root, or
as a trusted uid (``SO_PEERCRED``), so a path bound first by another user is refused.
:func:`greet` then sends ``hello`` and reads its reply with ``recvmsg``, collecting the
pool descriptor the daemon passes beside it (SCM_RIGHTS) and mapping the pool.

It also owns the errors a client raises for its connection: :class:`Unreachable` (no
daemon answers), :class:`UntrustedDaemon` (the wrong one does) and :class:`DaemonError`
(an error reply, to hello or any later request).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from array import array
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from tierd.control.clients.pool import PoolMap
from tierd.control.protocol import PROTOCOL_VERSION, FrameDecoder, encode
from tierd.control.socketfile import peer_credentials
from tierd.errors import ProtocolError, TierdError

__all__ = [
    "HANGS_UP",
    "HELLO_ID",
    "DaemonError",
    "DaemonSilent",
    "Greeting",
    "Unreachable",
    "UntrustedDaemon",
    "check_server",
    "greet",
    "hello_reply",
    "hello_request",
    "open_socket",
    "recv_with_fds",
]

HELLO_ID = 1  # the request id of hello; a client's later requests count on from it
_MAX_FDS = 4  # descriptors accepted with the hello reply (the daemon passes one)


class DaemonError(TierdError):
    """The daemon answered with an error; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code

    @classmethod
    def of(cls, reply: dict[str, Any]) -> DaemonError:
        """The error an error reply carries."""
        return cls(str(reply.get("error")), str(reply.get("message")))

    @property
    def hangs_up(self) -> bool:
        """Whether the daemon closes the connection after this error (:data:`HANGS_UP`)."""
        return self.code in HANGS_UP


# The errors after which the daemon closes the connection (id 0: a frame it refused).
HANGS_UP = frozenset({"not_allowed", "busy", "shutting_down", "frame_too_large"})


class Unreachable(TierdError):
    """No daemon answers on the socket (missing, refused, or the connection was lost)."""


class DaemonSilent(Unreachable):
    """The daemon did not answer a call within its deadline."""


class UntrustedDaemon(Unreachable):
    """The socket is served by a process of another user: not a daemon to trust."""


@dataclass(frozen=True, slots=True)
class Greeting:
    """What hello brought: its reply's fields, the pool mapped from the descriptor passed
    with it (when asked for and named) and the messages that arrived behind it."""

    info: dict[str, Any]
    pool: PoolMap | None
    more: list[Any]


async def open_socket(loop: asyncio.AbstractEventLoop, path: str) -> socket.socket:
    """A non-blocking socket connected to ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, path)
    except OSError as exc:
        sock.close()
        raise Unreachable(f"cannot connect to {path}: {exc.strerror or exc}") from exc
    return sock


def check_server(sock: socket.socket, path: str, server_uids: Collection[int]) -> None:
    """Refuse a socket served by a process of another user, unless one of ``server_uids``."""
    try:
        pid, uid, _ = peer_credentials(sock)
    except OSError as exc:
        raise Unreachable(f"cannot read who serves {path}: {exc.strerror or exc}") from exc
    if uid in (os.getuid(), 0) or uid in server_uids:
        return
    raise UntrustedDaemon(
        f"refusing the socket {path}: it is served by uid {uid} (pid {pid}), not by this"
        f" user (uid {os.getuid()}) or root. Another user may have bound it first; if that"
        " daemon is the one you mean, trust its uid (server_uids)."
    )


async def greet(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    decoder: FrameDecoder,
    *,
    namespace: str | None,
    block_bytes: int | None,
    map_pool: bool,
) -> Greeting:
    """Say hello (naming ``namespace``; ``block_bytes`` must then match the daemon's) and
    map the pool when there is one and ``map_pool``. Every descriptor received is closed
    before this returns (the mapping keeps the memory)."""
    want_pool = map_pool and namespace is not None
    hello = hello_request(namespace, block_bytes, pool_fd=want_pool)
    fds: list[int] = []
    try:
        # Refused at accept, the daemon has hung up: its reason is waiting to be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await loop.sock_sendall(sock, encode(hello))
        replies = await _first_replies(loop, sock, decoder, fds)
        info = hello_reply(replies[0])
        pool = None
        named = info.get("pool")
        if want_pool and named is not None:
            if not fds:
                raise ProtocolError("the daemon named a pool but did not pass it")
            pool = PoolMap(fds[0], block_bytes=info["block_bytes"], **named)
    finally:
        for fd in fds:
            os.close(fd)  # mapped (the mapping keeps the memory) or not wanted
    return Greeting(info, pool, replies[1:])


async def _first_replies(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, decoder: FrameDecoder, fds: list[int]
) -> list[Any]:
    """Read until the first whole reply (the hello's), collecting the descriptors passed
    with it into ``fds``; the messages decoded so far."""
    while True:
        try:
            data = recv_with_fds(sock, fds)
        except BlockingIOError:
            await _readable(loop, sock)
            continue
        except OSError as exc:
            raise Unreachable(f"the connection was lost: {exc.strerror or exc}") from exc
        if not data:
            raise Unreachable("the daemon closed the connection before its hello reply")
        messages = decoder.feed(data)
        if messages:
            return messages


def recv_with_fds(sock: socket.socket, fds: list[int]) -> bytes:
    """One ``recvmsg`` on ``sock``: the bytes, the descriptors passed with them added to
    ``fds`` (the caller's to close)."""
    data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(_MAX_FDS * 4))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array("i", payload[: len(payload) - len(payload) % 4]))
    return data


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def hello_request(
    namespace: str | None, block_bytes: int | None, *, pool_fd: bool
) -> dict[str, Any]:
    """The hello request (id :data:`HELLO_ID`) naming ``namespace`` and ``block_bytes``."""
    hello: dict[str, Any] = {"id": HELLO_ID, "op": "hello", "version": PROTOCOL_VERSION}
    hello["pool_fd"] = pool_fd
    if namespace is not None:
        hello["namespace"] = namespace
    if block_bytes is not None:
        hello["block_bytes"] = block_bytes
    return hello


def hello_reply(message: Any) -> dict[str, Any]:
    """The hello reply's fields, or the error the daemon answered with."""
    if not isinstance(message, dict):
        raise ProtocolError("the daemon's first reply is not a map")
    if not message.get("ok"):
        raise DaemonError.of(message)
    return message
