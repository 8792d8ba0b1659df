"""The GPU pool: one ``[num_blocks, block_bytes]`` uint8 tensor on a CUDA device.

Copies run on two dedicated CUDA streams, one per direction, so loads and stores overlap
each other and the engine's compute. Before each copy the lane's stream waits for the
caller's current stream, captured on the caller's thread (a batch launched from a worker
thread would otherwise wait on that thread's stream, not the caller's): bytes a caller's
kernel is still writing into a slot view are not copied early, and a released slot is not
overwritten under a kernel still reading it. Host tensors move straight into or out of
pool rows (one DMA per consecutive run, or per block): no device temporary. Host buffers
that are not tensors are packed into pinned staging of bounded size per launch (bigger
batches go in pieces: :mod:`tierd.stores.gpu_packing`). Completion comes back to the event
loop through an :class:`~tierd.stores.cuda.EventWaiter` per stream: the loop never blocks
or polls.

A copy from or to host memory that is not page-locked is synchronous in CUDA: such a
batch is never launched on the event loop (it goes to a worker thread), and
``stats().details["unpinned_copies"]`` counts them. A copy that was launched is always
waited for, even when its caller is cancelled meanwhile. A sticky CUDA error (an illegal
access, a lost device) or a copy that does not finish within ``copy_timeout_s`` marks the
store *lost*: every later operation fails at once with :class:`StoreIOError`, and
``close()`` no longer waits for the device.

Worker and event threads set the store's device first: a thread's first CUDA call would
otherwise make a context on GPU 0 whatever the configured device.

``device="cpu"`` runs the same code without streams or events (for development and
tests); ``stats().details`` says so. torch is the GPU extra's (``pip install
'tierd[gpu]'``): this module is imported only for a GPU tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierd.errors import StoreClosed, StoreIOError
from tierd.keys import BlockKey, Medium
from tierd.stores.base import (
    INLINE_COPY_BYTES,
    BlockBatch,
    BlockStore,
    Buffer,
    InFlight,
    StoreCounters,
    StoreStats,
    block_batch,
    run_copy,
    settle,
    slot_run_start,
)
from tierd.stores.cuda import EventWaiter, cuda_unavailable_reason
from tierd.stores.gpu_calls import DeviceLost, is_device_error, is_sticky
from tierd.stores.gpu_calls import bind as _bind
from tierd.stores.gpu_calls import current_stream as _current_stream
from tierd.stores.gpu_calls import device_scope as _device_scope
from tierd.stores.gpu_calls import host_pinned as _host_pinned
from tierd.stores.gpu_calls import set_device as _set_device
from tierd.stores.gpu_calls import stream_scope as _stream_scope
from tierd.stores.gpu_calls import within as _within
from tierd.stores.gpu_packing import new_staging, pack, pieces, tensor_if_array, unpack

__all__ = ["COPY_TIMEOUT_S", "DeviceLost", "GpuStore", "is_device_error", "is_sticky"]

# A copy not done after this long means a hung device: it is far beyond any batch's copy.
COPY_TIMEOUT_S = 60.0


@dataclass(slots=True)
class _Lane:
    """One copy direction: its stream and the thread that waits for its events."""

    stream: torch.cuda.Stream
    waiter: EventWaiter


@dataclass(slots=True)
class _Pending:
    """A launched copy: its completion event (``None`` when it ran synchronously) and the
    tensors that must outlive it."""

    event: torch.cuda.Event | None
    keep: tuple[Any, ...]
    staging: torch.Tensor | None = None


class GpuStore(BlockStore):
    """Slots as rows of one uint8 device tensor; ``view(slot)`` is the row.

    ``device``: ``"cuda:N"`` (``"cuda"`` means the current device) or ``"cpu"``.
    ``inline_limit``: batches above this many bytes are launched from a worker thread.
    """

    medium = Medium.GPU
    has_views = True

    def __init__(
        self,
        *,
        num_blocks: int,
        block_bytes: int,
        device: str | torch.device = "cuda:0",
        inline_limit: int = INLINE_COPY_BYTES,
        copy_timeout_s: float = COPY_TIMEOUT_S,
    ) -> None:
        super().__init__(num_blocks=num_blocks, block_bytes=block_bytes)
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"GpuStore needs a cuda or cpu device, got {self.device}")
        self.inline_limit = inline_limit
        self.copy_timeout_s = copy_timeout_s
        self._counters = StoreCounters()
        self._pool = torch.empty((0, block_bytes), dtype=torch.uint8)
        self._h2d: _Lane | None = None
        self._d2h: _Lane | None = None
        self._in_flight = InFlight()  # copies under way
        self._lost: str | None = None  # why the device is unusable, once it is
        self._unpinned_copies = 0

    # -- lifecycle -------------------------------------------------------------------

    async def _open(self) -> None:
        if self.device.type == "cpu":
            self._pool = torch.zeros((self.num_blocks, self.block_bytes), dtype=torch.uint8)
            return
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise StoreIOError(f"cannot open a GPU store: {reason}", **self._where(None))
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if (index := self.device.index) >= (count := torch.cuda.device_count()):
            message = f"no CUDA device {index}: {count} visible (cuda:0..cuda:{count - 1})"
            raise StoreIOError(message, **self._where(errno.ENODEV))
        try:
            pool = torch.zeros(
                (self.num_blocks, self.block_bytes), dtype=torch.uint8, device=self.device
            )
            torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError as exc:
            raise StoreIOError("cannot allocate the GPU pool", **self._where(errno.ENOMEM)) from exc
        except RuntimeError as exc:
            if not is_device_error(exc):
                raise
            raise StoreIOError(f"cannot open the GPU pool: {exc}", **self._where(None)) from exc
        self._pool = pool
        set_device = _set_device(index)
        self._h2d = _Lane(_new_stream(self.device), EventWaiter(f"tierd-h2d-{index}", set_device))
        self._d2h = _Lane(_new_stream(self.device), EventWaiter(f"tierd-d2h-{index}", set_device))

    async def _close(self) -> None:
        if self._lost is None:
            await self._in_flight.idle()  # copies still in flight finish first
        for lane in (self._h2d, self._d2h):
            if lane is not None:
                # A lost device may never finish an event: do not wait for the thread.
                lane.waiter.close(timeout=0 if self._lost else None)
        self._h2d = self._d2h = None
        if self._lost is None:  # else a DMA may still target the pool: keep it
            self._pool = torch.empty((0, self.block_bytes), dtype=torch.uint8)

    def _where(self, code: int | None) -> dict[str, Any]:
        return {"path": str(self.device), "errno": code, "medium": str(self.medium)}

    # -- views -----------------------------------------------------------------------

    def _view(self, slot: int) -> torch.Tensor:
        return self._pool[slot]

    def pool_tensor(self) -> torch.Tensor:
        """The whole pool, ``[num_blocks, block_bytes]`` on ``device``."""
        if not self.is_open:
            raise StoreClosed("GpuStore is not open")
        return self._pool

    def stats(self) -> StoreStats:
        details: dict[str, Any] = {
            "device": str(self.device),
            "cuda": self._h2d is not None,
            "unpinned_copies": self._unpinned_copies,
        }
        if self.device.type == "cpu":
            details["reason"] = "device is cpu: copies run without CUDA streams"
        if self._lost is not None:
            details["lost"] = self._lost
        return self._counters.snapshot(self, details)

    # -- data ------------------------------------------------------------------------

    async def _write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        count = len(slots)
        src = tensor_if_array(
            block_batch(data, count, self.block_bytes, writable=False, host_rows=True)
        )
        self._refuse_if_lost()
        if count == 0:
            return []
        for begin, end in pieces(src, count, self.block_bytes):
            part = src[begin:end]
            launch = self._launcher(self._launch_write, slots[begin:end], part)
            await self._copy(self._h2d, launch, part, (end - begin), write=True)
        self._counters.bytes_written += count * self.block_bytes
        return [True] * count

    async def _read(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]:
        count = len(slots)
        dst = tensor_if_array(
            block_batch(out, count, self.block_bytes, writable=True, host_rows=True)
        )
        self._refuse_if_lost()
        if count == 0:
            return []
        for begin, end in pieces(dst, count, self.block_bytes):
            part = dst[begin:end]
            launch = self._launcher(self._launch_read, slots[begin:end], part)
            pending = await self._copy(self._d2h, launch, part, end - begin, write=False)
            if pending.staging is not None:
                nbytes = (end - begin) * self.block_bytes
                copy = _bind(unpack, pending.staging, part)
                await run_copy(copy, nbytes, inline_limit=self.inline_limit)
        self._counters.bytes_read += count * self.block_bytes
        return [True] * count

    def _launcher(
        self, launch: Callable[..., _Pending], slots: Sequence[int], batch: BlockBatch
    ) -> Callable[[], _Pending]:
        """``launch(slots, batch, caller)`` bound to the caller's current stream, read here
        on the caller's thread (a worker thread's current stream is not the caller's)."""
        caller = _current_stream(self.device) if self._h2d is not None else None
        return _bind(launch, slots, batch, caller)

    async def _copy(
        self,
        lane: _Lane | None,
        launch: Callable[[], _Pending],
        batch: BlockBatch,
        count: int,
        *,
        write: bool,
    ) -> _Pending:
        """Launch (inline when small and pinned, else on a worker thread) and wait for the
        copy to finish, even through a cancellation: a launched DMA is always waited for."""
        nbytes = count * self.block_bytes
        inline = self.inline_limit
        if lane is not None and not _host_pinned(batch):
            self._unpinned_copies += 1
            inline = -1  # a copy with pageable memory blocks its thread: not the loop
        launched: list[_Pending] = []

        def run() -> _Pending:
            launched.append(pending := launch())
            return pending

        with self._in_flight.tracked():
            try:
                try:
                    pending = await run_copy(run, nbytes, inline_limit=inline)
                except asyncio.CancelledError:
                    if launched:  # the launch ended after the cancellation: wait for it
                        await self._finish(lane, launched[0])
                    raise
                await self._finish(lane, pending)
            except Exception as exc:
                self._fail(exc, count, write=write)
                raise
        return pending

    def _fail(self, exc: Exception, count: int, *, write: bool) -> None:
        if not is_device_error(exc) and not isinstance(exc, DeviceLost):
            return
        if write:
            self._counters.write_errors += count
        else:
            self._counters.read_errors += count
        if isinstance(exc, DeviceLost):
            return
        if is_sticky(exc) and self._lost is None:
            self._lost = f"a CUDA error left the device unusable: {exc}"
        kind = "write" if write else "read"
        raise StoreIOError(f"GPU {kind} failed: {exc}", **self._where(None)) from exc

    def _refuse_if_lost(self) -> None:
        if self._lost is not None:
            raise DeviceLost(f"the GPU store is lost ({self._lost})", **self._where(errno.EIO))

    async def _finish(self, lane: _Lane | None, pending: _Pending) -> None:
        if lane is None or pending.event is None:
            return
        done = lane.waiter.wait(pending.event)
        try:
            await settle(asyncio.ensure_future(_within(done, self.copy_timeout_s)))
        except TimeoutError as exc:
            self._lost = f"a copy did not finish within {self.copy_timeout_s:g} s"
            message = f"the GPU store is lost ({self._lost})"
            raise DeviceLost(message, **self._where(errno.EIO)) from exc

    # -- launching (inline or on a worker thread) -----------------------------------

    def _launch_write(
        self, slots: Sequence[int], src: BlockBatch, caller: torch.cuda.Stream | None
    ) -> _Pending:
        lane = self._h2d
        with self._on(lane, caller):
            if isinstance(src, list) and src and isinstance(src[0], torch.Tensor):
                rows = src
                for slot, row in zip(slots, rows, strict=True):  # one DMA per block
                    self._pool[slot].copy_(row, non_blocking=True)
                return _Pending(_record(lane), tuple(rows))
            host = pack(src, len(slots), self.block_bytes, self.device)
            start = slot_run_start(slots)
            if start is not None:  # straight into the rows: no device temporary
                self._pool[start : start + len(slots)].copy_(host, non_blocking=True)
                return _Pending(_record(lane), (host,))
            block = host.to(self.device, non_blocking=True)
            index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
            self._pool.index_copy_(0, index, block)
            return _Pending(_record(lane), (host, block, index))

    def _launch_read(
        self, slots: Sequence[int], dst: BlockBatch, caller: torch.cuda.Stream | None
    ) -> _Pending:
        lane = self._d2h
        with self._on(lane, caller):
            if isinstance(dst, list) and dst and isinstance(dst[0], torch.Tensor):
                targets = dst
                for slot, target in zip(slots, targets, strict=True):  # one DMA per block
                    target.copy_(self._pool[slot], non_blocking=True)
                return _Pending(_record(lane), tuple(targets))
            start = slot_run_start(slots)
            if start is not None:
                rows = self._pool[start : start + len(slots)]
            else:
                index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
                rows = self._pool.index_select(0, index)
            staging = None
            if isinstance(dst, torch.Tensor):
                dst.copy_(rows, non_blocking=True)
            else:
                staging = new_staging(len(slots), self.block_bytes, self.device)
                staging.copy_(rows, non_blocking=True)
            return _Pending(_record(lane), (rows,), staging)

    def _on(
        self, lane: _Lane | None, caller: torch.cuda.Stream | None
    ) -> contextlib.AbstractContextManager[Any]:
        """Run on ``lane``'s stream, on the store's device, after the caller's stream."""
        if lane is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(_device_scope(self.device))  # no context on GPU 0
        if caller is not None:
            lane.stream.wait_stream(caller)
        stack.enter_context(_stream_scope(lane.stream))
        return stack


def _record(lane: _Lane | None) -> torch.cuda.Event | None:
    if lane is None:
        return None
    # blocking=True: the waiter thread sleeps in cudaEventSynchronize instead of spinning.
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(lane.stream)
    return event


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
