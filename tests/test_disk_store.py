"""The disk store: round trips, restart, crash, corruption, faults, probing, cancellation.

Faults come from :class:`FaultyIO`, a :class:`~tierd.stores.disk.io.FileIO` subclass; a crash
is either a real SIGKILL of a child process or a copy of the store's files taken while it
is open (what a kill at that moment would leave behind).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.disk_store_kit import (
    BB,
    FILES,
    block,
    crash_copy,
    get,
    put,
    run_child_until_killed,
    store_at,
)
from tierd.errors import SlabInUse, SlotError, StoreClosed, StoreIOError
from tierd.keys import int_key
from tierd.stores.base import BlockStore
from tierd.stores.disk.block_format import BlockHeader
from tierd.stores.disk.io import ALIGN, FileIO, address_of, aligned_buffer
from tierd.stores.disk.store import DiskStore
from tierd.testing import StoreConformance

SLOT = ALIGN + BB


class FaultyIO(FileIO):
    """Fails chosen calls: writes of chosen keys, all reads, O_DIRECT opens."""

    def __init__(self) -> None:
        self.write_faults: dict[bytes, int | str] = {}  # key -> errno, or "short"
        self.read_fault = 0
        self.refuse_direct = False
        self.data_addresses: list[int] = []

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self.refuse_direct and flags & self.o_direct_flag:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return super().open(path, flags, mode)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        # Block writes: a header page and a body per block (blocks of adjacent slots in one).
        heads = [BlockHeader.unpack(b) for b in buffers[0::2]] if len(buffers) >= 2 else []
        faults = [self.write_faults.get(h.key) for h in heads if h is not None]
        if "short" in faults:  # a torn write: it stops after the faulty block's header page
            torn = faults.index("short")
            return super().pwritev(fd, buffers[: 2 * torn + 1], offset)
        if any(isinstance(f, int) for f in faults):
            code = next(f for f in faults if isinstance(f, int))
            raise OSError(code, os.strerror(code))
        if len(buffers) >= 2:
            self.data_addresses += [address_of(body) for body in buffers[1::2]]
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        # Block reads: a header page and a body per block (blocks of adjacent slots in one).
        if self.read_fault and len(buffers) >= 2:
            raise OSError(self.read_fault, os.strerror(self.read_fault))
        if len(buffers) >= 2:
            self.data_addresses += [address_of(body) for body in buffers[1::2]]
        return super().preadv(fd, buffers, offset)


# -- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("o_direct", ["auto", False])
async def test_round_trip_buffer_kinds(tmp_path: Path, o_direct: Any) -> None:
    async with store_at(tmp_path, o_direct=o_direct) as store:
        assert await put(store, range(4)) == [True] * 4
        outs: list[Any] = [
            bytearray(BB),
            np.zeros(BB, np.uint8),
            aligned_buffer(BB),
            torch.zeros(BB, dtype=torch.uint8),
        ]
        assert await store.read(range(4), [int_key(i) for i in range(4)], outs) == [True] * 4
        for i, out in enumerate(outs):
            assert bytes(memoryview(out.numpy() if isinstance(out, torch.Tensor) else out)) == (
                block(i)
            )
        whole = torch.zeros((4, BB), dtype=torch.uint8)
        assert await store.read(range(4), [int_key(i) for i in range(4)], whole) == [True] * 4
        assert bytes(whole[3].numpy()) == block(3)


async def test_odd_block_size_round_trip(tmp_path: Path) -> None:
    async with DiskStore(num_blocks=4, block_bytes=1000, directories=[tmp_path]) as store:
        data = [os.urandom(1000) for _ in range(4)]
        keys = [int_key(i) for i in range(4)]
        assert await store.write(range(4), keys, data) == [True] * 4
        outs = [bytearray(1000) for _ in range(4)]
        assert await store.read(range(4), keys, outs) == [True] * 4
        assert [bytes(o) for o in outs] == data


async def test_wrong_key_unwritten_slot_and_bad_arguments(tmp_path: Path) -> None:
    store = store_at(tmp_path, num_blocks=4)
    with pytest.raises(StoreClosed):
        await put(store, [0])
    async with store:
        await put(store, [0])
        assert await get(store, 0, 1) is None  # another key
        assert await get(store, 1, 1) is None  # never written
        assert store.stats().details["index_misses"] == 2
        with pytest.raises(SlotError):
            await store.write([4], [int_key(4)], [block(4)])
        with pytest.raises(SlotError):
            await store.write([1], [int_key(1)], [b"short"])
        with pytest.raises(SlotError):
            await store.read([0], [int_key(0)], [bytes(BB)])  # read-only target
        with pytest.raises(SlotError):
            store.invalidate([9])
        assert await get(store, 0, 0) == block(0)
    with pytest.raises(StoreClosed):
        await store.open()


async def test_zero_copy_for_aligned_buffers(tmp_path: Path) -> None:
    io = FaultyIO()
    async with store_at(tmp_path, fileio=io) as store:
        if not store.stats().details["o_direct"]:
            pytest.skip("no O_DIRECT on this file system")
        src, dst = aligned_buffer(BB), aligned_buffer(BB)
        src[:] = block(7)
        io.data_addresses.clear()
        assert await store.write([1], [int_key(7)], [src]) == [True]
        assert await store.read([1], [int_key(7)], [dst]) == [True]
        assert io.data_addresses == [address_of(src), address_of(dst)]
        assert bytes(dst) == block(7)


async def test_many_blocks_many_chunks_concurrently(tmp_path: Path) -> None:
    async with store_at(tmp_path, num_blocks=64, blocks_per_task=3) as store:
        results = await asyncio.gather(put(store, range(32)), put(store, range(32, 64)))
        assert results == [[True] * 32] * 2
        reads = await asyncio.gather(*(get(store, i, i) for i in range(64)))
        assert reads == [block(i) for i in range(64)]
        assert store.stats().bytes_read == 64 * BB


# -- restart and index -----------------------------------------------------------------


async def test_restart_keeps_index_and_bytes(tmp_path: Path) -> None:
    async with store_at(tmp_path) as store:
        await put(store, range(10))
        await put(store, [20, 21], slots=[3, 4])  # overwrites
        store.invalidate([5])
        before = store.index()
    assert before == {s: int_key(s) for s in range(10) if s not in (3, 4, 5)} | {
        3: int_key(20),
        4: int_key(21),
    }
    async with store_at(tmp_path) as store:
        assert store.index() == before
        assert store.stats().details["recovery"] == ["clean"]
        for slot, key in before.items():
            assert await get(store, slot, int.from_bytes(key, "little")) == block(
                int.from_bytes(key, "little")
            )
        assert await get(store, 5, 5) is None


async def test_another_block_size_discards_blocks_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with store_at(tmp_path) as store:
        await put(store, range(4))
    async with DiskStore(num_blocks=16, block_bytes=4096, directories=[tmp_path]) as store:
        assert store.index() == {}
    said = capsys.readouterr()
    assert "another block size or directory layout; discarding its blocks" in said.out + said.err


async def test_a_resized_slab_keeps_the_blocks_whose_slots_remain(tmp_path: Path) -> None:
    """A tier's capacity changed (or its share under ``block_sizes``): the slab grows or
    shrinks in place and every block whose slot still exists is kept, its bytes intact."""
    slab = tmp_path / "tierd-slab.bin"
    async with store_at(tmp_path, num_blocks=16) as store:
        assert await put(store, range(16)) == [True] * 16
    async with store_at(tmp_path, num_blocks=32) as store:  # grown: every block kept
        assert sorted(store.index()) == list(range(16))
        assert slab.stat().st_size == ALIGN + 32 * SLOT
        assert await put(store, [100], [31]) == [True]
        for i in range(16):
            assert await get(store, i, i) == block(i)
    async with store_at(tmp_path, num_blocks=8) as store:  # shrunk: slots 0-7 kept
        assert sorted(store.index()) == list(range(8))
        assert slab.stat().st_size == ALIGN + 8 * SLOT
        for i in range(8):
            assert await get(store, i, i) == block(i)
        assert await put(store, [200], [7]) == [True]
    async with store_at(tmp_path, num_blocks=8) as store:  # and the next start agrees
        assert store.stats().details["recovery"] == ["clean"]
        assert sorted(store.index()) == list(range(8))
        assert await get(store, 7, 200) == block(200)


async def test_a_shrink_cut_short_by_a_crash_drops_only_the_slots_gone(tmp_path: Path) -> None:
    """The new superblock is on disk but the index (snapshot) still names slots past the
    end: the next open drops those, keeps the rest and reads them back intact."""
    async with store_at(tmp_path, num_blocks=16) as store:
        assert await put(store, range(16)) == [True] * 16
    saved = {n: (tmp_path / n).read_bytes() for n in FILES if (tmp_path / n).exists()}
    async with store_at(tmp_path, num_blocks=8):
        pass
    for name, data in saved.items():  # the snapshot of 16 slots back, as a crash leaves it
        if name != "tierd-slab.bin":
            (tmp_path / name).write_bytes(data)
    async with store_at(tmp_path, num_blocks=8) as store:
        assert sorted(store.index()) == list(range(8))
        for i in range(8):
            assert await get(store, i, i) == block(i)


async def test_same_directory_twice_is_refused(tmp_path: Path) -> None:
    async with store_at(tmp_path):
        with pytest.raises(StoreIOError) as info:
            await store_at(tmp_path).open()
        assert info.value.errno in (errno.EWOULDBLOCK, errno.EAGAIN)


# -- crash -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fsync", "acks"), [("always", 61), ("none", 150), ("batch", 97), ("always", 1)]
)
async def test_sigkill_recovery_never_serves_wrong_bytes(
    tmp_path: Path, fsync: str, acks: int
) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    num_blocks = 24
    acked = await run_child_until_killed(dirs, num_blocks, fsync, acks)
    last_acked = {i % num_blocks: i for i in acked}
    async with store_at(dirs, num_blocks=num_blocks) as store:
        index = store.index()
        assert store.stats().details["recovery"] == ["crash", "crash"]
        assert index, "nothing survived the crash"
        for slot, key in index.items():
            i = int.from_bytes(key, "little")
            assert i % num_blocks == slot
            assert i >= last_acked.get(slot, 0)  # nothing older than an acknowledged write
            assert await get(store, slot, i) == block(i)
        for i in acked:  # every other key ever written to a slot misses, never lies
            got = await get(store, i % num_blocks, i)
            assert got is None or got == block(i)


async def test_crash_copy_recovers_and_honours_invalidations(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, fsync="none") as store:
        await put(store, range(8))
        store.invalidate([2])
        await put(store, [30], slots=[3])
        await store.sync()
        dead = crash_copy(live, tmp_path / "dead")
        expected = store.index()
    async with store_at(dead) as store:
        assert store.stats().details["recovery"] == ["crash"]
        assert store.index() == expected
        assert 2 not in store.index()
        assert await get(store, 3, 30) == block(30)


async def test_rebuild_from_headers_alone(tmp_path: Path) -> None:
    async with store_at(tmp_path) as store:
        await put(store, range(6))
    (tmp_path / "tierd-index.msgpack").unlink()
    with (tmp_path / "tierd-slab.bin").open("r+b") as f:  # rot block 4's data
        f.seek(ALIGN + 4 * SLOT + ALIGN + 100)
        f.write(b"\xff" * 8)
    async with store_at(tmp_path) as store:
        assert store.index() == {i: int_key(i) for i in range(6) if i != 4}
        assert store.stats().details["dropped_blocks"] == 1
        assert await get(store, 5, 5) == block(5)


async def test_journal_checkpoints_bound_its_size(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, journal_limit_bytes=2048) as store:
        for round_ in range(20):
            await put(store, [round_ * 16 + s for s in range(16)], slots=range(16))
            await store.sync()  # and the checkpoint this round started
        assert (live / "tierd-journal.bin").stat().st_size < 4096
        assert not (live / "tierd-journal.old.bin").exists()
        dead = crash_copy(live, tmp_path / "dead")
    async with store_at(dead) as store:
        assert store.index() == {s: int_key(19 * 16 + s) for s in range(16)}


class _RotationFails(FileIO):
    """While armed, fails the header write of the journal a checkpoint's rotation starts
    (a full file system), once."""

    def __init__(self) -> None:
        self.armed = False
        self.failed = 0
        self._fds: set[int] = set()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        if self.armed and path.endswith(".next"):
            self._fds.add(fd)
        return fd

    def write(self, fd: int, data: bytes) -> int:
        if fd in self._fds:
            self._fds.discard(fd)
            self.armed, self.failed = False, self.failed + 1
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return super().write(fd, data)


async def test_a_checkpoint_that_cannot_start_its_journal_loses_nothing(tmp_path: Path) -> None:
    # The new journal of a checkpoint could not be written: the checkpoint is given up,
    # said once, and the old journal goes on growing, so blocks written after it survive
    # a crash; writes never fail for it. A later checkpoint (after the backoff) succeeds.
    live = tmp_path / "live"
    live.mkdir()
    io = _RotationFails()
    async with store_at(live, num_blocks=64, journal_limit_bytes=2048, fileio=io) as store:
        io.armed = True
        written = 0
        while not io.failed:
            assert await put(store, range(written, written + 4)) == [True] * 4
            await store.sync()
            written += 4
        for _ in range(2):  # synced after the failed checkpoint
            assert await put(store, range(written, written + 4)) == [True] * 4
            await store.sync()
            written += 4
        assert store.stats().details["snapshot_failures"] == 1  # said, and waits for 5 s
        assert not (live / "tierd-journal.old.bin").exists()
        dead = crash_copy(live, tmp_path / "dead")
    async with store_at(dead, num_blocks=64) as store:
        assert store.stats().details["recovery"] == ["crash"]
        assert store.index() == {s: int_key(s) for s in range(written)}


# -- corruption and faults -------------------------------------------------------------


@pytest.mark.parametrize("where", [ALIGN + 17, 40, 3])  # data, header fields, magic
async def test_flipped_bytes_read_as_failed(tmp_path: Path, where: int) -> None:
    async with store_at(tmp_path) as store:
        await put(store, range(4))
    with (tmp_path / "tierd-slab.bin").open("r+b") as f:
        f.seek(ALIGN + 2 * SLOT + where)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    async with store_at(tmp_path) as store:
        assert await get(store, 2, 2) is None
        assert store.stats().details["checksum_failures"] == 1
        assert [await get(store, s, s) for s in (0, 1, 3)] == [block(0), block(1), block(3)]


class RunIO(FileIO):
    """Counts block reads and writes (a header page and a body per block) by blocks per
    call; with ``short_runs``, a read of several blocks comes back one byte short and a
    write of several stops before the last block's body (that block torn)."""

    def __init__(self, short_runs: bool = False) -> None:
        self.blocks_per_read: list[int] = []
        self.blocks_per_write: list[int] = []
        self.short_runs = short_runs

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if len(buffers) >= 2:
            self.blocks_per_write.append(len(buffers) // 2)
            if self.short_runs and len(buffers) > 2:  # the last block's body does not land
                return super().pwritev(fd, buffers[:-1], offset)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if len(buffers) >= 2:
            self.blocks_per_read.append(len(buffers) // 2)
            if self.short_runs and len(buffers) > 2:
                return super().preadv(fd, buffers, offset) - 1
        return super().preadv(fd, buffers, offset)


@pytest.mark.parametrize("short", [False, True], ids=["whole", "short-read"])
async def test_adjacent_slots_are_read_at_once_and_each_block_checked(
    tmp_path: Path, short: bool
) -> None:
    """Eight blocks of adjacent slots come back in one ``preadv`` (a header page and a
    body each); a flipped byte in the middle one fails that block only. A read of
    several blocks that comes back short is made again a block at a time."""
    async with store_at(tmp_path) as store:
        await put(store, range(8))
    with (tmp_path / "tierd-slab.bin").open("r+b") as f:
        f.seek(ALIGN + 5 * SLOT + ALIGN + 99)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    io = RunIO(short_runs=short)
    async with store_at(tmp_path, fileio=io, read_threads=1) as store:
        outs = [aligned_buffer(BB) for _ in range(8)]
        io.blocks_per_read.clear()
        got = await store.read(list(range(8)), [int_key(i) for i in range(8)], outs)
        assert got == [i != 5 for i in range(8)]
        assert [bytes(outs[i]) for i in range(8) if i != 5] == [
            block(i) for i in range(8) if i != 5
        ]
        assert io.blocks_per_read == ([8] + [1] * 8 if short else [8])
        assert store.stats().details["checksum_failures"] == 1


@pytest.mark.parametrize("short", [False, True], ids=["whole", "short-write"])
async def test_adjacent_slots_are_written_at_once_and_each_block_stands_alone(
    tmp_path: Path, short: bool
) -> None:
    """Eight blocks of adjacent slots go down in one ``pwritev`` (a header page and a
    body each), and each reads back alone after a restart. A write of several blocks
    that comes back short is made again a block at a time, whole: no block is left
    torn. A fault on one block of a run fails that block only."""
    io = RunIO(short_runs=short)
    async with store_at(tmp_path, fileio=io, write_threads=1) as store:
        io.blocks_per_write.clear()
        assert await write_aligned(store, range(8), range(8)) == [True] * 8
        assert io.blocks_per_write == ([8] + [1] * 8 if short else [8])
    async with store_at(tmp_path) as store:
        assert [await get(store, i, i) for i in range(8)] == [block(i) for i in range(8)]
    faulty = FaultyIO()
    async with store_at(tmp_path, fileio=faulty, write_threads=1) as store:
        faulty.write_faults[int_key(13)] = errno.EIO
        got = await write_aligned(store, range(10, 16), range(8, 14))
        assert got == [i != 13 for i in range(10, 16)]
        assert store.stats().write_errors == 1
    async with store_at(tmp_path) as store:
        assert [await get(store, s, s + 2) for s in range(8, 14)] == [
            None if s == 11 else block(s + 2) for s in range(8, 14)
        ]


async def test_a_large_write_goes_in_few_chunks_and_few_syncs(tmp_path: Path) -> None:
    """By default a write chunk holds up to WRITE_TASK_BYTES of blocks (two syncs each
    under fsync always), not 8 blocks: 64 adjacent blocks on one write thread are one
    ``pwritev``; a store told ``blocks_per_task`` still cuts its writes that small."""
    io = RunIO()
    async with store_at(tmp_path, num_blocks=64, fileio=io, write_threads=1) as store:
        io.blocks_per_write.clear()
        assert await write_aligned(store, range(64), range(64)) == [True] * 64
        assert io.blocks_per_write == [64]
    io = RunIO()
    async with store_at(tmp_path, num_blocks=64, fileio=io, blocks_per_task=4) as store:
        io.blocks_per_write.clear()
        assert await write_aligned(store, range(16), range(16)) == [True] * 16
        assert io.blocks_per_write == [4] * 4
    async with store_at(tmp_path, num_blocks=64) as store:
        assert [await get(store, i, i) for i in range(16)] == [block(i) for i in range(16)]


@pytest.mark.parametrize("bad", [{"blocks_per_task": 0}, {"read_threads": 0}, {"write_threads": 0}])
def test_a_store_of_no_blocks_per_task_or_no_threads_is_refused(
    tmp_path: Path, bad: dict[str, int]
) -> None:
    """``blocks_per_task=0`` is an error, not the default (``None`` is the default)."""
    with pytest.raises(ValueError, match="must be positive"):
        store_at(tmp_path, **bad)


async def write_aligned(store: DiskStore, ids: Sequence[int], slots: Sequence[int]) -> list:
    """:func:`put` from page-aligned buffers (what a run of adjacent slots needs under
    O_DIRECT)."""
    srcs = [aligned_buffer(BB) for _ in ids]
    for i, src in zip(ids, srcs, strict=True):
        src[:] = block(i)
    return await store.write(list(slots), [int_key(i) for i in ids], srcs)


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EIO, "short"])
async def test_failed_write_leaves_slot_unreadable(tmp_path: Path, fault: int | str) -> None:
    io = FaultyIO()
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, fileio=io) as store:
        await put(store, range(4))
        io.write_faults[int_key(1)] = fault
        # rewrite slot 1 with the key it already holds: the old bytes must not come back
        assert await put(store, [1, 2], slots=[1, 2]) == [False, True]
        assert store.stats().write_errors == 1
        assert await get(store, 1, 1) is None
        assert 1 not in store.index()
        io.write_faults.clear()
        assert await put(store, [9], slots=[1]) == [True]  # still usable
        assert await get(store, 1, 9) == block(9)
        io.write_faults[int_key(3)] = fault
        assert await put(store, [3]) == [False]
        await store.sync()
        dead = crash_copy(live, tmp_path / "dead")
    async with store_at(dead) as store:
        assert 3 not in store.index()
    async with store_at(live) as store:
        assert 3 not in store.index()
        assert await get(store, 1, 9) == block(9)


async def test_read_eio_fails_the_block(tmp_path: Path) -> None:
    io = FaultyIO()
    async with store_at(tmp_path, fileio=io) as store:
        await put(store, range(2))
        io.read_fault = errno.EIO
        assert await get(store, 0, 0) is None
        assert store.stats().read_errors == 1
        io.read_fault = 0
        assert await get(store, 0, 0) == block(0)


async def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(StoreIOError) as info:
        await store_at(missing).open()
    assert str(missing) in info.value.path
    assert info.value.errno == errno.ENOENT
    assert isinstance(info.value.__cause__, OSError)


async def test_directory_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    good = tmp_path / "good"
    good.mkdir()
    with pytest.raises(StoreIOError) as info:
        await store_at([good, tmp_path / "file" / "dir"]).open()
    assert info.value.errno == errno.ENOTDIR
    assert str(tmp_path / "file" / "dir") in str(info.value)
    async with store_at(good) as store:  # the failed open released the first slab
        assert store.index() == {}


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o500)
    yield tmp_path
    tmp_path.chmod(0o700)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
async def test_read_only_directory(read_only_dir: Path) -> None:
    with pytest.raises(StoreIOError) as info:
        await store_at(read_only_dir).open()
    assert info.value.errno == errno.EACCES
    assert str(read_only_dir) in info.value.path


# -- opening: a slab in use, a failed preallocation -------------------------------------


class _AllocateFails(FileIO):
    """Preallocation fails with ``code`` (a full drive, a file system's size limit)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def allocate(self, fd: int, nbytes: int) -> None:
        raise OSError(self.code, os.strerror(self.code))


async def test_a_slab_open_elsewhere_is_in_use(tmp_path: Path) -> None:
    async with store_at(tmp_path) as first:
        assert await put(first, [1]) == [True]
        with pytest.raises(SlabInUse) as caught:
            async with store_at(tmp_path):
                pass
        slab = str(tmp_path / "tierd-slab.bin")
        assert str(caught.value) == (
            f"the slab {slab} is in use by another process (a running tierd daemon?)"
        )
        assert caught.value.path == slab
        assert await get(first, 1, 1) == block(1)  # the holder is untouched


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
async def test_a_failed_preallocation_leaves_no_partial_slab(tmp_path: Path, code: int) -> None:
    with pytest.raises(StoreIOError) as caught:
        async with store_at(tmp_path, fileio=_AllocateFails(code)):
            pass
    assert caught.value.errno == code
    assert f"({os.strerror(code)}; the partial slab was removed)" in str(caught.value)
    size = ALIGN + 16 * SLOT  # the superblock and 16 slots
    assert str(caught.value).startswith(f"cannot preallocate {size:,} bytes for the disk slab")
    assert os.listdir(tmp_path) == []


async def test_a_failed_reformat_removes_the_old_slab_too(tmp_path: Path) -> None:
    async with store_at(tmp_path, num_blocks=16) as store:
        assert await put(store, [1]) == [True]
    other = DiskStore(  # another block size: the old blocks are discarded
        num_blocks=16,
        block_bytes=BB * 2,
        directories=[tmp_path],
        fileio=_AllocateFails(errno.ENOSPC),
    )
    with pytest.raises(StoreIOError):
        async with other:
            pass
    assert not (tmp_path / "tierd-slab.bin").exists()


async def test_a_failed_growth_keeps_the_slab_and_its_blocks(tmp_path: Path) -> None:
    async with store_at(tmp_path, num_blocks=16) as store:
        assert await put(store, [1]) == [True]
    with pytest.raises(StoreIOError):
        async with store_at(tmp_path, num_blocks=32, fileio=_AllocateFails(errno.ENOSPC)):
            pass
    async with store_at(tmp_path, num_blocks=16) as store:
        assert await get(store, 1, 1) == block(1)


async def test_a_failed_open_keeps_a_reused_slab(tmp_path: Path) -> None:
    async with store_at(tmp_path) as store:
        assert await put(store, [1]) == [True]
    faulty = FaultyIO()
    faulty.refuse_direct = True
    with pytest.raises(StoreIOError, match="O_DIRECT probe failed"):
        async with store_at(tmp_path, fileio=faulty, o_direct=True):
            pass
    async with store_at(tmp_path) as store:
        assert await get(store, 1, 1) == block(1)


# -- striping and O_DIRECT -------------------------------------------------------------


async def test_slots_stripe_across_directories(tmp_path: Path) -> None:
    dirs = [tmp_path / n for n in "abc"]
    for d in dirs:
        d.mkdir()
    async with store_at(dirs, num_blocks=10) as store:
        assert await put(store, range(10)) == [True] * 10
        assert store.stats().details["files"] == [str(d / "tierd-slab.bin") for d in dirs]
    sizes = [(d / "tierd-slab.bin").stat().st_size for d in dirs]
    assert sizes == [ALIGN + n * SLOT for n in (4, 3, 3)]
    with (dirs[1] / "tierd-slab.bin").open("rb") as f:  # slot 4 = slab b, local slot 1
        f.seek(ALIGN + SLOT + ALIGN)
        assert f.read(BB) == block(4)
    async with store_at(dirs, num_blocks=10) as store:
        assert store.index() == {i: int_key(i) for i in range(10)}


async def test_o_direct_probe_is_reported(tmp_path: Path) -> None:
    async with store_at(tmp_path) as store:
        details = store.stats().details
        assert isinstance(details["o_direct"], bool)
        assert details["reason"] == "probe passed" or not details["o_direct"]
        assert details["reason"]
        assert details["slabs"][0]["o_direct"] is details["o_direct"]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="tierd-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d)


async def test_dev_shm_probe_is_reported(shm_dir: Path) -> None:
    # tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: either way the store
    # works and says which it got.
    async with store_at(shm_dir) as store:
        details = store.stats().details
        if details["o_direct"]:
            assert details["reason"] == "probe passed"
        else:
            assert "O_DIRECT probe failed" in details["reason"]
        assert await put(store, [0]) == [True]
        assert await get(store, 0, 0) == block(0)


async def test_o_direct_fallback_when_refused(tmp_path: Path) -> None:
    io = FaultyIO()
    io.refuse_direct = True
    async with store_at(tmp_path, fileio=io) as store:
        details = store.stats().details
        assert details["o_direct"] is False
        assert "O_DIRECT probe failed" in details["reason"]
        assert await put(store, [0]) == [True]
        assert await get(store, 0, 0) == block(0)
    with pytest.raises(StoreIOError) as info:
        await store_at(tmp_path, fileio=io, o_direct=True).open()
    assert info.value.errno == errno.EINVAL
    async with store_at(tmp_path, o_direct=False) as store:
        assert store.stats().details["reason"] == "disabled by configuration"
        assert await get(store, 0, 0) == block(0)


# -- cancellation ----------------------------------------------------------------------


class GatedIO(FileIO):
    """Holds the first block write until ``gate`` is set; records the order of events."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.log: list[str] = []
        self.writes = 0

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if len(buffers) == 2:
            self.writes += 1
            self.entered.set()
            self.gate.wait()
            done = super().pwritev(fd, buffers, offset)
            self.log.append("io done")
            return done
        return super().pwritev(fd, buffers, offset)


async def test_cancelled_write_waits_for_submitted_io(tmp_path: Path) -> None:
    io = GatedIO()
    async with store_at(tmp_path, fileio=io, write_threads=1, blocks_per_task=1) as store:
        task = asyncio.create_task(put(store, range(3)))
        await asyncio.to_thread(io.entered.wait)
        task.cancel()
        asyncio.get_running_loop().call_soon(io.gate.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        io.log.append("task done")
        assert io.log == ["io done", "task done"]
        assert io.writes == 1  # chunks not started yet were dropped
        assert store.index() == {}
        assert await put(store, [0]) == [True]


# -- the shared contract ---------------------------------------------------------------


class DiskConformance(StoreConformance):
    """The block-store contract, over slab files in a fresh directory per store."""

    o_direct: Any = "auto"

    @pytest.fixture(autouse=True)
    def _workdir(self, tmp_path: Path) -> None:
        self.workdir = tmp_path
        self.made = 0

    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        self.made += 1
        directory = self.workdir / f"store{self.made}"
        directory.mkdir()
        return DiskStore(
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            directories=[directory],
            o_direct=self.o_direct,
            blocks_per_task=4,
        )


class TestDiskStoreConformance(DiskConformance):
    pass


class TestDiskStoreBufferedConformance(DiskConformance):
    o_direct = False
