"""Byte budgets and counters of the transfer engine's routes.

:class:`ByteBudget` bounds the bytes in flight on one route (a FIFO semaphore counting
bytes); :class:`RouteState` is one route's budget with its running counters, and
:class:`RouteStats` the snapshot of them that :meth:`TransferEngine.stats` returns.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from tierd.keys import Medium

__all__ = ["ByteBudget", "Route", "RouteState", "RouteStats"]

Route = tuple[Medium, Medium]


@dataclass(frozen=True, slots=True)
class RouteStats:
    """Counters for one route; ``busy_s`` is wall time with at least one copy in flight."""

    src: Medium
    dst: Medium
    bytes: int
    blocks: int
    failures: int
    busy_s: float
    budget_bytes: int
    in_flight_bytes: int

    @property
    def gb_per_s(self) -> float:
        """Achieved throughput over busy time, in GB/s (10**9 bytes)."""
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


class ByteBudget:
    """A FIFO semaphore counting bytes: ``acquire(n)`` waits until ``n`` more bytes fit.

    ``release`` is synchronous, so it runs to completion in a ``finally`` even while the
    releasing task is being cancelled (an ``asyncio.Condition`` would need its lock there).
    A request larger than the capacity is charged the whole capacity and runs alone.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a byte budget must be positive, got {capacity}")
        self.capacity = capacity
        self._used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_flight(self) -> int:
        return self._used

    @property
    def available(self) -> int:
        return self.capacity - self._used

    async def acquire(self, nbytes: int) -> int:
        """Take ``nbytes`` (clamped to the capacity); returns the amount to release."""
        charge = min(max(nbytes, 0), self.capacity)
        if not self._waiters and self._used + charge <= self.capacity:
            self._used += charge
            return charge
        entry = (charge, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self.release(charge)  # granted just before the cancellation arrived
            else:
                self._waiters.remove(entry)
                self._wake()  # a smaller waiter behind us may fit now
            raise
        return charge

    def release(self, charge: int) -> None:
        self._used -= charge
        self._wake()

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[int]:
        charge = await self.acquire(nbytes)
        try:
            yield charge
        finally:
            self.release(charge)

    def _wake(self) -> None:
        while self._waiters:
            charge, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self._used + charge > self.capacity:
                return
            self._waiters.popleft()
            self._used += charge
            fut.set_result(None)


class RouteState:
    """Budget and running counters of one route."""

    def __init__(self, route: Route, budget: int) -> None:
        self.route = route
        self.budget = ByteBudget(budget)
        self.bytes = 0
        self.blocks = 0
        self.failures = 0
        self.busy_s = 0.0
        self._active = 0
        self._since = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.busy_s += time.perf_counter() - self._since

    def snapshot(self) -> RouteStats:
        busy = self.busy_s
        if self._active:
            busy += time.perf_counter() - self._since
        (src, dst), b = self.route, self.budget
        return RouteStats(
            src, dst, self.bytes, self.blocks, self.failures, busy, b.capacity, b.in_flight
        )
