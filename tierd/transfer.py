"""Copies of blocks between two stores, routed by (source medium, destination medium).

:class:`TransferEngine` owns three things: the route table (which handler moves bytes from
one medium to another), a byte budget per route (how many bytes may be in flight on it),
and a pinned staging area for the routes that need one (GPU <-> DISK). It never touches a
tier: the caller prepares slots, awaits :meth:`TransferEngine.copy`, and completes.

A handler moves a block with one store operation where the other store offers zero-copy
slot views (``disk.read`` into CPU views, ``gpu.write`` from CPU views: no staging copy),
else with two through staging. Guarantees:

- per-block success: a block counts as copied only when its read from the source and its
  write to the destination both succeeded;
- a batch larger than its route's budget is split into chunks; in-flight bytes per route
  never exceed the budget (a single block larger than the budget runs alone);
- cancelling the awaiting task waits for the store operation already started to finish
  (so no byte lands in a slot after the caller released it), starts no further one,
  returns the budget, then re-raises :class:`asyncio.CancelledError`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from tierd.errors import SlotError, TransferError
from tierd.keys import BlockKey, Medium
from tierd.stores.base import BlockStore, slot_run_start
from tierd.stores.memory import HostPoolStore

__all__ = ["ByteBudget", "RouteStats", "StagingFactory", "TransferEngine"]

Route = tuple[Medium, Medium]
# Builds an unopened CPU store of (num_blocks, block_bytes) whose views are the staging area.
StagingFactory = Callable[[int, int], BlockStore]

_T = TypeVar("_T")
_MiB = 1 << 20
# A cudaMemcpyAsync costs about 2 us: at or above 1 MiB per block, one DMA per block wastes
# little, below it the GPU store had better pack the blocks into one buffer first.
_DMA_BLOCK_BYTES = _MiB
_STAGING_SEGMENTS = 2
_RAM = (Medium.MEMORY, Medium.CPU)


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


class _RouteState:
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


class _Staging:
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
            yield _batch(self.store, range(first, first + count), dma=True)
        finally:
            self._free.put_nowait(first)


def _batch(store: BlockStore, slots: Sequence[int], *, dma: bool) -> Any | None:
    """Zero-copy buffers for ``slots`` of ``store``, in the cheapest form another store
    takes: one ``[n, block_bytes]`` tensor for a consecutive run of a host pool (one copy,
    one DMA), per-block tensors towards a GPU for big blocks (one DMA each, no packing),
    else per-slot views; ``None`` when the store has no views."""
    if not store.has_views:
        return None
    if isinstance(store, HostPoolStore) and store.stride == store.block_bytes:
        start = slot_run_start(slots)
        if start is not None:
            return store.pool_tensor()[start : start + len(slots)]
        if dma and store.block_bytes >= _DMA_BLOCK_BYTES:
            return [store.tensor_view(slot) for slot in slots]
    return [store.view(slot) for slot in slots]


def _default_staging(num_blocks: int, block_bytes: int) -> BlockStore:
    # Imported here: only the staged routes need a CPU pool.
    from tierd.stores.cpu import CpuStore

    return CpuStore(num_blocks=num_blocks, block_bytes=block_bytes)


_Handler = Callable[["TransferEngine", _Job], Awaitable[list[bool]]]


class TransferEngine:
    """Copies blocks between stores; see the module docstring for its guarantees.

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
            route: _RouteState(route, overrides.pop(route, budget_bytes)) for route in _ROUTES
        }
        if overrides:
            raise ValueError(f"budgets for routes without a handler: {sorted(overrides)}")
        self._staging_bytes = staging_bytes
        self._staging_factory = staging_factory or _default_staging
        self._staging: dict[int, _Staging] = {}
        self._staging_lock = asyncio.Lock()
        self._closed = False

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
        self._closed = True
        async with self._staging_lock:
            stagings, self._staging = list(self._staging.values()), {}
        for staging in stagings:
            await staging.store.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals -----------------------------------------------------------------

    def _state(self, src: Medium, dst: Medium) -> _RouteState:
        state = self._routes.get((src, dst))
        if state is None:
            supported = ", ".join(f"{s}->{d}" for s, d in _ROUTES)
            raise TransferError(f"no transfer route from {src} to {dst} (supported: {supported})")
        return state

    async def _run(self, state: _RouteState, handler: _Handler, job: _Job) -> list[bool]:
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

    async def _staging_for(self, block_bytes: int) -> _Staging:
        async with self._staging_lock:
            if self._closed:
                raise TransferError("the transfer engine is closed")
            staging = self._staging.get(block_bytes)
            if staging is None:
                per_segment = max(1, self._staging_bytes // block_bytes // _STAGING_SEGMENTS)
                factory = self._staging_factory(per_segment * _STAGING_SEGMENTS, block_bytes)
                store = await factory.open()
                staging = self._staging[block_bytes] = _Staging(store, _STAGING_SEGMENTS)
            return staging

    # -- handlers ------------------------------------------------------------------

    async def _dst_writes(self, job: _Job) -> list[bool]:
        """The destination writes from the source's slot buffers (RAM -> anything)."""
        bufs = _batch(job.src, job.src_slots, dma=job.dst.medium is Medium.GPU)
        if bufs is None:
            return await self._staged(job)
        return await _guarded(job.dst.write(job.dst_slots, job.keys, bufs))

    async def _src_reads(self, job: _Job) -> list[bool]:
        """The source reads into the destination's slot buffers (GPU/DISK -> RAM)."""
        bufs = _batch(job.dst, job.dst_slots, dma=job.src.medium is Medium.GPU)
        if bufs is None:
            return await self._staged(job)
        return await _guarded(job.src.read(job.src_slots, job.keys, bufs))

    async def _staged(self, job: _Job) -> list[bool]:
        """Source read into a staging segment, then destination write from it, chunked."""
        staging = await self._staging_for(job.src.block_bytes)
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
