"""Block events: what a tier stored and removed, tagged with its medium and name.

A tier buffers :class:`TierEvent` values as its bookkeeping changes; whoever drives the
tier drains them with ``take_events()`` and publishes them on an :class:`EventBus`, whose
subscribers read through bounded queues.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum

from tierd.keys import BlockKey, Medium

__all__ = ["EventBus", "EventKind", "Subscription", "TierEvent"]


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Blocks that became ready (``STORED``) or left (``REMOVED``) one tier, in order."""

    kind: EventKind
    keys: tuple[BlockKey, ...]
    medium: Medium
    tier: str


class Subscription:
    """One subscriber's bounded queue of event batches; iterate it with ``async for``.

    When the queue is full, new batches are dropped and ``dropped`` counts the events lost:
    the data path never waits for a slow subscriber."""

    def __init__(self, bus: EventBus, maxsize: int) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[list[TierEvent]] = asyncio.Queue(maxsize)
        self.dropped = 0
        self.closed = False

    def _offer(self, batch: list[TierEvent]) -> None:
        try:
            self._queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.dropped += len(batch)

    async def get(self) -> list[TierEvent]:
        """The next batch of events, oldest first."""
        return await self._queue.get()

    def get_nowait(self) -> list[TierEvent] | None:
        """The next batch if one is queued, else ``None``."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._bus._unsubscribe(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> list[TierEvent]:
        return await self.get()


class EventBus:
    """Fans event batches out to subscribers without ever blocking the publisher."""

    def __init__(self) -> None:
        self._subscribers: list[Subscription] = []
        self.published = 0
        self._dropped_gone = 0  # drops of subscriptions closed since: the total never falls

    def subscribe(self, maxsize: int = 1024) -> Subscription:
        """A new subscription holding at most ``maxsize`` batches."""
        subscription = Subscription(self, maxsize)
        self._subscribers.append(subscription)
        return subscription

    def publish(self, batch: list[TierEvent]) -> None:
        if not batch:
            return
        self.published += len(batch)
        for subscription in self._subscribers:
            subscription._offer(batch)

    @property
    def dropped(self) -> int:
        """Events lost by every subscriber so far, closed ones included."""
        return self._dropped_gone + sum(s.dropped for s in self._subscribers)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def _unsubscribe(self, subscription: Subscription) -> None:
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)
            self._dropped_gone += subscription.dropped
