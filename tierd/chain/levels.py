"""The levels of a chain side by side, and their events.

:class:`ChainLevels` owns the levels (fastest first), which one is the entry level, the
event bus, the optional remote side and the census fed from the events. Every part of the
chain is given it: it pins and unpins blocks at a level, and after each operation
publishes what every level buffered. It knows nothing of writes in flight
(:mod:`tierd.chain.pending`), admission (:mod:`tierd.chain.admit`) or copies
(:mod:`tierd.chain.moves`, :mod:`tierd.chain.loads`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.chain.census import PrefixCensus
from tierd.chain.remote import RemoteSide
from tierd.chain.values import Level
from tierd.events import EventBus
from tierd.keys import BlockKey, Medium
from tierd.stores import BlockStore

__all__ = ["ChainLevels"]


class ChainLevels:
    """Levels fastest first, on one block size, with the bus their events go to."""

    def __init__(
        self,
        levels: Sequence[Level],
        *,
        entry: int = 0,
        bus: EventBus | None = None,
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
        self.entry = entry
        self.bus = bus or EventBus()
        self.block_bytes = block_sizes.pop()
        self.remote = remote
        self.tiers = [level.tier for level in self.levels]  # read on every lookup
        self.media = [level.medium for level in self.levels]
        self.census: PrefixCensus | None = None  # blocks per key prefix, once asked for

    def level_of(self, medium: Medium | str) -> int:
        """The index of the first level on ``medium`` (a name in any case: "cpu" or "CPU")."""
        wanted = str(medium).upper()
        for index, level in enumerate(self.levels):
            if level.medium == wanted:
                return index
        raise ValueError(f"no level on medium {medium!r}")

    def store_at(self, level: int) -> BlockStore:
        """The store of level ``level``."""
        return self.levels[level].store

    def medium_at(self, level: int) -> Medium:
        """The medium of ``level``; one past the last local level is the remote level."""
        if level >= len(self.levels) and self.remote is not None:
            return self.remote.level.medium
        return self.media[level]

    def pin(self, index: int, keys: list[BlockKey], pinned: set[BlockKey]) -> None:
        """Pin the ``keys`` at ``index`` not in ``pinned`` yet, and add them to it."""
        fresh = [k for k in keys if k not in pinned]
        if fresh:
            self.levels[index].tier.prepare_load(fresh)
            pinned.update(fresh)

    def unpin(self, index: int, keys: list[BlockKey]) -> None:
        """Unpin ``keys`` at ``index`` (once each) and publish what that changed."""
        if keys:
            self.levels[index].tier.complete_load(keys)
            self.publish()

    def publish(self) -> None:
        """Publish every level's buffered events (the census sees the local ones first)."""
        census = self.census
        for index, level in enumerate(self.levels):
            events = level.tier.take_events()
            if events:
                if census is not None:
                    census.seen(index, events)
                self.bus.publish(events)
        if self.remote is not None and (events := self.remote.level.take_events()):
            self.bus.publish(events)
