"""Reading back everything a daemon's full chain holds, through its socket (issue 60,
item 11): a daemon of 16 CPU blocks over 32 disk blocks, 48 blocks stored a prefix at a
time by a client, then loaded back oldest first. Every block comes back (32 did before
a promotion out of the full disk tier became a swap: see docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierd.client import Client
from tierd.keys import int_key
from tierd.testing import daemon_config, running_daemon

BB = 4096


def block(prefix: int, index: int) -> bytes:
    """Distinct bytes for every block of every prefix."""
    return bytes([prefix + 1, index + 1]) * (BB // 2)


@pytest.mark.parametrize("size", [4, 8])
async def test_a_daemon_serves_every_block_its_full_chain_holds(tmp_path: Path, size: int) -> None:
    config = daemon_config(tmp_path, cpu_blocks=16, disk_blocks=32, block_bytes=BB)
    count = 48 // size
    stored = [[int_key(p * 1000 + i) for i in range(size)] for p in range(count)]
    async with running_daemon(config) as daemon:
        path = str(daemon.config.socket.path)
        async with await Client.connect(path, namespace="ns") as client:
            for p, keys in enumerate(stored):
                assert await client.store(keys, [block(p, i) for i in range(size)]) == size
            served = 0
            for p, keys in enumerate(stored):  # oldest first, a prefix a request
                got = await client.load(keys)
                assert got == [block(p, i) for i in range(len(got))]
                served += len(got)
            assert served == 48
            cpu, disk = (await client.stats())["tiers"]
            assert disk["used"] == 32 and cpu["used"] == 16
            assert disk["copies_dropped"] > 0  # duplicates made room before any eviction
