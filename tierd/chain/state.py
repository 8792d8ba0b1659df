"""The chain's state and the bookkeeping every chain operation shares.

:class:`ChainState` holds the levels (fastest first), the transfer engine, the event bus,
the optional remote level, the writes in flight (``_pending``: per level and key, the
future of the write it is part of, so a caller that finds a block in flight waits for
it) and what admission rules know of recent uses. It pins and unpins, registers and
completes writes, decides admission and publishes each level's events. It is also what
a handle calls back (:class:`~tierd.chain.handles.HandleOwner`). The operations are built
on it, one module each: :mod:`tierd.chain.moves` (writes, demotion, write-through),
:mod:`tierd.chain.loads` (promotion), :mod:`tierd.chain.core` (the public chain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import repeat

from tierd.chain.census import PrefixCensus
from tierd.chain.remote import RemoteSide
from tierd.chain.values import Admission, Level
from tierd.events import EventBus
from tierd.keys import BlockKey, Medium
from tierd.policy.admission import Comeback, KeyUses
from tierd.stores import BlockStore
from tierd.transfer import TransferEngine

__all__ = ["ChainState"]


class ChainState:
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
        self.census: PrefixCensus | None = None  # blocks per key prefix, once asked for
        self._tracks_uses = any(rule.counts_uses for rule in rules)

    def set_admissions(self, rules: Sequence[Admission], remote: Admission | None = None) -> None:
        """New admission rules, one per level (and the remote level's): what the old rules
        counted of recent uses is kept only if the new ones need no more of it."""
        if len(rules) != len(self.levels):
            raise ValueError(f"{len(rules)} admission rules for {len(self.levels)} levels")
        for level, rule in zip(self.levels, rules, strict=True):
            level.admission = rule
        if self.remote is not None and remote is not None:
            self.remote.admission = remote
        every = list(rules) + ([self.remote.admission] if self.remote is not None else [])
        draws = any(rule.sample for rule in every)
        ends = any(rule.comeback for rule in every)
        uses = self._uses
        if (draws and uses.draws is None) or (ends and uses.ends is None):
            self._uses = KeyUses(self._reuse_memory, draws=draws, ends=ends)
        self._comebacks.clear()  # rebuilt on the next candidate, at the new thresholds
        self._tracks_uses = any(rule.counts_uses for rule in every)

    def level_of(self, medium: Medium | str) -> int:
        """The index of the first level on ``medium``."""
        for index, level in enumerate(self.levels):
            if level.medium == medium:
                return index
        raise ValueError(f"no level on medium {medium!r}")

    def store_at(self, level: int) -> BlockStore:
        return self.levels[level].store

    def medium_at(self, level: int) -> Medium:
        """The medium of ``level``; one past the last local level is the remote level."""
        if level >= len(self.levels) and self.remote is not None:
            return self.remote.level.medium
        return self._media[level]

    def release_pins(self, level: int, keys: list[BlockKey]) -> None:
        self._unpin(level, keys)

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
        """Put ``keys`` in flight at ``index``: one future for the whole write, under each
        key (a future per key cost a 4,096-key store milliseconds of the loop to make and
        to resolve); co-indexed with ``keys``. It is done when the write ends."""
        future = asyncio.get_running_loop().create_future()
        self._pending.update(zip(zip(repeat(index), keys), repeat(future)))
        return [future] * len(keys)

    def end_store(
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
        pending = self._pending
        for key in keys:
            del pending[(index, key)]
        for future in dict.fromkeys(futures):  # one per write (at C speed)
            if not future.done():
                future.set_result(True)  # ended: a waiter looks at the tier, not the result
        self._publish()
        return good

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
        census = self.census
        for index, level in enumerate(self.levels):
            events = level.tier.take_events()
            if events:
                if census is not None:
                    census.seen(index, events)
                self.bus.publish(events)
        if self.remote is not None and (events := self.remote.level.take_events()):
            self.bus.publish(events)
