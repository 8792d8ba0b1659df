"""Faults for tests, without mocks: :class:`FailingStore` wraps a real store and fails
chosen blocks (or holds copies at a gate); :func:`corrupt_disk_block` flips a disk store's
bytes on disk behind its back, as a bad sector would."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from tierd.keys import BlockKey
from tierd.stores.base import BlockStore, Buffer, StoreStats, block_batch

__all__ = ["FailingStore", "corrupt_disk_block"]


class FailingStore(BlockStore):
    """A wrapper that fails chosen blocks and can hold copies at a gate.

    Writes of keys in ``fail_writes`` report ``False`` and leave the slot unreadable
    until a later successful write; reads of keys in ``fail_reads`` (or of such slots)
    report ``False``. When ``gate`` is set to an ``asyncio.Event``, every write and read
    sets ``entered`` and then waits for the gate: a test holds copies in flight without
    sleeping.
    """

    def __init__(
        self,
        inner: BlockStore,
        *,
        fail_writes: Iterable[BlockKey] = (),
        fail_reads: Iterable[BlockKey] = (),
        gate: asyncio.Event | None = None,
    ) -> None:
        super().__init__(num_blocks=inner.num_blocks, block_bytes=inner.block_bytes)
        self.inner = inner
        self.medium = inner.medium
        self.has_views = inner.has_views
        self.fail_writes = set(fail_writes)
        self.fail_reads = set(fail_reads)
        self.gate = gate
        self.entered = asyncio.Event()
        self._poisoned: set[int] = set()
        self._write_failures = 0
        self._read_failures = 0

    async def _open(self) -> None:
        await self.inner.open()

    async def _close(self) -> None:
        await self.inner.close()

    def _view(self, slot: int) -> Buffer:
        return self.inner.view(slot)

    def stats(self) -> StoreStats:
        stats = self.inner.stats()
        return dataclasses.replace(
            stats,
            write_errors=stats.write_errors + self._write_failures,
            read_errors=stats.read_errors + self._read_failures,
        )

    async def _hold(self) -> None:
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()

    async def _write(self, slots: Sequence[int], keys: Sequence[BlockKey], data: Any) -> list[bool]:
        await self._hold()
        data = block_batch(data, len(slots), self.block_bytes, writable=False)
        ok = [key not in self.fail_writes for key in keys]
        await _pass_through(self.inner.write, ok, slots, keys, data)
        for slot, good in zip(slots, ok, strict=True):
            (self._poisoned.discard if good else self._poisoned.add)(slot)
        self._write_failures += ok.count(False)
        return ok

    async def _read(self, slots: Sequence[int], keys: Sequence[BlockKey], out: Any) -> list[bool]:
        await self._hold()
        out = block_batch(out, len(slots), self.block_bytes, writable=True)
        ok = [
            k not in self.fail_reads and s not in self._poisoned
            for s, k in zip(slots, keys, strict=True)
        ]
        await _pass_through(self.inner.read, ok, slots, keys, out)
        self._read_failures += ok.count(False)
        return ok


async def _pass_through(
    op: Callable[[list[int], list[BlockKey], list[Buffer]], Awaitable[list[bool]]],
    ok: list[bool],
    slots: Sequence[int],
    keys: Sequence[BlockKey],
    buffers: Sequence[Buffer],
) -> None:
    """Hand the blocks still ``ok`` to the inner store's ``op``; its answer for each goes
    into ``ok`` (the others stay failed)."""
    chosen = [i for i, good in enumerate(ok) if good]
    if chosen:
        result = await op(
            [slots[i] for i in chosen], [keys[i] for i in chosen], [buffers[i] for i in chosen]
        )
        for i, good in zip(chosen, result, strict=True):
            ok[i] = good


def corrupt_disk_block(store: BlockStore, slot: int, nbytes: int = 16) -> None:
    """Flip the first ``nbytes`` data bytes of ``slot`` in a disk store's slab file behind
    its back, as a bad sector would: the block's checksum no longer matches its bytes, so
    reading it must fail (never return the flipped bytes). The slab layout is the one
    :mod:`tierd.stores.disk.slab` describes: a superblock page, then per slot one header
    page followed by the data; slot ``s`` lives in file ``s % len(files)``."""
    import os

    from tierd.stores.disk.io import ALIGN
    from tierd.stores.disk.store import DiskStore

    if not isinstance(store, DiskStore):
        raise TypeError(f"not a disk store: {type(store).__name__}")
    details = store.stats().details
    files: list[str] = details["files"]
    offset = ALIGN + (slot // len(files)) * int(details["slot_bytes"]) + ALIGN
    with open(files[slot % len(files)], "r+b") as slab:
        slab.seek(offset)
        flipped = bytes(b ^ 0xFF for b in slab.read(nbytes))
        slab.seek(offset)
        slab.write(flipped)
        slab.flush()
        os.fsync(slab.fileno())
