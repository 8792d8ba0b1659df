"""The remote level against servers that misbehave: a hostile one streaming a reply of two
billion elements, one answering with the wrong shape, and a real redis-server asked by
more callers at once than the pool has connections.

A server may cost misses, never a stalled daemon, an ``internal`` error or a breaker
opened by the daemon's own concurrency. The hostile servers are ``tests/fake_redis.py``
on loopback; the real one is ``tests/redis_kit.py``'s.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_redis import fake_redis
from redis.exceptions import InvalidResponse
from redis_kit import RedisServer, redis_server

from tests.daemon_kit import Spawn
from tierd.client import Client
from tierd.config import ChainConfig
from tierd.errors import BlockMissing
from tierd.keys import BlockKey
from tierd.library import open_chain
from tierd.remote.guard import ReplyGuard
from tierd.testing import daemon_config

BLOCK = 4096
NAMESPACE = "model-x"
PING_GUARD_S = 2.0  # a hang guard: the stall this reproduces lasted 4 s per reconnect


def block(key: bytes) -> bytes:
    return random.Random(key).randbytes(BLOCK)


def names(prefix: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{prefix}-{i}".encode()) for i in range(count)]


def chain_config(remote: dict[str, Any], *, blocks: int = 4, **tier: Any) -> ChainConfig:
    return ChainConfig.model_validate(
        {
            "block_bytes": BLOCK,
            "tiers": [{"name": "mem", "kind": "memory", "capacity": blocks, **tier}],
            "remote": {"breaker_backoff": 0.3, **remote},
        }
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


# -- break 1: a server streaming a huge array -----------------------------------------------


def test_the_guard_refuses_headers_over_its_bounds_across_chunk_edges() -> None:
    guard = ReplyGuard(max_elements=4, max_bulk=8)
    guard.feed(b"*4\r\n$8\r\n01234")  # a value cut inside its body...
    guard.feed(b"567\r\n$-1\r\n:1\r\n+OK\r\n-ERR x\r\n*")  # ...and a header cut in two
    guard.feed(b"2\r\n$3\r\nabc\r\n$0\r\n\r\n")
    cut = ReplyGuard(4, 8)
    cut.feed(b"*21474836")  # the header comes in pieces
    with pytest.raises(InvalidResponse, match="2147483648 elements, over the bound of 4"):
        cut.feed(b"48\r\n")
    with pytest.raises(InvalidResponse, match="a value of 9 bytes, over the bound of 8"):
        ReplyGuard(4, 8).feed(b"$9\r\n")
    with pytest.raises(InvalidResponse, match="not a length"):
        ReplyGuard(4, 8).feed(b"*x\r\n")


async def test_a_server_streaming_a_huge_array_never_stalls_the_daemon(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Loads make the server stream ``*2147483648`` then elements without end; another
    client's round trips keep being answered all along, and the level says why it
    refused the reply."""
    with fake_redis("huge") as bad:
        config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
        config["remote"] = {"url": bad.url, "deadline": "100ms", "breaker_failures": 1000}
        daemon = await spawn(config)
        loader = await Client.connect(daemon.socket_path, namespace=NAMESPACE, block_bytes=BLOCK)
        pinger = await Client.connect(daemon.socket_path)
        done = asyncio.Event()

        async def loads() -> None:
            try:
                for key in names("held-remotely", 4):
                    assert await loader.load([key]) == []  # one MGET, one reconnect each
            finally:
                done.set()

        async def pings() -> int:
            answered = 0
            while not done.is_set() and answered < 10_000:
                async with asyncio.timeout(PING_GUARD_S):
                    await pinger.health()
                answered += 1
            return answered

        try:
            _, answered = await asyncio.gather(loads(), pings())
            remote = (await pinger.stats())["remote"]
        finally:
            await loader.close()
            await pinger.close()
        assert bad.streamed >= 2 and answered > 0
        assert remote["errors"] >= 2 and remote["hits"] == 0
        assert "2147483648 elements, over the bound" in remote["last_error"]
        assert await daemon.stop() == 0


# -- break 5: replies of the wrong shape ---------------------------------------------------


@pytest.mark.parametrize("mode", ["short", "integer"])
async def test_a_reply_of_the_wrong_shape_is_a_counted_miss(mode: str) -> None:
    keys = names("shape", 3)
    with fake_redis(mode) as bad:
        async with open_chain(chain_config({"url": bad.url, "deadline": "2s"})) as chain:
            assert (await chain.find(keys)).count == 3  # the server says it holds them
            with pytest.raises(BlockMissing):
                await chain.load(keys)
            assert chain.remote is not None
            stats = chain.remote.level.stats()
    assert stats["malformed"] == 1 and stats["misses"] == 3 and stats["hits"] == 0
    assert stats["last_error"].startswith("malformed reply: MGET of 3 keys answered with")


async def test_a_malformed_reply_through_the_daemon_is_a_miss_not_internal(
    tmp_path: Path, spawn: Spawn
) -> None:
    with fake_redis("short") as bad:
        config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
        config["remote"] = {"url": bad.url, "deadline": "2s"}
        daemon = await spawn(config)
        client = await Client.connect(daemon.socket_path, namespace=NAMESPACE, block_bytes=BLOCK)
        try:
            assert await client.get(names("shape", 2)) == []
            assert await client.load(names("shape", 2)) == []  # prepare_load
            assert (await client.stats())["remote"]["malformed"] == 2
        finally:
            await client.close()
        assert "Traceback" not in daemon.stderr()
        assert await daemon.stop() == 0


# -- break 2: more callers than connections ------------------------------------------------


async def test_calls_beyond_the_pool_wait_for_a_connection(server: RedisServer) -> None:
    keys = names("pooled", 64)
    writer_config = chain_config({"url": server.url}, blocks=64, write_through=True)
    async with open_chain(writer_config) as writer:
        await writer.store(keys, [block(k) for k in keys])
        assert writer.remote is not None
        await writer.remote.level.drain()
    reader_config = chain_config({"url": server.url, "pool_size": 4, "deadline": "5s"}, blocks=64)
    async with open_chain(reader_config) as reader:
        found = await asyncio.gather(*(reader.find([k]) for k in keys))
        loaded = await asyncio.gather(*(reader.load([k]) for k in keys))
        assert reader.remote is not None
        stats = reader.remote.level.stats()
    assert [f.count for f in found] == [1] * 64
    assert len(loaded) == 64 and stats["hits"] == 64
    assert (stats["errors"], stats["breaker_opened"], stats["busy"]) == (0, 0, 0)


async def test_a_full_pool_past_the_deadline_is_busy_not_a_server_failure() -> None:
    """A wedged server holds both pooled connections: those two calls time out (the
    server's fault, counted); the thirty others, still waiting for a connection at their
    deadline, are ``busy`` and do not count against the server."""
    with fake_redis("slow") as wedged:
        remote = {"url": wedged.url, "pool_size": 2, "deadline": "300ms", "breaker_failures": 3}
        async with open_chain(chain_config(remote)) as chain:
            results = await asyncio.gather(
                *(chain.load([k]) for k in names("wedged", 32)), return_exceptions=True
            )
            assert chain.remote is not None
            stats = chain.remote.level.stats()
            wedged.release.set()
    assert all(isinstance(r, BlockMissing) for r in results)
    assert stats["timeouts"] == 2 and stats["busy"] == 30
    assert stats["breaker_opened"] == 0


# -- deployments that differ ---------------------------------------------------------------


async def test_another_block_size_never_sees_nor_deletes_the_values(server: RedisServer) -> None:
    keys = names("sized", 2)
    async with open_chain(chain_config({"url": server.url}, write_through=True)) as small:
        await small.store(keys, [block(k) for k in keys])
        assert small.remote is not None
        await small.remote.level.drain()
    bigger = ChainConfig.model_validate(
        {
            "block_bytes": 2 * BLOCK,
            "tiers": [{"name": "mem", "kind": "memory", "capacity": 4}],
            "remote": {"url": server.url},
        }
    )
    async with open_chain(bigger) as big:
        assert (await big.find(keys)).count == 0
        assert big.remote is not None and big.remote.level.stats()["corrupt"] == 0
    async with (
        open_chain(chain_config({"url": server.url})) as again,
        again.loading(keys) as handle,
    ):
        assert [bytes(view) for view in handle.views()] == [block(k) for k in keys]
