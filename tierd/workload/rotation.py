"""Taking turns: the calls of a replay's workers made one at a time, in a fixed rotation,
so that the order in which the cache sees them depends on the trace alone, never on how
fast it answers (an ordered replay, :func:`tierd.workload.replayer.replay`).

Worker 0 calls first, then worker 1, and so on round the workers still working; a worker
whose turn it is holds everyone up until it makes its call (or leaves). Each worker's
requests still interleave with the others' (a lookup can come before an earlier request's
store, as with engines side by side), but the same trace gives the same interleaving.

A store keeps its worker's turn for the :meth:`InTurn.settle` that follows it: no call of
another worker reaches the cache while the store's background copies (``write_behind``)
still run, so the state it finds does not depend on how fast the disk writes either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tierd.workload.replay_figures import ReplayBackend

__all__ = ["InTurn", "Turns"]


class Turns:
    """The rotation: whose turn it is among the workers still working."""

    def __init__(self, count: int) -> None:
        self._active = list(range(count))
        self._ready = [asyncio.Event() for _ in range(count)]
        self._current = 0
        if count:
            self._ready[0].set()

    async def take(self, worker: int) -> None:
        """Wait for ``worker``'s turn (at once when it is already)."""
        await self._ready[worker].wait()

    def give(self, worker: int) -> None:
        """``worker`` made its call: the next worker's turn."""
        self._pass(worker, self._after(worker))

    def leave(self, worker: int) -> None:
        """``worker`` has no more calls to make: the rotation goes on without it."""
        if worker not in self._active:
            return
        after = self._after(worker)
        self._active.remove(worker)
        if self._current == worker and self._active:
            self._pass(worker, after)

    def _after(self, worker: int) -> int:
        at = self._active.index(worker)
        return self._active[(at + 1) % len(self._active)]

    def _pass(self, worker: int, to: int) -> None:
        self._ready[worker].clear()
        self._current = to
        self._ready[to].set()


class InTurn:
    """A worker's backend whose every call waits for the worker's turn."""

    def __init__(self, inner: ReplayBackend, turns: Turns, worker: int) -> None:
        self.inner, self.turns, self.worker = inner, turns, worker

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def target(self) -> str:
        return self.inner.target

    @property
    def block_bytes(self) -> int:
        return self.inner.block_bytes

    @property
    def entry_capacity(self) -> int:
        return self.inner.entry_capacity

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        await self.turns.take(self.worker)
        try:
            return await self.inner.lookup(keys)
        finally:
            self.turns.give(self.worker)

    async def touch(self, keys: Sequence[bytes]) -> None:
        await self.turns.take(self.worker)
        try:
            await self.inner.touch(keys)
        finally:
            self.turns.give(self.worker)

    async def load(self, keys: Sequence[bytes]) -> list[bytes]:
        await self.turns.take(self.worker)
        try:
            return await self.inner.load(keys)
        finally:
            self.turns.give(self.worker)

    async def store(self, keys: Sequence[bytes], data: Sequence[bytes]) -> int:
        """Store, keeping the turn (whatever the outcome) for the :meth:`settle` that the
        replay makes next; a worker that leaves instead hands it on then."""
        await self.turns.take(self.worker)
        return await self.inner.store(keys, data)

    async def settle(self) -> bool:
        await self.turns.take(self.worker)  # at once after this worker's store
        try:
            return await self.inner.settle()
        finally:
            self.turns.give(self.worker)

    async def stats(self) -> dict[str, Any]:
        await self.turns.take(self.worker)
        try:
            return await self.inner.stats()
        finally:
            self.turns.give(self.worker)

    async def close(self) -> None:
        await self.inner.close()
