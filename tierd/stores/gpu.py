"""The GPU pool: one ``[num_blocks, block_bytes]`` uint8 tensor on a CUDA device.

Copies run on two dedicated CUDA streams, one per direction, so loads and stores overlap
each other and the engine's compute. A batch of blocks costs a few calls, not one per
block: host buffers are packed into one staging tensor (pinned), moved in one copy, and
scattered into the pool with ``index_copy_`` (or one slice copy when the slots are
consecutive); reads gather with ``index_select`` the same way. Completion comes back to
the event loop through an :class:`~tierd.stores.cuda.EventWaiter` per stream: the loop
never blocks or polls.

``device="cpu"`` runs the same code without streams or events (for development and
tests); ``stats().details`` says so. Staging tensors come from torch's pinned allocator,
which caches them; they are per batch, so its power-of-two rounding costs little here.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

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
    tensor_memoryview,
)
from tierd.stores.cuda import EventWaiter, cuda_unavailable_reason

__all__ = ["GpuStore"]

_DEVICE_ERRORS = (torch.AcceleratorError, torch.OutOfMemoryError)


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
    ) -> None:
        super().__init__(num_blocks=num_blocks, block_bytes=block_bytes)
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"GpuStore needs a cuda or cpu device, got {self.device}")
        self.inline_limit = inline_limit
        self._counters = StoreCounters()
        self._pool = torch.empty((0, block_bytes), dtype=torch.uint8)
        self._h2d: _Lane | None = None
        self._d2h: _Lane | None = None
        self._in_flight = InFlight()  # copies under way

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
        try:
            pool = torch.zeros(
                (self.num_blocks, self.block_bytes), dtype=torch.uint8, device=self.device
            )
            torch.cuda.synchronize(self.device)
        except _DEVICE_ERRORS as exc:
            raise StoreIOError("cannot allocate the GPU pool", **self._where(errno.ENOMEM)) from exc
        index = self.device.index
        self._pool = pool
        self._h2d = _Lane(_new_stream(self.device), EventWaiter(f"tierd-h2d-{index}"))
        self._d2h = _Lane(_new_stream(self.device), EventWaiter(f"tierd-d2h-{index}"))

    async def _close(self) -> None:
        await self._in_flight.idle()  # copies still in flight finish first
        for lane in (self._h2d, self._d2h):
            if lane is not None:
                lane.waiter.close()
        self._h2d = self._d2h = None
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
        details: dict[str, Any] = {"device": str(self.device), "cuda": self._h2d is not None}
        if self.device.type == "cpu":
            details["reason"] = "device is cpu: copies run without CUDA streams"
        return self._counters.snapshot(self, details)

    # -- data ------------------------------------------------------------------------

    async def _write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        count = len(slots)
        src = block_batch(data, count, self.block_bytes, writable=False)
        if count == 0:
            return []
        nbytes = count * self.block_bytes
        with self._in_flight.tracked():
            try:
                launch = partial(self._launch_write, slots, src)
                pending = await run_copy(launch, nbytes, inline_limit=self.inline_limit)
                await self._finish(self._h2d, pending)
            except _DEVICE_ERRORS as exc:
                self._counters.write_errors += count
                raise StoreIOError(f"GPU write failed: {exc}", **self._where(None)) from exc
        self._counters.bytes_written += nbytes
        return [True] * count

    async def _read(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]:
        count = len(slots)
        dst = block_batch(out, count, self.block_bytes, writable=True)
        if count == 0:
            return []
        nbytes = count * self.block_bytes
        with self._in_flight.tracked():
            try:
                launch = partial(self._launch_read, slots, dst)
                pending = await run_copy(launch, nbytes, inline_limit=self.inline_limit)
                await self._finish(self._d2h, pending)
            except _DEVICE_ERRORS as exc:
                self._counters.read_errors += count
                raise StoreIOError(f"GPU read failed: {exc}", **self._where(None)) from exc
            if pending.staging is not None:
                unpack = partial(_unpack, pending.staging, dst)
                await run_copy(unpack, nbytes, inline_limit=self.inline_limit)
        self._counters.bytes_read += nbytes
        return [True] * count

    async def _finish(self, lane: _Lane | None, pending: _Pending) -> None:
        if lane is not None and pending.event is not None:
            await settle(lane.waiter.wait(pending.event))

    # -- launching (inline or on a worker thread) -----------------------------------

    def _launch_write(self, slots: Sequence[int], src: BlockBatch) -> _Pending:
        lane = self._h2d
        with self._on(lane, _touches_device(src)):
            host = self._pack(src, len(slots))
            block = host.to(self.device, non_blocking=True)
            start = slot_run_start(slots)
            if start is not None:
                self._pool[start : start + len(slots)].copy_(block, non_blocking=True)
            else:
                index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
                self._pool.index_copy_(0, index, block)
            return _Pending(_record(lane), (host, block))

    def _launch_read(self, slots: Sequence[int], dst: BlockBatch) -> _Pending:
        lane = self._d2h
        with self._on(lane, _touches_device(dst)):
            start = slot_run_start(slots)
            if start is not None:
                rows = self._pool[start : start + len(slots)]
            else:
                index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
                rows = self._pool.index_select(0, index)
            staging = None
            if isinstance(dst, torch.Tensor):
                dst.copy_(rows, non_blocking=True)
            elif dst and isinstance(dst[0], torch.Tensor):
                for target, row in zip(dst, rows, strict=True):
                    target.copy_(row, non_blocking=True)
            else:
                staging = self._staging(len(slots))
                staging.copy_(rows, non_blocking=True)
            return _Pending(_record(lane), (rows,), staging)

    def _on(
        self, lane: _Lane | None, device_tensors: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Run on ``lane``'s stream; wait for the current stream first when the caller's
        own device tensors take part (they may still be in the making there)."""
        if lane is None:
            return contextlib.nullcontext()
        if device_tensors:
            lane.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(lane.stream)

    def _pack(self, src: BlockBatch, count: int) -> torch.Tensor:
        """One ``[count, block_bytes]`` tensor holding the blocks to write."""
        if isinstance(src, torch.Tensor):
            return src
        if src and isinstance(src[0], torch.Tensor):
            return torch.stack([row.to(self.device, non_blocking=True) for row in src])
        staging = self._staging(count)
        flat, size = tensor_memoryview(staging), self.block_bytes
        for i, view in enumerate(cast(list[memoryview], src)):
            flat[i * size : (i + 1) * size] = view
        return staging

    def _staging(self, count: int) -> torch.Tensor:
        pinned = self.device.type == "cuda"
        return torch.empty((count, self.block_bytes), dtype=torch.uint8, pin_memory=pinned)


def _record(lane: _Lane | None) -> torch.cuda.Event | None:
    if lane is None:
        return None
    # blocking=True: the waiter thread sleeps in cudaEventSynchronize instead of spinning.
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(lane.stream)
    return event


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _touches_device(blocks: BlockBatch) -> bool:
    if isinstance(blocks, torch.Tensor):
        return blocks.device.type != "cpu"
    return any(isinstance(b, torch.Tensor) and b.device.type != "cpu" for b in blocks)


def _unpack(staging: torch.Tensor, dst: BlockBatch) -> None:
    """Copy a read's staging rows into the caller's host buffers."""
    flat, size = tensor_memoryview(staging), staging.shape[1]
    for i, view in enumerate(cast(list[memoryview], dst)):
        view[:] = flat[i * size : (i + 1) * size]
