"""``Client.store()`` and the example client split a batch to fit what the daemon takes at
once (``limits.lease_blocks_per_connection`` through the pool, the frame size inline)
instead of failing on the bound. A real daemon on a real socket; the example runs as a
second process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tierd.client import Client
from tierd.testing import daemon_config, running_daemon

BLOCK = 4096
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "client_demo.py"


def blocks(prefix: str, count: int) -> tuple[list[bytes], list[bytes]]:
    keys = [f"{prefix}-{i}".encode() for i in range(count)]
    return keys, [bytes([i % 251]) * BLOCK for i in range(count)]


def small_leases(tmp_path: Path, **limits: object) -> dict[str, Any]:
    cfg = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=BLOCK)
    cfg["limits"] = {"lease_blocks_per_connection": "10%", **limits}  # 6 blocks
    return cfg


async def test_store_splits_a_batch_over_the_lease_bound(tmp_path: Path) -> None:
    cfg = small_leases(tmp_path)
    keys, data = blocks("many", 40)
    socket = cfg["socket"]["path"]
    async with running_daemon(cfg), await Client.connect(socket, namespace="ns") as client:
        assert client.pool is not None and client.info["max_lease_blocks"] == 6
        assert await client.store(keys, data) == 40
        assert await client.store(keys, data) == 0  # all there: nothing new
        loaded = [b for s in range(0, 40, 6) for b in await client.load(keys[s : s + 6])]
    assert loaded == data


async def test_inline_store_splits_a_batch_over_the_frame_size(tmp_path: Path) -> None:
    cfg = small_leases(tmp_path, max_frame_bytes=(64 << 10) + 4 * BLOCK)
    keys, data = blocks("inline", 20)
    async with running_daemon(cfg):
        path = cfg["socket"]["path"]
        async with await Client.connect(path, namespace="ns", map_pool=False) as client:
            assert client.pool is None
            assert await client.store(keys, data) == 20
            assert await client.get(keys[:3]) == data[:3]


def demo(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIERD_SOCKET": socket}
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


async def test_the_example_client_fits_its_batches_to_the_daemon(tmp_path: Path) -> None:
    cfg = small_leases(tmp_path)
    socket = str(cfg["socket"]["path"])
    async with running_daemon(cfg):
        stored = await asyncio.to_thread(demo, socket, "store", "--count", "40")
        loaded = await asyncio.to_thread(demo, socket, "load", "--count", "40")

    assert stored.returncode == 0, stored.stderr
    assert "Traceback" not in stored.stderr + loaded.stderr
    assert "stored 40 new blocks" in stored.stdout
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded 40 blocks byte-identical, 0 wrong" in loaded.stdout
