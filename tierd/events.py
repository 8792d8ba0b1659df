"""Block events: what a tier stored and removed, tagged with its medium and name.

A tier buffers :class:`TierEvent` values as its bookkeeping changes; whoever drives the
tier drains them with ``take_events()`` and publishes them on an :class:`EventBus`, whose
subscribers read through bounded queues (:class:`Subscription`, iterated by a task) or are
handed each turn's batches in one call (:class:`Listener`, for a subscriber that keeps up
at the loop's pace: no task, future or queue per wake-up).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from tierd.keys import BlockKey, Medium

__all__ = ["EventBus", "EventKind", "Listener", "Subscription", "TierEvent"]


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


class _Subscriber:
    """What every subscriber of a bus has: the events it lost (``dropped``), and its
    ``close``."""

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self.dropped = 0
        self.closed = False

    def _offer(self, batch: list[TierEvent]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Unsubscribed: nothing more comes (what waits is dropped, uncounted: the
        subscriber is gone)."""
        if not self.closed:
            self.closed = True
            self._bus._unsubscribe(self)


class Subscription(_Subscriber):
    """One subscriber's bounded queue of event batches; iterate it with ``async for``.

    When the queue is full, new batches are dropped and ``dropped`` counts the events lost:
    the data path never waits for a slow subscriber."""

    def __init__(self, bus: EventBus, maxsize: int) -> None:
        super().__init__(bus)
        self._queue: asyncio.Queue[list[TierEvent]] = asyncio.Queue(maxsize)

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

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> list[TierEvent]:
        return await self.get()


class Listener(_Subscriber):
    """A subscriber handed the batches published in one turn of the loop together, in a
    callback of its own soon after (``take``, in the loop's next round of callbacks, as a
    task waiting on a queue would be woken; never within the publisher's call, so the data
    path never runs a subscriber's code). At most ``maxsize`` batches wait for that call:
    past it, new batches are dropped and ``dropped`` counts their events."""

    def __init__(
        self, bus: EventBus, take: Callable[[list[list[TierEvent]]], None], maxsize: int
    ) -> None:
        super().__init__(bus)
        self._take = take
        self._maxsize = maxsize
        self._waiting: list[list[TierEvent]] = []
        self._planned = False

    def _offer(self, batch: list[TierEvent]) -> None:
        waiting = self._waiting
        if len(waiting) >= self._maxsize:
            self.dropped += len(batch)
            return
        waiting.append(batch)
        if not self._planned:
            self._planned = True
            asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        self._planned = False
        batches, self._waiting = self._waiting, []
        if not self.closed:
            self._take(batches)


class EventBus:
    """Fans event batches out to subscribers without ever blocking the publisher."""

    def __init__(self) -> None:
        self._subscribers: list[_Subscriber] = []
        self.published = 0
        self._dropped_gone = 0  # drops of subscriptions closed since: the total never falls

    def subscribe(self, maxsize: int = 1024) -> Subscription:
        """A new subscription holding at most ``maxsize`` batches."""
        subscription = Subscription(self, maxsize)
        self._subscribers.append(subscription)
        return subscription

    def listen(
        self, take: Callable[[list[list[TierEvent]]], None], maxsize: int = 1024
    ) -> Listener:
        """A new :class:`Listener`: ``take`` is called after each turn in which batches
        were published, with them (at most ``maxsize``)."""
        listener = Listener(self, take, maxsize)
        self._subscribers.append(listener)
        return listener

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

    def _unsubscribe(self, subscription: _Subscriber) -> None:
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)
            self._dropped_gone += subscription.dropped
