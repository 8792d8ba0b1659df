"""The tier chain: demotion on eviction, promotion on hit, events from every medium.

A :class:`TierChain` holds levels fastest first (typically GPU -> CPU -> DISK). Each level
is a :class:`~tierd.tier.Tier` (bookkeeping) over a :class:`~tierd.stores.BlockStore`
(bytes). The chain is the only place that awaits: tier bookkeeping stays synchronous and
every byte moves through the :class:`~tierd.transfer.TransferEngine`.

- A block at level *i* is *clean* when level *i+1* holds it ready, else *dirty*. Clean is
  derived from the levels' indexes, never stored, so it cannot go stale.
- Evicting a clean block drops it; evicting a dirty block demotes it: its bytes are copied
  down (the level below may evict and demote in turn) before its slot is written again.
  A block demoted past the last level, or refused by the admission rule below, is dropped.
- ``load`` promotes what lies below the target level up to it; the lower copy stays, and
  is the first its level drops when a demotion needs room there (``copies``). From a
  full last level without such copies a promotion swaps instead (the block moves up, the
  target's victim takes its slot: ``loads``), so reading back what a full chain holds
  loses none of it. Two callers promoting the same block at once share one read.
- After every operation each level's events are published on the chain's event bus.

The chain is composed of parts, each owning its state and given what it calls in its
constructor: the levels and their events (``levels.ChainLevels``), admission
(``admit.Admissions``), writes in flight (``pending.PendingWrites``), writes and demotion
(``moves.Movement``: levels, transfer, pending writes, admission, and
``copies.UpperCopies``, the copies below of blocks held above), promotion
(``loads.Loading``: levels, transfer, pending writes, movement) and lookups with their
counts (``lookups.Lookups``: levels). :class:`TierChain` builds them, delegates to them
and adds the whole-chain operations (store, flush, clear, delete, stats).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from tierd.chain.admit import Admissions
from tierd.chain.behind import BATCH_BLOCKS, BATCH_BYTES
from tierd.chain.census import PrefixCensus
from tierd.chain.copies import UpperCopies
from tierd.chain.handles import LoadHandle, StoreHandle
from tierd.chain.invariants import check_levels
from tierd.chain.levels import ChainLevels
from tierd.chain.loads import Loading
from tierd.chain.lookups import Lookups
from tierd.chain.moves import Movement
from tierd.chain.pending import PendingWrites
from tierd.chain.remote import Landing, RemoteSide
from tierd.chain.values import Admission, ChainStats, Deleted, FlushResult, Level, LookupResult
from tierd.errors import CapacityError
from tierd.events import EventBus
from tierd.keys import BlockKey, Medium
from tierd.stores import Buffer
from tierd.transfer import TransferEngine
from tierd.turns import DELETE_KEYS, INDEX_KEYS, TOUCH_KEYS, next_turn

__all__ = ["TierChain"]

_IN_USE = ("writing", "pinned")
_REMOTE_BATCH = 256  # blocks per round trip when a flush sends the last level's blocks


class TierChain:
    """Levels fastest first, moved between by one transfer engine: lookups, stores, loads
    and whole-chain operations, over the parts it builds."""

    def __init__(
        self,
        levels: Sequence[Level],
        transfer: TransferEngine,
        *,
        entry: int = 0,
        bus: EventBus | None = None,
        reuse_memory: int = 1 << 20,
        remote: RemoteSide | None = None,
    ) -> None:
        self._levels = chain_levels = ChainLevels(levels, entry=entry, bus=bus, remote=remote)
        self.levels = chain_levels.levels
        self.entry = entry
        self.bus = chain_levels.bus
        self.block_bytes = chain_levels.block_bytes
        self.remote = remote
        self.transfer = transfer
        self._admissions = Admissions(chain_levels, reuse_memory)
        self._writes = PendingWrites(chain_levels)
        copies = UpperCopies(chain_levels)
        self._moves = Movement(chain_levels, transfer, self._writes, self._admissions, copies)
        self._loads = Loading(chain_levels, transfer, self._writes, self._moves)
        self._lookups = Lookups(chain_levels)
        self._behind = self._moves.behind

    async def close(self) -> None:
        """Stop copying behind stores (waiting for the copies under way); the stores are
        the opener's to close, after this."""
        await self._behind.close()

    @property
    def census(self) -> PrefixCensus | None:
        """Blocks per key prefix, once :meth:`prefix_census` was asked for."""
        return self._levels.census

    def set_admissions(self, rules: Sequence[Admission], remote: Admission | None = None) -> None:
        """New admission rules, one per level (and the remote level's): what the old rules
        counted of recent uses is kept only if the new ones need no more of it."""
        self._admissions.set_rules(rules, remote)

    def level_of(self, medium: Medium | str) -> int:
        """The index of the first level on ``medium``."""
        return self._levels.level_of(medium)

    def _publish(self) -> None:
        """Publish every level's buffered events now."""
        self._levels.publish()

    def loading(
        self, keys: Sequence[BlockKey], into: Medium | str | None = None
    ) -> AbstractAsyncContextManager[LoadHandle]:
        """``async with chain.loading(keys) as handle:`` — :meth:`load`, released on exit."""
        return self._loads.loading(keys, into)

    async def load(
        self,
        keys: Sequence[BlockKey],
        into: Medium | str | None = None,
        *,
        wait_s: float | None = None,
    ) -> LoadHandle:
        """Promote ``keys`` up to the level on ``into`` (default: the entry level) and pin
        them there: see :meth:`tierd.chain.loads.Loading.load`."""
        return await self._loads.load(keys, into, wait_s=wait_s)

    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        """How many leading keys are ready at some level, and where; counts no use:
        see :meth:`tierd.chain.lookups.Lookups.lookup`."""
        return self._lookups.lookup(keys)

    async def find(self, keys: Sequence[BlockKey]) -> LookupResult:
        """:meth:`lookup`, then the rest of the leading run on the remote level:
        see :meth:`tierd.chain.lookups.Lookups.find`."""
        return await self._lookups.find(keys)

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some local level holds it ready; counted as a lookup."""
        return self._lookups.holds(keys)

    def held_locally(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some local level holds it ready; a query that counts nothing."""
        return self._lookups.held_locally(keys)

    async def find_each(self, keys: Sequence[BlockKey]) -> list[bool]:
        """:meth:`holds`, then one batched existence check on the remote level."""
        return await self._lookups.find_each(keys)

    def touch(self, keys: Sequence[BlockKey], *, uses: bool = True) -> None:
        """Mark ``keys`` used at every level that holds them. A touch is a request's use of
        its keys, held or not: admission rules count one use per key per touch, unless
        ``uses`` is false (an order only: a client telling which of its keys came first)."""
        if uses and self._admissions.tracks_uses:
            self._admissions.count_uses(keys)
        for level in self.levels:
            level.tier.touch(keys)

    async def touch_in_pieces(self, keys: Sequence[BlockKey], *, uses: bool = True) -> None:
        """:meth:`touch`, :data:`TOUCH_KEYS` keys a turn of the event loop, the tail's
        first (so ``keys[0]`` still ends up the most recent); uses counted once, first (a
        key in two pieces is still one use)."""
        if uses and self._admissions.tracks_uses:
            self._admissions.count_uses(keys)
        for end in range(len(keys), 0, -TOUCH_KEYS):
            if end < len(keys):
                await next_turn()
            self.touch(keys[max(0, end - TOUCH_KEYS) : end], uses=False)

    async def store(self, keys: Sequence[BlockKey], data: Sequence[Buffer] | Any) -> list[BlockKey]:
        """Write blocks at the entry level; ``data`` is co-indexed with ``keys`` (buffers or
        a ``[n, block_bytes]`` uint8 tensor). Keys already present are skipped. Returns the
        keys that became ready. Raises :class:`CapacityError` if the entry level cannot
        make room (everything pinned or in flight)."""
        row = {key: i for i, key in enumerate(keys)}
        handle = await self.begin_store(keys)
        ok: list[bool] = []
        try:
            if handle.keys:
                rows = [data[row[k]] for k in handle.keys]
                ok = await self.levels[self.entry].store.write(handle.slots, handle.keys, rows)
        finally:
            if len(ok) != len(handle.keys):
                handle.abort()
        self.levels[self.entry].io_errors += ok.count(False)  # the entry store's write failed
        return await handle.commit(ok)

    async def begin_store(self, keys: Sequence[BlockKey]) -> StoreHandle:
        """Reserve entry-level slots for the keys of ``keys`` not held or in flight there,
        after demoting the victims. The caller fills ``handle.slots`` (zero-copy, through
        the store's views) and then calls ``commit`` or ``abort``; until then the keys are
        in flight. Raises :class:`CapacityError` as :meth:`store` does."""
        reserved = await self._moves.reserve(self.entry, list(dict.fromkeys(keys)))
        if reserved is None:
            stats = self.levels[self.entry].tier.stats()
            raise CapacityError(
                f"cannot make room for {len(keys)} blocks in a tier of {stats.capacity}"
                f" ({stats.pinned} pinned, {stats.writing} in flight)",
                tier=stats.name,
                medium=str(stats.medium),
            )
        return StoreHandle(self._moves, self.entry, *reserved)

    def behind_backlog(self, index: int) -> int:
        """Blocks stored into level ``index`` still to be copied down behind their stores
        (``write_behind``): queued, or being copied."""
        return self._behind.backlog(index)

    async def settle(self) -> None:
        """Wait for what stores left running in the background: the copies behind them
        (``write_behind``), then the remote writes queued by then (each under its
        deadline). With no store meanwhile, the levels are then at rest: what a next
        call finds does not depend on how fast the copies were."""
        await self._behind.settled()
        if self.remote is not None:
            await self.remote.level.settle()

    async def flush(self) -> FlushResult:
        """Copy every dirty block down, level by level, so that the last level ends up
        holding everything it can; says what was copied and what stayed dirty, and why."""
        async with self._behind.paused():  # no copy behind stores beside this one
            return await self._flush()

    async def _flush(self) -> FlushResult:
        copied = 0
        errors = [level.io_errors for level in self.levels]
        upper = range(len(self.levels) - 1)
        # Copying into level i+1 may evict (and demote) the clean copy of another block of
        # level i, dirty again: a few more passes settle that; a tier below that is too
        # small never settles, so the passes are bounded.
        for _ in range(len(self.levels)):
            moved = 0
            for index in upper:
                moved += await self._copy_down_dirty(index)
            copied += moved
            if not moved:
                break
        landing = Landing()
        if self.remote is not None:  # the server skips what it holds already
            last = len(self.levels) - 1
            tier = self._levels.tiers[last]
            async for keys in self._walk(last):
                ready = [k for k in keys if k in tier]
                for start in range(0, len(ready), _REMOTE_BATCH):
                    batch = ready[start : start + _REMOTE_BATCH]
                    landing.add(await self._moves.write_remote(last, batch))
            # The writes queued before (evictions, write-through): each under its deadline.
            await self.remote.level.settle()
            copied += landing.sent - landing.not_landed + landing.unread
            self._publish()
        dirty = {}
        for index in upper:
            if count := await self._count_dirty(index):
                dirty[self.levels[index].tier.name] = count
        failed = {
            level.tier.name: level.io_errors - before
            for level, before in zip(self.levels, errors, strict=True)
            if level.io_errors > before
        }
        missed = {level: dict(causes) for level, causes in landing.missed.items()}
        return FlushResult(copied, dirty, failed, landing.sent, missed, landing.unread)

    async def _walk(self, index: int) -> AsyncIterator[list[BlockKey]]:
        """The keys of level ``index`` (every state, kept ones not adopted yet last),
        :data:`INDEX_KEYS` a turn of the loop: a pass over a big tier is never one turn
        (a flush's or a clear's scan of it at once would hold the loop a second or more)."""
        first = True
        for part in self._levels.tiers[index].key_parts():
            for start in range(0, len(part), INDEX_KEYS):
                if not first:
                    await next_turn()
                first = False
                yield part[start : start + INDEX_KEYS]

    def _dirty_of(self, index: int, keys: list[BlockKey]) -> list[BlockKey]:
        """The ``keys`` ready at ``index`` that the level below neither holds nor writes."""
        tiers = self._levels.tiers
        tier, lower = tiers[index], tiers[index + 1]
        return [k for k in keys if k in tier and k not in lower and not lower.is_writing(k)]

    async def _copy_down_dirty(self, index: int) -> int:
        """Copy the dirty blocks of level ``index`` down, a batch at a time: a batch is
        pinned while it is copied, so a batch is at most a quarter of the level (and
        what a write-behind batch may be), and the stores beside a flush find room (a
        flush of the whole level at once pinned it: 71 of 72 puts beside it refused)."""
        tier = self._levels.tiers[index]
        batch = max(1, min(BATCH_BLOCKS, BATCH_BYTES // self.block_bytes, tier.num_blocks // 4))
        moved = 0
        waiting: list[BlockKey] = []
        async for keys in self._walk(index):
            waiting += self._dirty_of(index, keys)
            while len(waiting) >= batch:
                chunk, waiting = waiting[:batch], waiting[batch:]
                moved += len(await self._moves.copy_down(index, chunk))
        if waiting:
            moved += len(await self._moves.copy_down(index, self._dirty_of(index, waiting)))
        return moved

    async def _count_dirty(self, index: int) -> int:
        count = 0
        async for keys in self._walk(index):
            count += len(self._dirty_of(index, keys))
        return count

    def clear(self, index: int | None = None) -> int:
        """Drop every idle block at one level (or all) at once; returns how many were
        removed. A persistent store forgets them too: a cleared disk tier stays empty
        after a restart. The daemon's clear is :meth:`clear_in_pieces`."""
        targets = range(len(self.levels)) if index is None else [index]
        removed = 0
        for i in targets:
            tier = self._levels.tiers[i]
            removed += self._clear_keys(i, [k for part in tier.key_parts() for k in part])
        self._publish()
        return removed

    async def clear_in_pieces(self, index: int | None = None) -> int:
        """:meth:`clear`, :data:`INDEX_KEYS` keys of a level a turn of the loop; a block
        pinned or written meanwhile stays."""
        targets = range(len(self.levels)) if index is None else [index]
        removed = 0
        for i in targets:
            async for keys in self._walk(i):
                removed += self._clear_keys(i, keys)
                self._publish()
        return removed

    def _clear_keys(self, index: int, keys: list[BlockKey]) -> int:
        """Drop the idle blocks of ``keys`` at level ``index`` (kept ones not adopted yet
        too), their slots forgotten by a persistent store; how many went."""
        level = self.levels[index]
        tier = level.tier
        idle = [k for k in keys if not tier.is_pinned(k) and not tier.is_writing(k)]
        slots = {k: s for k in idle if (s := tier.slot_of(k)) is not None}
        gone = tier.discard(idle)  # kept blocks not adopted yet too: the tier drops them
        if gone:
            level.store.invalidate([s for k in gone if (s := slots.get(k)) is not None])
        return len(gone)

    def delete(self, keys: Sequence[BlockKey]) -> Deleted:
        """Remove ``keys`` from every level (a ``Removed`` event per level; a persistent
        store forgets them across a restart too). A key being written or pinned at any
        level is kept whole, at every level: no reader loses a block under it and no key
        is left half removed. It is reported busy, to be asked again. The remote level
        is not asked: its server owns membership (its TTL and eviction)."""
        tiers = self._levels.tiers
        asked = list(dict.fromkeys(keys))
        busy = [k for k in asked if any(t.state_of(k) in _IN_USE for t in tiers)]
        held = set(busy)
        todo = [k for k in asked if k not in held]
        removed: set[BlockKey] = set()
        for level in self.levels:
            tier = level.tier
            slots = [s for k in todo if (s := tier.slot_of(k)) is not None]
            removed.update(tier.discard(todo))
            if slots:
                level.store.invalidate(slots)
        self._publish()
        return Deleted(len(removed), len(busy))

    async def delete_in_pieces(self, keys: Sequence[BlockKey]) -> Deleted:
        """:meth:`delete`, :data:`DELETE_KEYS` keys a turn of the event loop (a key is
        a Python step at every level: a big delete at once would hold the loop)."""
        asked = list(dict.fromkeys(keys))
        removed = busy = 0
        for start in range(0, len(asked), DELETE_KEYS):
            if start:
                await next_turn()
            done = self.delete(asked[start : start + DELETE_KEYS])
            removed, busy = removed + done.removed, busy + done.busy
        return Deleted(removed, busy)

    def prefix_census(self, length: int) -> PrefixCensus:
        """Ready blocks per level by the first ``length`` bytes of their keys, kept up to
        date from the chain's events from the first call on (which counts each level
        once; a call with another length starts again)."""
        levels = self._levels
        if levels.census is None or levels.census.length != length:
            levels.publish()  # events still buffered are in the count already
            levels.census = PrefixCensus(length, levels.tiers)
        return levels.census

    def holders(self, key: BlockKey) -> list[tuple[str, str, str, int]]:
        """Where ``key`` is: (tier, medium, state, slot) for every level holding it."""
        out = []
        for level in self.levels:
            tier = level.tier
            state = tier.state_of(key)
            slot = tier.slot_of(key)
            if state is not None and slot is not None:
                out.append((tier.name, str(level.medium), state, slot))
        return out

    def stats(self) -> ChainStats:
        counts = self._lookups
        by_medium: dict[str, int] = {}
        for level, hits in zip(self.levels, counts.hits_by_level, strict=True):
            if hits:
                by_medium[level.medium] = by_medium.get(level.medium, 0) + hits
        if self.remote is not None and self.remote.hits:
            by_medium[self.remote.level.medium] = self.remote.hits
        return ChainStats(
            lookups=counts.lookups,
            hit_blocks=counts.hit_blocks,
            miss_blocks=counts.miss_blocks,
            hits_by_medium=by_medium,
            hits_by_level=tuple(counts.hits_by_level),
            events_published=self.bus.published,
            events_dropped=self.bus.dropped,
        )

    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise ``AssertionError`` naming the first broken invariant. With ``idle=True``
        (no operation in progress) pins, in-flight writes and pending futures must be 0."""
        check_levels(self.levels, idle=idle, pending=len(self._writes))
