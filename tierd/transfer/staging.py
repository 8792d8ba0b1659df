"""Staging areas of the transfer engine, and the zero-copy buffers of a batch.

A route between two stores that both lack slot views (GPU <-> DISK) copies through a
pinned CPU store used only through its views: :class:`StagingAreas` makes one per block
size on first use (:class:`Staging`, cut into segments a chunk leases one at a time) and
releases them all on close. :func:`slot_buffers` gives the cheapest form of a batch's
slot buffers that another store takes, for the direct routes and the staged ones alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from tierd.errors import TransferError
from tierd.stores.base import BlockStore, slot_run_start
from tierd.stores.cuda import split_at_boundaries
from tierd.stores.memory import HostPoolStore

__all__ = ["Staging", "StagingAreas", "StagingFactory", "dma_pieces", "slot_buffers"]

# Builds an unopened CPU store of (num_blocks, block_bytes) whose views are the staging area.
StagingFactory = Callable[[int, int], BlockStore]

# Scattered slots of a pinned pool go to or from a GPU as one DMA per block at or above
# this size, else packed by a Python memcpy into pinned staging first. On an H100 (16 cores,
# docs/BENCHMARKS.md "GPU probe") per-block DMAs moved 22 GB/s at 256 KiB and 49 at 2 MiB,
# packing 5 at both.
_DMA_BLOCK_BYTES = 256 << 10
_STAGING_SEGMENTS = 2


class Staging:
    """A CPU store used only through its slot views, cut into equal segments of
    consecutive slots; a staged chunk leases one segment at a time."""

    def __init__(self, store: BlockStore, segments: int) -> None:
        self.store = store
        self.blocks = store.num_blocks // segments  # per segment
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for segment in range(segments):
            self._free.put_nowait(segment * self.blocks)

    @asynccontextmanager
    async def lease(self, count: int) -> AsyncIterator[Any]:
        first = await self._free.get()
        try:
            yield slot_buffers(self.store, range(first, first + count), dma=True)
        finally:
            self._free.put_nowait(first)


class StagingAreas:
    """One :class:`Staging` per block size, of about ``staging_bytes`` (at least one block
    per segment), opened on first use; :meth:`close` releases them and refuses more."""

    def __init__(self, staging_bytes: int, factory: StagingFactory | None) -> None:
        self._bytes = staging_bytes
        self._factory = factory or _default_staging
        self._areas: dict[int, Staging] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    async def get(self, block_bytes: int) -> Staging:
        async with self._lock:
            if self._closed:
                raise TransferError("the transfer engine is closed")
            staging = self._areas.get(block_bytes)
            if staging is None:
                per_segment = max(1, self._bytes // block_bytes // _STAGING_SEGMENTS)
                factory = self._factory(per_segment * _STAGING_SEGMENTS, block_bytes)
                store = await factory.open()
                staging = self._areas[block_bytes] = Staging(store, _STAGING_SEGMENTS)
            return staging

    async def close(self) -> None:
        """Release the staging areas; idempotent."""
        self._closed = True
        async with self._lock:
            stagings, self._areas = list(self._areas.values()), {}
        for staging in stagings:
            await staging.store.close()


def slot_buffers(store: BlockStore, slots: Sequence[int], *, dma: bool) -> Any | None:
    """Zero-copy buffers for ``slots`` of ``store``, in the cheapest form another store
    takes; ``None`` when the store has no views. Towards or from a GPU (``dma``): one
    ``[n, block_bytes]`` tensor for a consecutive run of a host pool (one DMA), per-block
    tensors for big blocks (one DMA each: no packing by a Python memcpy under the GIL).
    Between host memories and disks: a numpy array for a consecutive run (one copy, no
    torch), else per-slot memoryviews."""
    if not store.has_views:
        return None
    if isinstance(store, HostPoolStore):
        start = slot_run_start(slots)
        if start is not None and store.stride == store.block_bytes:
            pool = store.pool_tensor() if dma else store.pool_array()
            return pool[start : start + len(slots)]
        if dma and store.block_bytes >= _DMA_BLOCK_BYTES:
            return store.slot_tensors(slots)
    return [store.view(slot) for slot in slots]


def dma_pieces(store: BlockStore, slots: Sequence[int]) -> list[tuple[int, int]]:
    """Index ranges of ``slots`` that each stay inside one host registration of
    ``store`` (a pinned pool registers in chunks; one copy must not cross two)."""
    boundary = getattr(store, "dma_boundary", 0)
    if not boundary:
        return [(0, len(slots))]
    return split_at_boundaries(slots, boundary)


def _default_staging(num_blocks: int, block_bytes: int) -> BlockStore:
    # Imported here: only the staged routes need a CPU pool.
    from tierd.stores.cpu import CpuStore

    return CpuStore(num_blocks=num_blocks, block_bytes=block_bytes)
