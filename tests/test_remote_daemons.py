"""Two real ``tierd serve`` processes over one shared redis-server: a block stored through
one daemon is found and loaded byte-exact through the other, which names the remote level
as where it was, counts the hit in its stats, and shows the level in ``tierd top``.

Each daemon is a child process with its own socket, its own CPU tier (shared memory) and
its own disk tier directory; both name the same ``remote: url``. The blocks reach the
server deterministically: ``flush`` through daemon A copies its CPU tier down to its disk
tier and then sends the disk tier's blocks to the remote level, waiting for the writes.
The daemons are started and stopped (by PID) with the ``spawn`` fixture that the lifecycle
tests use.

The last tests check the write path the daemons share through the level itself: a write
asks ``EXISTS`` first only while that pays, and the value buffers it reuses never mix
blocks up.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis_kit import RedisServer, redis_server

from tests.daemon_kit import DaemonProcess, Spawn
from tests.remote_daemon_kit import BLOCK, block, cli, connect, names, node_config
from tierd.remote.calls import RemoteSettings
from tierd.remote.redis_level import RedisLevel


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@asynccontextmanager
async def two_daemons(
    tmp_path: Path, spawn: Spawn, url: str
) -> AsyncIterator[tuple[DaemonProcess, DaemonProcess]]:
    """Daemons A and B over the server at ``url``, both ready; stopped by PID (SIGTERM,
    status 0) on exit."""
    a, b = [await spawn(node_config(tmp_path / name, url)) for name in ("a", "b")]
    try:
        yield a, b
    finally:
        statuses = [await a.stop(), await b.stop()]
    assert statuses == [0, 0], [a.stderr(), b.stderr()]


async def test_a_block_stored_through_one_daemon_loads_byte_exact_through_another(
    tmp_path: Path, spawn: Spawn, server: RedisServer
) -> None:
    keys = names("shared", 6)
    async with two_daemons(tmp_path, spawn, server.url) as (a, b):
        async with await connect(a) as client:
            assert await client.store(keys, [block(k) for k in keys]) == len(keys)
            flushed = await client.flush()
            assert flushed.dirty == 0, flushed
            a_remote = (await client.stats())["remote"]
        assert a_remote["stores"] == len(keys) and a_remote["write_errors"] == 0
        assert server.cli("DBSIZE").strip() == str(len(keys))

        async with await connect(b) as client:
            before = await client.stats()
            assert before["remote"]["hits"] == 0
            assert all(tier["used"] == 0 for tier in before["tiers"])  # B holds nothing
            # One more key that nobody stored: the run of hits stops before it.
            found = await client.lookup([*keys, b"nobody-stored-this"])
            assert found.count == len(keys)
            assert found.media == ("REMOTE",) * len(keys)
            assert await client.load(keys) == [block(k) for k in keys]
            # Promoted into B's own CPU tier: the next lookup is local.
            assert (await client.lookup(keys)).media == ("CPU",) * len(keys)
            after = await client.stats()

        remote = after["remote"]
        assert remote["medium"] == "REMOTE" and remote["state"] == "closed"
        assert remote["endpoint"] == server.url
        assert remote["lookup_hits"] == len(keys)  # lookups found them only remotely
        assert remote["hits"] == len(keys)  # read, verified
        assert remote["promotions"] == len(keys)
        assert remote["corrupt"] == remote["errors"] == remote["timeouts"] == 0
        assert remote["bytes_read"] >= len(keys) * BLOCK
        cpu = next(tier for tier in after["tiers"] if tier["name"] == "cpu")
        assert cpu["promotions"] == len(keys) and cpu["used"] == len(keys)

        # Another namespace is another key prefix: B finds nothing of model-x's there.
        async with await connect(b, "model-y") as client:
            assert (await client.lookup(keys)).count == 0

        status, out = await cli("stats", "--json", "--socket", b.socket_path)
        assert status == 0
        assert '"lookup_hits": 6' in out and '"medium": "REMOTE"' in out
        status, out = await cli("stats", "--socket", b.socket_path)
        assert status == 0
        assert f"remote remote (REMOTE) {server.url}: breaker closed, 6 lookup hits" in out
        status, out = await cli(
            "top", "--socket", b.socket_path, "--plain", "--count", "1", "--interval", "0.05"
        )
        assert status == 0, out
        assert f"remote remote (REMOTE) {server.url}" in out
        assert "breaker closed" in out and "lookup hits 6" in out


# -- the write path both daemons use (tierd/remote/redis_level.py) -------------------------


def exists_calls(server: RedisServer) -> int:
    """How many EXISTS commands the server has run."""
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_exists:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def open_level(server: RedisServer, block_bytes: int) -> RedisLevel:
    settings = RemoteSettings(name="remote", block_bytes=block_bytes, url=server.url)
    return await RedisLevel(settings).open()


async def test_writes_ask_which_blocks_are_there_only_while_that_pays(
    server: RedisServer,
) -> None:
    size = 256 << 10  # EXISTS first pays when more than 1/8 of written blocks are there
    payload = random.Random(1).randbytes(size)
    level = await open_level(server, size)
    try:
        assert level.check_above == 1 / 8 and level.held_share > level.check_above
        new = names("new", 7)
        assert await level.put(new[:1], [payload]) == 1
        assert exists_calls(server) == 1  # a fresh level asks first
        for i in range(1, 6):  # new blocks, written: the share of held ones falls
            assert await level.put(new[i : i + 1], [payload]) == 1
        asked = exists_calls(server)
        assert level.held_share < level.check_above
        assert await level.put(new[6:], [payload]) == 1
        assert exists_calls(server) == asked  # no EXISTS round trip for new blocks
        # Blocks another node wrote: SET NX says they were there, and writes ask again.
        assert await level.put(new[:2], [payload, payload]) == 0
        assert level.held_share > level.check_above
        assert await level.put(new[2:3], [payload]) == 0
        assert exists_calls(server) == asked + 1
        stats = level.stats()
        assert stats["stores"] == 7 and stats["skipped"] == 3
    finally:
        await level.close()


async def test_small_blocks_are_written_once_without_asking(server: RedisServer) -> None:
    size = 4096  # a check costs more than sending such a block again
    keys = names("small", 40)
    first, second = await open_level(server, size), await open_level(server, size)
    try:
        assert first.held_share <= first.check_above == 1.0
        # Many writes in a row: the value buffers are reused; every value reads back whole.
        for start in range(0, len(keys), 8):
            part = keys[start : start + 8]
            assert await first.put(part, [block(k)[:size] for k in part]) == len(part)
        assert await second.put(keys, [block(k)[:size] for k in keys]) == 0  # SET NX
        assert exists_calls(server) == 0
        assert second.stats()["skipped"] == len(keys)
        got = await second.get(keys)
        assert [bytes(view) for view in got] == [block(k)[:size] for k in keys]
    finally:
        await first.close()
        await second.close()
