"""Host-memory block pools: one buffer, slot ``s`` at byte ``s * stride``.

:class:`HostPoolStore` is the machinery shared by stores whose bytes sit in one host buffer
(a ``bytearray`` for :class:`MemoryStore`, a shared-memory mapping for
:class:`~tierd.stores.cpu.CpuStore`). Each slot holds ``block_bytes`` valid bytes at
``slot * stride``; ``stride >= block_bytes``. Slot views are zero-copy memoryviews
(:meth:`~BlockStore.view`) or, for callers that have torch, uint8 tensors
(:meth:`HostPoolStore.tensor_view`; the whole pool is a ``[num_blocks, stride]`` tensor,
:meth:`HostPoolStore.pool_tensor`).

The pool is a numpy array: torch is the GPU extra's, and a host pool must work without it.
Tensor batches (only a caller that imported torch can hand one in) become numpy arrays
without a copy, then move with one numpy call per batch (a slice, a fancy-index store or
``take``: the GIL released); sequences of buffers move by memoryview slices. Batches above
``inline_limit`` bytes run in a worker thread.

:class:`MemoryStore` is the plain in-process pool, and the fake every test may use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

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
    is_tensor,
    run_copy,
    slot_run_start,
)
from tierd.stores.buffers import PoolRows

if TYPE_CHECKING:
    import torch

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
        # The array (and every tensor made from it) keeps a reference to ``view``, so the
        # buffer stays exported (and mapped) for as long as any of them lives.
        flat = np.frombuffer(view, dtype=np.uint8)
        self._pool = flat.reshape(self.num_blocks, self.stride)
        self._rows = self._pool[:, : self.block_bytes]
        self._tensor: torch.Tensor | None = None
        self._row_tensor: torch.Tensor | None = None

    def _detach(self) -> None:
        """Drop the store's own references to the pool (views handed out keep theirs)."""
        self._mv = _NO_BYTES
        self._pool = np.empty((0, self.stride), dtype=np.uint8)
        self._rows = self._pool
        self._tensor = None
        self._row_tensor = None

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
        """The slot's ``block_bytes`` as a zero-copy uint8 tensor (needs torch)."""
        row: torch.Tensor = self.slot_tensors((slot,))[0]
        return row

    def slot_tensors(self, slots: Sequence[int]) -> PoolRows:
        """The ``block_bytes`` of each of ``slots`` as zero-copy uint8 tensors, checked
        once for the batch rather than per slot (a copy per block to or from a GPU takes
        these)."""
        self._check(slots, None)
        if self._row_tensor is None:
            self._row_tensor = self.pool_tensor()[:, : self.block_bytes]
        rows = self._row_tensor  # a view per row is made per call, not kept: 650 bytes each
        return PoolRows([rows[slot] for slot in slots], self.block_bytes)

    def pool_tensor(self) -> torch.Tensor:
        """The whole pool as a zero-copy ``[num_blocks, stride]`` uint8 tensor (needs
        torch: only GPU routes and callers that use tensors ask)."""
        if not self.is_open:
            raise StoreClosed(f"{type(self).__name__} is not open")
        if self._tensor is None:
            import torch  # the GPU extra's; its callers have it loaded already

            self._tensor = torch.from_numpy(self._pool)
        return self._tensor

    def pool_array(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The whole pool as a zero-copy ``[num_blocks, stride]`` uint8 numpy array."""
        if not self.is_open:
            raise StoreClosed(f"{type(self).__name__} is not open")
        return self._pool

    # -- data ------------------------------------------------------------------------

    async def _write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        self._counters.bytes_written += await self._copy(self._copy_in, slots, data, False)
        return [True] * len(slots)

    async def _read(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]:
        self._counters.bytes_read += await self._copy(self._copy_out, slots, out, True)
        return [True] * len(slots)

    async def _copy(
        self,
        copy: Callable[[Sequence[int], BlockBatch], None],
        slots: Sequence[int],
        blocks: Sequence[Buffer] | Any,
        writable: bool,
    ) -> int:
        """Copy ``blocks`` to or from ``slots`` with ``copy`` (inline or on a thread, by
        size); the bytes copied. ``writable``: the blocks are written (a read)."""
        count = len(slots)
        batch = block_batch(blocks, count, self.block_bytes, writable=writable)
        if count == 0:
            return 0
        nbytes = count * self.block_bytes
        await run_copy(partial(copy, slots, batch), nbytes, inline_limit=self.inline_limit)
        return nbytes

    def _copy_in(self, slots: Sequence[int], src: BlockBatch) -> None:
        if isinstance(src, list) and src and is_tensor(src[0]):
            rows = cast("list[torch.Tensor]", src)  # device rows: one host batch
            src = rows[0].new_empty((len(rows), self.block_bytes), device="cpu")
            for i, row in enumerate(rows):
                src[i].copy_(row)
        if is_tensor(src) or isinstance(src, np.ndarray):
            array = src if isinstance(src, np.ndarray) else _host_array(cast("torch.Tensor", src))
            start = slot_run_start(slots)
            if start is not None:
                self._rows[start : start + len(slots)] = array
            else:
                self._rows[np.asarray(slots, dtype=np.intp)] = array
            return
        pool, stride, size = self._mv, self.stride, self.block_bytes
        for slot, view in zip(slots, cast(list[memoryview], src), strict=True):
            offset = slot * stride
            pool[offset : offset + size] = view

    def _copy_out(self, slots: Sequence[int], dst: BlockBatch) -> None:
        if isinstance(dst, np.ndarray):
            self._gather(slots, dst)
        elif is_tensor(dst):
            tensor = cast("torch.Tensor", dst)
            if tensor.device.type == "cpu":
                self._gather(slots, tensor.numpy())
            else:
                tensor.copy_(_from_numpy(self._gathered(slots)))
        elif dst and is_tensor(dst[0]):
            rows = self._gathered(slots)
            for target, row in zip(cast("list[torch.Tensor]", dst), rows, strict=True):
                target.copy_(_from_numpy(row))
        else:
            pool, stride, size = self._mv, self.stride, self.block_bytes
            for slot, view in zip(slots, cast(list[memoryview], dst), strict=True):
                offset = slot * stride
                view[:] = pool[offset : offset + size]

    def _gathered(self, slots: Sequence[int]) -> np.ndarray[Any, np.dtype[np.uint8]]:
        out = np.empty((len(slots), self.block_bytes), dtype=np.uint8)
        self._gather(slots, out)
        return out

    def _gather(self, slots: Sequence[int], out: np.ndarray[Any, Any]) -> None:
        start = slot_run_start(slots)
        if start is not None:
            out[...] = self._rows[start : start + len(slots)]
        elif out.flags.c_contiguous:
            # mode="clip": slots are checked already, and "raise" would buffer the output.
            np.take(self._rows, np.asarray(slots, dtype=np.intp), axis=0, out=out, mode="clip")
        else:
            out[...] = self._rows[np.asarray(slots, dtype=np.intp)]


def _host_array(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A host tensor's numpy view (no copy); a device tensor is copied to the host first."""
    return tensor.detach().to("cpu").numpy()


def _from_numpy(array: np.ndarray[Any, Any]) -> torch.Tensor:
    import torch  # only reached with a tensor in hand: torch is loaded

    return torch.from_numpy(array)


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
