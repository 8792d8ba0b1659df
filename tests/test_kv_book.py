"""The book of block descriptions: where each block is, when its description goes, its
budget, and its file across restarts (tierd.kvevents.book, book_file)."""

from __future__ import annotations

import asyncio
import functools
import gc
import random
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from tests.gc_walk import largest_dict, references_walked
from tierd.keys import BlockKey
from tierd.kvevents.book import (
    FRESH_KEYS,
    FRESH_S,
    INDEX_PART_BUCKETS,
    INDEX_ROWS,
    ROW_PART_BUCKETS,
    DescriptorBook,
    Entry,
)
from tierd.kvevents.book_file import HAND_S, BookFile, read_book
from tierd.kvevents.describe import BadDescription, parse_description

CPU, DISK = 1, 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(i: int, tokens: int = 4) -> Entry:
    return parse_description(
        msgpack.packb({"hashes": [i], "parent": None, "tokens": [1] * tokens, "block_size": tokens})
    )


def _key(i: int) -> BlockKey:
    return BlockKey(f"k{i}".encode())


def test_a_block_demoted_keeps_its_description_and_one_gone_loses_it() -> None:
    clock = Clock()
    book = DescriptorBook(1 << 20, grace_s=2.0, clock=clock)
    book.put(_key(1), _entry(1))
    book.put(_key(2), _entry(2))
    for k in (1, 2):
        book.stored(_key(k), CPU)
    # Evicted from the CPU tier (announced before the demotion stores it below).
    book.removed(_key(1), CPU, last=False)
    book.removed(_key(2), CPU, last=False)
    book.stored(_key(1), DISK)  # 1 was demoted; 2 was refused below
    clock.now = 1.9
    assert book.sweep() == 0 and len(book) == 2
    clock.now = 2.1
    book.sweep()
    assert book.get(_key(1)) is not None and book.get(_key(2)) is None
    assert book.held([1], lambda mask: "DISK" if mask == DISK else "?") == ["DISK"]
    book.removed(_key(1), DISK, last=True)  # left the node: gone at once
    assert len(book) == 0 and book.bytes_used == 0
    assert book.held([1], str) == []


def test_a_key_twice_in_one_removal_from_the_last_level_is_removed_once() -> None:
    # The rows of a tier event are read in one call: a key named twice, dropped at its
    # first, must not be read again at its second (an error there would stop the feed).
    book = DescriptorBook(1 << 20)
    dropped: list[bytes] = []
    book.put(_key(1), _entry(1))
    book.on_records = dropped.extend
    (row,) = book.stored_rows([_key(1)], DISK)
    assert book.removed_rows([_key(1), _key(1)], DISK, last=True) == [row, None]
    assert _key(1) not in book and book.bytes_used == 0
    assert [msgpack.unpackb(r) for r in dropped] == [[_key(1)]]


@pytest.mark.parametrize("indexed", [False, True])
def test_the_budget_counts_a_description_back_out_whatever_its_shape(indexed: bool) -> None:
    # A drop reads a row's sizes without decoding it (inline for the usual small row):
    # every shape of row must give back exactly what its put counted.
    book = DescriptorBook(1 << 30)
    shapes = [
        {"hashes": [1], "tokens": [1] * 4, "block_size": 4},
        {"hashes": [2, 3, 4], "tokens": [1] * 12, "block_size": 4},
        {"hashes": list(range(10, 30)), "tokens": [1] * 20, "block_size": 1},  # array 16
        {"hashes": [b"h" * 64, 5], "tokens": [7] * 200, "block_size": 100},  # bins 16
        {"hashes": [6], "tokens": [1] * 4, "block_size": 4, "group": 3},
    ]
    if indexed:
        assert book.index_part()
    for i, shape in enumerate(shapes):
        book.put(_key(i), parse_description(msgpack.packb({"parent": None, **shape})))
        book.stored(_key(i), DISK)
    assert book.bytes_used > 0
    for i in range(len(shapes)):
        book.removed(_key(i), DISK, last=True)
    assert len(book) == 0 and book.bytes_used == 0
    assert book.held([1], str) == []


def test_a_description_of_a_block_never_stored_goes_after_its_wait() -> None:
    clock = Clock()
    book = DescriptorBook(1 << 20, unheld_s=60.0, clock=clock)
    book.put(_key(1), _entry(1))
    clock.now = 59.0
    book.sweep()
    assert len(book) == 1
    clock.now = 61.0
    book.sweep()
    assert len(book) == 0


def test_a_description_waits_its_whole_wait_from_its_last_put_however_it_waited() -> None:
    # A description waits first in a plain dict, passed whole to the queue of the unheld
    # ones at most FRESH_S later or at FRESH_KEYS keys (a set and a pop, where the
    # queue cost five times as much, for the common case of a store a moment later).
    clock = Clock()
    book = DescriptorBook(1 << 30, grace_s=2.0, unheld_s=60.0, clock=clock)
    never = FRESH_KEYS + 10  # more than wait in the dict at once: a pass in a put
    for i in range(never):
        book.put(_key(i), _entry(i))
    clock.now = 10.0
    book.put(_key(5), _entry(5_000))  # described again: its wait starts over
    book.put(_key(-1), _entry(-1))  # held nowhere since: its wait starts here
    book.stored(_key(-1), CPU)
    book.removed(_key(-1), CPU, last=True)
    book.put(_key(-1), _entry(-2))
    book.put(_key(-2), _entry(-3))  # stored a moment later: it waits for nothing
    book.stored(_key(-2), CPU)
    assert book.next_due() == FRESH_S  # the dict's pass (of those since 0), before any is due
    clock.now = 59.5
    assert book.sweep() == 0 and len(book) == never + 2
    assert book.next_due() == 60.0
    clock.now = 60.5
    assert book.sweep() == never - 1 and sorted(book) == sorted(map(_key, (5, -1, -2)))
    clock.now = 69.5
    assert book.sweep() == 0
    clock.now = 70.5  # 60 s after their last put
    assert book.sweep() == 2 and list(book) == [_key(-2)]
    assert book.next_due() is None
    book.removed(_key(-2), CPU, last=False)  # evicted, never stored below: its grace
    clock.now = 72.5
    assert book.sweep() == 1 and len(book) == 0 and book.bytes_used == 0


def test_a_pass_late_still_drops_at_once_what_is_due() -> None:
    # No sweep for longer than the wait (an idle feed): the pass and the drop are one.
    clock = Clock()
    book = DescriptorBook(1 << 30, unheld_s=60.0, clock=clock)
    book.put(_key(1), _entry(1))
    clock.now = 61.0
    assert book.sweep() == 1 and len(book) == 0


def test_a_grace_shorter_than_the_pass_is_kept_to_the_letter() -> None:
    clock = Clock()
    book = DescriptorBook(1 << 30, grace_s=FRESH_S / 4, clock=clock)
    book.put(_key(1), _entry(1))
    book.stored(_key(1), CPU)
    clock.now = 10.0
    book.removed(_key(1), CPU, last=False)  # evicted: waits for its demotion
    assert book.next_due() == 10.0 + FRESH_S / 4  # not the pass's time, later
    clock.now = 10.0 + FRESH_S / 8
    assert book.sweep() == 0 and len(book) == 1
    book.stored(_key(1), DISK)  # demoted in time: it waits no more
    clock.now = 20.0
    assert book.sweep() == 0 and book.next_due() is None
    book.removed(_key(1), DISK, last=False)
    clock.now = 20.0 + FRESH_S / 4
    assert book.sweep() == 1 and len(book) == 0


def test_the_budget_pushes_out_the_oldest_and_counts_them() -> None:
    one = _entry(0).cost
    book = DescriptorBook(3 * one + one // 2)
    for i in range(5):
        book.put(_key(i), _entry(i))
    assert [bytes(k) for k in book] == [b"k2", b"k3", b"k4"]
    assert book.evicted == 2 and book.bytes_used == 3 * one
    assert book.held([0], str) == [] and book.held([1], str) == []


def test_a_shared_hash_stays_held_while_any_key_holds_it() -> None:
    book = DescriptorBook(1 << 20)
    book.put(_key(1), _entry(7))
    book.put(_key(2), _entry(7))  # two namespaces, the same prompt
    book.stored(_key(1), CPU)
    book.stored(_key(2), DISK)
    book.removed(_key(1), CPU, last=False)
    assert book.held([7], lambda mask: {CPU: "CPU", DISK: "DISK"}[mask]) == ["DISK"]


def _kept_in(path: Path, budget_bytes: int) -> tuple[DescriptorBook, BookFile]:
    """A book of ``budget_bytes`` whose every change goes to its file at ``path`` (started)."""
    book = DescriptorBook(budget_bytes)
    file = BookFile(path, book.row_parts)
    file.start()
    book.on_records = lambda records: file.changed(records, book.bytes_used)
    return book, file


def test_the_file_keeps_the_last_word_on_each_key_and_survives_a_torn_end(tmp_path: Path) -> None:
    path = tmp_path / "kv-descriptors.log"
    book, file = _kept_in(path, 1 << 20)
    for i in range(10):
        book.put(_key(i), _entry(i))
    book.drop(_key(3))
    book.put(_key(4), _entry(40))  # described again
    file.close()
    with open(path, "ab") as f:
        f.write(b"\x95\xc4")  # a record cut short by a crash
    back = read_book(path)
    assert sorted(back) == sorted(book)
    assert back[_key(4)].hashes == (40,)
    assert back[_key(4)].described == book.get(_key(4)).described  # type: ignore[union-attr]


def test_the_file_is_rewritten_when_it_has_grown_past_the_live_entries(tmp_path: Path) -> None:
    path = tmp_path / "kv-descriptors.log"
    book, file = _kept_in(path, 1 << 30)
    big = 4096
    for i in range(3000):  # bounded: ~36 MB of records for one live entry at the end
        book.put(_key(i % 2), _entry(i, tokens=big))
        book.drop(_key(i % 2))
    book.put(_key(1), _entry(1))
    file.close()
    assert path.stat().st_size < 9 << 20
    assert list(read_book(path)) == [_key(1)]


async def test_a_rewrite_takes_the_descriptions_from_the_loop_a_part_a_turn(
    tmp_path: Path,
) -> None:
    # Taken at once, a full book's rows (560,000) held the loop 75-90 ms in the put that
    # found the file grown past its live descriptions. Now the writer starts a fresh file
    # and the loop hands it a part a turn, while the book goes on changing; the file
    # still ends with the last word on every key.
    path = tmp_path / "kv-descriptors.log"
    book = DescriptorBook(1 << 30)
    turns = 0
    drawn: list[tuple[int, int]] = []  # (turn, rows) of each part handed over

    def parts() -> Iterator[list[tuple[BlockKey, bytes]]]:
        for part in book.row_parts():
            drawn.append((turns, len(part)))
            yield part

    file = BookFile(path, parts)
    file.start()
    book.on_records = lambda records: file.changed(records, book.bytes_used)
    live = 17_000
    for i in range(live):
        book.put(_key(i), _entry(i))
    drawn.clear()
    i = 0
    while not drawn and i < 4000:  # bounded: grows the file past four times the live
        book.put(_key(live + i % 2), _entry(i, tokens=16384))
        book.drop(_key(live + i % 2))
        i += 1
        if i % 64 == 0:
            await asyncio.sleep(0)
            turns += 1
    assert drawn, "no rewrite began"
    for turn in range(turns + 1, turns + 40):  # the book changes between the parts
        await asyncio.sleep(0)
        turns = turn
        book.put(_key(turn % 50), _entry(10_000 + turn))
        book.drop(_key(100 + turn))
        book.put(_key(live + 10 + turn), _entry(turn))
    file.settle()
    file.close()
    assert len(drawn) >= 2 and all(rows <= ROW_PART_BUCKETS * 1024 for _, rows in drawn)
    assert len({turn for turn, _ in drawn}) == len(drawn)  # one part a turn
    back = read_book(path)
    assert sorted(back) == sorted(book)
    assert all(back[k].described == book.get(k).described for k in book)  # type: ignore[union-attr]
    assert path.stat().st_size < 6 * book.bytes_used


async def test_changes_made_on_the_loop_reach_the_file_gathered(tmp_path: Path) -> None:
    # On the loop, the changes are handed to the writer together, HAND_S after the first
    # (one wake-up of its thread and one write for many, not one each): they get there
    # with no settle or close, and a close from another thread writes what is left.
    path = tmp_path / "kv-descriptors.log"
    book, file = _kept_in(path, 1 << 20)
    for i in range(10):
        book.put(_key(i), _entry(i))
    book.drop(_key(3))
    for _ in range(200):  # bounded: some 40 times HAND_S
        await asyncio.sleep(HAND_S / 5)
        if sorted(read_book(path)) == sorted(book):
            break
    assert sorted(read_book(path)) == sorted(book)
    book.put(_key(3), _entry(30))  # gathered, not handed over yet when the close comes
    await asyncio.to_thread(file.close)
    assert read_book(path)[_key(3)].hashes == (30,)


def test_the_hash_index_built_while_the_book_changes_answers_as_one_kept_all_along() -> None:
    # The index is built at the first ask, a part of the book a turn, and the book goes
    # on changing between the parts: keys described again with other hashes, dropped,
    # put new (some into the last bucket the build reads), on a part read already or not
    # yet. Once built it answers what an index kept from the start would.
    rng = random.Random(59)
    book = DescriptorBook(1 << 34)
    hash_of: dict[int, int] = {}  # key -> its hash (the described ones)
    levels: dict[int, int] = {}
    universe = set()

    def describe(k: int, h: int) -> None:
        book.put(_key(k), _entry(h))
        hash_of[k] = h
        universe.add(h)
        levels.setdefault(k, 0)

    count = INDEX_PART_BUCKETS * 1024 * 2 + 500  # three lists of rows, each read in parts
    for k in range(count):
        describe(k, k % 9000)  # hashes shared by up to five keys
        if k % 3:
            book.stored(_key(k), CPU)
            levels[k] = CPU
    assert not book.indexed
    assert book.bytes_used == sum(_entry(h).cost for h in hash_of.values())
    parts = 0
    while not book.index_part():
        parts += 1
        for _ in range(400):
            k = rng.randrange(count + 2000)
            choice = rng.random()
            if choice < 0.4:
                describe(k, rng.randrange(12000))  # again, or new at the back
            elif choice < 0.6 and k in hash_of:
                book.drop(_key(k))
                del hash_of[k], levels[k]
            elif k in hash_of:
                book.stored(_key(k), DISK)
                levels[k] |= DISK
    assert parts >= 2 * 1024 * INDEX_PART_BUCKETS // INDEX_ROWS and book.indexed
    assert book.bytes_used == sum(_entry(h).cost for h in hash_of.values())
    holders: dict[int, int] = {}
    for k, h in hash_of.items():
        holders[h] = holders.get(h, 0) | levels[k]
    for h in sorted(universe):
        expected = (
            [{CPU: "CPU", DISK: "DISK", CPU | DISK: "CPU"}[holders[h]]] if holders.get(h) else []
        )
        assert book.held([h], lambda mask: "CPU" if mask & CPU else "DISK") == expected, h
    for k in list(hash_of):  # every key's hashes leave the index with it
        book.drop(_key(k))
    assert all(book.held([h], str) == [] for h in universe) and book.bytes_used == 0


def test_a_collection_never_walks_the_descriptions() -> None:
    # A full book held as objects (an entry, its description, a list per hash: 1.7
    # million tracked objects at the default 256 MiB) held the loop 250-280 ms at every
    # full collection, for every tenant. Whatever state the descriptions are in, and
    # after a full collection and more descriptions, a collection follows a few hundred
    # references for the book (the 64 parts of each of its maps, and a few per 1,024
    # descriptions kept in order), not some per description (7,313 here as objects).
    clock = Clock()
    book = DescriptorBook(1 << 30, clock=clock)
    book.restore({_key(i): _entry(i) for i in range(100)})
    for i in range(100, 400):
        book.put(_key(i), _entry(i % 250))  # some hashes shared by two keys
        book.stored(_key(i), CPU if i % 2 else DISK)
    for i in range(100, 200):
        book.removed(_key(i), CPU, last=False)
    assert book.held([120], str) != []  # the hash index, built at the first ask
    gc.collect()
    for i in range(400, 500):
        book.put(_key(i), _entry(i))
    assert len(book) == 500 and book.held([120], str) != []
    assert references_walked(book) <= 400


def test_no_map_of_the_book_is_one_dict_of_all_its_descriptions() -> None:
    # A dict that grows past its table is copied whole in the put that overflowed it, and
    # a book's dicts of keys grow in step: at 350,000 descriptions, one put held the loop
    # 97 ms (four dicts). A dict churning at its size is copied the same way to sweep its
    # deleted slots. The book's maps are cut in 64 parts that resize on their own.
    clock = Clock()
    book = DescriptorBook(1 << 30, clock=clock)
    for i in range(20_000):
        book.put(_key(i), _entry(i))
        if i % 3:
            book.stored(_key(i), CPU)
    for i in range(0, 20_000, 5):
        book.removed(_key(i), CPU, last=False)  # some wait in their grace
    assert len(book) == 20_000
    assert largest_dict(book) <= 1_024


class CountingClock:
    """A clock whose instants count how often they are compared."""

    compared = 0

    def __init__(self) -> None:
        self.now = Instant(0.0)

    def __call__(self) -> Instant:
        return self.now


@functools.total_ordering
class Instant:
    def __init__(self, t: float) -> None:
        self.t = t

    def __add__(self, seconds: float) -> Instant:
        return Instant(self.t + seconds)

    def __eq__(self, other: object) -> bool:
        CountingClock.compared += 1
        return isinstance(other, Instant) and self.t == other.t

    def __lt__(self, other: Instant) -> bool:
        CountingClock.compared += 1
        return self.t < other.t

    __hash__ = None  # type: ignore[assignment]


def test_a_sweep_looks_at_the_due_descriptions_only() -> None:
    # A tenant that describes blocks it never stores fills its book with descriptions
    # waiting for their store; a sweep runs after each of its event batches, and looked at
    # every waiting one (47-68 ms at 500,000). Now it looks at those due, and one more.
    clock = CountingClock()
    book = DescriptorBook(1 << 30, grace_s=2.0, unheld_s=60.0, clock=clock)  # type: ignore[arg-type]
    for i in range(3):  # stored, then evicted from the CPU tier: 2 s of grace
        book.put(_key(i), _entry(i))
        book.stored(_key(i), CPU)
        book.removed(_key(i), CPU, last=False)
    clock.now = Instant(1.0)
    for i in range(3, 2003):  # never stored: 60 s of wait
        book.put(_key(i), _entry(i))
    clock.now = Instant(2.5)
    CountingClock.compared = 0
    assert book.sweep() == 3 and len(book) == 2000
    assert CountingClock.compared <= 8
    assert book.next_due() == Instant(61.0)
    clock.now = Instant(61.5)
    assert book.sweep() == 2000 and len(book) == 0 and book.next_due() is None


@pytest.mark.parametrize(
    ("hashes", "said"),
    [
        ([True], r"`int \| bytes`, got `bool` - at `\$.hashes\[0\]`"),
        ([b""], r"length >= 1 - at `\$.hashes\[0\]`"),
        ([b"x" * 65], r"length <= 64 - at `\$.hashes\[0\]`"),
        ([7, 1.0], r"`int \| bytes`, got `float` - at `\$.hashes\[1\]`"),
        (["7"], r"`int \| bytes`, got `str` - at `\$.hashes\[0\]`"),
    ],
)
def test_a_hash_is_a_64_bit_integer_or_1_to_64_bytes(hashes: list[object], said: str) -> None:
    description = {"hashes": hashes, "tokens": [1] * len(hashes), "block_size": 1}
    with pytest.raises(BadDescription, match=said):
        parse_description(msgpack.packb(description))


def test_a_description_nested_past_any_need_is_refused_not_raised() -> None:
    # extra_keys' entries are decoded as any msgpack before their check: a description
    # of 100,000 nested arrays reached the decoder's recursion bound and raised
    # RecursionError, past the request's handling of a bad description.
    head = msgpack.packb({"hashes": [1], "tokens": [1], "block_size": 1})
    deep = b"\x84" + head[1:] + msgpack.packb("extra_keys") + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(BadDescription, match="its containers nest too deep"):
        parse_description(deep)
    entry = parse_description(b"\x84" + head[1:] + msgpack.packb("extra_keys") + b"\x91\xc0")
    assert entry.hashes == (1,)  # (one hash, its entry null: still a description)


def test_every_kind_of_hash_is_kept_as_it_came() -> None:
    hashes = [-(1 << 63), (1 << 64) - 1, 0, b"\x01" * 64]
    entry = parse_description(msgpack.packb({"hashes": hashes, "tokens": [1] * 4, "block_size": 1}))
    assert entry.hashes == tuple(hashes)
    assert msgpack.unpackb(entry.described.hashes) == hashes
