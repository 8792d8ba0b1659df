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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from tierd.errors import SlotError, StoreClosed
from tierd.keys import BlockKey, Medium

__all__ = ["BlockStore", "Buffer", "StoreStats"]

# A block's bytes: anything exposing a contiguous buffer of exactly block_bytes
# (bytes, bytearray, memoryview, numpy array) or a uint8 torch tensor of block_bytes
# elements on any device.
Buffer = Any


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
