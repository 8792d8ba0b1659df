"""One client's connection: frames in, replies and event pushes out, and its guards.

:class:`Connection` is an :class:`asyncio.Protocol`: it finds the peer's tenant from its
``SO_PEERCRED`` credentials (refusing a peer of no tenant), passes the tenant's pool
descriptor with the hello reply that asks for it (SCM_RIGHTS), decodes frames, hands each
message to its :class:`~tierd.control.serving.session.Session`, and writes the replies of one
read in one call. When the client stops reading, the connection stops reading too (and
event batches wait, then drop), so no buffer grows unbounded. The guards of
:mod:`~tierd.control.serving.guards` close a connection that sends no hello, leaves a frame
unfinished, or leaves its replies unread. Each connection has a number (``conn`` in log
lines); at debug level its opening and closing are logged with the peer's pid and uid,
so a request's ``conn`` names a process.

A connection knows the server that accepted it only through :class:`Listener`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from array import array
from collections import deque
from typing import Any, Protocol, cast

import structlog

from tierd.control.protocol import (
    PASS_FDS,
    DecodeLimits,
    ErrorCode,
    FrameDecoder,
    FrameTooLarge,
    encode,
    error_reply,
)
from tierd.control.serving.guards import Deadline, PartialFrames, RateLimitedLog
from tierd.control.serving.session import Session
from tierd.control.socketfile import peer_credentials
from tierd.control.state.context import ServerContext

__all__ = ["MAX_REGION_JOBS", "Connection", "Listener"]

# Region jobs one connection runs at once; more wait in its backlog (and reading pauses):
# what a queued job holds (its pins, its offsets) is bounded per connection, and so is
# how much of the loop and of the copy queues one connection's pipeline takes. A job
# beyond the lease bounds is refused and may be sent again at once, each time costing the
# loop a parse of all its keys: the more a connection runs at once, the more a busy
# neighbour slows a bystander's loads. 4 keeps that small and big jobs through the disk
# tier as fast as more in flight would.
MAX_REGION_JOBS = 4
_JOB_OPS = frozenset({"region_load", "region_store"})


def _is_job(message: object) -> bool:
    return type(message) is dict and message.get("op") in _JOB_OPS


log = structlog.get_logger("tierd.control")


class Listener(Protocol):
    """What a connection asks of the server that accepted it."""

    ctx: ServerContext
    connections: set[Connection]  # every open connection
    silent: dict[Connection, None]  # those that have not said hello yet, oldest first
    partial: PartialFrames  # the budget of bytes of unfinished frames, all connections'
    refusals: RateLimitedLog  # "connection refused" lines
    drops: RateLimitedLog  # "connection dropped" lines

    def new_connection_id(self) -> int:
        """A number for a new connection, for log lines."""
        ...

    def make_room(self) -> bool:
        """Close the oldest connection that has not said hello; False if there is none."""
        ...


class Connection(asyncio.Protocol):
    """One client: frames in, replies and event pushes out.

    Decoded requests wait in ``backlog`` and are handed to the session only while the
    connection has room: fewer than ``max_requests_in_flight`` running, and its unsent
    replies plus the replies reserved by running ``get`` requests under
    ``output_buffer_bytes``. Past that the connection stops reading; it reads again as
    replies drain. A client that never reads therefore holds at most about one limit's
    worth of replies (plus one reply), and after ``output_stall_s`` it is closed."""

    def __init__(self, server: Listener) -> None:
        self.server = server
        self.ctx = ctx = server.ctx
        self.id = server.new_connection_id()
        self.session = Session(ctx, self.send, self.id, line=self)
        self.registrations = self.session.regions.registrations
        limits = ctx.limits
        self.decoder = FrameDecoder(
            limits.max_frame_bytes,
            DecodeLimits.for_requests(limits.max_keys_per_request, limits.max_frame_bytes),
        )
        self.transport: asyncio.Transport | None = None
        self.backlog: deque[Any] = deque()
        self._batch: list[bytes] | None = None
        self._batch_bytes = 0
        self._reserved = 0  # bytes of replies promised by running get requests
        self._jobs = 0  # region jobs running (see MAX_REGION_JOBS)
        self._reading_paused = False
        self._hello = Deadline(limits.hello_timeout_s, self._no_hello_in_time)
        self._frame = Deadline(limits.frame_deadline_s, lambda: self.drop("frame_deadline"))
        self._stall = Deadline(limits.output_stall_s, self._stalled)
        self._stall_mark = 0  # unsent bytes when the stall clock started
        self.peer: tuple[int, int, int] = (0, -1, -1)

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a stream server makes no other
        self.transport = transport
        self.server.connections.add(self)
        self.ctx.connections += 1
        refusal = self._refusal(transport)
        if refusal is not None:
            code, reason, message = refusal
            self.ctx.count_error(code)
            self.ctx.refused[reason] += 1
            self.server.refusals(reason, message=message, pid=self.peer[0], conn=self.id)
            transport.write(encode(error_reply(0, code, message)))
            transport.close()
            return
        self.server.silent[self] = None
        self._hello.arm()
        if self.ctx.timing.debug:
            pid, uid, _ = self.peer
            log.debug("connection opened", conn=self.id, pid=pid, uid=uid)

    def _refusal(self, transport: asyncio.Transport) -> tuple[ErrorCode, str, str] | None:
        sock = transport.get_extra_info("socket")
        try:
            self.peer = peer_credentials(sock)
        except OSError as exc:
            message = f"cannot read the peer's credentials: {exc.strerror}"
            return ErrorCode.NOT_ALLOWED, "credentials", message
        _, uid, gid = self.peer
        ctx = self.ctx
        grant = ctx.tenants.identify(uid, gid)
        if grant is None:
            return ErrorCode.NOT_ALLOWED, "not_allowed", f"uid {uid} / gid {gid} is not allowed"
        self.session.admit(grant)
        if ctx.shutting_down:
            return ErrorCode.SHUTTING_DOWN, "shutting_down", "the daemon is shutting down"
        if ctx.connections > ctx.limits.max_connections and not self.server.make_room():
            limit = ctx.limits.max_connections
            return ErrorCode.BUSY, "busy", f"too many connections (limit {limit})"
        return None

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        before = self.decoder.buffered
        try:
            messages = self.decoder.feed(data)
        except FrameTooLarge as exc:
            # Framing is lost: answer the whole frames that came before, then hang up.
            self.server.partial.change(before, 0)
            self.backlog.extend(exc.before)
            self._work()
            self.ctx.count_error(ErrorCode.FRAME_TOO_LARGE)
            transport.write(encode(error_reply(0, exc.code, str(exc))))
            transport.close()
            return
        if not self._account_partial(before, messages):
            return
        self.backlog.extend(messages)
        self._work()

    def _account_partial(self, before: int, messages: list[Any]) -> bool:
        """Charge the unfinished frame to the shared budget and (re)arm its deadline."""
        after = self.decoder.buffered
        if not self.server.partial.change(before, after):
            self.server.partial.change(before, 0)
            self.decoder = FrameDecoder(0)  # forget the bytes: the connection is done
            budget = self.server.partial.budget
            message = (
                f"unfinished frames of all connections would pass {budget} bytes;"
                " send whole frames sooner"
            )
            self.drop("partial_budget", message=message)
            return False
        if after == 0:
            self._frame.disarm()
        elif messages or not self._frame.armed:
            self._frame.arm()  # a frame has started (or one completed and the next began)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.silent.pop(self, None)
        self.server.partial.change(self.decoder.buffered, 0)
        # Free the unfinished frame now: the session's reply callback keeps this object
        # alive (a cycle only the cyclic collector breaks), and with it the decoder.
        self.decoder = FrameDecoder(0)
        self.ctx.connections -= 1
        for deadline in (self._hello, self._frame, self._stall):
            deadline.disarm()
        self.backlog.clear()
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
        self._work()

    # -- requests, output and flow control ----------------------------------------------

    def _work(self, *_: object) -> None:
        """Hand waiting requests to the session while there is room; pause reading when
        there is not (and while requests wait), read again once all are handed over.
        The replies of one pass go out in one write."""
        transport = self.transport
        if transport is None:
            return
        batch: list[bytes] = []
        self._batch, self._batch_bytes = batch, 0
        try:
            while self.backlog and self._has_room(transport):
                self._handle(self.backlog.popleft())
        finally:
            self._batch = None
            if batch and not transport.is_closing():
                transport.writelines(batch)
        if self.session.greeted and self in self.server.silent:
            del self.server.silent[self]
            self._hello.disarm()
        if self.backlog or not self._has_room(transport):
            self._pause_reading()
        elif self._reading_paused and not transport.is_closing():
            self._reading_paused = False
            self._stall.disarm()
            transport.resume_reading()
            if self.decoder.buffered:
                self._frame.arm()

    def _has_room(self, transport: asyncio.Transport) -> bool:
        limits = self.ctx.limits
        if self.registrations.busy:
            return False  # nothing is read or handled while a region is registered
        if len(self.session.tasks) >= limits.max_requests_in_flight:
            return False
        if self._jobs >= MAX_REGION_JOBS and self.backlog and _is_job(self.backlog[0]):
            return False  # the next region job waits, unread beyond it, for one to end
        if not self.session.writable.is_set():
            return False
        unsent = transport.get_write_buffer_size() + self._batch_bytes + self._reserved
        return unsent < limits.output_buffer_bytes

    def _handle(self, message: Any) -> None:
        """One request to the session; a ``get`` reserves its reply's bytes until done."""
        registering = type(message) is dict and message.get("op") == "register_region"
        if registering:  # its descriptor comes next, on the socket itself
            self.registrations.begin(clean=not self.backlog and not self.decoder.buffered)
        task = self.session.handle(message)
        if registering:
            self.registrations.follow(task)
        if task is None:
            return
        if _is_job(message):
            self._jobs += 1
            task.add_done_callback(self._job_ended)
        if type(message) is dict and message.get("op") == "get":
            keys = message.get("keys")
            tenant = self.session.tenant
            block = tenant.block_bytes if tenant is not None else self.ctx.default_block_bytes
            cost = len(keys) * block if isinstance(keys, list) else 0
            self._reserved += cost
            task.add_done_callback(lambda _: self._release(cost))
        task.add_done_callback(self._work)

    def _job_ended(self, _: object) -> None:
        self._jobs -= 1

    def _release(self, cost: int) -> None:
        self._reserved -= cost

    def send(self, message: dict[str, Any]) -> None:
        """Write ``message`` to the client (descriptors it names passed beside it)."""
        fds = message.pop(PASS_FDS, None)
        frame = encode(message)
        if fds:
            self._send_with_fds(frame, fds)
            return
        if self._batch is not None:
            self._batch.append(frame)
            self._batch_bytes += len(frame)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)

    def _send_with_fds(self, frame: bytes, fds: list[int]) -> None:
        """Send ``frame`` with descriptors attached (SCM_RIGHTS). Everything before it
        goes out first; the descriptors ride on the frame's first bytes, so the client
        receives them with the reply they belong to."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._batch:
            transport.writelines(self._batch)
            self._batch.clear()
            self._batch_bytes = 0
        if transport.get_write_buffer_size():
            # Replies the client has not read are still queued: the frame would overtake
            # them. A client asks for its pool in its first request, so this is a client
            # that piled requests before its hello and did not read their errors.
            self.drop("fd_blocked")
            return
        fd = transport.get_extra_info("socket").fileno()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(fd)) as sock:
            try:
                sent = sock.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))]
                )
            except BlockingIOError:
                sent = -1
            except OSError:
                transport.close()
                return
        if sent < 0:
            self.drop("fd_blocked")
        elif sent < len(frame):
            transport.write(frame[sent:])

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self._frame.disarm()  # a frame is not late while the daemon is not reading
            self.transport.pause_reading()
        unsent = self.transport.get_write_buffer_size() if self.transport is not None else 0
        if not unsent:
            self._stall.disarm()
        elif not self._stall.armed:
            self._stall_mark = unsent
            self._stall.arm()

    def _stalled(self) -> None:
        """The stall clock ran out: close the connection unless the client read some of
        its replies meanwhile (then the clock starts again)."""
        if self.transport is None:
            return
        unsent = self.transport.get_write_buffer_size()
        if unsent and unsent >= self._stall_mark:
            self.drop("output_stall")
        elif unsent:
            self._stall_mark = unsent
            self._stall.arm()

    def _no_hello_in_time(self) -> None:
        opening = self.session.opening_size
        if opening is None:
            self.drop("hello_timeout")
            return
        self.drop(  # the hello came: its block size takes longer to open than the bound
            "hello_timeout",
            message=f"block size {opening} is still opening after"
            f" {self.ctx.limits.hello_timeout_s} s (its share of every tier is being"
            " allocated; it opens to its end meanwhile): send hello again",
        )

    def drop(self, reason: str, code: ErrorCode | None = None, message: str | None = None) -> None:
        """Close the connection for breaking a guard: counted, logged at a bounded rate."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        default_code, template = _DROPS[reason]
        code = code or default_code
        text = message or template.format(limits=self.ctx.limits)
        self.ctx.dropped[reason] += 1
        self.server.drops(reason, message=text, pid=self.peer[0], conn=self.id)
        if reason != "output_stall":  # a client that does not read would not see it
            transport.write(encode(error_reply(0, code, text)))
        transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# Why a guard closed a connection: the error code and message the client is sent.
_DROPS = {
    "hello_timeout": (ErrorCode.HELLO_REQUIRED, "no hello within {limits.hello_timeout_s} s"),
    "frame_deadline": (
        ErrorCode.BAD_FRAME,
        "a frame did not complete within {limits.frame_deadline_s} s",
    ),
    "output_stall": (ErrorCode.BUSY, "replies left unread for {limits.output_stall_s} s"),
    "made_room": (ErrorCode.BUSY, "closed to make room for a new connection: no hello yet"),
    "partial_budget": (ErrorCode.BUSY, "unfinished frames are over the daemon's budget"),
    "region_fd": (ErrorCode.BAD_REQUEST, "register_region: no descriptor came"),
    "fd_blocked": (
        ErrorCode.BAD_REQUEST,
        "cannot pass the pool: earlier replies are unread; send hello first and read its reply",
    ),
}
