"""The disk tier's durability modes (``fsync: always | batch | none``) through the config.

A crash is a real SIGKILL of a child process that runs this module as a script: it opens
a chain with :func:`tierd.open` (a memory tier over a disk tier in the mode asked for),
stores and flushes blocks batch by batch, and prints ``ack I`` for every block whose
flush returned. The parent reopens the same config and reads everything back. When each
mode syncs is counted through a :class:`~tierd.stores.disk.io.FileIO` that records syncs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import tierd
from tests.disk_crash_child import content, kill_after_acks
from tierd.config import ChainConfig, load_config
from tierd.errors import ConfigError
from tierd.keys import int_key
from tierd.stores.disk.io import FileIO
from tierd.stores.disk.store import DiskStore

BB = 4096
BATCH = 8
DISK_BLOCKS = 4096  # more than the child writes before it is killed: nothing is evicted
THIS = Path(__file__).resolve()


def chain_config(directory: Path, fsync: str, **disk: Any) -> dict[str, Any]:
    return {
        "block_bytes": BB,
        "tiers": [
            {"name": "mem", "kind": "memory", "capacity": 64},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": DISK_BLOCKS,
                "directories": [str(directory)],
                "fsync": fsync,
                **disk,
            },
        ],
    }


async def _child(config: dict[str, Any]) -> None:
    """Store and flush batches forever, acknowledging each block once flushed."""
    async with tierd.open(config) as chain:
        print("ready", flush=True)
        for start in range(0, DISK_BLOCKS - BATCH, BATCH):
            ids = range(start, start + BATCH)
            await chain.store([int_key(i) for i in ids], [content(i, BB) for i in ids])
            done = await chain.flush()
            if not done.left_dirty and not done.write_errors:
                print("\n".join(f"ack {i}" for i in ids), flush=True)
        await asyncio.Event().wait()  # out of work: wait for the kill


async def _run_until_killed(config: dict[str, Any], acks: int) -> list[int]:
    argv = [sys.executable, str(THIS), json.dumps(config)]
    return await kill_after_acks(argv, THIS.parent.parent, acks)


async def _read_back(config: dict[str, Any], ids: Sequence[int]) -> dict[int, bool]:
    """Per id: whether the reopened chain holds it with the right bytes (False: a miss);
    wrong bytes fail the test at once."""
    found: dict[int, bool] = {}
    async with tierd.open(config) as chain:
        for first in range(0, len(ids), 32):
            part = list(ids[first : first + 32])
            held = chain.held_locally([int_key(i) for i in part])
            present = [i for i, h in zip(part, held, strict=True) if h]
            found.update(dict.fromkeys(part, False))
            if not present:
                continue
            async with chain.loading([int_key(i) for i in present]) as handle:
                for i, view in zip(present, handle.views(), strict=True):
                    assert bytes(view) == content(i, BB), f"block {i}: wrong bytes served"
                    found[i] = True
    return found


@pytest.mark.parametrize("fsync", ["always", "batch", "none"])
async def test_a_sigkilled_daemon_never_serves_wrong_bytes(tmp_path: Path, fsync: str) -> None:
    config = chain_config(tmp_path, fsync, fsync_interval="50ms")
    acked = await _run_until_killed(config, 160)
    found = await _read_back(config, range(max(acked) + BATCH + 1))
    lost = [i for i in acked if not found[i]]
    if fsync == "always":  # every acknowledged block survives any crash
        assert lost == [], f"acknowledged blocks lost: {lost}"
    # batch and none may lose blocks to a power loss (never to a process crash: the
    # kernel still holds what was written); whatever is served has its own bytes.
    assert any(found.values()), "nothing was read back"


class SyncCounter(FileIO):
    """Counts fsync and fdatasync calls and lists the files synced, in order; ``synced``
    is set (from any thread) on each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.syncs = 0
        self.files: list[str] = []
        self.paths: dict[int, str] = {}
        self.loop = loop
        self.synced = asyncio.Event()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        self.paths[fd] = Path(path).name
        return fd

    def _count(self, fd: int) -> None:
        self.syncs += 1
        self.files.append(self.paths.get(fd, "?"))
        self.loop.call_soon_threadsafe(self.synced.set)

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self._count(fd)

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        self._count(fd)


async def _write_batches(store: DiskStore, batches: int) -> None:
    for b in range(batches):
        ids = range(b * BATCH, (b + 1) * BATCH)
        ok = await store.write(list(ids), [int_key(i) for i in ids], [content(i, BB) for i in ids])
        assert all(ok)


@pytest.mark.parametrize(("fsync", "interval"), [("always", 1.0), ("batch", 3600.0), ("none", 1.0)])
async def test_each_mode_syncs_when_it_says(tmp_path: Path, fsync: str, interval: float) -> None:
    io = SyncCounter(asyncio.get_running_loop())
    store = DiskStore(
        num_blocks=256,
        block_bytes=BB,
        directories=[tmp_path],
        fsync=fsync,
        fsync_interval=interval,
        fileio=io,
        blocks_per_task=BATCH,
    )
    async with store:
        opened = io.syncs
        await _write_batches(store, 10)
        during = io.syncs - opened
        assert store.stats().details["fsync"] == fsync
        if fsync == "always":  # the BEGIN records before, the data after, every batch
            assert during >= 2 * 10
        else:  # batch: not before its interval; none: never while serving
            assert during == 0
    assert io.syncs > opened + during  # a clean close syncs in every mode


async def test_batch_mode_syncs_data_then_journal_after_its_interval(tmp_path: Path) -> None:
    io = SyncCounter(asyncio.get_running_loop())
    store = DiskStore(
        num_blocks=64,
        block_bytes=BB,
        directories=[tmp_path],
        fsync="batch",
        fsync_interval=0.01,
        fileio=io,
    )
    async with store:
        before = len(io.files)
        await _write_batches(store, 1)
        async with asyncio.timeout(30):  # the periodic sync comes without another write
            while "tierd-journal.bin" not in io.files[before:]:
                io.synced.clear()
                await io.synced.wait()
        assert io.files[before:] == ["tierd-slab.bin", "tierd-journal.bin"]  # data first
        assert store.stats().details["periodic_syncs"] == 1


def test_a_bad_mode_is_a_config_error_naming_its_path(tmp_path: Path) -> None:
    bad = chain_config(tmp_path, "sometimes")
    with pytest.raises(ConfigError, match=r"tiers\.1\.fsync: must be 'always', 'batch' or 'none'"):
        load_config(bad, ChainConfig)
    on_memory = chain_config(tmp_path, "none")
    on_memory["tiers"][0]["fsync"] = "none"
    with pytest.raises(ConfigError, match=r"tiers\.0\.fsync: only applies to disk tiers"):
        load_config(on_memory, ChainConfig)
    assert load_config(chain_config(tmp_path, "batch", fsync_interval="250ms"), ChainConfig)


if __name__ == "__main__":
    asyncio.run(_child(json.loads(sys.argv[1])))


# -- a power cut: what was written but not synced is lost ---------------------------------


class PowerCut(FileIO):
    """Records, per file, how to undo every write not synced yet; :meth:`cut` copies the
    store's files as a power cut at this instant would leave them, with ``lose`` (the
    names of the files whose unsynced writes are lost: by default all of them)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._names: dict[int, str] = {}
        self._undo: dict[str, list[tuple[int, bytes, int]]] = {}  # offset, old, old size

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        self._names[fd] = Path(path).name
        return fd

    def _remember(self, fd: int, offset: int, length: int) -> None:
        size = os.fstat(fd).st_size
        old = os.pread(fd, length, offset) if offset < size else b""
        self._undo.setdefault(self._names.get(fd, "?"), []).append((offset, old, size))

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        with self._lock:
            self._remember(fd, offset, sum(len(b) for b in buffers))
            return super().pwritev(fd, buffers, offset)

    def write(self, fd: int, data: bytes) -> int:
        with self._lock:
            self._remember(fd, os.fstat(fd).st_size, len(data))  # appends only
            return super().write(fd, data)

    def truncate(self, fd: int, nbytes: int) -> None:
        with self._lock:
            size = os.fstat(fd).st_size
            self._remember(fd, nbytes, max(0, size - nbytes))
            super().truncate(fd, nbytes)

    def fsync(self, fd: int) -> None:
        with self._lock:
            super().fsync(fd)
            self._undo.pop(self._names.get(fd, "?"), None)

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            super().fdatasync(fd)
            self._undo.pop(self._names.get(fd, "?"), None)

    def cut(self, src: Path, dst: Path, lose: Sequence[str] | None = None) -> Path:
        with self._lock:
            dst.mkdir()
            for path in src.iterdir():
                if path.is_file():
                    shutil.copyfile(path, dst / path.name)
            for name, undo in self._undo.items():
                if (dst / name).exists() and (lose is None or name in lose):
                    with (dst / name).open("r+b") as f:
                        for offset, old, size in reversed(undo):
                            f.seek(offset)
                            f.write(old)
                            f.truncate(size)
        return dst


def _writes(ids: range, first_slot: int, slots: int) -> tuple[list[int], list[int], list[bytes]]:
    return [first_slot + i % slots for i in ids], list(ids), [content(i, BB) for i in ids]


@pytest.mark.parametrize("lose", [None, ["tierd-slab.bin"], ["tierd-journal.bin"]])
@pytest.mark.parametrize("fsync", ["always", "batch", "none"])
async def test_a_power_cut_loses_what_its_mode_says_and_never_serves_wrong_bytes(
    tmp_path: Path, fsync: str, lose: list[str] | None
) -> None:
    # 200 writes of 4 blocks over slots 0-31, a sync, 100 more over slots 32-63
    # (checkpoints every ~46 records throughout); then the power goes: the unsynced writes
    # of the files in ``lose`` are lost. always: every acknowledged block survives. batch:
    # what the sync covered survives. Every mode: nothing served is wrong.
    live, slots = tmp_path / "live", 64
    live.mkdir()
    io = PowerCut()
    latest: dict[int, int] = {}
    store = DiskStore(
        num_blocks=slots,
        block_bytes=BB,
        directories=[live],
        fsync=fsync,
        fsync_interval=3600,
        o_direct=False,
        journal_limit_bytes=4096,
        fileio=io,
    )
    async with store:
        for n in range(300):
            slot_ids, ids, data = _writes(range(4 * n, 4 * n + 4), 0 if n < 200 else 32, 32)
            ok = await store.write(slot_ids, [int_key(i) for i in ids], data)
            latest.update((s, i) for s, i, good in zip(slot_ids, ids, ok, strict=True) if good)
            if n == 199:
                await store.sync()
                synced = dict(latest)
        dead = io.cut(live, tmp_path / "dead", lose)
    async with DiskStore(num_blocks=slots, block_bytes=BB, directories=[dead]) as store:
        served = {}
        for slot, key in store.index().items():
            i = int.from_bytes(key, "little")
            out = bytearray(BB)
            if (await store.read([slot], [key], [out]))[0]:
                assert bytes(out) == content(i, BB), f"slot {slot}: wrong bytes for {i}"
                served[slot] = i
    if fsync == "always":
        assert served == latest
    assert len(synced) == 32 and all(latest[s] == i for s, i in synced.items())
    if fsync != "none":  # (none never syncs while it serves, not even when asked)
        assert {s: served.get(s) for s in synced} == synced
