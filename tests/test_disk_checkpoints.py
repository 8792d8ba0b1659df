"""Checkpoints of the disk store's index while it serves: taken in slices on the loop,
rotated into the journal, written on a thread of their own, retried when they fail.

A crash is a copy of the store's files taken while it is open (``crash_copy``); faults and
holds come from :class:`~tierd.stores.disk.io.FileIO` subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tierd.stores.disk.checkpoints
import tierd.turns
from tests.disk_store_kit import block, crash_copy, get, put, store_at
from tierd.errors import StoreIOError
from tierd.keys import int_key
from tierd.stores.disk.index import IndexWalk, load_snapshot
from tierd.stores.disk.io import FileIO
from tierd.stores.disk.store import DiskStore
from tierd.testing.faults import corrupt_disk_block

SNAPSHOT_TMP = "tierd-index.msgpack.tmp"


class SnapshotFull(FileIO):
    """While ``full``, a snapshot's temporary file cannot be created (ENOSPC); counts the
    tries, and notes the thread each snapshot is written from."""

    def __init__(self) -> None:
        self.full = False
        self.tries = 0
        self.threads: list[str] = []

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if path.endswith(SNAPSHOT_TMP):
            self.tries += 1
            self.threads.append(threading.current_thread().name)
            if self.full:
                raise OSError(errno.ENOSPC, "injected: no space left on device", path)
        return super().open(path, flags, mode)


async def _rounds(store: DiskStore, first: int, rounds: int, slots: int, sync: bool = True) -> int:
    """Write ``rounds`` batches of 4 blocks (ids from ``first``, slot id % ``slots``),
    each followed by a :meth:`~DiskStore.sync` when ``sync``; returns the next id. (With
    ``fsync: always`` each write has its journal records on disk before its data.)"""
    for i in range(first, first + 4 * rounds, 4):
        ids = range(i, i + 4)
        assert await put(store, ids, [n % slots for n in ids]) == [True] * 4
        if sync:
            await store.sync()
    return first + 4 * rounds


def _latest(written: int, slots: int) -> dict[int, bytes]:
    """Each slot's key after blocks ``0 .. written - 1`` went round the ``slots``."""
    return {s: int_key(max(i for i in range(written) if i % slots == s)) for s in range(slots)}


async def _recovers_after_crash(dead: Path, slots: int, expected: dict[int, bytes]) -> None:
    """The store in ``dead`` opens as after a crash with the index ``expected``, every
    block of it readable."""
    async with store_at(dead, num_blocks=slots) as store:
        assert store.stats().details["recovery"] == ["crash"]
        assert store.index() == expected
        for slot, key in expected.items():
            assert await get(store, slot, int.from_bytes(key, "little")) is not None


async def test_a_snapshot_that_cannot_be_written_costs_no_write(tmp_path: Path) -> None:
    # A full file system refuses the snapshot: no write fails for it, it is not tried
    # again by every flush (once, then after a backoff), the journal goes on growing, and
    # a crash meanwhile loses nothing.
    live = tmp_path / "live"
    live.mkdir()
    io = SnapshotFull()
    slots = 64
    async with store_at(live, num_blocks=slots, journal_limit_bytes=2048, fileio=io) as store:
        io.full, opened = True, io.tries
        written = await _rounds(store, 0, 60, slots)  # ~10 journal limits' worth
        assert io.tries - opened == 1, f"{io.tries - opened} snapshot tries"
        assert io.threads[opened:] == ["tierd-disk-snap_0"]  # never inside a write
        assert store.stats().details["snapshot_failures"] == 1
        assert (live / "tierd-journal.old.bin").exists()  # kept until a snapshot covers it
        expected = _latest(written, slots)
        assert store.index() == expected
        dead = crash_copy(live, tmp_path / "dead")
        io.full = False
        store._checkpoints.retry_now()  # the backoff is over
        await _rounds(store, written, 1, slots)
    await _recovers_after_crash(dead, slots, expected)
    async with store_at(live, num_blocks=slots) as store:  # the retry, then a clean close
        assert store.stats().details["recovery"] == ["clean"]


class HeldSnapshot(FileIO):
    """A snapshot's temporary file is opened only once ``release`` is set; ``waiting`` is
    set (on the loop) when a snapshot waits for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.hold = False
        self.waiting = asyncio.Event()
        self.release = threading.Event()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if path.endswith(SNAPSHOT_TMP) and self.hold:
            self.loop.call_soon_threadsafe(self.waiting.set)
            self.release.wait(60)
        return super().open(path, flags, mode)


@contextlib.asynccontextmanager
async def _released(io: HeldSnapshot) -> AsyncIterator[None]:
    try:
        yield
    finally:
        io.release.set()  # before the store closes: its close waits for the snapshot


@contextlib.asynccontextmanager
async def _rotation_held(live: Path, slots: int) -> AsyncIterator[tuple[DiskStore, int]]:
    """A store in ``live`` whose journal has rotated while the rotation's snapshot is held
    unwritten (until the exit); the store and how many blocks it was given (the writes do
    not sync: a sync would wait for the held snapshot)."""
    io = HeldSnapshot(asyncio.get_running_loop())
    store = store_at(live, num_blocks=slots, journal_limit_bytes=2048, fileio=io)
    async with store, _released(io):
        io.hold = True
        written = 0
        async with asyncio.timeout(60):
            while not io.waiting.is_set():
                written = await _rounds(store, written, 1, slots, sync=False)
        yield store, written


async def test_a_crash_before_a_rotated_snapshot_is_written_loses_nothing(tmp_path: Path) -> None:
    # The journal was rotated and its snapshot is still being written when the daemon
    # dies: the restart replays the previous snapshot, the old journal, then the new one.
    # Writes and deletes after the rotation are all there.
    live, slots = tmp_path / "live", 64
    live.mkdir()
    async with _rotation_held(live, slots) as (store, written):
        written = await _rounds(store, written, 3, slots, sync=False)  # after the rotation
        gone = [(written - 8) % slots, (written - 7) % slots]  # not written again below
        store.invalidate(gone)
        written = await _rounds(store, written, 1, slots, sync=False)  # writes the DELs first
        expected = store.index()
        latest = {i % slots: int_key(i) for i in range(written)}
        assert expected == {s: k for s, k in latest.items() if s not in gone}
        dead = crash_copy(live, tmp_path / "dead")
        assert (dead / "tierd-journal.old.bin").exists()
    await _recovers_after_crash(dead, slots, expected)
    async with store_at(dead, num_blocks=slots) as store:  # that open wrote a new snapshot
        assert store.index() == expected
        assert not (dead / "tierd-journal.old.bin").exists()


async def test_a_walk_takes_the_index_as_it_is_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slots changed behind the walk (deleted, rewritten, a write begun) and ahead of it:
    # the checkpoint holds each as it is when the walk ends, and the writes in flight.
    monkeypatch.setattr(tierd.turns, "CHECKPOINT_SLOTS", 8)
    async with store_at(tmp_path, num_blocks=64) as store:
        assert await put(store, range(64)) == [True] * 64
        await store.sync()
        slab = store._slabs[0]
        slab.walk = IndexWalk(64)
        steps = 0
        while slab.walk.cursor < 24:
            assert not slab.walk_step()
            steps += 1
        assert steps == 3  # a slice per step: 8 slots each
        store.invalidate([3, 40])  # behind the walk, ahead of it
        gen = slab.begin(5)
        slab.commit(5, int_key(105), gen, True)  # rewritten behind the walk
        in_flight = slab.begin(7)
        while not slab.walk_step():
            pass
        expected = dict(slab.entries)
        assert expected[5] == (int_key(105), gen) and 3 not in expected and 40 not in expected
        await store.sync()  # the flush that rotates the journal, then the snapshot
        snap = load_snapshot(str(tmp_path / "tierd-index.msgpack"), slab.uuid)
        assert snap is not None and snap.epoch == slab.epoch
        assert snap.entries == expected and snap.pending == {7: in_flight}
        slab.commit(7, int_key(7), in_flight, False)  # as a failed write
    async with store_at(tmp_path, num_blocks=64) as store:
        assert await get(store, 0, 0) == block(0)


def test_which_journals_a_crash_after_a_rotation_replays() -> None:
    from tierd.stores.disk.block_format import Op
    from tierd.stores.disk.journal import Replay
    from tierd.stores.disk.opening import _after_rotation

    old = Replay(4, {1: (Op.SET, 10, b"a"), 2: (Op.SET, 11, b"b")}, 500)
    new = Replay(5, {2: (Op.DEL, 11, b""), 3: (Op.BEGIN, 12, b"")}, 300)
    # The rotation's snapshot (epoch 5) is in place: the new journal alone extends it.
    assert _after_rotation(5, old, new, True) is new
    # It is not: the old journal's records, then the new one's, over snapshot 4.
    merged = _after_rotation(4, old, new, True)
    assert merged is not None and merged.length is None  # two files: not gone on with
    assert merged.records == {1: old.records[1], 2: new.records[2], 3: new.records[3]}
    # A crash between the rotation's two renames: the old journal holds every record.
    only_old = _after_rotation(4, old, None, False)
    assert only_old is not None and only_old.records == old.records
    # A new journal that exists but cannot be read, or journals of other epochs: a scan.
    assert _after_rotation(4, old, None, True) is None
    assert _after_rotation(3, old, new, True) is None


async def test_a_rotation_whose_rename_fails_is_given_up_and_writes_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The new journal cannot be renamed into place: the rotation is given up as one
    # whose new file cannot be made (the journal goes on growing, retried after a
    # backoff), its file is closed and removed, and no write fails for it.
    live = tmp_path / "live"
    live.mkdir()
    real_replace, refused = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        if str(src).endswith("tierd-journal.bin.next"):
            refused.append(src)
            raise OSError(errno.EIO, "injected: rename failed", src)
        real_replace(src, dst)

    slots = 64
    async with store_at(live, num_blocks=slots, journal_limit_bytes=2048) as store:
        monkeypatch.setattr(os, "replace", replace)
        fds = len(os.listdir("/proc/self/fd"))
        written = await _rounds(store, 0, 60, slots)  # ~10 journal limits' worth
        assert len(refused) == 1  # once, then after a backoff
        assert store.stats().details["snapshot_failures"] == 1
        assert len(os.listdir("/proc/self/fd")) == fds
        assert not (live / "tierd-journal.bin.next").exists()
        assert not (live / "tierd-journal.old.bin").exists()
        # The journal's size, as the checkpoints see it, is its file's whole size again:
        # the retry is due once the backoff ends, not once it grows by another limit.
        journal = store._slabs[0].journal
        assert journal.bytes == (live / "tierd-journal.bin").stat().st_size > 4 * 2048
        expected = _latest(written, slots)
        assert store.index() == expected
        dead = crash_copy(live, tmp_path / "dead")
        monkeypatch.setattr(os, "replace", real_replace)
        store._checkpoints.retry_now()
        await _rounds(store, written, 1, slots)
    await _recovers_after_crash(dead, slots, expected)
    async with store_at(live, num_blocks=slots) as store:
        assert store.stats().details["recovery"] == ["clean"]


class JournalRefused(FileIO):
    """The journal file cannot be opened (EIO): an open that has just written its new
    snapshot fails before it starts the journal, as a crash at that point would."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if path.endswith("tierd-journal.bin"):
            raise OSError(errno.EIO, "injected: cannot open the journal", path)
        return super().open(path, flags, mode)


async def test_a_crash_after_the_opening_snapshot_never_replays_a_stale_journal(
    tmp_path: Path,
) -> None:
    # A crash during a rotation leaves the snapshot of epoch E, the old journal (E, its
    # header unreadable here: the open scans) and the rotated one (E + 1). The open that
    # recovers writes a new snapshot, then dies before starting its journal. The next
    # open must not take the rotated journal as extending that snapshot: its SET of a
    # block the scan found corrupt would bring the block back into the index.
    live, slots = tmp_path / "live", 64
    live.mkdir()
    async with _rotation_held(live, slots) as (store, written):
        written = await _rounds(store, written, 2, slots, sync=False)  # after the rotation
        bad = (written - 1) % slots
        corrupt_disk_block(store, bad)
        expected = {s: k for s, k in store.index().items() if s != bad}
        dead = crash_copy(live, tmp_path / "dead")
    old = dead / "tierd-journal.old.bin"
    old.write_bytes(b"X" + old.read_bytes()[1:])  # its header's checksum fails
    with pytest.raises(StoreIOError):
        async with store_at(dead, num_blocks=slots, fileio=JournalRefused()):
            pass
    async with store_at(dead, num_blocks=slots) as store:
        assert store.stats().details["recovery"] == ["crash"]
        assert store.index() == expected


async def test_a_write_goes_through_while_a_checkpoint_walks_a_big_index(tmp_path: Path) -> None:
    """A checkpoint walks the index a slice per loop turn. A block write made meanwhile
    runs on the store's writer thread, which needs the GIL: between two slices the loop
    hands it over (``tierd.turns.next_turn``), so the write ends while the walk
    still goes on. With ``asyncio.sleep(0)`` between slices the thread never got the GIL
    until the walk had ended (a write waited 200-300 ms at a million blocks)."""
    n = 400_000
    store = DiskStore(
        num_blocks=n,
        block_bytes=4096,
        directories=[tmp_path],
        fsync="none",
        journal_limit_bytes=4 * 88,  # a few journal records: a checkpoint is due at once
    )
    await store.open()
    try:
        slab = store._slabs[0]  # an index as a long-running store fills it (no data)
        slab.entries.update((i, (int_key(i + 1_000_000_000), i + 1)) for i in range(n))
        slab.next_gen = n + 1
        data = [bytes(4096)]
        for i in range(64):
            await store.write([i % 8], [int_key(i)], data)
            if slab.walk is not None:
                break
        assert slab.walk is not None, "no checkpoint started"
        walk = slab.walk
        assert await store.write([9], [int_key(10**6)], data) == [True]
        assert slab.walk is walk and walk.cursor < walk.end  # the walk is still under way
    finally:
        await store.close()
