"""How the disk store runs a batch's blocks on its thread pools.

A batch's per-block jobs are grouped by slab and cut into chunks of at most
``blocks_per_task`` blocks (fewer when that keeps every thread busy), one thread hop per
chunk, each running a slab's blocking ``write_chunk`` or ``read_chunk``. The store keeps
reads and writes on pools of their own, so loads never queue behind write-back.

This module owns that cutting and the waiting: results come back in job order, and a
cancelled batch drops the chunks not yet started but waits for those already running, so
no byte lands in a caller's buffer after the caller moved on. It holds no state; the pools
and the slabs are :class:`~tierd.stores.disk.store.DiskStore`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from tierd.stores.disk.block_format import OK
from tierd.stores.disk.slab import Slab

__all__ = ["Chunk", "Chunking", "run_chunks"]

Chunk = Callable[[], list[int]]


@dataclass(frozen=True, slots=True)
class Chunking:
    """How one pool's batches are cut: ``threads`` chunks in flight at most, each of up to
    ``per_task`` blocks."""

    threads: int
    per_task: int

    def cut(self, jobs: list[tuple[Slab, Any]], *, write: bool) -> tuple[list[Chunk], list[int]]:
        """The chunks and, per flattened result, the job position it belongs to."""
        groups: dict[int, list[int]] = {}
        for pos, (slab, _) in enumerate(jobs):
            groups.setdefault(id(slab), []).append(pos)
        size = max(1, min(self.per_task, -(-len(jobs) // self.threads)))
        chunks: list[Chunk] = []
        order: list[int] = []
        for positions in groups.values():
            slab = jobs[positions[0]][0]
            fn = slab.write_chunk if write else slab.read_chunk
            for i in range(0, len(positions), size):
                part = positions[i : i + size]
                chunks.append(partial(fn, [jobs[p][1] for p in part]))
                order += part
        return chunks, order

    async def run(
        self, pool: ThreadPoolExecutor | None, jobs: list[tuple[Slab, Any]], *, write: bool
    ) -> list[int]:
        """Per-block result codes, in job order."""
        chunks, order = self.cut(jobs, write=write)
        flat = await run_chunks(pool, chunks)
        codes = [OK] * len(jobs)
        for pos, code in zip(order, flat, strict=True):
            codes[pos] = code
        return codes


async def run_chunks(pool: ThreadPoolExecutor | None, chunks: list[Chunk]) -> list[int]:
    """Run the chunks on ``pool``; the flattened per-block codes in order.

    Cancelled: chunks not started yet are dropped, the ones already running are
    waited for (so no byte lands after the caller moved on), then CancelledError.
    """
    if pool is None:
        raise RuntimeError("the disk store's thread pools are gone")
    loop = asyncio.get_running_loop()
    cfs = [pool.submit(fn) for fn in chunks]
    waiter = asyncio.gather(
        *(asyncio.wrap_future(cf, loop=loop) for cf in cfs), return_exceptions=True
    )
    try:
        results = await asyncio.shield(waiter)
    except asyncio.CancelledError:
        for cf in cfs:
            cf.cancel()
        while not waiter.done():
            try:
                await asyncio.wait([waiter])
            except asyncio.CancelledError:
                continue
        raise
    codes: list[int] = []
    for res in results:
        if isinstance(res, BaseException):
            raise res
        codes += res
    return codes
