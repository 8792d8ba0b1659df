"""When the feed offers its batches (tierd.kvevents.feed): a chain of two levels on an
event bus, a publisher that records each offer with the loop's clock.

A store's events go out at the end of the loop's turn when the stream is idle (a router
hears of a block as its store returns, not a gathering interval later), and a busy
stream sends one batch per ``batch_s`` (not one per turn: a batch costs the daemon a
wake-up of the publisher's thread and a send, whatever its size)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import msgpack
import pytest

from tierd.events import EventBus, EventKind, TierEvent
from tierd.keys import BlockKey, Medium
from tierd.kvevents import wire
from tierd.kvevents.book import DescriptorBook
from tierd.kvevents.describe import parse_description
from tierd.kvevents.feed import EventFeed, FeedSettings, KvTenant, Stream

BATCH_S = 0.2
TURNS = 5  # loop turns that an idle stream's batch takes at most (no sleep in them)


class Tier:
    def __init__(self, name: str) -> None:
        self.name = name
        self.adopting = False

    def ready(self, keys: list[BlockKey]) -> list[BlockKey]:
        return []  # (nothing is held before its store)


class Offers:
    """A publisher that keeps each batch offered, with the loop's time of the offer."""

    endpoint = replay_endpoint = None

    def __init__(self) -> None:
        self.batches: list[tuple[float, list[bytes]]] = []

    def offer(self, events: list[bytes]) -> bool:
        self.batches.append((asyncio.get_running_loop().time(), list(events)))
        return True

    def stats(self) -> dict[str, int]:
        return {}


def _key(i: int) -> BlockKey:
    return BlockKey(f"k{i}".encode())


def _description(i: int) -> bytes:
    return msgpack.packb({"hashes": [i], "parent": None, "tokens": [i, i + 1], "block_size": 2})


def _feed(
    queue_batches: int = 4096, book: DescriptorBook | None = None
) -> tuple[EventFeed, KvTenant, Offers]:
    levels = [
        SimpleNamespace(tier=Tier("cpu"), medium=Medium.CPU),
        SimpleNamespace(tier=Tier("disk"), medium=Medium.DISK),
    ]
    chain = SimpleNamespace(levels=levels, remote=None, bus=EventBus())
    offers = Offers()
    book = DescriptorBook(1 << 20) if book is None else book
    tenant = KvTenant("t", chain, book, Stream(offers))  # type: ignore[arg-type]
    media = {"CPU": "CPU", "DISK": "DISK"}
    settings = FeedSettings(
        media=media, batch_s=BATCH_S, max_batch_events=4, queue_batches=queue_batches
    )
    feed = EventFeed([tenant], settings)
    feed.start()
    return feed, tenant, offers


@pytest.fixture
async def fed() -> AsyncIterator[tuple[EventFeed, KvTenant, Offers]]:
    feed, tenant, offers = _feed()
    yield feed, tenant, offers
    await feed.close()


def _store(tenant: KvTenant, keys: range) -> None:
    """The CPU level stored ``keys`` (its event, published on the chain's bus)."""
    event = TierEvent(EventKind.STORED, tuple(map(_key, keys)), Medium.CPU, "cpu")
    tenant.chain.bus.publish([event])


async def _turns(offers: Offers, count: int) -> int:
    """Turns of the loop (``TURNS`` at most) until ``count`` batches were offered."""
    for turn in range(TURNS):
        if len(offers.batches) >= count:
            return turn
        await asyncio.sleep(0)
    return TURNS


async def test_an_idle_streams_batch_goes_out_at_the_end_of_the_turn_then_one_per_batch_s(
    fed: tuple[EventFeed, KvTenant, Offers],
) -> None:
    feed, tenant, offers = fed
    entries = {i: parse_description(_description(i)) for i in range(3)}
    for i, entry in entries.items():
        feed.described(tenant, [_key(i)], [entry])
    assert len(offers.batches) == 1  # the incarnation's AllBlocksCleared
    _store(tenant, range(1))
    assert await _turns(offers, 2) < TURNS  # not a gathering interval later
    first_at, events = offers.batches[1]
    assert events == [wire.stored(entries[0].described, "CPU")]
    _store(tenant, range(1, 3))  # the stream just sent one: this waits for batch_s
    assert await _turns(offers, 3) == TURNS
    for _ in range(100):  # bounded: some 10 times batch_s
        if len(offers.batches) == 3:
            break
        await asyncio.sleep(BATCH_S / 10)
    second_at, events = offers.batches[2]
    assert second_at >= first_at + BATCH_S
    assert events == [wire.stored(entries[i].described, "CPU") for i in (1, 2)]
    assert [msgpack.unpackb(e)["block_hashes"] for e in events] == [[1], [2]]


async def test_a_full_batch_goes_out_at_once_and_none_is_bigger_than_the_bound(
    fed: tuple[EventFeed, KvTenant, Offers],
) -> None:
    feed, tenant, offers = fed
    for i in range(11):
        feed.described(tenant, [_key(i)], [parse_description(_description(i))])
    _store(tenant, range(1))
    assert await _turns(offers, 2) < TURNS
    _store(tenant, range(1, 11))  # 10 events within batch_s of the last batch: past the
    assert await _turns(offers, 5) < TURNS  # bound (4), all go at once, 4 a batch at most
    sizes = [len(events) for _, events in offers.batches]
    assert sizes == [1, 1, 4, 4, 2]
    hashes = [msgpack.unpackb(e)["block_hashes"] for _, b in offers.batches[1:] for e in b]
    assert hashes == [[i] for i in range(11)]


async def test_a_turns_tier_events_are_taken_together_in_order_and_past_the_bound_dropped() -> None:
    """The feed is handed what the chain published in a turn in one call, after it (the
    chain's own call never runs the feed's code): in order, at most ``queue_batches`` of
    them, the rest dropped and counted; once closed, it is handed nothing."""
    feed, tenant, offers = _feed(queue_batches=3)
    try:
        for i in range(8):
            feed.described(tenant, [_key(i)], [parse_description(_description(i))])
        for i in range(5):  # five of the chain's batches in one turn: two past the bound
            _store(tenant, range(i, i + 1))
        assert len(offers.batches) == 1  # (AllBlocksCleared) nothing taken in the turn
        assert await _turns(offers, 2) < TURNS
        hashes = [msgpack.unpackb(e)["block_hashes"] for _, b in offers.batches[1:] for e in b]
        assert hashes == [[0], [1], [2]]
        assert tenant.chain.bus.dropped == 2
        _store(tenant, range(5, 6))  # the next turn's are taken as well
        for _ in range(100):  # bounded: some 10 times batch_s
            if len(offers.batches) == 3:
                break
            await asyncio.sleep(BATCH_S / 10)
        assert [msgpack.unpackb(e)["block_hashes"] for e in offers.batches[2][1]] == [[5]]
    finally:
        await feed.close()
    assert tenant.chain.bus.subscriber_count == 0
    _store(tenant, range(6, 7))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(offers.batches) == 3


async def test_a_description_held_nowhere_goes_after_its_grace_while_events_keep_coming() -> None:
    """The feed looks at the book's waits when one is due, however busy: a block that
    left the CPU level and was never stored below is forgotten ``grace_s`` later while
    other blocks' events come every few milliseconds (the feed skips a look only when
    the one planned comes first)."""
    grace_s = 0.2
    feed, tenant, _ = _feed(book=DescriptorBook(1 << 20, grace_s=grace_s))
    try:
        for i in range(200):
            feed.described(tenant, [_key(i)], [parse_description(_description(i))])
        _store(tenant, range(2))
        await asyncio.sleep(0.01)
        left = TierEvent(EventKind.REMOVED, (_key(0),), Medium.CPU, "cpu")
        tenant.chain.bus.publish([left])
        began = asyncio.get_running_loop().time()
        for i in range(2, 200):  # bounded: 198 stores, 5 ms apart (about a second)
            _store(tenant, range(i, i + 1))
            await asyncio.sleep(0.005)
            if _key(0) not in tenant.book:
                break
        took = asyncio.get_running_loop().time() - began
        assert _key(0) not in tenant.book
        assert grace_s <= took < grace_s + 0.3
        assert _key(1) in tenant.book  # (held on the CPU level: kept)
    finally:
        await feed.close()


async def test_a_tier_event_that_fails_is_counted_and_the_turns_others_are_taken(
    fed: tuple[EventFeed, KvTenant, Offers],
) -> None:
    """A failure taking one of the chain's batches (none is expected: a bug) costs that
    batch's events, logged and counted, never the feed: the turn's other batches and
    every later one are published."""
    feed, tenant, offers = fed
    for i in range(3):
        feed.described(tenant, [_key(i)], [parse_description(_description(i))])
    framer = tenant.framers[1]
    failures = iter([True])

    class FailingOnce:
        def stored(self, row: bytes) -> bytes:
            if next(failures, False):
                raise RuntimeError("a bug")
            return framer.stored(row)

    tenant.framers[1] = FailingOnce()  # type: ignore[assignment]
    _store(tenant, range(1))  # fails
    _store(tenant, range(1, 2))  # the same turn's next batch
    assert await _turns(offers, 2) < TURNS
    _store(tenant, range(2, 3))  # a later turn's
    for _ in range(100):  # bounded: some 10 times batch_s
        if len(offers.batches) == 3:
            break
        await asyncio.sleep(BATCH_S / 10)
    hashes = [msgpack.unpackb(e)["block_hashes"] for _, b in offers.batches[1:] for e in b]
    assert hashes == [[1], [2]]
    assert feed.tier_events_failed == 1
