"""A bad day of the machine: a small /dev/shm, a file system that fills up while the
daemon runs, a journal deleted under a running daemon, a forged index snapshot.

Real daemon processes on real file systems: the full and small ones are tmpfs mounts
made for the test (root only; skipped with the reason otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash

from tests.daemon_kit import BLOCK, DaemonProcess, Spawn, block, keys
from tierd.client import Client
from tierd.testing import daemon_config

NS = "machine"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` mounted on a temporary directory."""
    mount_point = Path(tempfile.mkdtemp(prefix="tierd-tmpfs-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        check=True,
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
        mount_point.rmdir()


def fill(directory: Path) -> Path:
    """Write a filler file until the file system is full."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        chunk = b"\xff" * (64 << 10)
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
                f.flush()
    with contextlib.suppress(OSError):
        os.fsync(os.open(filler, os.O_RDONLY))
    return filler


def disk_config(tmp_path: Path, directory: Path, **extra: object) -> dict[str, object]:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64, **extra)
    cfg["tiers"][1]["directories"] = [str(directory)]  # type: ignore[index]
    return cfg


async def connect(socket_path: str) -> Client:
    return await Client.connect(socket_path, namespace=NS, block_bytes=BLOCK)


async def disk_stats(client: Client) -> dict[str, object]:
    tiers = (await client.stats())["tiers"]
    return next(t for t in tiers if t["name"] == "disk")


# -- /dev/shm too small -------------------------------------------------------------------------

_SHM_CHILD = """
import asyncio, sys
from tierd.stores.cpu import CpuStore
from tierd.errors import StoreIOError

async def main(shm_dir):
    store = CpuStore(num_blocks=32, block_bytes=1 << 20, shm_dir=shm_dir, pin=False)
    try:
        await store.open()
    except StoreIOError as exc:
        print("refused:", exc)
        return 3
    for slot in range(32):
        store.view(slot)[:] = b"x" * (1 << 20)
    await store.close()
    return 0

sys.exit(asyncio.run(main(sys.argv[1])))
"""


@needs_root
def test_a_pool_larger_than_its_shared_memory_is_refused_at_open() -> None:
    """A 32 MiB pool on a 16 MiB tmpfs mapped fine and died of SIGBUS at the 16th MiB
    written. Its pages are now allocated when it is created: a clear error, at once."""
    with tmpfs("16m") as shm:
        child = subprocess.run(
            [sys.executable, "-c", _SHM_CHILD, str(shm)], capture_output=True, text=True
        )
        assert child.returncode == 3, (child.returncode, child.stdout, child.stderr)
        assert "No space left on device" in child.stdout
        assert "33,554,432" in child.stdout or "32.0 MiB" in child.stdout, child.stdout
        assert os.listdir(shm) == []  # the failed pool is not left behind


# -- a full file system while running -------------------------------------------------------------


@needs_root
async def test_a_full_file_system_loses_no_block_silently(tmp_path: Path, spawn: Spawn) -> None:
    with tmpfs("2m") as directory:
        daemon = await spawn(disk_config(tmp_path, directory))
        client = await connect(daemon.socket_path)
        first = keys("before", 8)
        for name in first:
            assert await client.store([name], [block(name)]) == 1
        assert (await client.flush()).dirty == 0
        fill(directory)
        later = keys("full", 64)
        for i in range(0, len(later), 8):
            await client.store(later[i : i + 8], [block(k) for k in later[i : i + 8]])
        disk = await disk_stats(client)
        on_disk = [k for k in later if (await client.lookup([k])).count]
        # Every block that did not make it down is counted as refused by the disk tier.
        lost = len(later) - len(on_disk)
        assert lost > 0
        assert disk["io_errors"] + disk["refused"] >= lost - 8  # 8 still in the CPU tier
        await client.close()
        assert await daemon.stop() == 0
        err = daemon.stderr()
        assert "cannot start" not in err
        assert "could not save" in err, err[-2000:]
        assert not [p for p in os.listdir(directory) if p.endswith(".tmp")]
        # A restart on the still-full file system serves what the disk holds.
        again = await spawn(disk_config(tmp_path, directory))
        client = await connect(again.socket_path)
        try:
            assert await client.load(first) == [block(k) for k in first]
        finally:
            await client.close()
        assert await again.stop() == 0


# -- the journal deleted while running ------------------------------------------------------------


async def flushed_daemon(
    tmp_path: Path, spawn: Spawn, names: list[bytes]
) -> tuple[DaemonProcess, dict[str, Any], Path]:
    """A daemon (CPU 8 over disk 64) holding ``names``, flushed to its disk tier; with
    its config and its disk directory."""
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64)
    directory = Path(cfg["tiers"][1]["directories"][0])
    daemon = await spawn(cfg)
    client = await connect(daemon.socket_path)
    try:
        for i in range(0, len(names), 8):
            await client.store(names[i : i + 8], [block(k) for k in names[i : i + 8]])
        assert (await client.flush()).dirty == 0
    finally:
        await client.close()
    return daemon, cfg, directory


async def test_a_missing_journal_after_a_kill_means_a_crash(tmp_path: Path, spawn: Spawn) -> None:
    names = keys("kept", 40)
    daemon, cfg, directory = await flushed_daemon(tmp_path, spawn, names)
    (directory / "tierd-journal.bin").unlink()
    daemon.signal(signal.SIGKILL)
    await daemon.wait()
    again = await spawn(cfg)
    client = await connect(again.socket_path)
    try:
        assert await client.load(names[:8]) == [block(k) for k in names[:8]]
        found = sum([(await client.lookup([k])).count for k in names])
        assert found == len(names)
    finally:
        await client.close()
    assert "unclean shutdown" in again.stderr()
    assert await again.stop() == 0


# -- a forged snapshot --------------------------------------------------------------------


async def test_a_forged_snapshot_is_rebuilt_from_the_slab(tmp_path: Path, spawn: Spawn) -> None:
    names = keys("forged", 8)
    daemon, cfg, directory = await flushed_daemon(tmp_path, spawn, names)
    assert await daemon.stop() == 0
    body = msgpack.packb([1, 2, 3])  # a checksummed body that is not a map
    (directory / "tierd-index.msgpack").write_bytes(
        xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body
    )
    again = await spawn(cfg)
    client = await connect(again.socket_path)
    try:
        assert await client.load(names) == [block(k) for k in names]
    finally:
        await client.close()
    assert "snapshot" in again.stderr() and "rebuil" in again.stderr()
    assert await again.stop() == 0
    await asyncio.sleep(0)


# -- tenants' slabs on a small file system ------------------------------------------------------


@needs_root
async def test_tenants_slabs_are_reused_at_restart_not_asked_for_again(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Each tenant's slab is in ``<directory>/<tenant>/``. The machine checks looked for a
    slab in the directory itself, found none, and asked for the whole tier again on top
    of the slabs already there: a daemon whose disk tier took most of its file system
    could start once and never again."""
    with tmpfs("4m") as directory:
        cfg = disk_config(tmp_path, directory)
        # 384 blocks: 2 slabs of 192, 1.5 MiB each (a 4 KiB header per 4 KiB block), 3 MiB
        # of a 4 MiB file system.
        cfg["tiers"][1]["capacity"] = "1536KiB"
        cfg["tenants"] = [
            {"name": "ops", "uids": [0], "operator": True},
            {"name": "other", "uids": [54321]},
        ]
        first = await spawn(cfg)
        assert await first.stop() == 0
        assert sorted(p.name for p in directory.iterdir()) == ["ops", "other"]
        again = await spawn(cfg)  # refused before: "needs 1.5 MiB ... has 1 MiB free"
        async with await connect(again.socket_path) as client:
            assert (await client.stats())["tenants"].keys() == {"ops", "other"}
        assert await again.stop() == 0
