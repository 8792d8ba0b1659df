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


@pytest.fixture
async def fed() -> AsyncIterator[tuple[EventFeed, KvTenant, Offers]]:
    levels = [
        SimpleNamespace(tier=Tier("cpu"), medium=Medium.CPU),
        SimpleNamespace(tier=Tier("disk"), medium=Medium.DISK),
    ]
    chain = SimpleNamespace(levels=levels, remote=None, bus=EventBus())
    offers = Offers()
    tenant = KvTenant("t", chain, DescriptorBook(1 << 20), Stream(offers))  # type: ignore[arg-type]
    media = {"CPU": "CPU", "DISK": "DISK"}
    feed = EventFeed([tenant], FeedSettings(media=media, batch_s=BATCH_S, max_batch_events=4))
    feed.start()
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
