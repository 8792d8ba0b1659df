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
- ``load`` promotes what lies below the target level up to it; the lower copy stays. Two
  callers promoting the same block at once share one read.
- After every operation each level's events are published on the chain's event bus.

The chain is built in layers, a module each: its state and bookkeeping (``state``), writes
and demotion (``moves``), loads and promotion (``loads``), and this public face.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierd.chain.census import PrefixCensus
from tierd.chain.handles import StoreHandle
from tierd.chain.invariants import check_levels
from tierd.chain.loads import ChainLoads
from tierd.chain.values import ChainStats, Deleted, FlushResult, LookupResult
from tierd.errors import CapacityError
from tierd.keys import BlockKey
from tierd.stores import Buffer

__all__ = ["TierChain"]

_IN_USE = ("writing", "pinned")
_REMOTE_BATCH = 256  # blocks per round trip when a flush sends the last level's blocks


class TierChain(ChainLoads):
    """Levels fastest first, moved between by one transfer engine: lookups, stores, loads
    (:class:`~tierd.chain.loads.ChainLoads`) and whole-chain operations."""

    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        """How many leading keys are ready at some level, and where. A lookup is a query:
        it may be repeated while a request waits (``in_flight``), so it counts no use."""
        tiers = self._tiers
        top, hits = tiers[0], self._hits_by_level
        found: list[int] = []
        in_flight = False
        pos, n = 0, len(keys)
        while pos < n:
            run = top.ready_run(keys, pos)  # the hot case: a run of hits at the top level
            if run:
                found += [0] * run
                hits[0] += run
                pos += run
                continue
            key = keys[pos]
            for index in range(1, len(tiers)):
                if key in tiers[index]:
                    found.append(index)
                    hits[index] += 1
                    pos += 1
                    break
            else:
                in_flight = any(tier.is_writing(key) for tier in tiers)
                break
        self._lookups += 1
        self._hit_blocks += len(found)
        self._miss_blocks += n - len(found)
        media = tuple(map(self._media.__getitem__, found))
        return LookupResult(len(found), tuple(found), media, in_flight)

    async def find(self, keys: Sequence[BlockKey]) -> LookupResult:
        """:meth:`lookup`, then, with a remote level, the rest of the leading run across
        local and remote levels alike: past the local run, the keys no local level holds
        are asked of the remote level in one batched existence check (faults there are
        misses, bounded by its deadline), and the run goes on through keys held locally
        or remotely until the first key held nowhere. Under LRU a prefix's head ages out
        first, so a head on the remote level with its tail still local is the usual shape.
        Without a remote level it is :meth:`lookup` and never awaits."""
        local = self.lookup(keys)
        remote = self.remote
        if remote is None or local.in_flight or local.count == len(keys):
            return local
        holders = self._holders(keys, local.count)
        missing = [
            key for key, holder in zip(keys[local.count :], holders, strict=True) if holder is None
        ]
        run = await remote.level.exists(missing)
        if not run:
            return local
        where = len(self.levels)  # the remote level comes after the local ones
        levels = list(local.levels)
        for holder in holders:
            if holder is None:
                if run == 0:
                    break  # held nowhere: the run ends here
                run -= 1
                holder = where
            levels.append(holder)
        found = levels[local.count :]
        for holder in found:
            if holder == where:
                remote.hits += 1
            else:
                self._hits_by_level[holder] += 1
        self._hit_blocks += len(found)
        self._miss_blocks -= len(found)
        media = (*self._media, remote.level.medium)
        stop = keys[len(levels)] if len(levels) < len(keys) else None
        in_flight = stop is not None and any(tier.is_writing(stop) for tier in self._tiers)
        return LookupResult(len(levels), tuple(levels), tuple(media[i] for i in levels), in_flight)

    def _holders(self, keys: Sequence[BlockKey], start: int) -> list[int | None]:
        """For each key from ``keys[start]`` on, the highest local level holding it ready
        (``None``: none does)."""
        tiers = self._tiers
        return [
            next((i for i, tier in enumerate(tiers) if key in tier), None) for key in keys[start:]
        ]

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some local level holds it ready (in flight: False). Unlike
        :meth:`lookup` it does not stop at a miss; it counts one lookup and its hits."""
        by_level = self._hits_by_level
        held = [False] * len(keys)
        for i, key in enumerate(keys):
            index = self._holder(key)
            if index is not None:
                held[i] = True
                by_level[index] += 1
        hits = held.count(True)
        self._lookups += 1
        self._hit_blocks += hits
        self._miss_blocks += len(keys) - hits
        return held

    def held_locally(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some local level holds it ready; a query that counts nothing."""
        return [self._holder(key) is not None for key in keys]

    def _holder(self, key: BlockKey) -> int | None:
        """The fastest level that holds ``key`` ready."""
        return next((i for i, tier in enumerate(self._tiers) if key in tier), None)

    async def find_each(self, keys: Sequence[BlockKey]) -> list[bool]:
        """:meth:`holds`, then, with a remote level, one batched existence check there for
        the keys no local level holds (faults there are misses, bounded by its deadline)."""
        held = self.holds(keys)
        remote = self.remote
        if remote is None or all(held):
            return held
        missing = [i for i, flag in enumerate(held) if not flag]
        there = await remote.level.present([keys[i] for i in missing])
        for i, flag in zip(missing, there, strict=True):
            held[i] = flag
        found = sum(there)
        remote.hits += found
        self._hit_blocks += found
        self._miss_blocks -= found
        return held

    def touch(self, keys: Sequence[BlockKey], *, uses: bool = True) -> None:
        """Mark ``keys`` used at every level that holds them. A touch is a request's use of
        its keys, held or not: admission rules count one use per key per touch, unless
        ``uses`` is false (an order only: a client telling which of its keys came first)."""
        if uses and self._tracks_uses:
            self._count_uses(keys)
        for level in self.levels:
            level.tier.touch(keys)

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
        reserved = await self._reserve(self.entry, list(dict.fromkeys(keys)))
        if reserved is None:
            stats = self.levels[self.entry].tier.stats()
            raise CapacityError(
                f"cannot make room for {len(keys)} blocks in a tier of {stats.capacity}"
                f" ({stats.pinned} pinned, {stats.writing} in flight)",
                tier=stats.name,
                medium=str(stats.medium),
            )
        return StoreHandle(self, self.entry, *reserved)

    async def flush(self) -> FlushResult:
        """Copy every dirty block down, level by level, so that the last level ends up
        holding everything it can; says what was copied and what stayed dirty, and why."""
        copied = 0
        errors = [level.io_errors for level in self.levels]
        upper = range(len(self.levels) - 1)
        # Copying into level i+1 may evict (and demote) the clean copy of another block of
        # level i, dirty again: a few more passes settle that; a tier below that is too
        # small never settles, so the passes are bounded.
        for _ in range(len(self.levels)):
            moved = 0
            for index in upper:
                moved += len(await self._copy_down(index, self._dirty(index)))
            copied += moved
            if not moved:
                break
        if self.remote is not None:  # the server skips what it holds already
            last = len(self.levels) - 1
            ready = self._tiers[last].ready_keys()
            for start in range(0, len(ready), _REMOTE_BATCH):
                copied += await self._send_remote(
                    last, ready[start : start + _REMOTE_BATCH], wait=True
                )
            await self.remote.level.drain()
            self._publish()
        dirty = {self._tiers[i].name: n for i in upper if (n := len(self._dirty(i)))}
        failed = {
            level.tier.name: level.io_errors - before
            for level, before in zip(self.levels, errors, strict=True)
            if level.io_errors > before
        }
        return FlushResult(copied, dirty, failed)

    def _dirty(self, index: int) -> list[BlockKey]:
        """Ready blocks at ``index`` that the level below neither holds nor is writing."""
        lower = self._tiers[index + 1]
        return [
            k for k in self._tiers[index].ready_keys() if k not in lower and not lower.is_writing(k)
        ]

    def clear(self, index: int | None = None) -> int:
        """Drop every idle block at one level (or all); returns how many were removed. A
        persistent store forgets them too: a cleared disk tier stays empty after a restart."""
        targets = range(len(self.levels)) if index is None else [index]
        removed = 0
        for i in targets:
            level = self.levels[i]
            slots = {key: level.tier.slot_of(key) for key in level.tier.ready_keys()}
            gone = level.tier.clear()  # kept blocks not adopted yet too: the tier drops them
            if gone:
                level.store.invalidate([s for k in gone if (s := slots.get(k)) is not None])
            removed += len(gone)
        self._publish()
        return removed

    def delete(self, keys: Sequence[BlockKey]) -> Deleted:
        """Remove ``keys`` from every level (a ``Removed`` event per level; a persistent
        store forgets them across a restart too). A key being written or pinned at any
        level is kept whole, at every level: no reader loses a block under it and no key
        is left half removed. It is reported busy, to be asked again. The remote level
        is not asked: its server owns membership (its TTL and eviction)."""
        tiers = self._tiers
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

    def prefix_census(self, length: int) -> PrefixCensus:
        """Ready blocks per level by the first ``length`` bytes of their keys, kept up to
        date from the chain's events from the first call on (which counts each level
        once; a call with another length starts again)."""
        if self.census is None or self.census.length != length:
            self._publish()  # events still buffered are in the count already
            self.census = PrefixCensus(length, self._tiers)
        return self.census

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
        by_medium: dict[str, int] = {}
        for level, hits in zip(self.levels, self._hits_by_level, strict=True):
            if hits:
                by_medium[level.medium] = by_medium.get(level.medium, 0) + hits
        if self.remote is not None and self.remote.hits:
            by_medium[self.remote.level.medium] = self.remote.hits
        return ChainStats(
            lookups=self._lookups,
            hit_blocks=self._hit_blocks,
            miss_blocks=self._miss_blocks,
            hits_by_medium=by_medium,
            hits_by_level=tuple(self._hits_by_level),
            events_published=self.bus.published,
            events_dropped=self.bus.dropped,
        )

    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise ``AssertionError`` naming the first broken invariant. With ``idle=True``
        (no operation in progress) pins, in-flight writes and pending futures must be 0."""
        check_levels(self.levels, idle=idle, pending=len(self._pending))
