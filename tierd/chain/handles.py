"""Handles on blocks a caller holds between two phases of a chain operation.

- :class:`LoadHandle`: blocks pinned at one level after ``TierChain.load``; readable in
  place until ``release()``.
- :class:`StoreHandle`: entry-level slots reserved by ``TierChain.begin_store``; the
  caller writes the bytes (through the store's views, with no copy through tierd) and
  then ``commit``s or ``abort``s. Until then the keys are in flight: a concurrent load
  waits for them and ``lookup`` reports them as in flight.

Both are idempotent to finish, so an owner that cleans up on every exit path (a
connection that closes, an exception) can always call ``release``/``abort``.

A handle is given the part of the chain it calls back: a load handle the levels
(:class:`~tierd.chain.levels.ChainLevels`: the store to read, the pins to release), a
store handle :class:`~tierd.chain.moves.Movement` (which ends the write, and copies it
down where the chain writes through). Neither imports this module: dependencies point one
way, from the chain to its handles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tierd.chain.levels import ChainLevels
from tierd.chain.moves import Movement, in_pieces
from tierd.keys import BlockKey, Medium
from tierd.stores import BlockStore, Buffer
from tierd.tier import StorePlan
from tierd.turns import next_turn

__all__ = ["LoadHandle", "StoreHandle"]


class _SlotHandle:
    """``keys[i]`` lives in ``slots[i]`` of one level's store."""

    def __init__(self, levels: ChainLevels, level: int, keys: list[BlockKey], slots: list[int]):
        self._levels = levels
        self.level = level
        self.keys = keys
        self.slots = slots

    @property
    def store(self) -> BlockStore:
        return self._levels.store_at(self.level)

    def views(self) -> list[Buffer]:
        """Zero-copy views of the slots, co-indexed with ``keys``."""
        store = self.store
        return [store.view(slot) for slot in self.slots]


class LoadHandle(_SlotHandle):
    """Pinned blocks at one level, readable through ``views`` until ``release()``.
    ``source``: the slowest level the load read from (``level`` when nothing moved)."""

    def __init__(
        self,
        levels: ChainLevels,
        level: int,
        keys: list[BlockKey],
        slots: list[int],
        source: int | None = None,
    ):
        super().__init__(levels, level, keys, slots)
        self.source = level if source is None else source
        self.released = False

    @property
    def source_medium(self) -> Medium:
        """The medium of :attr:`source`: what the load's latency depended on (a source
        past the last level is the chain's remote level)."""
        return self._levels.medium_at(self.source)

    async def read_into(self, out: Sequence[Buffer]) -> list[bool]:
        """Copy the pinned blocks into caller buffers (for stores without views)."""
        return await self.store.read(self.slots, self.keys, out)

    def release(self) -> None:
        """Unpin the blocks; releasing twice is a no-op."""
        if not self.released:
            self.released = True
            self._levels.unpin(self.level, self.keys)

    async def release_in_pieces(self, piece: int) -> None:
        """:meth:`release`, ``piece`` keys a turn of the loop (a big load's unpin is a
        Python step a key); what is left is unpinned at once if this is cancelled."""
        if self.released:
            return
        self.released = True
        keys, start = self.keys, 0
        try:
            while start < len(keys):
                if start:
                    await next_turn()
                self._levels.unpin(self.level, keys[start : start + piece])
                start += piece
        finally:
            if start < len(keys):
                self._levels.unpin(self.level, keys[start:])

    async def __aenter__(self) -> LoadHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class StoreHandle(_SlotHandle):
    """Entry-level slots reserved for new blocks: ``keys[i]`` goes into ``slots[i]``.

    ``skipped`` are the requested keys that need no write (already held or in flight at
    the entry level). ``commit(ok)`` makes the written blocks ready (and copies them down
    from write-through levels); ``abort()`` frees the slots. Exactly one of them takes
    effect; later calls are no-ops (``commit`` then returns ``[]``).

    ``withdraw()`` (a lease that expired under a client that may still be writing) ends
    the write instead, nothing written: the keys go, so that other writes may store
    them, but the slots stay out of use, given to no other block, until ``abort()``
    (the client is done with them, or gone)."""

    def __init__(
        self,
        moves: Movement,
        level: int,
        plan: StorePlan,
        futures: list[asyncio.Future[bool]],
    ) -> None:
        super().__init__(moves.levels, level, list(plan.keys), list(plan.slots))
        self._moves = moves
        self._futures = futures
        self.finished = False
        self.quarantined: list[int] = []  # slots withdrawn and not released yet
        self._withdrawing = False
        self._release_asked = False  # abort() came while the withdrawal was in pieces

    async def commit(self, ok: Sequence[bool] | bool = True) -> list[BlockKey]:
        """Mark the blocks written (``ok`` per key, or one flag for all); the failed ones
        are dropped. Returns the keys that became ready."""
        if self.finished:
            return []
        self.finished = True
        flags = [ok] * len(self.keys) if isinstance(ok, bool) else list(ok)
        if len(flags) != len(self.keys):
            self._moves.abort_store(self.level, self.keys, self._futures)
            raise ValueError(f"commit needs {len(self.keys)} flags, got {len(flags)}")
        return await self._moves.commit_store(self.level, self.keys, flags, self._futures)

    def abort(self) -> None:
        """Drop the reserved blocks and free their slots (a withdrawn write's: the
        slots it kept); a no-op once committed or aborted."""
        if not self.finished:
            self.finished = True
            self._moves.abort_store(self.level, self.keys, self._futures)
        elif self._withdrawing:
            self._release_asked = True
        else:
            self._release()

    async def abort_in_pieces(self) -> None:
        """:meth:`abort`, a piece of the keys a turn of the loop (a big reservation's
        abort is a Python step a key); what is left is freed at once if cancelled."""
        if not self.finished:
            self.finished = True
            await self._moves.abort_in_pieces(self.level, self.keys, self._futures)
        else:
            self.abort()  # a withdrawn write's slots: one call at C speed

    def withdraw(self) -> None:
        """End the write, nothing written, keeping its slots until :meth:`abort`."""
        if not self.finished:
            self.finished = True
            self.quarantined += self._moves.withdraw(self.level, self.keys, self._futures)

    async def withdraw_in_pieces(self) -> None:
        """:meth:`withdraw`, a piece of the keys a turn of the loop; what is left is
        withdrawn at once if cancelled. An :meth:`abort` meanwhile frees the slots once
        all are withdrawn."""
        if self.finished:
            return
        self.finished = self._withdrawing = True
        moves, level, keys = self._moves, self.level, self.keys

        def step(piece: slice, last: list[asyncio.Future[bool]]) -> None:
            self.quarantined += moves.withdraw(level, keys[piece], last)

        try:
            await in_pieces(len(keys), self._futures, step)
        finally:
            self._withdrawing = False
            if self._release_asked:
                self._release()

    def _release(self) -> None:
        slots, self.quarantined = self.quarantined, []
        if slots:
            self._moves.release(self.level, slots)

    async def __aenter__(self) -> StoreHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
