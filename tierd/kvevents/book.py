"""What each of a tenant's blocks says of itself, for routers: a :class:`DescriptorBook`.

An engine that stores a block may describe it (the ``describe`` request): the engine's own
block hashes, the parent hash, the token ids, the block size in tokens, LoRA and extra
keys, as a router computes and indexes them. The book keeps that description, pre-encoded
for events (:class:`~tierd.kvevents.wire.Described`), while the block is anywhere in the
tenant's chain: for each key, the levels holding it (a bit per level, kept up to date by
:mod:`tierd.kvevents.feed` from the chain's own events), and an index from each engine
hash to its key, for the existence query (:meth:`held`).

An entry goes when its block leaves the node: removed from the chain's last level, or
from an upper one with no store below within ``grace_s`` (a tier announces an eviction
before the demotion stores the block below). A description that arrives for a block not
held is kept ``unheld_s`` for the store it comes ahead of. The book is bounded: past
``budget_bytes`` the oldest descriptions go first (counted in ``evicted``); a block
without one is not announced. Each tenant has its own book: one tenant's descriptions
never push out another's. Persistence is :mod:`tierd.kvevents.book_file`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from tierd.keys import BlockKey
from tierd.kvevents.wire import Described

__all__ = ["ENTRY_OVERHEAD", "HASH_OVERHEAD", "DescriptorBook", "Entry"]

# What an entry costs beyond its encoded bytes (the entry, its dict slot, the key), and
# each hash in the index (the int, its dict slot, the list): measured with tracemalloc on
# CPython 3.11, rounded up; docs/events.md quotes them.
ENTRY_OVERHEAD = 240
HASH_OVERHEAD = 120


@dataclass(slots=True)
class Entry:
    """One block's description and the chain levels holding it (bit ``i``: level ``i``)."""

    described: Described
    hashes: tuple[Hashable, ...]
    mask: int = 0

    @property
    def cost(self) -> int:
        return self.described.size + ENTRY_OVERHEAD + HASH_OVERHEAD * len(self.hashes)


@dataclass(slots=True)
class DescriptorBook:
    """A tenant's block descriptions (see the module's docstring)."""

    budget_bytes: int
    grace_s: float = 2.0
    unheld_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    on_change: Callable[[BlockKey, Entry | None], None] | None = None  # the book's file
    entries: dict[BlockKey, Entry] = field(default_factory=dict)  # oldest first
    bytes_used: int = 0
    evicted: int = 0  # descriptions pushed out by the budget
    _by_hash: dict[Hashable, list[BlockKey]] = field(default_factory=dict)
    _pending: dict[BlockKey, float] = field(default_factory=dict)  # held nowhere: until

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: BlockKey) -> Entry | None:
        return self.entries.get(key)

    def put(self, key: BlockKey, entry: Entry) -> None:
        """Keep ``entry`` for ``key`` (a new description replaces the old one; the levels
        holding the block stay as they were)."""
        old = self.entries.pop(key, None)
        if old is not None:
            entry.mask = old.mask
            self._unindex(key, old)
        self.entries[key] = entry
        self.bytes_used += entry.cost
        for h in entry.hashes:
            self._by_hash.setdefault(h, []).append(key)
        if entry.mask == 0:
            self._pending[key] = self.clock() + self.unheld_s
        if self.on_change is not None:
            self.on_change(key, entry)
        self._enforce_budget(key)

    def restore(self, entries: dict[BlockKey, Entry]) -> None:
        """Take the descriptions a restart read back (held nowhere yet: the feed settles
        them once the chain has adopted its kept blocks); nothing is written for them."""
        for key, entry in entries.items():
            self.entries[key] = entry
            self.bytes_used += entry.cost
            for h in entry.hashes:
                self._by_hash.setdefault(h, []).append(key)

    def drop(self, key: BlockKey) -> None:
        entry = self.entries.pop(key, None)
        self._pending.pop(key, None)
        if entry is not None:
            self._unindex(key, entry)
            if self.on_change is not None:
                self.on_change(key, None)

    def stored(self, key: BlockKey, bit: int) -> Entry | None:
        """The block of ``key`` became ready at the level of ``bit``."""
        entry = self.entries.get(key)
        if entry is not None:
            entry.mask |= bit
            self._pending.pop(key, None)
        return entry

    def removed(self, key: BlockKey, bit: int, *, last: bool) -> Entry | None:
        """The block of ``key`` left the level of ``bit`` (``last``: the chain's last level,
        where nothing goes further down): held nowhere now, it goes at once from the last
        level, after ``grace_s`` from another."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        entry.mask &= ~bit
        if entry.mask == 0:
            if last:
                self.drop(key)
            else:
                self._pending[key] = self.clock() + self.grace_s
        return entry

    def sweep(self) -> int:
        """Drop the descriptions of blocks held nowhere past their time; returns how many."""
        if not self._pending:
            return 0
        now = self.clock()
        due = [key for key, until in self._pending.items() if until <= now]
        for key in due:
            entry = self.entries.get(key)
            if entry is None or entry.mask == 0:
                self.drop(key)
            else:
                self._pending.pop(key, None)
        return len(due)

    def next_due(self) -> float | None:
        """When the first pending description is due (None: none is pending)."""
        return min(self._pending.values(), default=None)

    def held(self, hashes: Sequence[Hashable], medium_of: Callable[[int], str]) -> list[str]:
        """The medium of each of the leading ``hashes`` whose block the chain holds, up to
        the first it does not (``medium_of`` names the top level of a mask)."""
        media: list[str] = []
        for h in hashes:
            mask = 0
            for key in self._by_hash.get(h, ()):
                mask |= self.entries[key].mask
            if mask == 0:
                break
            media.append(medium_of(mask))
        return media

    def clear(self) -> None:
        for key in list(self.entries):
            self.drop(key)

    def _unindex(self, key: BlockKey, entry: Entry) -> None:
        self.bytes_used -= entry.cost
        for h in entry.hashes:
            keys = self._by_hash.get(h)
            if keys is None:
                continue
            if key in keys:
                keys.remove(key)
            if not keys:
                del self._by_hash[h]

    def _enforce_budget(self, keep: BlockKey) -> None:
        while self.bytes_used > self.budget_bytes and len(self.entries) > 1:
            oldest = next(iter(self.entries))
            if oldest == keep:
                break
            self.drop(oldest)
            self.evicted += 1
