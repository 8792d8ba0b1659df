"""Host-memory block pools: one buffer, slot ``s`` at byte ``s * stride``.

:class:`HostPoolStore` is the machinery shared by stores whose bytes sit in one host buffer
(a ``bytearray`` for :class:`MemoryStore`, a shared-memory mapping for
:class:`~tierd.stores.cpu.CpuStore`). Each slot holds ``block_bytes`` valid bytes at
``slot * stride``; ``stride >= block_bytes``. Slot views are zero-copy memoryviews
(:meth:`~BlockStore.view`) or uint8 tensors (:meth:`HostPoolStore.tensor_view`), and the
whole pool is a ``[num_blocks, stride]`` tensor (:meth:`HostPoolStore.pool_tensor`).

Copies use torch for tensor batches (``index_copy_`` / ``index_select``: one call per
batch, the GIL released) and memoryview slices for sequences of buffers; batches above
``inline_limit`` bytes run in a worker thread.

:class:`MemoryStore` is the plain in-process pool, and the fake every test may use.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import torch

from tierd.errors import SlotError, StoreClosed
from tierd.keys import BlockKey, Medium
from tierd.stores.base import (
    INLINE_COPY_BYTES,
    BlockBatch,
    BlockStore,
    Buffer,
    StoreCounters,
    StoreStats,
    block_batch,
    run_copy,
    slot_run_start,
)

__all__ = ["HostPoolStore", "MemoryStore"]

_NO_BYTES = memoryview(b"")


class HostPoolStore(BlockStore):
    """A store over one host buffer of ``num_blocks * stride`` bytes.

    Subclasses acquire the buffer in ``_open`` and hand it to :meth:`_attach`, and call
    :meth:`_detach` in ``_close``. Views handed out stay valid after close (they keep the
    buffer alive); they just no longer belong to a store.
    """

    has_views = True

    def __init__(
        self,
        *,
        num_blocks: int,
        block_bytes: int,
        stride: int | None = None,
        inline_limit: int = INLINE_COPY_BYTES,
    ) -> None:
        super().__init__(num_blocks=num_blocks, block_bytes=block_bytes)
        self.stride = block_bytes if stride is None else stride
        if self.stride < block_bytes:
            raise ValueError(f"stride {self.stride} is smaller than block_bytes {block_bytes}")
        self.inline_limit = inline_limit
        self._counters = StoreCounters()
        self._detach()

    # -- buffer ----------------------------------------------------------------------

    def _attach(self, buffer: Any) -> None:
        """Adopt ``buffer`` (writable, ``num_blocks * stride`` bytes) as the pool."""
        view = memoryview(buffer).cast("B")
        if view.readonly or view.nbytes != self.num_blocks * self.stride:
            raise ValueError("the pool buffer must be writable and num_blocks * stride bytes")
        self._mv = view
        # torch keeps a reference to ``view``, so the buffer stays exported (and mapped)
        # for as long as any tensor over it lives.
        self._pool = torch.frombuffer(view, dtype=torch.uint8).view(self.num_blocks, self.stride)
        self._rows = self._pool[:, : self.block_bytes]

    def _detach(self) -> None:
        """Drop the store's own references to the pool (views handed out keep theirs)."""
        self._mv = _NO_BYTES
        self._pool = torch.empty((0, self.stride), dtype=torch.uint8)
        self._rows = self._pool

    # -- views -----------------------------------------------------------------------

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in the pool (``slot * stride``)."""
        if not 0 <= slot < self.num_blocks:
            raise SlotError(f"slot {slot} out of range 0..{self.num_blocks - 1}")
        return slot * self.stride

    def _view(self, slot: int) -> memoryview:
        offset = slot * self.stride
        return self._mv[offset : offset + self.block_bytes]

    def tensor_view(self, slot: int) -> torch.Tensor:
        """The slot's ``block_bytes`` as a zero-copy uint8 tensor."""
        self._check((slot,), None)
        return self._rows[slot]

    def pool_tensor(self) -> torch.Tensor:
        """The whole pool as a zero-copy ``[num_blocks, stride]`` uint8 tensor."""
        if not self.is_open:
            raise StoreClosed(f"{type(self).__name__} is not open")
        return self._pool

    # -- data ------------------------------------------------------------------------

    async def _write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        count = len(slots)
        src = block_batch(data, count, self.block_bytes, writable=False)
        if count == 0:
            return []
        nbytes = count * self.block_bytes
        await run_copy(partial(self._copy_in, slots, src), nbytes, inline_limit=self.inline_limit)
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
        await run_copy(partial(self._copy_out, slots, dst), nbytes, inline_limit=self.inline_limit)
        self._counters.bytes_read += nbytes
        return [True] * count

    def _copy_in(self, slots: Sequence[int], src: BlockBatch) -> None:
        if isinstance(src, list) and src and isinstance(src[0], torch.Tensor):
            src = torch.stack([row.to("cpu") for row in src])  # device rows: one host batch
        if isinstance(src, torch.Tensor):
            start = slot_run_start(slots)
            if start is not None:
                self._rows[start : start + len(slots)].copy_(src)
            else:
                index = torch.tensor(slots, dtype=torch.long)
                self._rows.index_copy_(0, index, src.to("cpu"))
            return
        pool, stride, size = self._mv, self.stride, self.block_bytes
        for slot, view in zip(slots, cast(list[memoryview], src), strict=True):
            offset = slot * stride
            pool[offset : offset + size] = view

    def _copy_out(self, slots: Sequence[int], dst: BlockBatch) -> None:
        if isinstance(dst, torch.Tensor):
            self._gather(slots, dst)
        elif dst and isinstance(dst[0], torch.Tensor):
            rows = torch.empty((len(slots), self.block_bytes), dtype=torch.uint8)
            self._gather(slots, rows)
            for target, row in zip(dst, rows, strict=True):
                target.copy_(row)
        else:
            pool, stride, size = self._mv, self.stride, self.block_bytes
            for slot, view in zip(slots, cast(list[memoryview], dst), strict=True):
                offset = slot * stride
                view[:] = pool[offset : offset + size]

    def _gather(self, slots: Sequence[int], dst: torch.Tensor) -> None:
        start = slot_run_start(slots)
        if start is not None:
            dst.copy_(self._rows[start : start + len(slots)])
        elif dst.device.type == "cpu" and dst.is_contiguous():
            torch.index_select(self._rows, 0, torch.tensor(slots, dtype=torch.long), out=dst)
        else:
            dst.copy_(self._rows.index_select(0, torch.tensor(slots, dtype=torch.long)))


class MemoryStore(HostPoolStore):
    """Slots in one private ``bytearray``: no sharing, no pinning. The reference store
    and the fake for tests."""

    medium = Medium.MEMORY

    async def _open(self) -> None:
        self._attach(bytearray(self.num_blocks * self.stride))

    async def _close(self) -> None:
        self._detach()

    def stats(self) -> StoreStats:
        return self._counters.snapshot(self, {"stride": self.stride})
