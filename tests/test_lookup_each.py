"""``lookup_each``: one request answering, per key, whether the daemon holds it ready.

Through a real daemon in the test's loop and a real client: holes (a miss does not stop
the answer), blocks only on the disk tier, blocks still being written, namespaces kept
apart, the per-request key bound (the client splits, the daemon refuses a longer list)
and, with a real redis-server as the remote level, keys only the remote level holds,
found with one batched existence check.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from loop_daemon_kit import serve
from redis_kit import redis_server

from tierd.client import Client, DaemonError
from tierd.daemon import Daemon

BLOCK = 4096
NS = "model-a"


def block(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(BLOCK)


def names(tag: str, count: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(count)]


async def connect(daemon: Daemon, namespace: str | None = NS) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=namespace)


async def test_holes_and_misses_are_answered_per_key(tmp_path: Path) -> None:
    async with serve(tmp_path, watch_loop=False) as daemon, await connect(daemon) as client:
        keys = names("k", 8)
        held = [keys[i] for i in (0, 2, 3, 7)]
        assert await client.store(held, [block(k) for k in held]) == 4
        assert await client.lookup_each(keys) == [
            True,
            False,
            True,
            True,
            False,
            False,
            False,
            True,
        ]
        # The prefix lookup stops at the first hole; lookup_each does not.
        assert (await client.lookup(keys)).count == 1
        assert await client.lookup_each([b"absent"]) == [False]
        assert await client.lookup_each([]) == []


async def test_blocks_held_only_by_the_disk_tier_count(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, watch_loop=False, cpu_blocks=4) as daemon,
        await connect(daemon) as client,
    ):
        keys = names("d", 12)  # 12 blocks through a 4-block CPU tier: most are demoted
        for start in range(0, 12, 4):
            part = keys[start : start + 4]
            await client.store(part, [block(k) for k in part])
        media = (await client.lookup(keys)).media
        assert "DISK" in media and "CPU" in media
        assert await client.lookup_each(keys) == [True] * 12


async def test_a_block_still_being_written_is_not_held(tmp_path: Path) -> None:
    async with serve(tmp_path, watch_loop=False) as daemon, await connect(daemon) as client:
        lease = await client.prepare_store([b"w"])
        assert await client.lookup_each([b"w"]) == [False]
        await lease.commit()
        assert await client.lookup_each([b"w"]) == [True]


async def test_namespaces_are_kept_apart(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, watch_loop=False) as daemon,
        await connect(daemon, "model-a") as a,
        await connect(daemon, "model-b") as b,
    ):
        keys = names("n", 3)
        await a.store(keys, [block(k) for k in keys])
        assert await a.lookup_each(keys) == [True] * 3
        assert await b.lookup_each(keys) == [False] * 3


async def test_the_key_bound_holds_and_the_client_splits(tmp_path: Path) -> None:
    limits = {"max_keys_per_request": 8}
    async with (
        serve(tmp_path, watch_loop=False, cpu_blocks=32, limits=limits) as daemon,
        await connect(daemon) as client,
    ):
        keys = names("s", 20)
        held = keys[::3]
        await client.store(held[:7], [block(k) for k in held[:7]])
        assert await client.lookup_each(keys) == [k in held[:7] for k in keys]
        with pytest.raises(DaemonError) as info:
            await client.request("lookup_each", keys=keys)
        assert info.value.code == "too_many_keys"
        with pytest.raises(DaemonError) as info:
            await client.request("lookup_each", keys=[b"ok", 7])
        assert info.value.code == "bad_key"


async def test_keys_only_the_remote_level_holds_are_found(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        remote = {"url": server.url, "deadline": "2s"}
        async with (
            serve(tmp_path, watch_loop=False, remote=remote) as daemon,
            await connect(daemon) as client,
        ):
            keys = names("r", 6)
            sent = keys[:4]
            await client.store(sent, [block(k) for k in sent])
            await client.flush()  # copies down, then sends the disk tier's blocks
            async with await Client.connect(str(daemon.config.socket.path)) as operator:
                assert await operator.clear() >= 4  # gone from every local tier
            assert (await client.lookup(keys)).media == ("REMOTE",) * 4
            lookups = (await client.stats())["remote"]["lookups"]
            local = [b"local"]
            await client.store(local, [block(b"local")])
            # A local hit, two remote-only blocks, a miss, a remote-only block: one request.
            asked = [local[0], keys[1], keys[3], keys[5], keys[0]]
            assert await client.lookup_each(asked) == [True, True, True, False, True]
            stats = (await client.stats())["remote"]
            assert stats["lookups"] == lookups + 1  # one batched check for the four
            server.pause()  # a hung remote level is a miss within its deadline
            try:
                assert await client.lookup_each(asked) == [True, False, False, False, False]
            finally:
                server.resume()
