"""The async client of the control socket, for engines, tools and tests.

::

    async with await Client.connect("/run/tierd/tierd.sock", namespace="llama3-8b/fp16") as c:
        hit = await c.lookup(keys)                   # leading keys cached, and where
        async with c.storing(new_keys) as lease:     # zero-copy: write into pool slots
            for view, block in zip(lease.views(), blocks):
                view[:] = block
        async with c.loading(keys[: hit.count]) as lease:
            for view in lease.views():               # read in place, pinned meanwhile
                ...

Requests are pipelined: each carries an id, and any number may be in flight at once
(``asyncio.gather`` them). With the shared-memory pool mapped (the default when the
daemon has one), ``storing``/``loading`` hand out memoryviews (or torch tensors) of the
pool slots themselves; without it ``put``/``get`` carry the bytes in the messages. The
context managers always finish their lease, on error too; if the client dies instead,
the daemon releases the lease when the connection closes.

This module owns :class:`Client` (requests and their replies, the data path, engine
regions, events, the connection's end) and the values its data path's replies become;
connecting and the hello exchange are :mod:`~tierd.control.clients.handshake`'s, the pool mapping
and the leases :mod:`~tierd.control.clients.pool`'s, decoding the socket's frames
:mod:`~tierd.control.clients.wire`'s, and the operator's requests (stats, flush, delete,
reload...) with their :class:`Flushed` :mod:`~tierd.control.clients.operator`'s. Every
public name of those is importable from here.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from tierd.control.clients.handshake import (
    HANGS_UP,
    HELLO_ID,
    DaemonError,
    Unreachable,
    UntrustedDaemon,
    check_server,
    greet,
    open_socket,
)
from tierd.control.clients.operator import ControlRequests, Flushed
from tierd.control.clients.pool import LoadLease, PoolMap, StoreLease
from tierd.control.clients.regions import Registration, move_blocks, register_region
from tierd.control.clients.requests import key_parts, present, touch_requests
from tierd.control.clients.wire import ClientWire
from tierd.control.protocol import encode
from tierd.errors import ProtocolError, TierdError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "Client",
    "DaemonError",
    "Flushed",
    "LoadLease",
    "Lookup",
    "PoolMap",
    "StoreLease",
    "Unreachable",
    "UntrustedDaemon",
]

Buffer = bytes | bytearray | memoryview
# Error codes the daemon sends with id 0 just before it closes the connection.


@dataclass(frozen=True, slots=True)
class Lookup:
    count: int
    media: tuple[str, ...]
    in_flight: bool


class Client(ControlRequests):
    """One connection to the daemon. Build it with :meth:`connect`."""

    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._protocol: ClientWire | None = None
        self._closed: BaseException | None = None
        self.info: dict[str, Any] = {}
        self.pool: PoolMap | None = None
        self._subscribed = False
        self._registration = Registration()  # register_region's (client_regions)

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        namespace: str | None = None,
        block_bytes: int | None = None,
        map_pool: bool = True,
        max_frame_bytes: int = 1 << 30,
        server_uids: Collection[int] = (),
    ) -> Client:
        """Connect, say hello (naming ``namespace``; ``block_bytes`` must then match the
        daemon's) and map the pool when there is one and ``map_pool``.

        Before a byte is sent, the process serving the socket must run as this user, as
        root, or as one of ``server_uids`` (``SO_PEERCRED``): a socket path bound first by
        another user (squatting) is refused with :class:`UntrustedDaemon`, so no KV bytes
        are ever written to, or read from, an impostor."""
        client = cls()
        loop = asyncio.get_running_loop()
        where = os.fspath(path)
        sock = await open_socket(loop, where)
        protocol = ClientWire(max_frame_bytes, client._dispatch, client._lost)
        try:
            check_server(sock, where, server_uids)
            greeting = await greet(
                loop,
                sock,
                protocol.decoder,
                namespace=namespace,
                block_bytes=block_bytes,
                map_pool=map_pool,
            )
            client.info, client.pool = greeting.info, greeting.pool
            client._next_id = HELLO_ID
            await loop.create_unix_connection(lambda: protocol, sock=sock)
        except BaseException:
            sock.close()
            if client.pool is not None:
                client.pool.close()
            raise
        client._protocol = protocol
        for message in greeting.more:
            client._dispatch(message)
        return client

    @property
    def block_bytes(self) -> int:
        return int(self.info["block_bytes"])

    def require_pool(self) -> PoolMap:
        if self.pool is None:
            raise ProtocolError("the pool is not mapped: use put and get", code="no_pool")
        return self.pool

    # -- requests ---------------------------------------------------------------------

    def send(self, op: str, **fields: Any) -> asyncio.Future[dict[str, Any]]:
        """Send one request now; the future resolves to its reply (pipelining)."""
        if self._closed is not None or self._protocol is None or self._protocol.transport is None:
            raise Unreachable(f"the connection is closed ({self._closed})")
        self._next_id += 1
        request_id = self._next_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        frame = encode({"id": request_id, "op": op, **fields})
        if op == "register_region" or not self._registration.hold(frame):
            self._protocol.transport.write(frame)
        return future

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; :class:`DaemonError` on an error reply."""
        return await self.send(op, **fields)

    def _dispatch(self, message: Any) -> None:
        if not isinstance(message, dict):
            return
        if "push" in message:
            if message["push"] == "send_fd":
                self._registration.asked()
                return
            self._events.put_nowait(message)
            return
        future = self._waiting.pop(message.get("id", -1), None)
        if future is None:
            if message.get("error") in HANGS_UP:
                self._lost(DaemonError.of(message))
            return
        if future.done():
            return
        if message.get("ok"):
            future.set_result(message)
        else:
            future.set_exception(DaemonError.of(message))

    def _lost(self, exc: BaseException | None) -> None:
        if self._closed is None:
            self._closed = (
                exc if exc is not None else Unreachable("the daemon closed the connection")
            )
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                error = self._closed
                if not isinstance(error, TierdError):
                    error = Unreachable(f"the connection was lost: {error}")
                future.set_exception(error)
        self._events.put_nowait(None)

    # -- data path --------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes]) -> Lookup:
        reply = await self.request("lookup", keys=list(keys))
        return Lookup(reply["count"], tuple(reply["media"]), reply["in_flight"])

    async def lookup_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the daemon holds it ready in any tier of this tenant's chain,
        the remote level included (a key still being written: False). Unlike
        :meth:`lookup` a miss does not stop the answer. One request per
        ``max_keys_per_request`` keys (the daemon's limit, from hello), sent together."""
        if not keys:
            return []
        asked = [self.send("lookup_each", keys=part) for part in key_parts(self.info, keys)]
        return present(await asyncio.gather(*asked))

    async def touch(self, keys: Sequence[bytes], *, uses: bool = True) -> None:
        """Mark ``keys`` used, tail to head: ``keys[0]`` ends up the most recent. More
        than the daemon's ``max_keys_per_request`` go as several requests, the tail's
        first, so the order holds across them. ``uses=False``: the order only, no use
        counted for admission rules."""
        for fields in touch_requests(self.info, keys, uses):
            await self.request("touch", **fields)

    async def prepare_store(self, keys: Sequence[bytes]) -> StoreLease:
        return StoreLease(self, keys, await self.request("prepare_store", keys=list(keys)))

    async def prepare_load(self, keys: Sequence[bytes]) -> LoadLease:
        return LoadLease(self, keys, await self.request("prepare_load", keys=list(keys)))

    @asynccontextmanager
    async def storing(self, keys: Sequence[bytes]) -> AsyncIterator[StoreLease]:
        """Reserve pool slots; commit on normal exit, abort on an exception."""
        lease = await self.prepare_store(keys)
        try:
            yield lease
        except BaseException:
            if self._closed is None:
                await asyncio.shield(lease.abort())
            raise
        await lease.commit()

    @asynccontextmanager
    async def loading(self, keys: Sequence[bytes]) -> AsyncIterator[LoadLease]:
        """Pin the leading cached blocks in the pool; released on exit."""
        lease = await self.prepare_load(keys)
        try:
            yield lease
        finally:
            if self._closed is None:
                await asyncio.shield(lease.release())

    async def store(self, keys: Sequence[bytes], data: Sequence[Buffer]) -> int:
        """Store blocks (through the pool when mapped, else inline); returns how many
        new blocks the daemon stored. A batch larger than the daemon takes at once (the
        blocks one connection may hold in leases, ``max_lease_blocks``; the keys of one
        request; for inline data, the frame size) goes in parts, in order."""
        info = self.info
        step = int(info.get("max_keys_per_request") or len(keys) or 1)
        if self.pool is None:  # inline: a part's blocks and keys must fit one frame
            room = int(info.get("max_frame_bytes") or 1 << 62) - (64 << 10)
            each = self.block_bytes + int(info.get("max_key_bytes") or 64) + 16
            step = max(min(step, room // each), 1)
        elif info.get("max_lease_blocks"):  # 0: no bound (a daemon without tenants)
            step = min(step, int(info["max_lease_blocks"]))
        stored = 0
        for start in range(0, len(keys), step):
            part, rows = keys[start : start + step], data[start : start + step]
            if self.pool is None:
                stored += await self.put(part, rows)
                continue
            async with self.storing(part) as lease:
                for view, i in zip(lease.views(), lease.to_write, strict=True):
                    view[:] = rows[i]
                if not lease.finished:
                    stored += await lease.commit()
        return stored

    async def load(self, keys: Sequence[bytes]) -> list[bytes]:
        """Copies of the leading cached blocks (through the pool when mapped)."""
        if self.pool is None:
            return await self.get(keys)
        async with self.loading(keys) as lease:
            return [bytes(view) for view in lease.views()]

    async def put(self, keys: Sequence[bytes], data: Sequence[Buffer]) -> int:
        reply = await self.request("put", keys=list(keys), data=[bytes(d) for d in data])
        return int(reply["stored"])

    async def get(self, keys: Sequence[bytes]) -> list[bytes]:
        reply = await self.request("get", keys=list(keys))
        return list(reply["data"])

    # -- engine host regions (client_regions) -----------------------------------------

    async def register_region(self, fd: int, size: int) -> int:
        """Hand the daemon ``fd`` (``size`` bytes of this engine's memory, a memfd or a
        ``/dev/shm`` file open read-write); the region's id, on this connection only."""
        transport = lambda: self._protocol.transport if self._protocol else None  # noqa: E731
        return await register_region(self, self._registration, transport, fd, size)

    async def unregister_region(self, region: int) -> None:
        await self.request("unregister_region", region=region)

    async def region_store(
        self,
        region: int,
        keys: Sequence[bytes],
        offsets: npt.ArrayLike,
        piece_bytes: Sequence[int] | None = None,
        expires: float | None = None,
    ) -> list[bool]:
        """Store blocks the daemon reads out of the region: piece ``j`` of key ``i`` is
        ``piece_bytes[j]`` (default: one of ``block_bytes``) bytes at ``offsets[i, j]``.
        Per key, whether the daemon holds it now (held keys are not read again).
        ``expires`` (a ``time.monotonic()`` second): when this caller stops waiting and
        may reuse the memory; the daemon then reads no more of it and keeps nothing read."""
        return await move_blocks(self, "region_store", region, keys, offsets, piece_bytes, expires)

    async def region_load(
        self,
        region: int,
        keys: Sequence[bytes],
        offsets: npt.ArrayLike,
        piece_bytes: Sequence[int] | None = None,
        expires: float | None = None,
    ) -> list[bool]:
        """Load blocks the daemon writes into the region (as :meth:`region_store`); per
        key, whether its bytes were written there (a miss fails that key only). No write
        starts past ``expires``."""
        return await move_blocks(self, "region_load", region, keys, offsets, piece_bytes, expires)

    # -- events ---------------------------------------------------------------------

    async def subscribe(self) -> None:
        """Start the event stream (pushes queue up until :meth:`events` reads them)."""
        if not self._subscribed:
            await self.request("subscribe")
            self._subscribed = True

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Subscribe (unless :meth:`subscribe` did) and yield event pushes (``events``:
        list of {kind, medium, tier, keys}; ``dropped``: events lost so far) until the
        connection closes."""
        await self.subscribe()
        while True:
            message = await self._events.get()
            if message is None:
                return
            yield message

    # -- lifecycle --------------------------------------------------------------------

    async def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
            await self._protocol.lost
        self._lost(None)
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
