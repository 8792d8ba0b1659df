"""The block-store seam: ``num_blocks`` fixed-size slots of ``block_bytes`` on one medium.

A store holds bytes and nothing else: which key lives in which slot is the tier's business.
The key still travels with every read and write so that a store that persists blocks (the
disk) can record it beside a checksum and refuse to return another block's bytes.

A store is an async resource::

    async with MemoryStore(num_blocks=64, block_bytes=4096) as store:
        ok = await store.write([3, 4], [k3, k4], [buf3, buf4])
        ok = await store.read([3, 4], [k3, k4], [out3, out4])

``write`` and ``read`` report success per block, co-indexed with ``slots``. A block whose
write failed is never readable: a later read of it fails rather than returning old or
partial bytes. A slot out of range or a buffer of the wrong size is a caller bug and raises
:class:`~tierd.errors.SlotError` before any byte moves; an OS failure that concerns the
whole store (directory gone, device lost) raises :class:`~tierd.errors.StoreIOError`.

This module owns that seam (:class:`BlockStore`, its counters and stats) and the copies a
store runs off the loop (:func:`settle`, :func:`run_copy`, :class:`InFlight`); what a batch's
bytes may be and how they are checked is :mod:`~tierd.stores.buffers`', whose names are
importable from here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar

from tierd.errors import SlotError, StoreClosed
from tierd.keys import BlockKey, Medium
from tierd.stores.buffers import (
    BlockBatch,
    Buffer,
    block_array,
    block_batch,
    block_tensor,
    block_views,
    device_rows,
    is_tensor,
    slot_run_start,
    tensor_memoryview,
)

__all__ = [
    "INLINE_COPY_BYTES",
    "BlockStore",
    "InFlight",
    "BlockBatch",
    "Buffer",
    "StoreCounters",
    "StoreStats",
    "block_array",
    "block_batch",
    "block_tensor",
    "background_priority",
    "block_views",
    "device_rows",
    "is_tensor",
    "run_copy",
    "settle",
    "slot_run_start",
    "tensor_memoryview",
]

T = TypeVar("T")

# The niceness of the daemon's threads of bulk work (region copies, disk writes) above
# its own: where the machine's cores are all busy, the event loop (every tenant's
# requests) is scheduled before them: one tenant's copies never take the loop's share of
# the cores from the other tenants' lookups.
BACKGROUND_NICENESS = 10


def background_priority() -> None:
    """Run the calling thread at :data:`BACKGROUND_NICENESS` (nothing where a thread's
    priority cannot be set: other platforms, or a lower limit)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)


# Copies up to this many bytes per batch run inline on the event loop; larger ones go to a
# worker thread. A thread hop costs tens of microseconds, a 1 MiB memcpy about as much.
INLINE_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What a store reports about itself; ``details`` holds medium-specific facts (for
    example ``{"pinned": False, "reason": "no CUDA"}`` or ``{"o_direct": True}``)."""

    medium: Medium
    num_blocks: int
    block_bytes: int
    bytes_written: int
    bytes_read: int
    write_errors: int
    read_errors: int
    details: dict[str, Any] = field(default_factory=dict)


class BlockStore(ABC):
    """Fixed-size slots on one medium; an async context manager.

    Subclasses implement ``_open``, ``_close``, ``_write`` and ``_read``; this class owns
    the open/closed state and argument validation, so every store rejects bad input the
    same way (checked by the conformance suite in :mod:`tierd.testing`).
    """

    medium: Medium
    # Whether ``view(slot)`` returns a zero-copy view (the conformance suite checks views
    # only where this is true); a class default that an instance may override.
    has_views: bool = False

    def __init__(self, *, num_blocks: int, block_bytes: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._is_open = False
        self._was_closed = False

    # -- lifecycle -------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._is_open

    async def open(self) -> Self:
        if self._was_closed:
            raise StoreClosed(f"{type(self).__name__} was closed and cannot be reopened")
        if not self._is_open:
            await self._open()
            self._is_open = True
        return self

    async def close(self) -> None:
        """Release the store's resources; closing twice is a no-op."""
        if self._is_open:
            self._is_open = False
            self._was_closed = True
            await self._close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- data ------------------------------------------------------------------------

    async def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        """Write one block per slot; ``data`` is a sequence of buffers or a tensor of
        shape ``[len(slots), block_bytes]``. Returns per-block success."""
        self._check(slots, keys)
        return await self._write(slots, keys, data)

    async def read(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]:
        """Read one block per slot into ``out`` (writable buffers or a tensor of shape
        ``[len(slots), block_bytes]``). Returns per-block success; a failed block's
        buffer holds unspecified bytes and must not be used."""
        self._check(slots, keys)
        return await self._read(slots, keys, out)

    def view(self, slot: int) -> Buffer:
        """A zero-copy view of one slot (memoryview or tensor) where the medium allows."""
        self._check((slot,), None)
        return self._view(slot)

    def invalidate(self, slots: Sequence[int]) -> None:
        """Forget what ``slots`` hold, also across a restart (a deleted block must not come
        back). Memory forgets with the process: only a persistent store overrides this."""
        self._check(slots, None)

    def _view(self, slot: int) -> Buffer:
        raise NotImplementedError(f"{type(self).__name__} has no zero-copy slot views")

    @abstractmethod
    def stats(self) -> StoreStats:
        """Counters and medium-specific facts."""

    @abstractmethod
    async def _open(self) -> None: ...

    @abstractmethod
    async def _close(self) -> None: ...

    @abstractmethod
    async def _write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]: ...

    @abstractmethod
    async def _read(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]: ...

    # -- validation ------------------------------------------------------------------

    def _check(self, slots: Sequence[int], keys: Sequence[BlockKey] | None) -> None:
        if not self._is_open:
            raise StoreClosed(f"{type(self).__name__} is not open")
        if keys is not None and len(keys) != len(slots):
            raise SlotError(f"{len(slots)} slots but {len(keys)} keys")
        limit = self.num_blocks
        for slot in slots:
            if not 0 <= slot < limit:
                raise SlotError(f"slot {slot} out of range 0..{limit - 1}")


@dataclass(slots=True)
class StoreCounters:
    """The mutable counters behind :class:`StoreStats`."""

    bytes_written: int = 0
    bytes_read: int = 0
    write_errors: int = 0
    read_errors: int = 0

    def snapshot(self, store: BlockStore, details: dict[str, Any]) -> StoreStats:
        return StoreStats(
            medium=store.medium,
            num_blocks=store.num_blocks,
            block_bytes=store.block_bytes,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
            write_errors=self.write_errors,
            read_errors=self.read_errors,
            details=details,
        )


# -- copies off the loop ---------------------------------------------------------------


async def settle(future: asyncio.Future[T], on_cancel: Callable[[], None] | None = None) -> T:
    """Await ``future`` to its end even if the caller is cancelled meanwhile.

    A copy that already started keeps going when its awaiter is cancelled; returning early
    would let bytes land in a slot after the caller moved on. So a cancellation is held
    until the future is done, then re-raised. ``on_cancel`` is called at the first one
    (to ask the work to stop early, where it can).
    """
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.wait((future,))
        except asyncio.CancelledError as exc:
            if cancelled is None and on_cancel is not None:
                on_cancel()
            cancelled = exc
    if cancelled is not None:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller sees
        raise cancelled
    return future.result()


async def run_copy(fn: Callable[[], T], nbytes: int, *, inline_limit: int = INLINE_COPY_BYTES) -> T:
    """Run a synchronous copy of ``nbytes``: inline when small, else in the default
    executor (torch copies release the GIL), waiting for it even through cancellation."""
    if nbytes <= inline_limit:
        return fn()
    return await settle(asyncio.get_running_loop().run_in_executor(None, fn))


class InFlight:
    """Operations under way: ``with in_flight.tracked():`` around each; ``await
    in_flight.idle()`` returns once none is (a store closing waits for its copies)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def tracked(self) -> Iterator[None]:
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if not self.count:
                self._idle.set()

    async def idle(self) -> None:
        await self._idle.wait()
