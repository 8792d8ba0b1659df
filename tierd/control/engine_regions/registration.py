"""One owner of ``register_region``, from the request to the region in the table.

The descriptor does not come in the request's frame: the connection's transport reads
with plain ``read()``, which drops descriptors. So a registration runs, top to bottom:

1. :meth:`Registrations.begin` -- the connection hands on a ``register_region``: it
   reads and handles nothing more until the registration ends (:attr:`busy`), and notes
   whether anything came behind the request (then no descriptor can be told from it).
2. :meth:`Registrations.register` -- the request's fields and the session's rights are
   checked, the client is told to send (a ``send_fd`` push), the one descriptor is read
   (:func:`~tierd.control.engine_regions.descriptor.receive_fd`), checked
   (:func:`~tierd.control.engine_regions.descriptor.region_problem`) and entered in the session's
   :class:`~tierd.control.engine_regions.table.RegionTable`. A descriptor refused is closed; one
   whose byte cannot be told from a frame drops the connection.
3. :meth:`Registrations.follow` -- the connection reads again when the request ends.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Protocol

from tierd.control.engine_regions.descriptor import FdRefused, file_id, receive_fd, region_problem
from tierd.control.engine_regions.table import RegionTable
from tierd.control.protocol import ErrorCode, int_field
from tierd.control.requests.block_requests import Requester
from tierd.control.state.context import ServerContext
from tierd.errors import ProtocolError

__all__ = ["MAX_REGION_BYTES", "FdLine", "Registrations"]

MAX_REGION_BYTES = 1 << 40  # larger is not host memory any engine has


class FdLine(Protocol):
    """The connection a descriptor comes on: its transport, a push, a drop."""

    transport: asyncio.Transport | None

    def send(self, message: dict[str, Any]) -> None: ...

    def drop(
        self, reason: str, code: ErrorCode | None = None, message: str | None = None
    ) -> None: ...


class Registrations:
    """The registrations of one session's regions (one at a time: the connection reads
    nothing else meanwhile). ``line`` None: descriptors cannot come (no socket)."""

    def __init__(
        self, ctx: ServerContext, session: Requester, table: RegionTable, line: FdLine | None
    ) -> None:
        self.ctx = ctx
        self.session = session
        self.table = table
        self.line = line
        self.busy = False  # a register_region is being answered
        self._clean = False  # nothing came behind it

    def begin(self, *, clean: bool) -> None:
        """A ``register_region`` is handed on; ``clean``: nothing came behind it."""
        self.busy = True
        self._clean = clean

    def follow(self, task: asyncio.Task[None] | None) -> None:
        """The registration ends with ``task`` (None: it was answered at once)."""
        if task is None:
            self.busy = False
        else:
            task.add_done_callback(self._ended)

    def _ended(self, _: object) -> None:
        self.busy = False

    async def register(self, msg: dict[str, Any]) -> dict[str, Any]:
        size = self._checked(msg)
        fd = await self._receive(int_field(msg, "id"))
        try:
            pools = (t.pool for t in self.ctx.tenants.every())
            own = {file_id(pool.fd) for pool in pools if pool is not None}
            problem = region_problem(fd, size, own)
            if problem is not None:
                raise ProtocolError(problem, code=ErrorCode.BAD_REQUEST)
            region = self.table.add(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return {"region": region.id}

    def _checked(self, msg: dict[str, Any]) -> int:
        """The region's size, once the request may be answered with a ``send_fd``."""
        size = int_field(msg, "size")
        if not 0 < size <= MAX_REGION_BYTES:
            raise ProtocolError(
                f"a region's size must be 1 to {MAX_REGION_BYTES} bytes, not {size}",
                code=ErrorCode.BAD_REQUEST,
            )
        self.session.chain()  # a user of no tenant keeps no blocks
        if self.session.namespace is None:
            raise ProtocolError(
                "regions hold blocks of a namespace: name one in hello",
                code=ErrorCode.NAMESPACE_REQUIRED,
            )
        self.table.check_room()
        if self.line is None:
            raise ProtocolError(
                "this connection cannot receive descriptors", code=ErrorCode.BAD_REQUEST
            )
        return size

    async def _receive(self, request_id: int) -> int:
        """The descriptor the client sends with one byte after the ``send_fd`` push.
        Refused if it sent anything behind the request; the connection is dropped when
        framing can no longer be trusted."""
        line = self.line
        transport = line.transport if line is not None else None
        if line is None or transport is None or transport.is_closing():
            raise ProtocolError("the connection closed", code=ErrorCode.SHUTTING_DOWN)
        if not self._clean:
            raise ProtocolError(
                "requests came behind register_region: send nothing more until it is answered",
                code=ErrorCode.BAD_REQUEST,
            )
        # Through the session: a get's reply still going out in pieces is not cut into.
        self.session.send({"push": "send_fd", "request": request_id})
        fileno = transport.get_extra_info("socket").fileno()
        try:
            return await receive_fd(fileno, self.ctx.limits.hello_timeout_s)
        except FdRefused as exc:
            if exc.framing_lost:
                line.drop("region_fd", message=f"register_region: {exc}")
            raise
