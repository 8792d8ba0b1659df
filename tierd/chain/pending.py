"""Writes in flight: slots reserved at a level whose bytes are not written yet.

:class:`PendingWrites` owns, per level and key, the future of the write the key is part
of, so that a load that finds a block in flight can wait for it. A write is registered
when its slots are reserved and ended exactly once: by :meth:`PendingWrites.end_store`
(the blocks written become ready, the rest are dropped and their slots freed) or by
:meth:`PendingWrites.withdraw` (nothing is written, and the slots stay out of use until
:meth:`PendingWrites.release`: a client that may still write into them has them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import repeat

from tierd.chain.levels import ChainLevels
from tierd.keys import BlockKey

__all__ = ["PendingWrites"]


class PendingWrites:
    """The writes in flight at the levels of ``levels``."""

    def __init__(self, levels: ChainLevels) -> None:
        self._levels = levels
        self._futures: dict[tuple[int, BlockKey], asyncio.Future[bool]] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def future_of(self, index: int, key: BlockKey) -> asyncio.Future[bool] | None:
        """The future of the write of ``key`` at ``index``; ``None`` if none is in flight."""
        return self._futures.get((index, key))

    def in_flight(self, index: int, key: BlockKey) -> bool:
        return (index, key) in self._futures

    def register(self, index: int, keys: Sequence[BlockKey]) -> list[asyncio.Future[bool]]:
        """Put ``keys`` in flight at ``index``: one future for the whole write, under each
        key (a future per key cost a 4,096-key store milliseconds of the loop to make and
        to resolve); co-indexed with ``keys``. It is done when the write ends."""
        future = asyncio.get_running_loop().create_future()
        self._futures.update(zip(zip(repeat(index), keys), repeat(future)))
        return [future] * len(keys)

    def end_store(
        self,
        index: int,
        keys: Sequence[BlockKey],
        ok: Sequence[bool],
        futures: list[asyncio.Future[bool]],
        *,
        io_failed: bool = True,
    ) -> list[BlockKey]:
        """Complete a write: ``ok`` blocks become ready, the rest are dropped (and counted
        as I/O errors unless ``io_failed`` is false: a client that gave up is not one)."""
        level = self._levels.levels[index]
        tier = level.tier
        good = [k for k, flag in zip(keys, ok, strict=True) if flag]
        bad = [k for k, flag in zip(keys, ok, strict=True) if not flag]
        tier.complete_store(good)
        tier.complete_store(bad, success=False)
        if io_failed:
            level.io_errors += len(bad)
        self._settle(index, keys, futures)
        return good

    def withdraw(
        self, index: int, keys: Sequence[BlockKey], futures: list[asyncio.Future[bool]]
    ) -> list[int]:
        """End a client's write with nothing written, but keep its slots from every other
        block (:meth:`~tierd.tier.Tier.quarantine`: the client may still be writing into
        them); returns those slots, for :meth:`release` once the client is done."""
        held = self._levels.levels[index].tier.quarantine(keys)
        self._settle(index, keys, futures)
        return held

    def release(self, index: int, slots: Sequence[int]) -> None:
        """Free the slots of a withdrawn write (:meth:`withdraw`)."""
        self._levels.levels[index].tier.release_quarantine(slots)

    def _settle(
        self, index: int, keys: Sequence[BlockKey], futures: list[asyncio.Future[bool]]
    ) -> None:
        """The keys of an ended write are in flight no more: wake who waits on them."""
        pending = self._futures
        for key in keys:
            del pending[(index, key)]
        for future in dict.fromkeys(futures):  # one per write (at C speed)
            if not future.done():
                future.set_result(True)  # ended: a waiter looks at the tier, not the result
        self._levels.publish()

    def abort(
        self, index: int, keys: Sequence[BlockKey], futures: list[asyncio.Future[bool]]
    ) -> None:
        """End a client's write with nothing written (not an I/O error)."""
        self.end_store(index, keys, [False] * len(keys), futures, io_failed=False)
