"""The control socket: binding it safely, accepting peers, moving frames.

- :func:`bind_unix_socket` creates the socket file with its final mode and no window in
  which it is more open (bound inside a fresh 0700 directory, chmod-ed, then renamed into
  place). A socket file left by a crashed daemon (nobody accepts on it) is replaced; a
  live one is an error, "already running".
- :class:`Connection` is an :class:`asyncio.Protocol`: it checks the peer with
  ``SO_PEERCRED``, decodes frames, hands each message to its :class:`Session`, and writes
  the replies of one read in one call. When the client stops reading, the connection
  stops reading too (and event batches wait, then drop), so no buffer grows unbounded.
  Each connection has a number (``conn`` in log lines); at debug level its opening and
  closing are logged with the peer's pid and uid, so a request's ``conn`` names a process.
- :class:`Server` owns the listener and the connections: ``start``, ``stop_accepting``,
  ``drain`` (wait for running requests, up to a deadline) and ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import struct
import tempfile
from typing import Any, cast

import structlog

from tierd.control.context import ServerContext
from tierd.control.protocol import ErrorCode, FrameDecoder, FrameTooLarge, encode, error_reply
from tierd.control.session import Session
from tierd.errors import AlreadyRunning

__all__ = ["AlreadyRunning", "Connection", "Server", "bind_unix_socket", "peer_credentials"]

log = structlog.get_logger("tierd.control")

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """A listening Unix stream socket at ``path`` with permissions ``mode``."""
    _clear_stale(path)
    directory = os.path.dirname(os.path.abspath(path))
    private = tempfile.mkdtemp(prefix=".tierd-bind-", dir=directory)  # mode 0700
    staged = os.path.join(private, "sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(staged)
        os.chmod(staged, mode)
        # Listen before the path appears: a connect in between would be refused, and a
        # daemon starting at that moment would take the socket for a stale one.
        sock.listen(1024)
        os.rename(staged, path)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise
    finally:
        os.rmdir(private)
    return sock


def _clear_stale(path: str) -> None:
    """Remove a socket file nobody listens on; refuse to touch a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AlreadyRunning(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        log.warning("replacing a stale socket left by an earlier run", path=path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        raise AlreadyRunning(f"tierd is already running on {path}")
    finally:
        probe.close()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(raw)
    return pid, uid, gid


class Connection(asyncio.Protocol):
    """One client: frames in, replies and event pushes out."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.ctx = server.ctx
        self.id = server.new_connection_id()
        self.session = Session(server.ctx, self._send, self.id)
        self.decoder = FrameDecoder(server.ctx.limits.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self._batch: list[bytes] | None = None
        self._reading_paused = False
        self.peer: tuple[int, int, int] = (0, -1, -1)

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a stream server makes no other
        self.transport = transport
        self.server.connections.add(self)
        self.ctx.connections += 1
        refusal = self._refusal(transport)
        if refusal is not None:
            code, message = refusal
            self.ctx.count_error(code)
            log.warning("connection refused", reason=message, pid=self.peer[0], conn=self.id)
            transport.write(encode(error_reply(0, code, message)))
            transport.close()
        elif self.ctx.timing.debug:
            pid, uid, _ = self.peer
            log.debug("connection opened", conn=self.id, pid=pid, uid=uid)

    def _refusal(self, transport: asyncio.Transport) -> tuple[ErrorCode, str] | None:
        sock = transport.get_extra_info("socket")
        try:
            self.peer = peer_credentials(sock)
        except OSError as exc:
            return ErrorCode.NOT_ALLOWED, f"cannot read the peer's credentials: {exc.strerror}"
        _, uid, gid = self.peer
        ctx = self.ctx
        if uid != os.getuid() and uid not in ctx.allow_uids and gid not in ctx.allow_gids:
            return ErrorCode.NOT_ALLOWED, f"uid {uid} / gid {gid} is not allowed"
        if ctx.connections > ctx.limits.max_connections:
            return ErrorCode.BUSY, f"too many connections (limit {ctx.limits.max_connections})"
        if ctx.shutting_down:
            return ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"
        return None

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            messages = self.decoder.feed(data)
        except FrameTooLarge as exc:
            # Framing is lost: answer the whole frames that came before, then hang up.
            self._handle(transport, exc.before)
            self.ctx.count_error(ErrorCode.FRAME_TOO_LARGE)
            transport.write(encode(error_reply(0, exc.code, str(exc))))
            transport.close()
            return
        self._handle(transport, messages)
        if len(self.session.tasks) >= self.ctx.limits.max_requests_in_flight:
            self._pause_reading()
            for task in list(self.session.tasks):
                task.add_done_callback(self._maybe_resume)

    def _handle(self, transport: asyncio.Transport, messages: list[Any]) -> None:
        """Hand each message to the session; the replies of one read go out in one write."""
        batch: list[bytes] = []
        self._batch = batch
        try:
            for message in messages:
                self.session.handle(message)
        finally:
            self._batch = None
            if batch:
                transport.writelines(batch)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.ctx.connections -= 1
        if self.ctx.timing.debug:
            log.debug("connection closed", conn=self.id, requests_in_flight=len(self.session.tasks))
        self.session.writable.set()  # let a waiting event pump see the close
        self.session.close()
        self.transport = None

    def pause_writing(self) -> None:
        self.session.writable.clear()
        self._pause_reading()

    def resume_writing(self) -> None:
        self.session.writable.set()
        self._maybe_resume()

    # -- output and flow control ------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        frame = encode(message)
        if self._batch is not None:
            self._batch.append(frame)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _maybe_resume(self, *_: object) -> None:
        if (
            self._reading_paused
            and self.transport is not None
            and self.session.writable.is_set()
            and len(self.session.tasks) < self.ctx.limits.max_requests_in_flight
        ):
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Server:
    """Accepts clients on one Unix socket and serves them from ``ctx.chain``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.connections: set[Connection] = set()
        self.path: str | None = None
        self._inode: int | None = None
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._connections_made = 0
        ctx._open_leases = lambda: sum(len(c.session.leases) for c in self.connections)

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
        Returns whether everything finished in time."""
        tasks = self.running_tasks()
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        return not pending

    async def close(self) -> None:
        """Close every connection (releasing its leases) and remove the socket file."""
        self.stop_accepting()
        for conn in list(self.connections):
            conn.close()
            conn.session.close()
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
