"""Test kit shipped with tierd: the block-store conformance suite and store fakes.

Every :class:`~tierd.stores.BlockStore` must pass :class:`StoreConformance`. A test module
subclasses it and says how to build an *unopened* store::

    class TestMemoryStore(StoreConformance):
        async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
            return MemoryStore(num_blocks=num_blocks, block_bytes=block_bytes)

View checks run only where ``store.has_views`` is true. :class:`FailingStore` wraps a
real store and fails chosen blocks (or holds copies at a gate) for tier and chain tests.
:func:`running_daemon` runs a whole daemon inside the test's event loop, on a real
socket (:func:`daemon_config` builds a small cpu + disk config for it).
This module imports pytest: it is for tests only.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import random
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tierd.errors import SlotError, StoreClosed
from tierd.keys import BlockKey, int_key
from tierd.stores.base import BlockStore, Buffer, StoreStats, block_batch, tensor_memoryview

if TYPE_CHECKING:
    from tierd.daemon import Daemon

__all__ = [
    "FailingStore",
    "StoreConformance",
    "as_bytes",
    "daemon_config",
    "keys_for",
    "random_blocks",
    "running_daemon",
    "short_socket_path",
]


def short_socket_path() -> str:
    """A fresh socket path under /tmp: pytest's tmp_path can exceed the 107-byte limit
    of a Unix socket path. The directory is removed when the process exits."""
    directory = tempfile.mkdtemp(prefix="tierd-", dir="/tmp")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return str(Path(directory) / "tierd.sock")


def daemon_config(
    tmp_path: Path,
    *,
    cpu_blocks: int = 8,
    disk_blocks: int | None = 64,
    block_bytes: int = 4096,
    socket_path: str | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """A small daemon config: a cpu tier over an optional disk tier in ``tmp_path``."""
    tiers: list[dict[str, Any]] = [{"name": "cpu", "kind": "cpu", "capacity": cpu_blocks}]
    if disk_blocks is not None:
        directory = tmp_path / "disk"
        directory.mkdir(mode=0o700, exist_ok=True)
        tiers.append(
            {
                "name": "disk",
                "kind": "disk",
                "capacity": disk_blocks,
                "directories": [str(directory)],
            }
        )
    socket = {"path": socket_path or short_socket_path(), **sections.pop("socket", {})}
    # A test tier of a few blocks is often filled by one lease: the default bounds on
    # leases (a share of the entry tier) are tested where they are meant.
    limits = {**_WHOLE_TIER_LEASES, **sections.pop("limits", {})}
    return {
        "block_bytes": block_bytes,
        "tiers": tiers,
        "socket": socket,
        "limits": limits,
        **sections,
    }


_WHOLE_TIER_LEASES = {"lease_blocks_per_connection": "100%", "lease_blocks_per_tenant": "100%"}


@asynccontextmanager
async def running_daemon(config: Any) -> AsyncIterator[Daemon]:
    """Run a daemon (config: a ``DaemonConfig`` or a mapping) in this event loop until
    the block exits, then stop it as SIGTERM would and check it exited 0."""
    from tierd.config import DaemonConfig
    from tierd.daemon import Daemon

    cfg = config if isinstance(config, DaemonConfig) else DaemonConfig.model_validate(config)
    daemon = Daemon(cfg, handle_signals=False)
    task = asyncio.create_task(daemon.run())
    ready = asyncio.create_task(daemon.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        await task  # raises why it could not start
        raise RuntimeError("the daemon exited before it was ready")
    try:
        yield daemon
    finally:
        daemon.request_stop()
        status = await task
    if status != 0:
        raise RuntimeError(f"the daemon exited with status {status}")


def as_bytes(buf: Any) -> bytes:
    """The bytes of a buffer or a tensor on any device."""
    if isinstance(buf, torch.Tensor):
        flat = buf.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        return bytes(tensor_memoryview(flat))
    return bytes(memoryview(buf).cast("B"))


def keys_for(slots: Iterable[int]) -> list[BlockKey]:
    return [int_key(slot) for slot in slots]


def random_blocks(rng: random.Random, count: int, block_bytes: int) -> list[bytes]:
    return [rng.randbytes(block_bytes) for _ in range(count)]


class StoreConformance:
    """The contract every block store keeps; subclass it and implement :meth:`make_store`."""

    num_blocks = 16
    block_bytes = 1536
    # A batch above the 1 MiB inline limit, to run the worker-thread path.
    large_num_blocks = 24
    large_block_bytes = 1 << 16

    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        raise NotImplementedError("subclasses build the store under test")

    @pytest.fixture
    async def store(self) -> AsyncIterator[BlockStore]:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        async with store:
            yield store

    async def read_back(self, store: BlockStore, slots: Sequence[int]) -> list[bytes]:
        out = [bytearray(store.block_bytes) for _ in slots]
        assert await store.read(slots, keys_for(slots), out) == [True] * len(slots)
        return [bytes(b) for b in out]

    # -- round trips -----------------------------------------------------------------

    async def test_write_then_read_back(self, store: BlockStore) -> None:
        rng = random.Random(1)
        slots = [0, 5, store.num_blocks - 1]
        data = random_blocks(rng, len(slots), store.block_bytes)
        assert await store.write(slots, keys_for(slots), data) == [True] * 3
        assert await self.read_back(store, slots) == data

    async def test_random_batches_match_reference(self, store: BlockStore) -> None:
        rng = random.Random(2)
        reference: dict[int, bytes] = {}
        for _ in range(12):
            slots = rng.sample(range(store.num_blocks), rng.randint(1, store.num_blocks))
            data = random_blocks(rng, len(slots), store.block_bytes)
            assert await store.write(slots, keys_for(slots), data) == [True] * len(slots)
            reference.update(zip(slots, data, strict=True))
            check = rng.sample(sorted(reference), rng.randint(1, len(reference)))
            assert await self.read_back(store, check) == [reference[s] for s in check]

    async def test_consecutive_and_reversed_slots(self, store: BlockStore) -> None:
        rng = random.Random(3)
        slots = list(range(2, 9))
        data = random_blocks(rng, len(slots), store.block_bytes)
        await store.write(slots, keys_for(slots), data)
        assert await self.read_back(store, slots[::-1]) == data[::-1]

    async def test_tensor_batches(self, store: BlockStore) -> None:
        gen = torch.Generator().manual_seed(4)
        slots = [7, 1, 4]
        shape = (len(slots), store.block_bytes)
        src = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        assert await store.write(slots, keys_for(slots), src) == [True] * 3
        out = torch.zeros(shape, dtype=torch.uint8)
        assert await store.read(slots, keys_for(slots), out) == [True] * 3
        assert torch.equal(out, src)
        assert await self.read_back(store, slots) == [as_bytes(row) for row in src]
        rows = [torch.zeros(store.block_bytes, dtype=torch.uint8) for _ in slots]
        await store.read(slots, keys_for(slots), rows)
        assert torch.equal(torch.stack(rows), src)

    async def test_large_batch_round_trip(self) -> None:
        rng = random.Random(5)
        store = await self.make_store(self.large_num_blocks, self.large_block_bytes)
        async with store:
            slots = list(range(store.num_blocks))[::-1]
            data = random_blocks(rng, len(slots), store.block_bytes)
            assert await store.write(slots, keys_for(slots), data) == [True] * len(slots)
            assert await self.read_back(store, slots) == data

    async def test_concurrent_batches(self, store: BlockStore) -> None:
        rng = random.Random(6)
        groups = [list(range(i, store.num_blocks, 4)) for i in range(4)]
        datas = [random_blocks(rng, len(g), store.block_bytes) for g in groups]
        writes = [store.write(g, keys_for(g), d) for g, d in zip(groups, datas, strict=True)]
        assert all(all(ok) for ok in await asyncio.gather(*writes))
        for group, data in zip(groups, datas, strict=True):
            assert await self.read_back(store, group) == data

    async def test_empty_batch(self, store: BlockStore) -> None:
        assert await store.write([], [], []) == []
        assert await store.read([], [], []) == []

    async def test_stats_count_bytes(self, store: BlockStore) -> None:
        before = store.stats()
        await store.write(
            [1, 2], keys_for([1, 2]), random_blocks(random.Random(7), 2, store.block_bytes)
        )
        await self.read_back(store, [2])
        after = store.stats()
        assert after.medium == store.medium
        assert (after.num_blocks, after.block_bytes) == (store.num_blocks, store.block_bytes)
        assert after.bytes_written - before.bytes_written == 2 * store.block_bytes
        assert after.bytes_read - before.bytes_read == store.block_bytes
        assert isinstance(after.details, dict)

    # -- views -----------------------------------------------------------------------

    async def test_view_reflects_writes(self, store: BlockStore) -> None:
        if not store.has_views:
            pytest.skip(f"{type(store).__name__} has no zero-copy views")
        rng = random.Random(8)
        view = store.view(3)  # taken before the write: a view, not a copy
        data = random_blocks(rng, 1, store.block_bytes)
        await store.write([3], keys_for([3]), data)
        assert as_bytes(view) == data[0]
        assert as_bytes(store.view(3)) == data[0]
        assert len(as_bytes(view)) == store.block_bytes

    # -- bad input -------------------------------------------------------------------

    async def test_out_of_range_slot(self, store: BlockStore) -> None:
        buf = [bytes(store.block_bytes)]
        for slot in (-1, store.num_blocks):
            with pytest.raises(SlotError):
                await store.write([slot], keys_for([0]), buf)
            with pytest.raises(SlotError):
                await store.read([slot], keys_for([0]), [bytearray(store.block_bytes)])
            with pytest.raises(SlotError):
                store.view(slot)

    async def test_keys_slots_length_mismatch(self, store: BlockStore) -> None:
        with pytest.raises(SlotError):
            await store.write([0, 1], keys_for([0]), [bytes(store.block_bytes)] * 2)
        with pytest.raises(SlotError):
            await store.read([0], keys_for([0, 1]), [bytearray(store.block_bytes)])

    async def test_bad_write_buffers_change_nothing(self, store: BlockStore) -> None:
        size = store.block_bytes
        original = random_blocks(random.Random(9), 2, size)
        await store.write([0, 1], keys_for([0, 1]), original)
        fresh = bytes([0xAB]) * size
        bad_batches: list[Any] = [
            [fresh, bytes(size - 1)],  # short
            [fresh, bytes(size + 1)],  # long
            [fresh],  # too few buffers
            [fresh, 12345],  # not a buffer
            torch.zeros((2, size // 4), dtype=torch.float32),  # wrong dtype
            torch.zeros((2, size + 1), dtype=torch.uint8),  # wrong shape
            torch.zeros((3, size), dtype=torch.uint8),  # wrong count
        ]
        for batch in bad_batches:
            with pytest.raises(SlotError):
                await store.write([0, 1], keys_for([0, 1]), batch)
        assert await self.read_back(store, [0, 1]) == original

    async def test_bad_read_buffers_raise(self, store: BlockStore) -> None:
        size = store.block_bytes
        for out in (
            [bytearray(size - 1)],
            [bytes(size)],
            torch.zeros((1, size), dtype=torch.int16),
        ):
            with pytest.raises(SlotError):
                await store.read([0], keys_for([0]), out)

    # -- lifecycle -------------------------------------------------------------------

    async def test_close_twice(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        await store.open()
        await store.close()
        await store.close()
        assert not store.is_open

    async def test_use_after_close(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        async with store:
            pass
        with pytest.raises(StoreClosed):
            await store.write([0], keys_for([0]), [bytes(store.block_bytes)])
        with pytest.raises(StoreClosed):
            await store.read([0], keys_for([0]), [bytearray(store.block_bytes)])
        with pytest.raises(StoreClosed):
            store.view(0)

    async def test_open_after_close(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        async with store:
            pass
        with pytest.raises(StoreClosed):
            await store.open()

    async def test_not_opened(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        with pytest.raises(StoreClosed):
            await store.write([0], keys_for([0]), [bytes(store.block_bytes)])
        await store.close()  # closing a never-opened store is harmless

    async def test_cancelled_large_write_leaves_store_usable(self) -> None:
        rng = random.Random(10)
        store = await self.make_store(self.large_num_blocks, self.large_block_bytes)
        async with store:
            slots = list(range(store.num_blocks))
            task = asyncio.ensure_future(
                store.write(
                    slots, keys_for(slots), random_blocks(rng, len(slots), store.block_bytes)
                )
            )
            await asyncio.sleep(0)  # let the write start
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            data = random_blocks(rng, len(slots), store.block_bytes)
            await store.write(slots, keys_for(slots), data)
            assert await self.read_back(store, slots) == data


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
        chosen = [i for i, good in enumerate(ok) if good]
        if chosen:
            result = await self.inner.write(
                [slots[i] for i in chosen], [keys[i] for i in chosen], [data[i] for i in chosen]
            )
            for i, good in zip(chosen, result, strict=True):
                ok[i] = good
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
        chosen = [i for i, good in enumerate(ok) if good]
        if chosen:
            result = await self.inner.read(
                [slots[i] for i in chosen], [keys[i] for i in chosen], [out[i] for i in chosen]
            )
            for i, good in zip(chosen, result, strict=True):
                ok[i] = good
        self._read_failures += ok.count(False)
        return ok


def corrupt_disk_block(store: BlockStore, slot: int, nbytes: int = 16) -> None:
    """Flip the first ``nbytes`` data bytes of ``slot`` in a disk store's slab file behind
    its back, as a bad sector would: the block's checksum no longer matches its bytes, so
    reading it must fail (never return the flipped bytes). The slab layout is the one
    :mod:`tierd.stores.disk_slab` describes: a superblock page, then per slot one header
    page followed by the data; slot ``s`` lives in file ``s % len(files)``."""
    import os

    from tierd.stores.disk import DiskStore
    from tierd.stores.fileio import ALIGN

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
