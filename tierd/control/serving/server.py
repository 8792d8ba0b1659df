"""The control socket's server: the listener, its connections, draining and closing.

- :func:`~tierd.control.socketfile.bind_unix_socket` (in its own module) creates the
  socket file; :class:`Server` serves on it.
- :class:`~tierd.control.serving.connection.Connection` (in its own module) is one client's
  connection: frames, flow control, guards, descriptor passing.
- :class:`Server` owns the listener and the connections: ``start``, ``stop_accepting``,
  ``drain`` (wait for running requests, up to a deadline) and ``close``. When the daemon
  is full, the oldest connection that has not said hello makes room for a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog

from tierd.control.serving.connection import Connection
from tierd.control.serving.guards import PartialFrames, RateLimitedLog
from tierd.control.socketfile import bind_unix_socket, peer_credentials
from tierd.control.state.context import ServerContext
from tierd.errors import AlreadyRunning

__all__ = ["AlreadyRunning", "Connection", "Server", "bind_unix_socket", "peer_credentials"]

log = structlog.get_logger("tierd.control")


class Server:
    """Accepts clients on one Unix socket and serves them their tenants' chains."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.connections: set[Connection] = set()
        self.path: str | None = None
        self._inode: int | None = None
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._connections_made = 0
        # Connections that have not said hello yet, oldest first: the first to go when
        # the daemon is full, so silent sockets cannot lock clients out.
        self.silent: dict[Connection, None] = {}
        self.partial = PartialFrames(ctx.limits.partial_frame_bytes)
        self.refusals = RateLimitedLog(log, "connection refused")
        self.drops = RateLimitedLog(log, "connection dropped")

    def make_room(self) -> bool:
        """Close the oldest connection that has not said hello; False if there is none."""
        for conn in self.silent:
            conn.drop("made_room")
            self.silent.pop(conn, None)
            return True
        return False

    def new_connection_id(self) -> int:
        self._connections_made += 1
        return self._connections_made

    def bind(self, path: str, mode: int = 0o600) -> None:
        """Claim the socket path (fails with :class:`AlreadyRunning` if it is live)."""
        self.adopt(bind_unix_socket(path, mode), path)

    def adopt(self, sock: socket.socket, path: str) -> None:
        """Serve on a socket bound by :func:`bind_unix_socket`; ``close`` removes ``path``."""
        self._sock = sock
        self.path = path
        self._inode = os.stat(path).st_ino

    async def start(self, path: str | None = None, mode: int = 0o600) -> None:
        """Start accepting (binding ``path`` first unless :meth:`bind` was called)."""
        if path is not None:
            self.bind(path, mode)
        if self._sock is None:
            raise RuntimeError("bind the socket before starting the server")
        loop = asyncio.get_running_loop()
        sock, self._sock = self._sock, None
        self._server = await loop.create_unix_server(lambda: Connection(self), sock=sock)

    def stop_accepting(self) -> None:
        """Refuse new requests that start work; close the listener."""
        self.ctx.shutting_down = True
        if self._server is not None:
            self._server.close()

    def running_tasks(self) -> list[asyncio.Task[None]]:
        return [task for conn in self.connections for task in conn.session.tasks]

    async def drain(self, deadline_s: float) -> bool:
        """Wait up to ``deadline_s`` seconds for running requests; cancel what is left.
        Returns whether everything finished in time. The leases that closed connections
        left are ended now, at once (before the chains close)."""
        tasks = self.running_tasks()
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        await self._end_leases()
        return not pending

    async def _end_leases(self) -> None:
        """End at once every lease each tenant's closed connections left to the daemon."""
        for tenant in self.ctx.tenants.tenants:
            for each in tenant.each_size():
                await each.lease_ends.close()

    async def close(self) -> None:
        """Close every connection (ending its leases at once), stop the region copy threads
        (once what they run has ended) and remove the socket file."""
        self.stop_accepting()
        for conn in list(self.connections):
            conn.close()
            conn.session.close()
        await self._end_leases()
        self.ctx.copy_threads.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == self._inode:  # not a successor's socket
                    os.unlink(self.path)
            self.path = None
