"""What each of a tenant's blocks says of itself, for routers: a :class:`DescriptorBook`.

An engine that stores a block may describe it (the ``describe`` request): the engine's own
block hashes, the parent hash, the token ids, the block size in tokens, LoRA and extra
keys, as a router computes and indexes them. The book keeps that description, pre-encoded
for events (:class:`~tierd.kvevents.wire.Described`), while the block is anywhere in the
tenant's chain: for each key, the levels holding it (a bit per level, kept up to date by
:mod:`tierd.kvevents.feed` from the chain's own events: the tag of its key in the map of
rows, found and changed by the look that finds the row), and an index from each engine
hash to its key, for the existence query (:meth:`held`).

The index is made when the existence query is first asked, a part of the book at a time
(:meth:`index_part`; :mod:`tierd.kvevents.hash_index`): routers that listen never ask,
and a book nobody asks keeps none.

An entry goes when its block leaves the node: removed from the chain's last level, or
from an upper one with no store below within ``grace_s`` (a tier announces an eviction
before the demotion stores the block below). A description that arrives for a block not
held is kept ``unheld_s`` for the store it comes ahead of. The book is bounded: past
``budget_bytes`` the oldest descriptions go first (counted in ``evicted``); a block
without one is not announced. Each tenant has its own book: one tenant's descriptions
never push out another's. Persistence is :mod:`tierd.kvevents.book_file`'s.

The book holds no Python object per description that the garbage collector tracks: each
one is kept as its file record's bytes (a *row*: msgpack of ``[fields, count, hashes,
group_idx]``), the levels holding it as an int, and the hash index maps a hash to the
key's bytes (a tuple of keys, rarely, when keys share a hash). A full book held as
objects (an :class:`Entry`, its :class:`~tierd.kvevents.wire.Described` and a list per
hash) would be several tracked objects per description, all walked, on the loop every
tenant shares, by each full collection (which a tenant describing blocks brings about).
:class:`Entry` objects are made on the way out, for the caller of the moment.

A wait is usually short: a description comes a moment before its block's store, and a
block evicted from a level is stored below a moment later. So a key waits first in a plain
dict (``_fresh`` for its store, ``_fresh_grace`` for its demotion: a set and a pop, far
cheaper than the queues of :class:`~tierd.maps.Fifo`), which a *pass* empties
into the queues whole, at most :data:`FRESH_S` after its first key came (and before the
first of them is due) and at :data:`FRESH_KEYS` keys in both (so neither is ever a big
dict, and a pass moves a bounded number). The store of a block takes it out of its dict,
so a pass moves only the keys still waiting; their deadlines stay as they were, in the
order they came. A key waits in one place at most, and only while held nowhere: a
removal from a level of a block held there needs no look at where it waited.

Its maps of keys (:mod:`tierd.maps`) stay cheap at any size: the oldest description is
found in constant time (never by stepping past the deleted front of a dict, which a book
at its budget does at every put), and no map is one dict that a put copies whole when it
outgrows its table.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack

from tierd.keys import BlockKey
from tierd.kvevents import wire
from tierd.kvevents.hash_index import HashIndex
from tierd.kvevents.wire import Described
from tierd.maps import Fifo

__all__ = [
    "ENTRY_OVERHEAD",
    "HASH_OVERHEAD",
    "INDEX_PART_BUCKETS",
    "INDEX_ROWS",
    "DescriptorBook",
    "Entry",
    "dropped_record",
    "entry_of",
    "record_of",
    "row_of",
]

# What an entry is counted beyond its encoded bytes, and each hash in the index: at least
# what an entry takes as a row in the maps of tierd.maps, so the budget never counts less
# than is used; docs/events.md quotes them.
ENTRY_OVERHEAD = 240
HASH_OVERHEAD = 120
ROW_PART_BUCKETS = 16  # of 1,024 rows: a part of row_parts
# and of the hash index's build, a bucket's rows at a time: each row's hashes are decoded
# and indexed (some 2.5 us a row on this project's VM), so a part of row_parts would hold
# the loop some 40 ms; and INDEX_ROWS of them a turn, some 0.6 ms
INDEX_PART_BUCKETS = 1
INDEX_ROWS = 256
FRESH_S = 1.0  # how long a description waits in the fresh dict at most before a pass,
FRESH_KEYS = 1024  # and how many wait there at most


@dataclass(slots=True)
class Entry:
    """One block's description and the chain levels holding it (bit ``i``: level ``i``);
    ``row``, once made (:func:`row_of`), its row, for the book and its file alike."""

    described: Described
    hashes: tuple[Hashable, ...]
    mask: int = 0
    row: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def cost(self) -> int:
        return self.described.size + ENTRY_OVERHEAD + HASH_OVERHEAD * len(self.hashes)


def row_of(entry: Entry) -> bytes:
    """How the book keeps ``entry``'s description (:func:`tierd.kvevents.wire.row`): its
    file record less the key. Made once per entry."""
    row = entry.row
    if row is None:
        row = entry.row = wire.row(entry.described)
    return row


# A file record's head and its key's bin header, by the key's length (a key is 1-64 bytes).
_RECORD_HEADS = [b"\x95\xc4" + bytes((n,)) for n in range(256)]


def record_of(key: BlockKey, row: bytes) -> bytes:
    """The file record of ``key``'s description (msgpack ``[key, fields, count, hashes,
    group_idx]``): the row's four items after the key, under a header of five."""
    if len(key) < 256:  # a row opens with 0x94, cut off (a slice: cheaper than a view)
        return _RECORD_HEADS[len(key)] + key + row[1:]
    return b"\x95" + bytes(msgpack.packb(key)) + row[1:]


def dropped_record(key: BlockKey) -> bytes:
    """The file record of ``key``'s description dropped (msgpack ``[key]``)."""
    if len(key) < 256:  # an array of one bin 8
        return b"\x91\xc4" + bytes((len(key),)) + key
    return bytes(msgpack.packb([key]))


def described_of(items: Sequence[Any]) -> Described:
    """The description of a row's (or a file record's, after its key) four items."""
    fields, pairs, hashes, group_idx = items
    return Described(fields, pairs, hashes, group_idx, len(fields) + len(hashes))


def entry_of(items: Sequence[Any], mask: int = 0) -> Entry:
    """:func:`described_of`, with the hashes it lists and the levels of ``mask``."""
    described = described_of(items)
    return Entry(described, tuple(msgpack.unpackb(described.hashes)), mask)


def _described(row: bytes) -> Described:
    return described_of(msgpack.unpackb(row))


def _entry(row: bytes, mask: int) -> Entry:
    return entry_of(msgpack.unpackb(row), mask)


@dataclass(slots=True)
class DescriptorBook:
    """A tenant's block descriptions (see the module's docstring)."""

    budget_bytes: int
    grace_s: float = 2.0
    unheld_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    # The book's file: the records of each change (record_of, dropped_record), in order,
    # those of one call together.
    on_records: Callable[[list[bytes]], None] | None = None
    bytes_used: int = 0
    evicted: int = 0  # descriptions pushed out by the budget
    _rows: Fifo[BlockKey, bytes] = field(default_factory=Fifo)  # oldest first; tag: levels
    _index: HashIndex | None = None  # (none until the existence query is first asked)
    # Held nowhere, until when: one queue per wait, so each is in the order of its
    # deadlines (a key is taken out before it is put back) and a sweep, after every batch,
    # looks at the due ones only, never at every pending one.
    _unheld: Fifo[BlockKey, float] = field(default_factory=Fifo)
    _grace: Fifo[BlockKey, float] = field(default_factory=Fifo)
    # Held nowhere since the last pass: key -> its deadline, for its store, for its
    # demotion (see above).
    _fresh: dict[BlockKey, float] = field(default_factory=dict, repr=False)
    _fresh_grace: dict[BlockKey, float] = field(default_factory=dict, repr=False)
    _pass_at: float = 0.0  # when the fresh ones are passed at the latest

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __iter__(self) -> Iterator[BlockKey]:
        """The described keys, oldest first."""
        return iter(self._rows)

    def row_parts(self) -> Iterator[list[tuple[BlockKey, bytes]]]:
        """Every (key, row), oldest first (:func:`record_of` makes a file record of one),
        in parts of some 16,000, each read as it is asked for (on the loop, a part a turn:
        a full book's rows all at once would hold the loop every tenant shares)."""
        return self._rows.item_parts(ROW_PART_BUCKETS)

    def held_parts(self) -> Iterator[list[tuple[bytes, int]]]:
        """The row and levels of every block held somewhere, in the parts of
        :meth:`row_parts` (each read, and its levels looked up, as it is asked for)."""
        tagged_items = self._rows.tagged_items
        for part in self.row_parts():
            yield [(row, mask) for _, row, mask in tagged_items(part) if mask]

    def get(self, key: BlockKey) -> Entry | None:
        row = self._rows.get(key)
        return None if row is None else _entry(row, self._rows.tag(key))

    def mask_of(self, key: BlockKey) -> int:
        """The levels holding ``key``'s block (0: none, or not described)."""
        return self._rows.tag(key)

    def put(self, key: BlockKey, entry: Entry) -> None:
        """Keep ``entry`` for ``key`` (a new description replaces the old one; the levels
        holding the block stay as they were)."""
        self.put_all((key,), (entry,))

    def put_all(self, keys: Sequence[BlockKey], entries: Sequence[Entry]) -> None:
        """:meth:`put` for each of ``keys`` and its entry, in order."""
        replace = self._rows.replace
        waiting: list[BlockKey] = []
        records: list[bytes] = []
        for key, entry in zip(keys, entries, strict=True):
            row = row_of(entry)
            old = replace(key, row)  # described before? (its levels stay)
            if old is not None:
                old_row, entry.mask = old
                self._unindex(key, old_row)
            self._count(key, entry)
            records.append(record_of(key, row))
            if entry.mask == 0:  # held nowhere: waits for its store
                if old is not None:
                    self._unpend(key)
                waiting.append(key)
        if records and self.on_records is not None:
            self.on_records(records)
        self._wait_all(waiting)
        if keys and self.bytes_used > self.budget_bytes:
            self._enforce_budget(keys[-1])

    def restore(self, entries: dict[BlockKey, Entry]) -> None:
        """Take the descriptions a restart read back (held nowhere yet: the feed settles
        them once the chain has adopted its kept blocks); nothing is written for them."""
        for key, entry in entries.items():
            self._keep(key, entry)

    def drop(self, key: BlockKey) -> None:
        taken = self._rows.pop_tagged(key)
        if taken is not None:
            row, mask = taken
            if mask == 0:  # only a description held nowhere waits
                self._unpend(key)
            self._unindex(key, row)
            if self.on_records is not None:
                self.on_records([dropped_record(key)])

    def stored(self, key: BlockKey, bit: int) -> Described | None:
        """The block of ``key`` became ready at the level of ``bit``: its description."""
        (row,) = self.stored_rows((key,), bit)
        return None if row is None else _described(row)

    def stored_rows(self, keys: Sequence[BlockKey], bit: int) -> list[bytes | None]:
        """:meth:`stored` for each of ``keys``: the rows of their descriptions (None: not
        described), for :class:`~tierd.kvevents.wire.Framer`."""
        fresh, fresh_grace = self._fresh, self._fresh_grace
        rows, masks = self._rows.retag_all(keys, add=bit)
        for key, mask in zip(keys, masks, strict=True):
            # Held nowhere, it waited: nearly always still in a fresh dict (its
            # description came a moment before, or its demotion left a moment ago).
            if mask == 0 and fresh.pop(key, None) is None and fresh_grace.pop(key, None) is None:
                self._unpend(key)
        return rows

    def mark(self, key: BlockKey, bit: int) -> bytes | None:
        """:meth:`stored`, only where the level of ``bit`` was not counted yet: the row
        of its description when it was not (to announce), else None."""
        if self._rows.tag(key, bit) & bit:
            return None
        return self.stored_rows((key,), bit)[0]

    def removed(self, key: BlockKey, bit: int, *, last: bool) -> Described | None:
        """The block of ``key`` left the level of ``bit`` (``last``: the chain's last level,
        where nothing goes further down): its description. Held nowhere now, it goes at
        once from the last level, after ``grace_s`` from another."""
        (row,) = self.removed_rows((key,), bit, last=last)
        return None if row is None else _described(row)

    def removed_rows(self, keys: Sequence[BlockKey], bit: int, *, last: bool) -> list[bytes | None]:
        """:meth:`removed` for each of ``keys``: the rows of their descriptions (None: not
        described)."""
        rows = self._rows
        # From the last level, a block held nowhere else is gone from the node: its
        # description is dropped in the same look (a key twice: at its first).
        out, helds = rows.untag_all(keys, bit) if last else rows.retag_all(keys, remove=bit)
        waiting: list[BlockKey] = []
        dropped: list[bytes] = []
        for i, held in enumerate(helds):
            if held & ~bit:  # held elsewhere still (or not described: -1)
                continue
            key = keys[i]
            if last:  # gone from the node: dropped
                if held == 0:  # (held nowhere before either, it waited; held, it did not)
                    self._unpend(key)
                self._unindex(key, cast(bytes, out[i]))
                dropped.append(dropped_record(key))
                continue
            # Held nowhere now: below, a moment later, or gone after grace_s.
            if held == 0:
                self._unpend(key)
            waiting.append(key)
        if dropped and self.on_records is not None:
            self.on_records(dropped)
        if waiting:
            self._wait_all(waiting, grace=True)
        return out

    def sweep(self) -> int:
        """Drop the descriptions of blocks held nowhere past their time; returns how many."""
        if (self._fresh or self._fresh_grace) and not self.clock() < self._pass_at:
            self._pass()
        if not self._unheld and not self._grace:
            return 0
        now = self.clock()
        due: list[BlockKey] = []
        for pending in (self._unheld, self._grace):
            while (key := pending.oldest()) is not None and not pending[key] > now:
                pending.pop(key)
                due.append(key)
        for key in due:
            if self._rows.tag(key) == 0:
                self.drop(key)
            else:
                self._unpend(key)
        return len(due)

    @property
    def soonest_s(self) -> float:
        """How soon, at the earliest, a change made now can make anything due (a pass of
        the fresh keys, or a wait's end): a look planned sooner misses nothing new."""
        return min(FRESH_S, self.grace_s, self.unheld_s)

    def next_due(self) -> float | None:
        """When the first pending description is due (None: none is pending)."""
        firsts = [p[key] for p in (self._unheld, self._grace) if (key := p.oldest()) is not None]
        if self._fresh or self._fresh_grace:
            firsts.append(self._pass_at)  # (before any of them is due)
        return min(firsts, default=None)

    def held(self, hashes: Sequence[Hashable], medium_of: Callable[[int], str]) -> list[str]:
        """The medium of each of the leading ``hashes`` whose block the chain holds, up to
        the first it does not (``medium_of`` names the top level of a mask)."""
        while not self.index_part():  # (the loop's callers have built it a part a turn)
            pass
        keys_of = cast(HashIndex, self._index).keys_of
        media: list[str] = []
        for h in hashes:
            mask = 0
            for key in keys_of(h):
                mask |= self._rows.tag(key)
            if mask == 0:
                break
            media.append(medium_of(mask))
        return media

    @property
    def indexed(self) -> bool:
        """Whether the hash index of :meth:`held` is built."""
        return self._index is not None and self._index.whole

    def index_part(self) -> bool:
        """One more part of the book read into the hash index (begun if it was not):
        True when it is whole. From its first part on, every put and drop keeps it up to
        date (:mod:`tierd.kvevents.hash_index`)."""
        if self._index is None:
            self._index = HashIndex(
                self._rows.item_parts(INDEX_PART_BUCKETS), self._rows.get, INDEX_ROWS
            )
        return self._index.read_part()

    def clear(self) -> None:
        for key in list(self._rows):
            self.drop(key)

    def _wait_all(self, keys: Sequence[BlockKey], *, grace: bool = False) -> None:
        """``keys``, held nowhere, wait ``unheld_s`` for their store, or ``grace_s`` for
        their demotion (in a fresh dict; one look at the clock for all)."""
        for start in range(0, len(keys), FRESH_KEYS):  # (one pass, as a rule)
            piece = keys[start : start + FRESH_KEYS] if len(keys) > FRESH_KEYS else keys
            if len(self._fresh) + len(self._fresh_grace) + len(piece) > FRESH_KEYS:
                self._pass()
            fresh = self._fresh_grace if grace else self._fresh
            now = self.clock()
            due = now + (self.grace_s if grace else self.unheld_s)
            if not self._fresh and not self._fresh_grace:
                self._pass_at = min(now + FRESH_S, due)
            elif not fresh:  # the first of its wait: it may be due before the pass
                self._pass_at = min(self._pass_at, due)
            fresh.update(dict.fromkeys(piece, due))

    def _pass(self) -> None:
        """The fresh keys, still held nowhere, to the queues of their waits."""
        tag = self._rows.tag
        for fresh, pending in ((self._fresh, self._unheld), (self._fresh_grace, self._grace)):
            for key, due in fresh.items():  # in the order they came: that of their deadlines
                if tag(key, -1) == 0:
                    pending.put(key, due)
        self._fresh, self._fresh_grace = {}, {}

    def _unpend(self, key: BlockKey) -> None:
        """``key`` waits no more (a key waits in one place at most)."""
        if (
            self._fresh.pop(key, None) is None
            and self._fresh_grace.pop(key, None) is None
            and self._grace.pop(key, None) is None
        ):
            self._unheld.pop(key, None)

    def _keep(self, key: BlockKey, entry: Entry) -> None:
        """Keep ``entry`` for ``key`` (not described now)."""
        self._rows.put(key, row_of(entry), entry.mask)
        self._count(key, entry)

    def _count(self, key: BlockKey, entry: Entry) -> None:
        """``entry``, kept for ``key``, in the budget and the hash index."""
        self.bytes_used += entry.cost
        if self._index is not None:
            self._index.add(key, entry.hashes)

    def _unindex(self, key: BlockKey, row: bytes) -> None:
        # (an Entry's cost, without one: the row's two bins found, only the hashes read)
        fields_at, fields_end, hashes_at, hashes_end = wire.spans(row)
        self.bytes_used -= (
            fields_end
            - fields_at
            + hashes_end
            - hashes_at
            + ENTRY_OVERHEAD
            + HASH_OVERHEAD * wire.array_count(row, hashes_at)
        )
        if self._index is not None:
            self._index.remove(key, msgpack.unpackb(row[hashes_at:hashes_end]))

    def _enforce_budget(self, keep: BlockKey) -> None:
        while self.bytes_used > self.budget_bytes and len(self._rows) > 1:
            oldest = self._rows.oldest()
            if oldest is None or oldest == keep:
                break
            self.drop(oldest)
            self.evicted += 1
