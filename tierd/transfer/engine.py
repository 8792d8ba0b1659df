"""The transfer engine: its route table, the handlers that move a chunk of blocks on each
route, and :meth:`TransferEngine.copy`, which cuts a batch into chunks its route's budget
admits (the guarantees are in :mod:`tierd.transfer`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from tierd.errors import SlotError, TransferError
from tierd.keys import BlockKey, Medium
from tierd.stores.base import BlockStore
from tierd.transfer.budget import ByteBudget, Route, RouteState, RouteStats
from tierd.transfer.staging import StagingAreas, StagingFactory, dma_pieces, slot_buffers

__all__ = ["TransferEngine"]

_T = TypeVar("_T")
_MiB = 1 << 20
_RAM = (Medium.MEMORY, Medium.CPU)


async def _guarded(op: Awaitable[_T]) -> _T:
    """Await a store operation so that cancelling the caller cannot abandon it half-way.

    On cancellation the operation keeps running (shielded); this waits for it to finish,
    then re-raises the cancellation. Further cancellations while waiting are absorbed, as
    the first one is re-raised anyway.
    """
    task = asyncio.ensure_future(op)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller sees
        raise


@dataclass(frozen=True, slots=True)
class _Job:
    """One chunk of a copy: co-indexed slots and keys on both stores."""

    src: BlockStore
    src_slots: Sequence[int]
    dst: BlockStore
    dst_slots: Sequence[int]
    keys: Sequence[BlockKey]

    def part(self, start: int, stop: int) -> _Job:
        s = slice(start, stop)
        return _Job(self.src, self.src_slots[s], self.dst, self.dst_slots[s], self.keys[s])


_Handler = Callable[["TransferEngine", _Job], Awaitable[list[bool]]]


class TransferEngine:
    """Copies blocks between stores; see :mod:`tierd.transfer` for its guarantees.

    An async context manager: closing it releases the staging areas it allocated.
    ``budget_bytes`` applies to every route unless ``route_budgets`` names one;
    ``staging_bytes`` sizes the staging area per block size (at least one block).
    """

    def __init__(
        self,
        *,
        budget_bytes: int = 256 * _MiB,
        route_budgets: Mapping[Route, int] | None = None,
        staging_bytes: int = 64 * _MiB,
        staging_factory: StagingFactory | None = None,
    ) -> None:
        overrides = dict(route_budgets or {})
        self._routes = {
            route: RouteState(route, overrides.pop(route, budget_bytes)) for route in _ROUTES
        }
        if overrides:
            raise ValueError(f"budgets for routes without a handler: {sorted(overrides)}")
        self._staging = StagingAreas(staging_bytes, staging_factory)

    # -- public --------------------------------------------------------------------

    @staticmethod
    def routes() -> list[Route]:
        """The (source medium, destination medium) pairs this engine can copy."""
        return list(_ROUTES)

    def budget(self, src: Medium, dst: Medium) -> ByteBudget:
        return self._state(src, dst).budget

    def stats(self) -> dict[Route, RouteStats]:
        return {route: state.snapshot() for route, state in self._routes.items()}

    async def copy(
        self,
        src: BlockStore,
        src_slots: Sequence[int],
        dst: BlockStore,
        dst_slots: Sequence[int],
        keys: Sequence[BlockKey],
    ) -> list[bool]:
        """Copy ``src_slots`` of ``src`` to ``dst_slots`` of ``dst``; per-block success."""
        state = self._state(src.medium, dst.medium)
        job = _Job(src, src_slots, dst, dst_slots, keys)
        _check_batch(job)
        handler = _ROUTES[state.route]
        step = max(1, state.budget.capacity // src.block_bytes)
        results: list[bool] = []
        for start in range(0, len(keys), step):
            part = job.part(start, start + step)
            async with state.budget.hold(len(part.keys) * src.block_bytes):
                results.extend(await self._run(state, handler, part))
        return results

    async def close(self) -> None:
        """Release the staging areas; idempotent."""
        await self._staging.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals -----------------------------------------------------------------

    def _state(self, src: Medium, dst: Medium) -> RouteState:
        state = self._routes.get((src, dst))
        if state is None:
            supported = ", ".join(f"{s}->{d}" for s, d in _ROUTES)
            raise TransferError(f"no transfer route from {src} to {dst} (supported: {supported})")
        return state

    async def _run(self, state: RouteState, handler: _Handler, job: _Job) -> list[bool]:
        state.enter()
        ok: list[bool] = [False] * len(job.keys)
        try:
            ok = await handler(self, job)
            if len(ok) != len(job.keys):
                raise TransferError(
                    f"{state.route[0]}->{state.route[1]}: a store answered {len(ok)} "
                    f"results for {len(job.keys)} blocks"
                )
        finally:
            state.leave()
            done = sum(ok)
            state.blocks += done
            state.bytes += done * job.src.block_bytes
            state.failures += len(ok) - done
        return ok

    # -- handlers ------------------------------------------------------------------

    async def _dst_writes(self, job: _Job) -> list[bool]:
        """The destination writes from the source's slot buffers (RAM -> anything); towards
        a GPU, a piece per host registration the source's slots fall in."""
        dma = job.dst.medium is Medium.GPU
        pieces = dma_pieces(job.src, job.src_slots) if dma else [(0, len(job.keys))]
        results: list[bool] = []
        for start, stop in pieces:
            part = job.part(start, stop) if len(pieces) > 1 else job
            bufs = slot_buffers(part.src, part.src_slots, dma=dma)
            if bufs is None:
                return await self._staged(job)
            results += await _guarded(part.dst.write(part.dst_slots, part.keys, bufs))
        return results

    async def _src_reads(self, job: _Job) -> list[bool]:
        """The source reads into the destination's slot buffers (GPU/DISK -> RAM); from a
        GPU, a piece per host registration the destination's slots fall in."""
        dma = job.src.medium is Medium.GPU
        pieces = dma_pieces(job.dst, job.dst_slots) if dma else [(0, len(job.keys))]
        results: list[bool] = []
        for start, stop in pieces:
            part = job.part(start, stop) if len(pieces) > 1 else job
            bufs = slot_buffers(part.dst, part.dst_slots, dma=dma)
            if bufs is None:
                return await self._staged(job)
            results += await _guarded(part.src.read(part.src_slots, part.keys, bufs))
        return results

    async def _staged(self, job: _Job) -> list[bool]:
        """Source read into a staging segment, then destination write from it, chunked."""
        staging = await self._staging.get(job.src.block_bytes)
        results: list[bool] = []
        for start in range(0, len(job.keys), staging.blocks):
            part = job.part(start, start + staging.blocks)
            async with staging.lease(len(part.keys)) as bufs:
                results.extend(await _two_hops(part, bufs))
        return results


async def _two_hops(job: _Job, bufs: Any) -> list[bool]:
    read_ok = await _guarded(job.src.read(job.src_slots, job.keys, bufs))
    if all(read_ok):
        return await _guarded(job.dst.write(job.dst_slots, job.keys, bufs))
    idx = [i for i, ok in enumerate(read_ok) if ok]
    result = [False] * len(job.keys)
    if idx:
        slots = [job.dst_slots[i] for i in idx]
        keys = [job.keys[i] for i in idx]
        write_ok = await _guarded(job.dst.write(slots, keys, [bufs[i] for i in idx]))
        for i, ok in zip(idx, write_ok, strict=True):
            result[i] = ok
    return result


def _check_batch(job: _Job) -> None:
    counts = (len(job.src_slots), len(job.dst_slots), len(job.keys))
    if len(set(counts)) != 1:
        raise SlotError("{} source slots, {} destination slots and {} keys".format(*counts))
    src, dst = job.src, job.dst
    if src.block_bytes != dst.block_bytes:
        raise TransferError(
            f"block sizes differ: {src.medium} {src.block_bytes}, {dst.medium} {dst.block_bytes}"
        )


def _table() -> dict[Route, _Handler]:
    dst_writes, src_reads = TransferEngine._dst_writes, TransferEngine._src_reads
    table: dict[Route, _Handler] = {}
    for ram in _RAM:
        for other in _RAM:
            table[ram, other] = dst_writes  # the destination records its own write
        table[ram, Medium.GPU] = dst_writes
        table[Medium.GPU, ram] = src_reads
        table[ram, Medium.DISK] = dst_writes
        table[Medium.DISK, ram] = src_reads
    table[Medium.GPU, Medium.DISK] = TransferEngine._staged
    table[Medium.DISK, Medium.GPU] = TransferEngine._staged
    return table


_ROUTES: dict[Route, _Handler] = _table()
