"""The chain under failing stores: a failed copy loses a block, never serves wrong bytes.

Faults come from three places: the disk store's file-I/O layer (a :class:`FileIO` subclass
that fails block reads or writes with a chosen errno), :class:`tierd.testing.FailingStore`
(fails chosen keys, or holds copies at a gate), and bytes corrupted in the slab file on
disk. Chains that need an injected store are built the way :mod:`tierd.library` builds
them; the others go through ``tierd.open``.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import tierd
from tierd.chain import Level, TierChain
from tierd.errors import BlockMissing, StoreIOError
from tierd.keys import BlockKey, int_key
from tierd.stores import BlockStore
from tierd.stores.cpu import CpuStore
from tierd.stores.disk.io import ALIGN, FileIO
from tierd.stores.disk.store import DiskStore
from tierd.stores.memory import MemoryStore
from tierd.testing import FailingStore, as_bytes
from tierd.tier import Tier
from tierd.transfer import TransferEngine

BLOCK = 4096


def content(key: BlockKey) -> bytes:
    """Deterministic bytes for a key, different for every key."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def keys_of(*ids: int) -> list[BlockKey]:
    return [int_key(i) for i in ids]


async def store_all(chain: TierChain, keys: list[BlockKey]) -> list[BlockKey]:
    return await chain.store(keys, [content(k) for k in keys])


async def read_back(chain: TierChain, keys: list[BlockKey]) -> None:
    """Load ``keys`` into the entry level (all must load) and check every byte."""
    async with chain.loading(keys) as handle:
        assert handle.keys == keys
        if handle.store.has_views:
            got = [as_bytes(v) for v in handle.views()]
        else:
            out = [bytearray(BLOCK) for _ in keys]
            assert await handle.read_into(out) == [True] * len(keys)
            got = [bytes(b) for b in out]
        assert got == [content(k) for k in keys]


class FaultyIO(FileIO):
    """Fails block writes and/or block reads (a ``pwritev``/``preadv`` of a header page
    plus data, per block) with ``errno`` while armed; superblock, probe and journal I/O
    pass through, so the store opens and closes normally."""

    def __init__(self, code: int = errno.EIO) -> None:
        self.code = code
        self.fail_writes = False
        self.fail_reads = False
        self.failed_writes = 0
        self.failed_reads = 0

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.fail_writes and len(buffers) >= 2:  # a block write (one or adjacent ones)
            self.failed_writes += 1
            raise OSError(self.code, os.strerror(self.code))
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.fail_reads and len(buffers) >= 2:  # a block read (one or adjacent ones)
            self.failed_reads += 1
            raise OSError(self.code, os.strerror(self.code))
        return super().preadv(fd, buffers, offset)


def disk_store(path: Path, num_blocks: int, fileio: FileIO | None = None) -> DiskStore:
    path.mkdir(parents=True, exist_ok=True)
    return DiskStore(
        num_blocks=num_blocks, block_bytes=BLOCK, directories=[str(path)], fileio=fileio
    )


@asynccontextmanager
async def direct_chain(*stores: BlockStore, policy: str = "lru") -> AsyncIterator[TierChain]:
    """A chain over unopened stores, fastest first, built as tierd.library does."""
    async with AsyncExitStack() as stack:
        levels = []
        for i, store in enumerate(stores):
            await stack.enter_async_context(store)
            name = f"{str(store.medium).lower()}{i}"
            levels.append(
                Level(Tier(store.num_blocks, policy, name=name, medium=store.medium), store)
            )
        engine = await stack.enter_async_context(TransferEngine(budget_bytes=1 << 20))
        yield TierChain(levels, engine)


def config(tmp_path: Path, *tiers: dict[str, Any]) -> dict[str, Any]:
    specs = []
    for i, spec in enumerate(tiers):
        spec = {"name": f"{spec['kind']}{i}", **spec}
        if spec["kind"] == "disk":
            directory = tmp_path / f"disk{i}"
            directory.mkdir(parents=True, exist_ok=True)
            spec.setdefault("directories", [str(directory)])
        specs.append(spec)
    return {"block_bytes": BLOCK, "tiers": specs}


def assert_gone(chain: TierChain, key: BlockKey) -> None:
    assert chain.lookup([key]).count == 0
    assert not chain.lookup([key]).in_flight
    assert all(key not in level.tier and level.tier.slot_of(key) is None for level in chain.levels)


# -- (a) the disk fails writes: demotion drops the block -----------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
async def test_failed_demotion_drops_the_block_and_the_chain_keeps_serving(
    tmp_path: Path, code: int
) -> None:
    io = FaultyIO(code)
    memory = MemoryStore(num_blocks=2, block_bytes=BLOCK)
    async with direct_chain(memory, disk_store(tmp_path / "disk", 8, io)) as chain:
        top, disk = chain.levels
        a, b, c, d, e = keys_of(1, 2, 3, 4, 5)
        assert await store_all(chain, [a, b]) == [a, b]
        io.fail_writes = True
        assert await store_all(chain, [c]) == [c]  # evicts a; its demotion fails
        assert io.failed_writes == 1
        assert (top.dropped, top.demotions, disk.io_errors) == (1, 0, 1)
        assert disk.store.stats().write_errors == 1
        assert_gone(chain, a)
        with pytest.raises(BlockMissing):
            await chain.load([a])
        chain.check_invariants(idle=True)
        # Still failing: the entry level keeps taking stores and serving what it holds.
        assert await store_all(chain, [d]) == [d]  # evicts b; dropped too
        assert (top.dropped, disk.io_errors) == (2, 2)
        await read_back(chain, [c, d])
        chain.check_invariants(idle=True)
        # The disk recovers: demotion works again and the demoted block comes back intact.
        io.fail_writes = False
        assert await store_all(chain, [e]) == [e]  # evicts c -> disk
        assert top.demotions == 1
        assert chain.lookup([c, d, e]).levels == (1, 0, 0)
        await read_back(chain, [c])
        assert_gone(chain, a)
        assert_gone(chain, b)
        chain.check_invariants(idle=True)


async def test_partly_failed_demotion_keeps_the_blocks_that_were_written(tmp_path: Path) -> None:
    a, b, c, d = keys_of(1, 2, 3, 4)
    disk = FailingStore(disk_store(tmp_path / "disk", 8), fail_writes=[a])
    async with direct_chain(MemoryStore(num_blocks=2, block_bytes=BLOCK), disk) as chain:
        top, bottom = chain.levels
        await store_all(chain, [a, b])
        await store_all(chain, [c, d])  # evicts a and b in one demotion batch
        assert (top.demotions, top.dropped, bottom.io_errors) == (1, 1, 1)
        assert_gone(chain, a)
        assert chain.lookup([b, c, d]).levels == (1, 0, 0)
        await read_back(chain, [b])
        chain.check_invariants(idle=True)


async def test_demotion_into_a_full_pinned_level_is_refused_and_dropped(tmp_path: Path) -> None:
    a, b, c = keys_of(1, 2, 3)
    cpu = CpuStore(num_blocks=1, block_bytes=BLOCK)
    async with direct_chain(MemoryStore(num_blocks=1, block_bytes=BLOCK), cpu) as chain:
        top, lower = chain.levels
        await store_all(chain, [a])
        await store_all(chain, [b])  # a -> cpu
        async with chain.loading([a], lower.medium):
            assert await store_all(chain, [c]) == [c]  # b evicted; no room below
            chain.check_invariants()
        assert (top.dropped, lower.refused, lower.io_errors) == (1, 1, 0)
        assert_gone(chain, b)
        await read_back(chain, [c])
        chain.check_invariants(idle=True)


async def test_failed_write_through_leaves_the_block_dirty_above(tmp_path: Path) -> None:
    io = FaultyIO(errno.ENOSPC)
    memory = MemoryStore(num_blocks=2, block_bytes=BLOCK)
    async with direct_chain(memory, disk_store(tmp_path / "disk", 8, io)) as chain:
        chain.levels[0].write_through = True
        top, disk = chain.levels
        a, b, c = keys_of(1, 2, 3)
        io.fail_writes = True
        assert await store_all(chain, [a]) == [a]  # stored above; the copy down fails
        assert disk.io_errors == 1
        assert chain.lookup([a]).levels == (0,)
        io.fail_writes = False
        await store_all(chain, [b, c])  # evicts a, which is dirty: demoted, not dropped
        assert (top.demotions, top.dropped) == (1, 0)
        await read_back(chain, [a])
        chain.check_invariants(idle=True)


# -- (b) the disk fails a read: a miss, never wrong bytes ---------------------------------


def corrupt(chain: TierChain, level: int, key: BlockKey) -> None:
    """Flip bytes in the middle of ``key``'s data in the slab file."""
    store = chain.levels[level].store
    slot = chain.levels[level].tier.slot_of(key)
    assert slot is not None
    details = store.stats().details
    (path,) = details["files"]
    offset = ALIGN + slot * details["slot_bytes"] + ALIGN + 1000
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 16, offset)
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


async def push_down(chain: TierChain, keys: list[BlockKey], filler: list[BlockKey]) -> None:
    """Store ``keys``, then push them out of the two-block entry level with ``filler``
    (down to the level below: the disk in most tests)."""
    await store_all(chain, keys)
    await store_all(chain, filler)
    assert set(chain.lookup(keys).levels) == {1}


@pytest.mark.parametrize("o_direct", [False, "auto"])
async def test_corrupt_block_on_disk_is_a_miss_and_is_discarded(
    tmp_path: Path, o_direct: bool | str
) -> None:
    cfg = config(
        tmp_path,
        {"kind": "memory", "capacity": 2},
        {"kind": "disk", "capacity": 8, "o_direct": o_direct},
    )
    async with tierd.open(cfg) as chain:
        disk = chain.levels[1]
        a, b, x, y = keys_of(1, 2, 3, 4)
        await push_down(chain, [a, b], [x, y])
        corrupt(chain, 1, a)
        # a is first: nothing can be loaded.
        with pytest.raises(BlockMissing):
            await chain.load([a, b])
        assert disk.io_errors == 1
        assert disk.store.stats().details["checksum_failures"] == 1
        assert_gone(chain, a)
        chain.check_invariants(idle=True)
        # b is intact and still loads; a stored again reads back as its own bytes.
        await read_back(chain, [b])
        await store_all(chain, [a])
        await read_back(chain, [a])
        chain.check_invariants(idle=True)


async def test_corrupt_block_in_the_middle_shortens_the_prefix(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"kind": "memory", "capacity": 3}, {"kind": "disk", "capacity": 8})
    async with tierd.open(cfg) as chain:
        a, b, c, x, y, z = keys_of(1, 2, 3, 4, 5, 6)
        await store_all(chain, [a, b, c])
        await store_all(chain, [x, y, z])  # a, b, c only on disk now
        corrupt(chain, 1, b)
        async with chain.loading([a, b, c]) as handle:
            assert handle.keys == [a]
            assert [as_bytes(v) for v in handle.views()] == [content(a)]
        assert_gone(chain, b)
        assert chain.lookup([a, b, c]).count == 1
        # c was promoted with b (one batch) or not at all; either way it is intact.
        await read_back(chain, [c])
        chain.check_invariants(idle=True)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENXIO])
async def test_read_error_on_disk_is_a_miss(tmp_path: Path, code: int) -> None:
    io = FaultyIO(code)
    memory = MemoryStore(num_blocks=2, block_bytes=BLOCK)
    async with direct_chain(memory, disk_store(tmp_path / "disk", 8, io)) as chain:
        disk = chain.levels[1]
        a, b, x, y = keys_of(1, 2, 3, 4)
        await push_down(chain, [a, b], [x, y])
        io.fail_reads = True
        async with chain.loading([x, a]) as handle:  # x pinned, a read and lost
            assert handle.keys == [x]
            assert [as_bytes(v) for v in handle.views()] == [content(x)]
        assert io.failed_reads == 1
        assert disk.io_errors == 1
        assert disk.store.stats().read_errors == 1
        assert_gone(chain, a)
        chain.check_invariants(idle=True)
        io.fail_reads = False
        await read_back(chain, [b])  # b was never read: still on disk, intact
        chain.check_invariants(idle=True)


async def test_concurrent_loads_of_a_corrupt_block_all_miss(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"kind": "cpu", "capacity": 2}, {"kind": "disk", "capacity": 8})
    async with tierd.open(cfg) as chain:
        a, b, x, y = keys_of(1, 2, 3, 4)
        await push_down(chain, [a, b], [x, y])
        corrupt(chain, 1, a)
        results = await asyncio.gather(*(chain.load([a]) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, BlockMissing) for r in results), results
        assert chain.levels[1].io_errors == 1  # one shared read, one failure
        assert_gone(chain, a)
        chain.check_invariants(idle=True)


async def test_failed_promotion_write_keeps_the_lower_copy(tmp_path: Path) -> None:
    """The copy up fails on the destination's side: the block in RAM below is intact and
    must stay (it used to be discarded as if it were unreadable, losing the block)."""
    a, b, x, y = keys_of(1, 2, 3, 4)
    top = FailingStore(MemoryStore(num_blocks=2, block_bytes=BLOCK))
    async with direct_chain(top, CpuStore(num_blocks=8, block_bytes=BLOCK)) as chain:
        await push_down(chain, [a, b], [x, y])
        top.fail_writes = {a}
        with pytest.raises(BlockMissing):
            await chain.load([a])
        assert chain.levels[0].io_errors == 1
        assert chain.lookup([a]).levels == (1,)
        chain.check_invariants(idle=True)
        top.fail_writes = set()
        await read_back(chain, [a])
        chain.check_invariants(idle=True)


# -- (c) the entry level fails a write: nothing readable, nothing pinned -------------------


async def test_failed_entry_write_leaves_nothing_readable(tmp_path: Path) -> None:
    io = FaultyIO(errno.ENOSPC)
    async with direct_chain(disk_store(tmp_path / "disk", 4, io)) as chain:
        (level,) = chain.levels
        a, b = keys_of(1, 2)
        io.fail_writes = True
        assert await store_all(chain, [a, b]) == []
        assert level.io_errors == 2
        assert len(level.tier) == 0
        assert_gone(chain, a)
        assert_gone(chain, b)
        with pytest.raises(BlockMissing):
            await chain.load([a])
        chain.check_invariants(idle=True)
        io.fail_writes = False
        assert await store_all(chain, [a, b]) == [a, b]
        await read_back(chain, [a, b])
        chain.check_invariants(idle=True)


async def test_partly_failed_entry_write_keeps_the_good_blocks(tmp_path: Path) -> None:
    a, b, c = keys_of(1, 2, 3)
    top = FailingStore(MemoryStore(num_blocks=4, block_bytes=BLOCK), fail_writes=[b])
    async with direct_chain(top, disk_store(tmp_path / "disk", 8)) as chain:
        assert await store_all(chain, [a, b, c]) == [a, c]
        assert chain.levels[0].io_errors == 1
        assert_gone(chain, b)
        async with chain.loading([a, b, c]) as handle:
            assert handle.keys == [a]
        with pytest.raises(BlockMissing):
            await chain.load([b])
        await read_back(chain, [c])
        chain.check_invariants(idle=True)


class RaisingStore(FailingStore):
    """Raises an OS-level error from every write while ``broken``."""

    broken = True

    async def _write(self, slots: Sequence[int], keys: Sequence[BlockKey], data: Any) -> list[bool]:
        if self.broken:
            raise StoreIOError("device lost", path="/dev/fake", errno=errno.EIO)
        return await super()._write(slots, keys, data)


async def test_entry_write_that_raises_releases_everything(tmp_path: Path) -> None:
    a, b, c = keys_of(1, 2, 3)
    top = RaisingStore(MemoryStore(num_blocks=2, block_bytes=BLOCK))
    async with direct_chain(top, disk_store(tmp_path / "disk", 8)) as chain:
        top.broken = False
        await store_all(chain, [a, b])
        top.broken = True
        with pytest.raises(StoreIOError):
            await store_all(chain, [c])  # a was demoted first, then the write raised
        assert_gone(chain, c)
        assert chain.lookup([a]).levels == (1,)
        chain.check_invariants(idle=True)
        top.broken = False
        await read_back(chain, [c] if await store_all(chain, [c]) else [])
        await read_back(chain, [a])
        chain.check_invariants(idle=True)


async def test_cancelled_entry_write_leaves_nothing_and_waiting_loads_miss(
    tmp_path: Path,
) -> None:
    a, b = keys_of(1, 2)
    gate = asyncio.Event()
    top = FailingStore(MemoryStore(num_blocks=2, block_bytes=BLOCK), gate=gate)
    async with direct_chain(top, disk_store(tmp_path / "disk", 8)) as chain:
        writer = asyncio.create_task(store_all(chain, [a, b]))
        await top.entered.wait()
        assert chain.lookup([a]).in_flight
        reader = asyncio.create_task(chain.load([a]))  # waits for the write in flight
        for _ in range(3):
            await asyncio.sleep(0)
        assert not reader.done()
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        with pytest.raises(BlockMissing):
            await reader
        assert_gone(chain, a)
        assert_gone(chain, b)
        chain.check_invariants(idle=True)
        gate.set()
        assert await store_all(chain, [a, b]) == [a, b]
        await read_back(chain, [a, b])
        chain.check_invariants(idle=True)
