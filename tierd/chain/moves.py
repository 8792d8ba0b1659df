"""Writing blocks into a level, and moving them down the chain.

- A write reserves slots at a level (``prepare_store``), first demoting the victims it
  evicts, fills them and completes (:meth:`ChainMoves._store_into`).
- Evicting a clean block drops it; evicting a dirty one demotes it: its bytes are copied
  to the level below (which may evict and demote in turn), subject to that level's
  admission rule, before its slot is reused. Past the last local level a victim goes to
  the remote level, queued, or is dropped.
- Write-through levels copy a block down as soon as it is stored, so later evictions
  are free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tierd.chain.state import ChainState
from tierd.chain.values import Level
from tierd.keys import BlockKey
from tierd.stores import BlockStore
from tierd.tier import StorePlan

__all__ = ["ChainMoves"]


class ChainMoves(ChainState):
    """Writes into a level, demotion and write-through."""

    async def commit_store(
        self, index: int, keys: Sequence[BlockKey], ok: Sequence[bool], futures: list[Any]
    ) -> list[BlockKey]:
        stored = self.end_store(index, keys, ok, futures, io_failed=False)
        await self._write_through(index, stored)
        return stored

    async def _reserve(
        self, index: int, keys: Sequence[BlockKey]
    ) -> tuple[StorePlan, list[asyncio.Future[bool]]] | None:
        """prepare_store at one level and demote its victims; ``None`` if there is no
        room. The keys stay in flight until :meth:`end_store`."""
        level = self.levels[index]
        plan = level.tier.prepare_store(keys)
        if plan is None:
            self._publish()
            return None
        futures = self._register(index, plan.keys)
        try:
            if plan.evicted:
                await self._demote(index, plan)
        except BaseException:
            self.end_store(index, plan.keys, [False] * len(plan.keys), futures)
            raise
        return plan, futures

    async def _store_into(
        self,
        index: int,
        keys: Sequence[BlockKey],
        fill: Callable[[BlockStore, StorePlan], Awaitable[list[bool]]],
    ) -> list[BlockKey]:
        """Reserve slots at one level, fill them, complete; ``[]`` if there is no room."""
        reserved = await self._reserve(index, keys)
        if reserved is None:
            return []
        plan, futures = reserved
        ok: list[bool] = [False] * len(plan.keys)
        try:
            ok = await fill(self.levels[index].store, plan)
        finally:
            stored = self.end_store(index, plan.keys, ok, futures)
        return stored

    async def _demote(self, index: int, plan: StorePlan) -> None:
        """Copy the dirty victims of ``plan`` one level down before their slots are reused."""
        level = self.levels[index]
        below = index + 1
        if below >= len(self.levels):
            await self._demote_remote(level, plan)
            return
        lower = self.levels[below]
        source = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
        dirty = [k for k in plan.evicted if k not in lower.tier and not lower.tier.is_writing(k)]
        admitted = [k for k in dirty if self._admits(lower, k)]
        lower.refused += len(dirty) - len(admitted)
        level.dropped += len(dirty) - len(admitted)
        if not admitted:
            return

        planned = False  # fill only runs once the level below made room

        async def fill(store: BlockStore, down: StorePlan) -> list[bool]:
            nonlocal planned
            planned = True
            src = [source[k] for k in down.keys]
            return await self.transfer.copy(level.store, src, store, down.slots, down.keys)

        moved = await self._store_into(below, admitted, fill)
        level.demotions += len(moved)
        level.dropped += len(admitted) - len(moved)
        if not planned:  # refused for lack of room (everything below pinned or in flight)
            lower.refused += len(admitted)

    async def _demote_remote(self, level: Level, plan: StorePlan) -> None:
        """Evicted from the last local level: send the admitted victims to the remote
        level (queued: an eviction does not wait on the network), or drop them."""
        remote = self.remote
        if remote is None:
            level.dropped += len(plan.evicted)
            return
        admitted = [k for k in plan.evicted if self._admits(remote, k)]
        remote.refused += len(plan.evicted) - len(admitted)
        slots = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
        sent = await remote.copy_out(level.store, [slots[k] for k in admitted], admitted)
        level.demotions += sent
        level.dropped += len(plan.evicted) - sent

    async def _write_through(self, index: int, keys: list[BlockKey]) -> None:
        """Copy freshly stored blocks down from every write-through level (from the last
        local level to the remote one, when there is one)."""
        while keys and self.levels[index].write_through and index + 1 < len(self.levels):
            keys = await self._copy_down(index, keys)
            index += 1
        if keys and self.levels[index].write_through and self.remote is not None:
            await self._send_remote(index, keys, wait=False)

    async def _send_remote(self, index: int, keys: list[BlockKey], *, wait: bool) -> int:
        """Copy ready blocks of level ``index`` to the remote level, pinned meanwhile
        (nothing is sent from a chain without one)."""
        remote = self.remote
        tier = self.levels[index].tier
        keys = [k for k in keys if k in tier]
        if remote is None or not keys:
            return 0
        slots = tier.prepare_load(keys)
        try:
            return await remote.copy_out(self.levels[index].store, slots, keys, wait=wait)
        finally:
            self._unpin(index, keys)

    async def _copy_down(self, index: int, keys: list[BlockKey]) -> list[BlockKey]:
        """Copy ready blocks from level ``index`` to the next one, pinned meanwhile; the
        upper copy stays (and is then clean). Returns the keys now ready below."""
        level = self.levels[index]
        keys = [k for k in keys if k in level.tier]
        if not keys:
            return []
        source = dict(zip(keys, level.tier.prepare_load(keys), strict=True))

        async def fill(store: BlockStore, down: StorePlan) -> list[bool]:
            src = [source[k] for k in down.keys]
            return await self.transfer.copy(level.store, src, store, down.slots, down.keys)

        try:
            return await self._store_into(index + 1, keys, fill)
        finally:
            self._unpin(index, keys)
