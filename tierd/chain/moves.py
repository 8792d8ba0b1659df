"""Writing blocks into a level, and moving them down the chain.

- A write reserves slots at a level (``prepare_store``), first demoting the victims it
  evicts, fills them and completes (:meth:`Movement.store_into`).
- Evicting a clean block drops it; evicting a dirty one demotes it: its bytes are copied
  to the level below (which may evict and demote in turn), subject to that level's
  admission rule, before its slot is reused. The level below makes room by dropping
  copies of blocks a level above holds first (:mod:`tierd.chain.copies`), and evicts
  by its policy only for what is still missing. Past the last local level a victim goes to
  the remote level, queued, or is dropped.
- Write-through levels copy a block down as soon as it is stored, so later evictions
  are free.

:class:`Movement` owns no state of its own: it is given the levels, the transfer engine,
the writes in flight (where every write it makes is registered and ended), the
admission answers and the copies below of blocks held above, and is what loads
(promotion) and the chain's stores and flushes call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from itertools import chain

from tierd.chain.admit import Admissions
from tierd.chain.behind import WriteBehind
from tierd.chain.copies import UpperCopies
from tierd.chain.levels import ChainLevels
from tierd.chain.pending import PendingWrites
from tierd.chain.remote import Landing
from tierd.chain.values import Level
from tierd.keys import BlockKey
from tierd.stores import BlockStore
from tierd.tier import StorePlan
from tierd.transfer import TransferEngine
from tierd.turns import STORE_KEYS, next_turn

__all__ = ["Movement", "in_pieces"]


Prepared = Callable[[StorePlan], Awaitable[None]]  # told of a reservation before demotion


class Movement:
    """Writes into a level, demotion and write-through."""

    def __init__(
        self,
        levels: ChainLevels,
        transfer: TransferEngine,
        writes: PendingWrites,
        admissions: Admissions,
        copies: UpperCopies,
    ) -> None:
        self.levels = levels
        self._transfer = transfer
        self._writes = writes
        self._admissions = admissions
        self.copies = copies
        # Told of the keys each client store made ready, and asked to end its pins at a
        # level where a reservation found no room: copies down with this movement's own.
        self.behind = WriteBehind(levels, self.copy_down)

    async def commit_store(
        self,
        index: int,
        keys: Sequence[BlockKey],
        ok: Sequence[bool],
        futures: list[asyncio.Future[bool]],
    ) -> list[BlockKey]:
        """End a client's write (a failed block is not an I/O error of the level), then
        copy what became ready down where the chain writes through."""
        stored = await self._end_in_pieces(index, keys, ok, futures)
        await self.write_through(index, stored)
        self.behind.stored(index, stored)
        return stored

    async def _end_in_pieces(
        self,
        index: int,
        keys: Sequence[BlockKey],
        ok: Sequence[bool],
        futures: list[asyncio.Future[bool]],
    ) -> list[BlockKey]:
        """:meth:`PendingWrites.end_store` of a client's write, :func:`in_pieces`."""
        stored: list[BlockKey] = []
        end = self._writes.end_store

        def step(piece: slice, last: list[asyncio.Future[bool]]) -> None:
            stored.extend(end(index, keys[piece], ok[piece], last, io_failed=False))

        await in_pieces(len(keys), futures, step)
        return stored

    def abort_store(
        self, index: int, keys: Sequence[BlockKey], futures: list[asyncio.Future[bool]]
    ) -> None:
        """End a client's write with nothing written."""
        self._writes.abort(index, keys, futures)

    async def abort_in_pieces(
        self, index: int, keys: Sequence[BlockKey], futures: list[asyncio.Future[bool]]
    ) -> None:
        """:meth:`abort_store`, :data:`STORE_KEYS` keys a turn of the loop (each freed
        slot is a Python step); what is left is ended at once if this is cancelled."""
        await self._end_in_pieces(index, keys, [False] * len(keys), futures)

    def withdraw(
        self, index: int, keys: Sequence[BlockKey], futures: list[asyncio.Future[bool]]
    ) -> list[int]:
        """End a client's write with nothing written, its slots kept out of use
        (:meth:`PendingWrites.withdraw`); returns them, for :meth:`release`."""
        return self._writes.withdraw(index, keys, futures)

    def release(self, index: int, slots: Sequence[int]) -> None:
        """Free the slots of a withdrawn write."""
        self._writes.release(index, slots)

    async def reserve(
        self, index: int, keys: Sequence[BlockKey], before_demote: Prepared | None = None
    ) -> tuple[StorePlan, list[asyncio.Future[bool]]] | None:
        """prepare_store at one level and demote its victims; ``None`` if there is no
        room. The keys stay in flight until the write is ended
        (:meth:`PendingWrites.end_store`). More than :data:`STORE_KEYS` keys are
        reserved a piece a turn of the loop (a big tier's maps cost a Python step a key),
        all or nothing still: the pieces reserved are ended unwritten if a later one
        finds no room, or the reservation fails or is cancelled. ``before_demote`` is
        awaited with each piece's plan once its keys are in flight, before its victims
        are demoted (a swap reads its blocks out then: see ``tierd.chain.loads``)."""
        if len(keys) <= STORE_KEYS:
            return await self._reserve(index, keys, None, before_demote)
        keep = set(keys)  # no piece evicts a key of another
        plans: list[StorePlan] = []
        futures: list[asyncio.Future[bool]] = []
        done = False
        try:
            for start in range(0, len(keys), STORE_KEYS):
                if start:
                    await next_turn()
                piece = keys[start : start + STORE_KEYS]
                reserved = await self._reserve(index, piece, keep, before_demote)
                if reserved is None:
                    return None
                plans.append(reserved[0])
                futures += reserved[1]
            done = True
        finally:
            if not done and plans:
                written = [key for plan in plans for key in plan.keys]
                self._writes.abort(index, written, futures)
        return _joined(plans), futures

    async def _reserve(
        self,
        index: int,
        keys: Sequence[BlockKey],
        keep: Collection[BlockKey] | None,
        before_demote: Prepared | None,
    ) -> tuple[StorePlan, list[asyncio.Future[bool]]] | None:
        tier = self.levels.levels[index].tier
        plan = tier.prepare_store(keys, keep)
        if plan is None and await self.behind.unpin(index):
            plan = tier.prepare_store(keys, keep)  # at once: no new batch pinned meanwhile
        if plan is None:
            self.levels.publish()
            return None
        futures = self._writes.register(index, plan.keys)
        try:
            if before_demote is not None:
                await before_demote(plan)
            if plan.evicted:
                await self._demote(index, plan)
        except BaseException:
            self._writes.end_store(index, plan.keys, [False] * len(plan.keys), futures)
            raise
        return plan, futures

    async def store_into(
        self,
        index: int,
        keys: Sequence[BlockKey],
        fill: Callable[[BlockStore, StorePlan], Awaitable[list[bool]]],
        before_demote: Prepared | None = None,
    ) -> list[BlockKey]:
        """Reserve slots at one level, fill them, complete; ``[]`` if there is no room.
        ``before_demote``: see :meth:`reserve`."""
        reserved = await self.reserve(index, keys, before_demote)
        if reserved is None:
            return []
        plan, futures = reserved
        ok: list[bool] = [False] * len(plan.keys)
        try:
            ok = await fill(self.levels.levels[index].store, plan)
        finally:
            stored = self._writes.end_store(index, plan.keys, ok, futures)
        return stored

    async def _demote(self, index: int, plan: StorePlan) -> None:
        """Copy the dirty victims of ``plan`` one level down before their slots are reused."""
        levels = self.levels.levels
        level = levels[index]
        below = index + 1
        if below >= len(levels):
            await self._demote_remote(level, plan)
            return
        lower = levels[below]
        source = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
        dirty = [k for k in plan.evicted if k not in lower.tier and not lower.tier.is_writing(k)]
        admits = self._admissions.admits
        admitted = [k for k in dirty if admits(lower, k)]
        lower.refused += len(dirty) - len(admitted)
        level.dropped += len(dirty) - len(admitted)
        if not admitted:
            return

        self.copies.make_room(below, len(admitted))  # duplicates go before unique blocks
        planned = False  # fill only runs once the level below made room

        async def fill(store: BlockStore, down: StorePlan) -> list[bool]:
            nonlocal planned
            planned = True
            src = [source[k] for k in down.keys]
            return await self._transfer.copy(level.store, src, store, down.slots, down.keys)

        moved = await self.store_into(below, admitted, fill)
        level.demotions += len(moved)
        level.dropped += len(admitted) - len(moved)
        if not planned:  # refused for lack of room (everything below pinned or in flight)
            lower.refused += len(admitted)

    async def _demote_remote(self, level: Level, plan: StorePlan) -> None:
        """Evicted from the last local level: send the admitted victims to the remote
        level (queued: an eviction does not wait on the network), or drop them."""
        remote = self.levels.remote
        if remote is None:
            level.dropped += len(plan.evicted)
            return
        admitted = [k for k in plan.evicted if self._admissions.admits(remote, k)]
        remote.refused += len(plan.evicted) - len(admitted)
        slots = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
        sent = await remote.copy_out(level.store, [slots[k] for k in admitted], admitted)
        level.demotions += sent
        level.dropped += len(plan.evicted) - sent

    async def write_through(self, index: int, keys: list[BlockKey]) -> None:
        """Copy freshly stored blocks down from every write-through level (from the last
        local level to the remote one, when there is one)."""
        levels = self.levels.levels
        while keys and levels[index].write_through and index + 1 < len(levels):
            keys = await self.copy_down(index, keys)
            index += 1
        if keys and levels[index].write_through and self.levels.remote is not None:
            await self.send_remote(index, keys)

    async def send_remote(self, index: int, keys: list[BlockKey]) -> int:
        """Queue ready blocks of level ``index`` for the remote level, read out of their
        slots pinned meanwhile (nothing is sent from a chain without one); how many."""
        remote = self.levels.remote
        level = self.levels.levels[index]
        keys = [k for k in keys if k in level.tier]
        if remote is None or not keys:
            return 0
        slots = level.tier.prepare_load(keys)
        try:
            return await remote.copy_out(level.store, slots, keys)
        finally:
            self.levels.unpin(index, keys)

    async def write_remote(self, index: int, keys: list[BlockKey]) -> Landing:
        """Write ready blocks of level ``index`` to the remote level and wait for the
        writes (pinned meanwhile): what became of each."""
        remote = self.levels.remote
        level = self.levels.levels[index]
        keys = [k for k in keys if k in level.tier]
        if remote is None or not keys:
            return Landing()
        slots = level.tier.prepare_load(keys)
        try:
            return await remote.write_out(level.store, slots, keys)
        finally:
            self.levels.unpin(index, keys)

    async def copy_down(self, index: int, keys: list[BlockKey]) -> list[BlockKey]:
        """Copy ready blocks from level ``index`` to the next one, pinned meanwhile; the
        upper copy stays (and is then clean). Returns the keys now ready below."""
        level = self.levels.levels[index]
        keys = [k for k in keys if k in level.tier]
        if not keys:
            return []
        source = dict(zip(keys, level.tier.prepare_load(keys), strict=True))

        async def fill(store: BlockStore, down: StorePlan) -> list[bool]:
            src = [source[k] for k in down.keys]
            return await self._transfer.copy(level.store, src, store, down.slots, down.keys)

        try:
            return await self.store_into(index + 1, keys, fill)
        finally:
            self.levels.unpin(index, keys)


async def in_pieces(
    count: int,
    futures: list[asyncio.Future[bool]],
    step: Callable[[slice, list[asyncio.Future[bool]]], None],
) -> None:
    """Run ``step`` over ``count`` keys of a write, :data:`STORE_KEYS` keys a turn of
    the loop (a write of that many or fewer, at once). ``step`` gets the piece's slice
    and the futures to resolve with it: the write's, with its last piece only (a waiter
    woken sooner could find its key still being written). What is left is done at once
    if this is cancelled."""
    start = 0
    try:
        while start < count:
            if start:
                await next_turn()
            stop = start + STORE_KEYS
            step(slice(start, stop), futures if stop >= count else [])
            start = stop
    finally:
        if start < count:
            step(slice(start, None), futures)


def _joined(plans: Sequence[StorePlan]) -> StorePlan:
    """The plans of a store's pieces as one, in order."""
    flat = chain.from_iterable
    return StorePlan(
        tuple(flat(p.keys for p in plans)),
        tuple(flat(p.slots for p in plans)),
        tuple(flat(p.evicted for p in plans)),
        tuple(flat(p.evicted_slots for p in plans)),
    )
