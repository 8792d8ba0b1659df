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

Writes into a level register a future in ``_pending`` until they complete, so a caller
that finds a block in flight waits for it (or, from ``lookup``, is told to retry).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from tierd.chain.handles import LoadHandle, StoreHandle
from tierd.chain.invariants import check_levels
from tierd.chain.remote import RemoteSide
from tierd.chain.values import Admission, ChainStats, FlushResult, Level, LookupResult
from tierd.errors import BlockMissing, CapacityError
from tierd.events import EventBus
from tierd.keys import BlockKey, Medium
from tierd.policy.admission import Comeback, KeyUses
from tierd.stores import BlockStore, Buffer
from tierd.tier import StorePlan
from tierd.transfer import TransferEngine

__all__ = ["TierChain"]

_REMOTE_BATCH = 256  # blocks per round trip when a flush sends the last level's blocks


class TierChain:
    """Levels fastest first, moved between by one transfer engine."""

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
        if not levels:
            raise ValueError("a chain needs at least one level")
        if not 0 <= entry < len(levels):
            raise ValueError(f"entry level {entry} out of range 0..{len(levels) - 1}")
        block_sizes = {level.store.block_bytes for level in levels}
        if len(block_sizes) != 1:
            raise ValueError(f"every level needs the same block_bytes, got {sorted(block_sizes)}")
        self.levels = list(levels)
        self.transfer = transfer
        self.entry = entry
        self.bus = bus or EventBus()
        self.block_bytes = block_sizes.pop()
        self._pending: dict[tuple[int, BlockKey], asyncio.Future[bool]] = {}
        rules = [level.admission for level in self.levels] + ([remote.admission] if remote else [])
        self._uses = KeyUses(  # what admission rules know of each recently used key
            reuse_memory,
            draws=any(rule.sample for rule in rules),
            ends=any(rule.comeback for rule in rules),
        )
        self._comebacks: dict[int, Comeback] = {}  # id(level or remote side) -> its shadow
        self._reuse_memory = reuse_memory
        self._lookups = self._hit_blocks = self._miss_blocks = 0
        self._hits_by_level = [0] * len(self.levels)
        self._media = [level.medium for level in self.levels]
        self._tiers = [level.tier for level in self.levels]
        self.remote = remote
        self._tracks_uses = any(rule.counts_uses for rule in rules)

    # -- queries ---------------------------------------------------------------------

    def level_of(self, medium: Medium | str) -> int:
        """The index of the first level on ``medium``."""
        for index, level in enumerate(self.levels):
            if level.medium == medium:
                return index
        raise ValueError(f"no level on medium {medium!r}")

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
        """:meth:`lookup`, then, with a remote level, one batched existence check there for
        the keys past the local run (faults there are misses, bounded by its deadline).
        Without a remote level it is :meth:`lookup` and never awaits."""
        local = self.lookup(keys)
        remote = self.remote
        if remote is None or local.in_flight or local.count == len(keys):
            return local
        rest = keys[local.count :]
        run = await remote.level.exists(rest)
        if not run:
            return local
        remote.hits += run
        self._hit_blocks += run
        self._miss_blocks -= run
        where = len(self.levels)  # the remote level comes after the local ones
        return LookupResult(
            local.count + run,
            local.levels + (where,) * run,
            local.media + (remote.level.medium,) * run,
            False,
        )

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` used at every level that holds them. A touch is a request's use of
        its keys, held or not: admission rules count one use per key per touch."""
        if self._tracks_uses:
            self._count_uses(keys)
        for level in self.levels:
            level.tier.touch(keys)

    # -- store -----------------------------------------------------------------------

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

    async def _commit(
        self, index: int, keys: Sequence[BlockKey], ok: Sequence[bool], futures: list[Any]
    ) -> list[BlockKey]:
        stored = self._finish_store(index, keys, ok, futures, io_failed=False)
        await self._write_through(index, stored)
        return stored

    async def _reserve(
        self, index: int, keys: Sequence[BlockKey]
    ) -> tuple[StorePlan, list[asyncio.Future[bool]]] | None:
        """prepare_store at one level and demote its victims; ``None`` if there is no
        room. The keys stay in flight until :meth:`_finish_store`."""
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
            self._finish_store(index, plan.keys, [False] * len(plan.keys), futures)
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
            stored = self._finish_store(index, plan.keys, ok, futures)
        return stored

    def _finish_store(
        self,
        index: int,
        keys: Sequence[BlockKey],
        ok: Sequence[bool],
        futures: list[asyncio.Future[bool]],
        *,
        io_failed: bool = True,
    ) -> list[BlockKey]:
        """Complete a write: ``ok`` blocks become ready, the rest are dropped (and counted
        as I/O errors unless ``io_failed`` is false: a client that gave up is not one)."""
        tier = self.levels[index].tier
        good = [k for k, flag in zip(keys, ok, strict=True) if flag]
        bad = [k for k, flag in zip(keys, ok, strict=True) if not flag]
        tier.complete_store(good)
        tier.complete_store(bad, success=False)
        if io_failed:
            self.levels[index].io_errors += len(bad)
        for key, future, flag in zip(keys, futures, ok, strict=True):
            del self._pending[(index, key)]
            if not future.done():
                future.set_result(flag)
        self._publish()
        return good

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
        """Copy ready blocks of level ``index`` to the remote level, pinned meanwhile."""
        assert self.remote is not None
        tier = self.levels[index].tier
        keys = [k for k in keys if k in tier]
        if not keys:
            return 0
        slots = tier.prepare_load(keys)
        try:
            return await self.remote.copy_out(self.levels[index].store, slots, keys, wait=wait)
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

    # -- load ------------------------------------------------------------------------

    @asynccontextmanager
    async def loading(
        self, keys: Sequence[BlockKey], into: Medium | str | None = None
    ) -> AsyncIterator[LoadHandle]:
        """``async with chain.loading(keys) as handle:`` — :meth:`load`, released on exit."""
        handle = await self.load(keys, into)
        try:
            yield handle
        finally:
            handle.release()

    async def load(
        self,
        keys: Sequence[BlockKey],
        into: Medium | str | None = None,
        *,
        wait_s: float | None = None,
    ) -> LoadHandle:
        """Promote ``keys`` up to the level on ``into`` (default: the entry level) and pin
        them there. The handle holds the leading keys that could be loaded: it stops at
        the first key held nowhere or whose copy failed (a repeated key counts once).
        A key still being written (another store's reservation) is waited for at most
        ``wait_s`` seconds from the call (``None``: until that store ends); past that the
        load stops before it. Raises :class:`BlockMissing` if not even the first key can
        be loaded."""
        target = self.entry if into is None else self.level_of(into)
        wanted = list(dict.fromkeys(keys))
        pinned: set[BlockKey] = set()
        deadline = None if wait_s is None else asyncio.get_running_loop().time() + wait_s
        try:
            deepest = await self._gather(target, wanted, pinned, deadline)
        except BaseException:
            self._unpin(target, list(pinned))
            raise
        finally:
            self._publish()
        prefix: list[BlockKey] = []
        for key in wanted:
            if key not in pinned:
                break
            prefix.append(key)
        self._unpin(target, [k for k in pinned if k not in set(prefix)])
        tier = self.levels[target].tier
        if not prefix and wanted:
            raise BlockMissing(
                "no leading block can be loaded",
                tier=tier.name,
                medium=str(tier.medium),
                key=wanted[0],
            )
        slots = [tier.slot_of(k) for k in prefix]
        return LoadHandle(self, target, prefix, [s for s in slots if s is not None], deepest)

    async def _gather(
        self, target: int, keys: list[BlockKey], pinned: set[BlockKey], deadline: float | None
    ) -> int:
        """Make ``keys`` ready at ``target`` as far as possible, pinning each as soon as it
        is there (so nothing evicts it meanwhile); a key in flight is waited for until
        ``deadline`` (loop time), then the run stops before it. Returns the slowest level
        read from."""
        tier = self.levels[target].tier
        sources: dict[int, list[BlockKey]] = {}
        reachable: list[BlockKey] = []
        remote: list[BlockKey] = []  # held by no local level: asked of the remote one
        for key in keys[: tier.num_blocks]:  # a load cannot hold more than the level
            if key not in tier and (target, key) not in self._pending:
                source = self._source_of(key, target)
                if source is None:
                    if self.remote is None or any(t.is_writing(key) for t in self._tiers):
                        break  # nothing beyond the first absent key can be in the prefix
                    remote.append(key)
                else:
                    sources.setdefault(source, []).append(key)
            reachable.append(key)
        # Pinning keys past that point would only take room the promotions need.
        keys = reachable
        self._pin(target, [k for k in keys if k in tier], pinned)
        # Hold every source until its turn, so that promoting one group (which may evict
        # and demote at the levels below) cannot push another group's source away.
        waiting = dict(sources)
        for source, group in waiting.items():
            self.levels[source].tier.prepare_load(group)
        try:
            for source, group in sources.items():
                del waiting[source]
                self._unpin(source, group)  # _promote pins them again before it awaits
                await self._promote(source, target, group, pinned)
        finally:
            for source, group in waiting.items():
                self._unpin(source, group)
        if remote:
            await self._promote_remote(target, remote, pinned)
        for key in keys:
            future = self._pending.get((target, key))
            if key not in pinned and future is not None and not await _wait(future, deadline):
                break  # another client is still writing it: the prefix ends here
            if key not in pinned and key in tier:
                self._pin(target, [key], pinned)
        if remote and any(k in pinned for k in remote):
            return len(self.levels)  # read from the remote level, the slowest
        return max(sources, default=target)  # levels go fastest first

    def _source_of(self, key: BlockKey, target: int) -> int | None:
        """The level nearest to ``target`` that holds ``key`` ready."""
        order = sorted(range(len(self.levels)), key=lambda i: (abs(i - target), i))
        return next((i for i in order if i != target and key in self.levels[i].tier), None)

    async def _promote(
        self, source: int, target: int, keys: list[BlockKey], pinned: set[BlockKey]
    ) -> None:
        """Copy ready blocks from ``source`` into ``target``; the source copy stays."""
        upper, lower = self.levels[target], self.levels[source]
        keys = [k for k in keys if k in lower.tier]
        if not keys:
            return
        slots = dict(zip(keys, lower.tier.prepare_load(keys), strict=True))
        failed: list[BlockKey] = []

        async def fill(store: BlockStore, plan: StorePlan) -> list[bool]:
            src = [slots[k] for k in plan.keys]
            ok = await self.transfer.copy(lower.store, src, store, plan.slots, plan.keys)
            failed.extend(k for k, flag in zip(plan.keys, ok, strict=True) if not flag)
            return ok

        try:
            moved = await self._store_into(target, keys, fill)
            upper.promotions += len(moved)
            self._pin(target, moved, pinned)
        finally:
            self._unpin(source, keys)
        if failed and lower.medium not in (Medium.MEMORY, Medium.CPU):
            # A block that cannot be read is useless below too (bad checksum, bad sector).
            # Host memory cannot fail a read: there the destination's write failed (it
            # counted the error itself) and the copy below is intact, so it stays.
            lower.io_errors += len(failed)
            lower.tier.discard([k for k in failed if not lower.tier.is_pinned(k)])

    async def _promote_remote(
        self, target: int, keys: list[BlockKey], pinned: set[BlockKey]
    ) -> None:
        """Fetch the leading ``keys`` the remote level holds intact (verified into private
        buffers first) and store them into ``target``, pinned there."""
        assert self.remote is not None
        payloads = await self.remote.level.get(keys)
        if not payloads:
            return
        fetched = dict(zip(keys, payloads, strict=False))

        async def fill(store: BlockStore, plan: StorePlan) -> list[bool]:
            return await store.write(plan.slots, plan.keys, [fetched[k] for k in plan.keys])

        moved = await self._store_into(target, list(fetched), fill)
        self.remote.promotions += len(moved)
        self.levels[target].promotions += len(moved)
        self._pin(target, moved, pinned)

    # -- housekeeping ------------------------------------------------------------------

    def _pin(self, index: int, keys: list[BlockKey], pinned: set[BlockKey]) -> None:
        fresh = [k for k in keys if k not in pinned]
        if fresh:
            self.levels[index].tier.prepare_load(fresh)
            pinned.update(fresh)

    def _unpin(self, index: int, keys: list[BlockKey]) -> None:
        if keys:
            self.levels[index].tier.complete_load(keys)
            self._publish()

    def _register(self, index: int, keys: Sequence[BlockKey]) -> list[asyncio.Future[bool]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in keys]
        for key, future in zip(keys, futures, strict=True):
            self._pending[(index, key)] = future
        return futures

    def _admits(self, side: Level | RemoteSide, key: BlockKey) -> bool:
        """Whether the level (or remote side) ``side`` admits ``key``, a candidate now;
        call once per candidate (a ``comeback`` rule records each one)."""
        rule = side.admission
        shadow = None
        if rule.comeback:  # the shadow spans the level's size (the remote: the reuse memory)
            shadow = self._comebacks.get(id(side))
            if shadow is None or shadow.threshold != rule.comeback:
                horizon = side.tier.num_blocks if isinstance(side, Level) else self._reuse_memory
                shadow = self._comebacks[id(side)] = Comeback(
                    rule.comeback, horizon, self._reuse_memory
                )
        return self._admits_rule(rule, key, shadow)

    def _admits_rule(
        self, admission: Admission, key: BlockKey, shadow: Comeback | None = None
    ) -> bool:
        return admission.admits(key, self._uses, shadow)

    def _count_uses(self, keys: Sequence[BlockKey]) -> None:
        """Count one use per distinct key for admission rules, and tell ``comeback``
        shadows which of their candidates came back (callers check ``_tracks_uses``
        first)."""
        self._uses.count(keys)
        for shadow in self._comebacks.values():
            shadow.touched(keys)

    def _publish(self) -> None:
        for level in self.levels:
            events = level.tier.take_events()
            if events:
                self.bus.publish(events)
        if self.remote is not None and (events := self.remote.level.take_events()):
            self.bus.publish(events)

    # -- whole-chain operations ----------------------------------------------------------

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
        """Drop every idle block at one level (or all); returns how many were removed."""
        targets = range(len(self.levels)) if index is None else [index]
        removed = sum(len(self.levels[i].tier.clear()) for i in targets)
        self._publish()
        return removed

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


async def _wait(future: asyncio.Future[bool], deadline: float | None) -> bool:
    """Wait for a store in flight to end, until ``deadline``; whether it ended."""
    if deadline is None:
        await asyncio.shield(future)
        return True
    left = deadline - asyncio.get_running_loop().time()
    try:
        async with asyncio.timeout(max(left, 0.0)):
            await asyncio.shield(future)
    except TimeoutError:
        return future.done()
    return True
