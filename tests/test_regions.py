"""Engine host regions through a real daemon: an engine's memory (a real memfd, a real
``/dev/shm`` file) handed over once, then stores and loads of (key, offsets) descriptors
that the daemon copies itself.

Round trips are byte-exact with one and two pieces per block; loads are per key; regions
belong to the connection that registered them (other connections and other tenants get
``unknown_region``) and their descriptor is closed when it goes. The hostile cases are in
``tests/test_region_attacks.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tierd.client import Client
from tierd.daemon import Daemon
from tierd.testing import daemon_config, running_daemon

BLOCK = 4096
NS = "model-a"


def pattern(tag: bytes, size: int) -> bytes:
    """Bytes derived from ``tag`` alone, so any mix-up shows."""
    return (tag * (size // len(tag) + 1))[:size]


@asynccontextmanager
async def serve(tmp_path: Path, **options: Any) -> AsyncIterator[Daemon]:
    options.setdefault("logging", {"level": "warning"})
    async with asyncio.timeout(60), running_daemon(daemon_config(tmp_path, **options)) as daemon:
        yield daemon


async def connect(daemon: Daemon, namespace: str | None = NS) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=namespace)


@contextmanager
def memfd(size: int, name: str = "engine-kv") -> Iterator[int]:
    fd = os.memfd_create(name)
    try:
        os.ftruncate(fd, size)
        yield fd
    finally:
        os.close(fd)


def rows(*indices: int, size: int = BLOCK) -> np.ndarray:
    """One piece per key: key i's block at row ``indices[i]``."""
    return np.array([[i * size] for i in indices], dtype=np.uint64)


def read(fd: int, offset: int, size: int = BLOCK) -> bytes:
    return os.pread(fd, size, offset)


async def test_one_piece_round_trip_is_byte_exact(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(16 * BLOCK) as fd:
            blocks = [os.urandom(BLOCK) for _ in range(6)]
            for i, data in enumerate(blocks):
                os.pwrite(fd, data, i * BLOCK)
            region = await client.register_region(fd, 16 * BLOCK)
            keys = [f"k{i}".encode() for i in range(6)]
            assert await client.region_store(region, keys, rows(0, 1, 2, 3, 4, 5)) == [True] * 6
            assert await client.lookup_each(keys) == [True] * 6
            # Loaded into other rows, in another order.
            order = [5, 3, 1, 0, 2, 4]
            dest = rows(*(10 + j for j in range(6)))
            done = await client.region_load(region, [keys[i] for i in order], dest)
            assert done == [True] * 6
            for j, i in enumerate(order):
                assert read(fd, (10 + j) * BLOCK) == blocks[i]
            # The same bytes come back through the ordinary lease path.
            assert await client.load(keys[:2]) == blocks[:2]
