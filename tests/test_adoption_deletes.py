"""Deletes and clears while a restarted daemon still adopts the disk tier's kept blocks.

Over ``adopt_inline`` kept blocks the disk tier serves before it has adopted them; a
block not adopted yet is a miss. A ``delete`` (by keys, by prefix, a whole namespace)
or a ``clear`` sent meanwhile must remove it for good: not brought back when adoption
reaches it, nor by the next restart. Each test runs a real daemon in this loop, stops
it cleanly, and starts it again on the same slab.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.soak_daemon_kit import NS, blocks, make_keys, store_batches, tier
from tierd.client import Client
from tierd.testing import daemon_config, running_daemon

KEPT = 200  # blocks kept across the restart, all over adopt_inline (0)
RATE = 100  # blocks adopted a second: two seconds of adoption to delete during


def _config(tmp_path: Path, **disk: Any) -> dict[str, Any]:
    config = daemon_config(tmp_path, cpu_blocks=16, disk_blocks=512, logging={"level": "warning"})
    config["tiers"][1].update(disk)
    return config


async def _connect(daemon: Any, namespace: str | None = NS) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=namespace)


async def _adoption_done() -> None:
    """Wait for the daemon's adoption tasks (in this loop) to finish."""
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("adopt-")]
    if tasks:
        await asyncio.wait(tasks)


async def _found(client: Client, keys: Sequence[bytes]) -> list[bytes]:
    return [k for k, held in zip(keys, await client.lookup_each(keys), strict=True) if held]


async def _delete(daemon: Any, client: Client, mode: str, doomed: list[bytes]) -> None:
    if mode == "all":
        await client.delete(everything=True)
    elif mode == "prefix":
        await client.delete(prefix=b"doomed-")
    elif mode == "keys":
        await client.delete(doomed)
    else:
        async with await _connect(daemon, None) as operator:
            await operator.clear()


@pytest.mark.parametrize("mode", ["all", "prefix", "keys", "clear"])
async def test_blocks_deleted_while_adopting_never_come_back(tmp_path: Path, mode: str) -> None:
    doomed, spared = make_keys("doomed", KEPT // 2), make_keys("spared", KEPT // 2)
    every = doomed + spared
    if mode in ("all", "clear"):  # these take every block of the namespace (or tier)
        doomed, spared = doomed + spared, []
    async with asyncio.timeout(120):
        async with running_daemon(_config(tmp_path)) as daemon, await _connect(daemon) as c:
            await store_batches(c, every, 16)
            await c.flush()
        async with (
            running_daemon(_config(tmp_path, adopt_inline=0, adopt_rate=RATE)) as daemon,
            await _connect(daemon) as client,
        ):
            assert tier(await client.stats(), "disk")["adopting"] > KEPT // 2
            await _delete(daemon, client, mode, doomed)
            await _adoption_done()
            assert tier(await client.stats(), "disk")["adopting"] == 0
            assert await _found(client, doomed) == []
            assert await _found(client, spared) == spared
        async with running_daemon(_config(tmp_path)) as daemon, await _connect(daemon) as client:
            assert await _found(client, doomed) == []
            assert await _found(client, spared) == spared
            for i in range(0, len(spared), 16):  # a load lease is bounded by the cpu tier
                assert await client.load(spared[i : i + 16]) == blocks(spared[i : i + 16])


@pytest.mark.parametrize("mode", ["prefix", "keys"])
async def test_a_restart_mid_adoption_keeps_the_deletes(tmp_path: Path, mode: str) -> None:
    # Stopped before adoption reached the deleted blocks: the next start must not find them.
    doomed, spared = make_keys("doomed", KEPT // 2), make_keys("spared", KEPT // 2)
    async with asyncio.timeout(120):
        async with running_daemon(_config(tmp_path)) as daemon, await _connect(daemon) as c:
            await store_batches(c, spared + doomed, 16)
            await c.flush()
        slow = _config(tmp_path, adopt_inline=0, adopt_rate=1)
        async with running_daemon(slow) as daemon, await _connect(daemon) as client:
            assert tier(await client.stats(), "disk")["adopting"] > KEPT - 2
            await _delete(daemon, client, mode, doomed)
        async with running_daemon(_config(tmp_path)) as daemon, await _connect(daemon) as client:
            assert await _found(client, doomed) == []
            assert await _found(client, spared) == spared
