"""The requests that move block bytes: stores and loads, through the pool or inline.

- **Zero-copy** (the tenant's entry tier is a shared-memory pool): ``prepare_store``
  reserves slots for the keys the chain does not hold and ``complete_store`` (or
  ``abort_store``) finishes it; ``prepare_load`` pins the leading cached blocks and
  ``complete_load`` unpins them. Each hands out a lease of the session's
  :class:`~tierd.control.requests.leases.Leases`, whose bounds are held (a
  :class:`~tierd.control.requests.leases.Hold`) before the chain is asked.
  A load waits at most ``load_wait_s`` on blocks another client is still writing.
- **Inline**: ``put`` and ``get`` carry the bytes in the messages (``get`` at most what
  fits in one frame). A get's blocks are copied out while pinned, encoded for the reply
  as they are copied (:func:`~tierd.control.requests.frame_pieces.encode_bins`), 256 KiB a turn of
  the loop, then unpinned 512 a turn, and the session writes the reply a piece a turn
  (``frame_in_pieces``): copied, packed and written at once, a get of a frame of blocks
  would hold the loop, every tenant's, for as long as all of it takes.

``lookup`` and ``touch`` move no bytes: the session answers them itself, on its fast path.
A :class:`BlockRequests` knows its session only through :class:`Requester`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from tierd.chain import LoadHandle, StoreHandle, TierChain
from tierd.control.figures.namespaces import NamespaceFigures
from tierd.control.protocol import (
    ErrorCode,
    bool_field,
    bool_list_field,
    bytes_list_field,
    int_field,
    opt_seconds_field,
)
from tierd.control.requests.frame_pieces import PIECE_BYTES, EncodedBins, encode_bins
from tierd.control.requests.leases import Hold, Leases
from tierd.control.state.context import ServerContext
from tierd.control.state.lease_ends import Lease, finish, finish_in_pieces, small
from tierd.control.state.tenant_table import Tenant
from tierd.errors import BlockMissing, ProtocolError
from tierd.keys import BlockKey, Medium
from tierd.turns import LOAD_KEYS, TOUCH_KEYS, next_turn

__all__ = ["LOADED_FROM", "BlockRequests", "Requester", "distinct"]

Reply = dict[str, Any]
_Handle = TypeVar("_Handle", StoreHandle, LoadHandle)

# A load's reply carries the slowest medium it read from under this key, for the timing;
# the session takes it out before the reply is sent.
LOADED_FROM = "_loaded_from"


class Requester(Protocol):
    """What the block requests ask of the session they serve."""

    @property
    def tenant(self) -> Tenant | None:
        """The connection's tenant (None: a user of no tenant)."""
        ...

    @property
    def namespace(self) -> str | None:
        """The namespace named in hello (None: none)."""
        ...

    @property
    def figures(self) -> NamespaceFigures:
        """The figures of the connection's namespace (stores are counted there)."""
        ...

    def chain(self) -> TierChain:
        """The tenant's chain; refused for a user of no tenant."""
        ...

    def send(self, message: dict[str, Any]) -> None:
        """Write ``message`` to the client, after any reply still going out in pieces."""
        ...

    def keys(self, msg: dict[str, Any], name: str = "keys") -> list[BlockKey]:
        """The keys of ``msg``'s field ``name``, prefixed with the namespace's id."""
        ...


class BlockRequests:
    """Stores and loads for one session; every lease they open is in ``leases``."""

    def __init__(self, ctx: ServerContext, session: Requester, leases: Leases) -> None:
        self.ctx = ctx
        self.session = session
        self.leases = leases

    def _require_pool(self) -> None:
        tenant = self.session.tenant
        if tenant is not None and tenant.pool is None:
            raise ProtocolError(
                "the entry tier is not a shared-memory pool: use put and get",
                code=ErrorCode.NO_POOL,
            )

    # -- zero-copy, through the pool --------------------------------------------------

    async def reserve(self, keys: list[BlockKey]) -> tuple[StoreHandle, Hold]:
        """Entry-level slots for the keys the chain does not hold, under the lease bounds,
        and the hold that counts the blocks of ``handle.keys`` (the caller's to release)."""
        chain = self.session.chain()
        with self.leases.hold(len(keys)) as asked:
            handle = await chain.begin_store(keys)
            return handle, asked.keep(len(handle.keys))

    async def prepare_store(self, msg: dict[str, Any]) -> Reply:
        keys = distinct(self.session.keys(msg))
        self.session.chain()
        self._require_pool()
        handle, held = await self.reserve(keys)
        slot_of = dict(zip(handle.keys, handle.slots, strict=True))
        slots = [slot_of.get(key) for key in keys]
        if not handle.keys:
            await handle.commit()
            return {"lease": None, "slots": slots}
        return {"lease": self.leases.register(handle, held), "slots": slots}

    async def complete_store(self, msg: dict[str, Any]) -> Reply:
        lease = int_field(msg, "lease")
        handle = self.leases.named(lease, StoreHandle)
        ok = bool_list_field(msg, "ok", count=len(handle.keys))
        self.leases.end(lease)
        return {"stored": self._stored(await handle.commit(ok))}

    def abort_store(self, msg: dict[str, Any]) -> Reply | Awaitable[Reply]:
        """Free the slots (a big store's in pieces: :func:`_ended`)."""
        return _ended(self._take(msg, StoreHandle))

    def _take(self, msg: dict[str, Any], kind: type[_Handle]) -> _Handle:
        """The handle of the request's ``lease``, which must be of ``kind``; the lease ends
        here (its blocks no longer count) and the caller finishes the handle."""
        lease = int_field(msg, "lease")
        handle = self.leases.named(lease, kind)
        self.leases.end(lease)
        return handle

    async def pin(self, keys: list[BlockKey], wait_s: float) -> tuple[LoadHandle, Hold] | None:
        """The leading keys loaded into the entry level and pinned there, under the lease
        bounds, and the hold that counts them (the caller's to release); None: not even
        the first. Waits at most ``wait_s`` on blocks being written."""
        chain = self.session.chain()
        with self.leases.hold(len(dict.fromkeys(keys))) as asked:
            try:
                handle = await chain.load(keys, wait_s=wait_s)
            except BlockMissing:
                return None
            return handle, asked.keep(len(handle.keys))

    async def prepare_load(self, msg: dict[str, Any]) -> Reply:
        keys = self.session.keys(msg)
        self.session.chain()
        self._require_pool()
        wait_s = self.ctx.limits.load_wait_s  # a client may ask to wait less (0: not at all)
        asked = opt_seconds_field(msg, "wait_s")
        pinned = await self.pin(keys, wait_s if asked is None else min(asked, wait_s))
        if pinned is None:
            return {"lease": None, "count": 0, "slots": []}
        handle, held = pinned
        return {
            "lease": self.leases.register(handle, held),
            "count": len(handle.keys),
            "slots": handle.slots,
            LOADED_FROM: str(handle.source_medium),
        }

    def complete_load(self, msg: dict[str, Any]) -> Reply | Awaitable[Reply]:
        """Unpin (a big load's keys in pieces: :func:`_ended`)."""
        return _ended(self._take(msg, LoadHandle))

    def touch(self, msg: dict[str, Any]) -> Reply | Awaitable[Reply]:
        """Mark the keys used at once; more than :data:`TOUCH_KEYS` keys, a piece a turn
        of the loop (the tail's first), answered when done."""
        chain = self.session.chain()
        keys, uses = self.session.keys(msg), bool_field(msg, "uses", True)
        if len(keys) <= TOUCH_KEYS:
            chain.touch(keys, uses=uses)
            return {}
        return _answered_after(chain.touch_in_pieces(keys, uses=uses))

    # -- inline, in the messages ------------------------------------------------------

    async def put(self, msg: dict[str, Any]) -> Reply:
        keys = distinct(self.session.keys(msg))
        chain = self.session.chain()
        data = bytes_list_field(msg, "data", count=len(keys), size=chain.block_bytes)
        return {"stored": self._stored(await chain.store(keys, data))}

    def _stored(self, keys: list[BlockKey]) -> int:
        figures = self.session.figures
        figures.stored_blocks += len(keys)
        figures.last_used = time.time()
        return len(keys)

    async def get(self, msg: dict[str, Any]) -> Reply:
        keys = self.session.keys(msg)
        chain = self.session.chain()
        room = (self.ctx.limits.max_frame_bytes - 4096) // (chain.block_bytes + 16)
        if len(keys) > room:
            raise ProtocolError(
                f"a get of {len(keys)} blocks would not fit in one frame: at most {room}",
                code=ErrorCode.TOO_MANY_KEYS,
            )
        try:
            handle = await chain.load(keys, wait_s=self.ctx.limits.load_wait_s)
        except BlockMissing:
            return {"count": 0, "data": []}
        try:
            data = await _copied_out(handle, chain.block_bytes)
        except BaseException:
            handle.release()
            raise
        await handle.release_in_pieces(LOAD_KEYS)  # a Python step a key
        return {"count": data.count, "data": data, LOADED_FROM: str(handle.source_medium)}


async def _copied_out(handle: LoadHandle, block_bytes: int) -> EncodedBins:
    """The pinned blocks of ``handle``, up to the first that cannot be read, encoded for a
    reply: :data:`PIECE_BYTES` of blocks a turn of the loop, each copied once (from its
    view; or, from a store without views, read into a buffer first). The caller keeps
    them pinned until this returns: no byte of a block released and reused is sent."""
    store = handle.store
    views = store.has_views and store.medium is not Medium.GPU
    step = max(1, PIECE_BYTES // max(1, block_bytes))
    pieces: list[bytes] = []
    count = 0
    for start in range(0, len(handle.keys), step):
        if start:
            await next_turn()
        slots = handle.slots[start : start + step]
        if views:
            blocks: list[Any] = [memoryview(store.view(slot)).cast("B") for slot in slots]
        else:
            out = [bytearray(block_bytes) for _ in slots]
            ok = await store.read(slots, handle.keys[start : start + step], out)
            blocks = out[: _leading(ok)]
        pieces.append(encode_bins(blocks))
        count += len(blocks)
        if len(blocks) < len(slots):
            break
    return EncodedBins(count, pieces)


def distinct(keys: list[BlockKey]) -> list[BlockKey]:
    if len(set(keys)) != len(keys):
        raise ProtocolError("a key appears twice in one store", code=ErrorCode.BAD_REQUEST)
    return keys


def _leading(flags: list[bool]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def _ended(handle: Lease) -> Reply | Awaitable[Reply]:
    """End a lease the client finished: at once if it is small, else a piece a turn of
    the loop (a key is a Python step: a slot freed, or a key moved to its policy's
    recent end), answered when done."""
    if small(handle):
        finish(handle)
        return {}
    return _answered_after(finish_in_pieces(handle))


async def _answered_after(work: Awaitable[object]) -> Reply:
    """An empty reply once ``work`` is done: an op whose pieces run a turn of the loop
    each is answered when the last one has."""
    await work
    return {}
