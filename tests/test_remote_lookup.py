"""A lookup over a chain with a remote level reports the whole leading run across local and
remote levels: under LRU a prefix's head ages out of the local tiers first, so a head held
only by the remote level with its tail still local is the usual shape. One real ``tierd
serve`` over one real redis-server; the keys the local tiers lack are asked of the server
in one existence round trip, and a load serves the whole run, byte-exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_kit import RedisServer, redis_server

from tests.daemon_kit import DaemonProcess, Spawn
from tests.remote_daemon_kit import block, connect, names, node_config
from tierd.client import Client


async def clear_local_tiers(daemon: DaemonProcess) -> None:
    """Drop every block of the local tiers (an operator's ``clear``; the server keeps its)."""
    async with await Client.connect(daemon.socket_path) as operator:
        assert await operator.clear() > 0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


async def test_a_prefix_with_its_head_only_remote_and_its_tail_local_is_one_run(
    tmp_path: Path, spawn: Spawn, server: RedisServer
) -> None:
    head, middle, end = names("head", 5), names("middle", 6), names("end", 3)
    daemon = await spawn(node_config(tmp_path / "node", server.url))
    try:
        async with await connect(daemon) as client:
            # head and end reach the server (flush sends the last local level's blocks),
            # then leave every local tier; middle is stored locally only.
            remote_only = head + end
            assert await client.store(remote_only, [block(k) for k in remote_only]) == 8
            assert (await client.flush()).dirty == 0
            await clear_local_tiers(daemon)
            assert await client.store(middle, [block(k) for k in middle]) == 6
            assert server.cli("DBSIZE").strip() == "8"
            before = (await client.stats())["remote"]

            prefix = head + middle + end
            found = await client.lookup([*prefix, b"nobody-stored-this", *middle])
            after = (await client.stats())["remote"]
            assert found.count == len(prefix)
            assert found.media == ("REMOTE",) * 5 + ("CPU",) * 6 + ("REMOTE",) * 3
            assert not found.in_flight
            assert after["lookups"] - before["lookups"] == 1  # one existence round trip
            assert after["lookup_hits"] - before["lookup_hits"] == 8

            assert await client.load(prefix) == [block(k) for k in prefix]
            assert (await client.lookup(prefix)).media == ("CPU",) * len(prefix)
    finally:
        assert await daemon.stop() == 0, daemon.stderr()


async def test_the_run_stops_at_the_first_key_held_nowhere(
    tmp_path: Path, spawn: Spawn, server: RedisServer
) -> None:
    head, tail = names("head", 4), names("tail", 4)
    daemon = await spawn(node_config(tmp_path / "node", server.url))
    try:
        async with await connect(daemon) as client:
            assert await client.store(head, [block(k) for k in head]) == 4
            assert (await client.flush()).dirty == 0
            await clear_local_tiers(daemon)
            assert await client.store(tail, [block(k) for k in tail]) == 4

            gap = await client.lookup([*head, b"missing", *tail])
            assert (gap.count, gap.media) == (4, ("REMOTE",) * 4)
            local_first = await client.lookup([*tail, *head, b"missing"])
            assert local_first.media == ("CPU",) * 4 + ("REMOTE",) * 4
    finally:
        assert await daemon.stop() == 0, daemon.stderr()
