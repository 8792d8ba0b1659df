"""Loading blocks: promotion up the chain to the level a caller asked for.

``load`` pins the leading keys it can make ready at the target level: the ones there
already, the ones it copies up from the nearest level below that holds them (the lower
copy stays, so a promoted block is clean), and past the local levels the ones the remote
level holds intact. Two callers promoting the same block share one read; a block another
caller is still writing is waited for, until a deadline.

The lower copy of a promoted block is the first its level drops when a demotion needs
room there (:mod:`tierd.chain.copies`). When the level right below the target is full
and holds no such copies for the victims the target must evict, the promotion is a
swap instead: the blocks are read out into private buffers first, so that the victims
demoted from the target take their slots below, rather than blocks held nowhere else.

:class:`Loading` owns no state of its own: it is given the levels (where it pins), the
transfer engine, the writes in flight (which it waits for) and :class:`Movement` (every
promotion is a write into the target level, which may evict and demote there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from itertools import filterfalse, takewhile

from tierd.chain.handles import LoadHandle
from tierd.chain.levels import ChainLevels
from tierd.chain.moves import Movement
from tierd.chain.pending import PendingWrites
from tierd.errors import BlockMissing
from tierd.keys import BlockKey, Medium
from tierd.stores import BlockStore
from tierd.tier import StorePlan, Tier
from tierd.transfer import TransferEngine
from tierd.turns import LOAD_KEYS, next_turn

__all__ = ["Loading"]


class Loading:
    """Loads: promotion and pinning at the target level."""

    def __init__(
        self,
        levels: ChainLevels,
        transfer: TransferEngine,
        writes: PendingWrites,
        moves: Movement,
    ) -> None:
        self._levels = levels
        self._transfer = transfer
        self._writes = writes
        self._moves = moves

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
        levels = self._levels
        target = levels.entry if into is None else levels.level_of(into)
        tier = levels.tiers[target]
        wanted = list(dict.fromkeys(keys))[: tier.num_blocks]  # no more than the level holds
        pinned: set[BlockKey] = set()
        deadline = None if wait_s is None else asyncio.get_running_loop().time() + wait_s
        try:
            deepest = await self._gather_pieces(target, wanted, pinned, deadline)
        except BaseException:
            levels.unpin(target, list(pinned))
            raise
        finally:
            levels.publish()
        prefix = wanted[: _leading_run(wanted, pinned)]
        if len(prefix) != len(pinned):  # pinned past the first gap: not part of the load
            leading = set(prefix)
            levels.unpin(target, [k for k in pinned if k not in leading])
        if not prefix and wanted:
            raise BlockMissing(
                "no leading block can be loaded",
                tier=tier.name,
                medium=str(tier.medium),
                key=wanted[0],
            )
        # Every key of the prefix is pinned at the target: present, each with its slot.
        return LoadHandle(levels, target, prefix, tier.slots_of(prefix), deepest)

    async def _gather_pieces(
        self, target: int, keys: list[BlockKey], pinned: set[BlockKey], deadline: float | None
    ) -> int:
        """:meth:`_gather` ``keys`` :data:`LOAD_KEYS` at a time, yielding to the loop
        between pieces (a 4,096-key load is eight bounded steps, not one long
        one); stops after the first piece that is not wholly pinned. Returns the slowest
        level read from."""
        deepest = target
        for start in range(0, len(keys), LOAD_KEYS):
            if start:
                await next_turn()  # other clients' requests, and threads, between pieces
            piece = keys[start : start + LOAD_KEYS]
            deepest = max(deepest, await self._gather(target, piece, pinned, deadline))
            if _leading_run(piece, pinned) != len(piece):
                break  # the prefix ends in this piece: nothing after it can be part of it
        return deepest

    async def _gather(
        self, target: int, keys: list[BlockKey], pinned: set[BlockKey], deadline: float | None
    ) -> int:
        """Make ``keys`` ready at ``target`` as far as possible, pinning each as soon as it
        is there (so nothing evicts it meanwhile); a key in flight is waited for until
        ``deadline`` (loop time), then the run stops before it. Returns the slowest level
        read from."""
        levels = self._levels
        tier = levels.tiers[target]
        keys, run, sources, remote = self._plan(target, keys)
        # Pinning keys past that point would only take room the promotions need.
        levels.pin(target, keys[:run] + [k for k in keys[run:] if k in tier], pinned)
        # Hold every source until its turn, so that promoting one group (which may evict
        # and demote at the levels below) cannot push another group's source away.
        waiting = dict(sources)
        for source, group in waiting.items():
            levels.tiers[source].prepare_load(group)
        try:
            for source, group in sources.items():
                del waiting[source]
                levels.unpin(source, group)  # _promote pins them again before it awaits
                await self._promote(source, target, group, pinned)
        finally:
            for source, group in waiting.items():
                levels.unpin(source, group)
        if remote:
            await self._promote_remote(target, remote, pinned)
        for key in filterfalse(pinned.__contains__, keys):  # the pinned ones at C speed
            future = self._writes.future_of(target, key)
            if future is not None and not await _wait(future, deadline):
                break  # another client is still writing it: the prefix ends here
            if key not in pinned and key in tier:
                levels.pin(target, [key], pinned)
        if remote and any(k in pinned for k in remote):
            return len(levels.levels)  # read from the remote level, the slowest
        return max(sources, default=target)  # levels go fastest first

    def _plan(
        self, target: int, keys: list[BlockKey]
    ) -> tuple[list[BlockKey], int, dict[int, list[BlockKey]], list[BlockKey]]:
        """Where ``keys`` come from: the keys up to the first one held nowhere (nor in
        flight), how many lead them ready at ``target`` (counted at C speed: the common
        case), the rest by the level nearest ``target`` that holds them, and those only
        the remote level may hold."""
        tiers, in_flight = self._levels.tiers, self._writes.in_flight
        tier = tiers[target]
        run = tier.ready_run(keys)
        reachable = keys[:run]
        sources: dict[int, list[BlockKey]] = {}
        remote: list[BlockKey] = []  # held by no local level: asked of the remote one
        nearest = self._nearest(target)  # once, not once per key
        no_remote = self._levels.remote is None
        for key in keys[run:]:
            if key not in tier and not in_flight(target, key):
                source = self._source_of(key, nearest)
                if source is None:
                    if no_remote or any(t.is_writing(key) for t in tiers):
                        break  # nothing beyond the first absent key can be in the prefix
                    remote.append(key)
                else:
                    sources.setdefault(source, []).append(key)
            reachable.append(key)
        return reachable, run, sources, remote

    def _nearest(self, target: int) -> list[tuple[int, Tier]]:
        """The other levels, nearest to ``target`` first (the upper one of two as near)."""
        tiers = self._levels.tiers
        order = sorted(range(len(tiers)), key=lambda i: (abs(i - target), i))
        return [(i, tiers[i]) for i in order if i != target]

    @staticmethod
    def _source_of(key: BlockKey, nearest: list[tuple[int, Tier]]) -> int | None:
        """The first of the ``nearest`` levels that holds ``key`` ready."""
        return next((i for i, tier in nearest if key in tier), None)

    async def _promote(
        self, source: int, target: int, keys: list[BlockKey], pinned: set[BlockKey]
    ) -> None:
        """Copy ready blocks from ``source`` into ``target``; the source copy stays."""
        levels = self._levels
        upper, lower = levels.levels[target], levels.levels[source]
        keys = [k for k in keys if k in lower.tier]
        if not keys:
            return
        if self._swaps(source, target, len(keys)):
            await self._swap_up(source, target, keys, pinned)
            return
        slots = dict(zip(keys, lower.tier.prepare_load(keys), strict=True))
        failed: list[BlockKey] = []

        async def fill(store: BlockStore, plan: StorePlan) -> list[bool]:
            src = [slots[k] for k in plan.keys]
            ok = await self._transfer.copy(lower.store, src, store, plan.slots, plan.keys)
            failed.extend(k for k, flag in zip(plan.keys, ok, strict=True) if not flag)
            return ok

        try:
            moved = await self._moves.store_into(target, keys, fill)
            upper.promotions += len(moved)
            levels.pin(target, moved, pinned)
        finally:
            levels.unpin(source, keys)
        self._moves.copies.promoted(source, moved)
        self._read_failed(source, failed)

    def _swaps(self, source: int, target: int, count: int) -> bool:
        """Whether promoting ``count`` blocks from ``source`` into ``target`` must swap:
        ``source`` is the level the target's victims are demoted into, the last one
        (what it evicts is lost: no level, local or remote, lies below), and it has
        neither free slots nor copies of blocks held above (:mod:`tierd.chain.copies`)
        for as many victims as ``target`` must evict. A copy would then evict a block
        held nowhere else (the next one a sequential read-back asks for). Above the
        last level a victim of the source is demoted on, not lost: no swap there; nor
        into a target that copies its blocks down itself (write-through, write-behind):
        its victims are clean, dropped without a demotion. Nor out of a level whose
        admission is not ``always``: the block moved up, demoted again later, could be
        refused, where its copy would have stayed."""
        levels = self._levels
        upper = levels.levels[target]
        if source != target + 1 or source != len(levels.levels) - 1 or levels.remote is not None:
            return False
        if upper.write_through or upper.write_behind:
            return False
        if not levels.levels[source].admission.always:
            return False  # a swapped block demoted again would face admission: maybe lost
        evict = count - self._levels.tiers[target].free
        room = self._levels.tiers[source].free + self._moves.copies.spare(source)
        return evict > 0 and room < evict

    async def _swap_up(
        self, source: int, target: int, keys: list[BlockKey], pinned: set[BlockKey]
    ) -> None:
        """Promote ``keys`` by a swap: once their slots at ``target`` are reserved (so a
        second caller waits for this write rather than reading them again), read them
        out of ``source`` into private buffers; then the target's victims are demoted
        into ``source``, where the blocks read out are the first to make room (the
        blocks move up, the victims down), and the buffers are written above. The
        buffers cost one more copy of the promoted bytes, paid only when ``_swaps``
        says so."""
        levels, copies = self._levels, self._moves.copies
        lower = levels.levels[source]
        read: dict[BlockKey, bytearray] = {}
        swapped: list[BlockKey] = []

        async def read_out(plan: StorePlan) -> None:
            wanted = [k for k in plan.keys if k in lower.tier]
            if not wanted:
                return
            buffers = [bytearray(lower.store.block_bytes) for _ in wanted]
            slots = lower.tier.prepare_load(wanted)
            try:
                ok = await lower.store.read(slots, wanted, buffers)
            finally:
                levels.unpin(source, wanted)
            good = {k: buf for k, buf, flag in zip(wanted, buffers, ok, strict=True) if flag}
            read.update(good)
            swapped.extend(copies.swap(source, list(good)))
            self._read_failed(source, [k for k in wanted if k not in good])

        async def fill(store: BlockStore, plan: StorePlan) -> list[bool]:
            ok = [k in read for k in plan.keys]  # a block not read out is not written
            rows = [i for i, flag in enumerate(ok) if flag]
            if rows:
                chosen = [plan.keys[i] for i in rows]
                slots = [plan.slots[i] for i in rows]
                written = await store.write(slots, chosen, [read[k] for k in chosen])
                for i, flag in zip(rows, written, strict=True):
                    ok[i] = flag
            return ok

        try:
            moved = await self._moves.store_into(target, keys, fill, read_out)
        finally:
            copies.end_swap(source, swapped)
        levels.levels[target].promotions += len(moved)
        levels.pin(target, moved, pinned)
        copies.promoted(source, [k for k in moved if k in lower.tier])

    def _read_failed(self, source: int, failed: list[BlockKey]) -> None:
        """Blocks of ``source`` whose copy up failed."""
        lower = self._levels.levels[source]
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
        buffers first) and store them into ``target``, pinned there (nothing without a
        remote level)."""
        remote = self._levels.remote
        payloads = await remote.level.get(keys) if remote is not None else []
        if remote is None or not payloads:
            return
        fetched = dict(zip(keys, payloads, strict=False))

        async def fill(store: BlockStore, plan: StorePlan) -> list[bool]:
            return await store.write(plan.slots, plan.keys, [fetched[k] for k in plan.keys])

        moved = await self._moves.store_into(target, list(fetched), fill)
        remote.promotions += len(moved)
        self._levels.levels[target].promotions += len(moved)
        self._levels.pin(target, moved, pinned)


def _leading_run(keys: list[BlockKey], pinned: set[BlockKey]) -> int:
    """How many of ``keys``, from the first, are in ``pinned`` (at C speed)."""
    return len(list(takewhile(pinned.__contains__, keys)))


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
