"""The control socket end to end: a real daemon in the test's loop, real clients, raw frames.

Each test starts a daemon with :func:`tierd.testing.running_daemon` and talks to it over its
Unix socket, with :class:`tierd.client.Client` or, where the client cannot express the bad
input, with raw frames. Nothing waits on time: the daemon's connections are wrapped (see
:class:`loop_daemon_kit._WatchedConnection`) so that a test can await the moment the daemon
has noticed a client going away, and in-flight disk reads are held at a gate where a test
needs one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from tests.loop_daemon_kit import (
    BLOCK,
    NS,
    assert_idle,
    chain_of,
    connect,
    connect_watched,
    daemon_noticed_close,
    serve,
    socket_of,
)
from tierd.client import Client, DaemonError, Unreachable
from tierd.config import DaemonConfig
from tierd.control.protocol import HEADER, PROTOCOL_VERSION, ErrorCode, encode
from tierd.daemon import Daemon
from tierd.testing import corrupt_disk_block

# The daemon's connections, watched (conftest's fixture).
pytestmark = pytest.mark.usefixtures("_watch_connections")


def content(key: bytes, size: int = BLOCK) -> bytes:
    """The bytes every test stores under ``key``: derived from the key alone."""
    return hashlib.shake_256(b"block:" + key).digest(size)


def make_keys(tag: str, count: int, start: int = 0) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(start, start + count)]


# -- harness ---------------------------------------------------------------------------------


def tier_stats(stats: dict[str, Any], name: str) -> dict[str, Any]:
    (tier,) = [t for t in stats["tiers"] if t["name"] == name]
    return tier


async def expect_error(code: ErrorCode, awaitable: Awaitable[Any]) -> DaemonError:
    with pytest.raises(DaemonError) as info:
        await awaitable
    assert info.value.code == code, info.value
    return info.value


async def store_via_pool(client: Client, keys: Sequence[bytes]) -> int:
    async with client.storing(keys) as lease:
        for view, i in zip(lease.views(), lease.to_write, strict=True):
            view[:] = content(keys[i])
        return await lease.commit()


class Raw:
    """A bare connection: frames in and out, no client logic."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.next_id = 0

    @classmethod
    async def open(cls, daemon: Daemon, *, hello: dict[str, Any] | None = None) -> Raw:
        raw = cls(*await asyncio.open_unix_connection(socket_of(daemon)))
        if hello is not None:
            reply = await raw.call("hello", **hello)
            assert reply["ok"], reply
        return raw

    def send(self, message: Any) -> None:
        self.writer.write(encode(message))

    def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self) -> dict[str, Any]:
        async with asyncio.timeout(30):
            (size,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
            message = msgpack.unpackb(await self.reader.readexactly(size), raw=False)
        assert isinstance(message, dict)
        return message

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.next_id += 1
        self.send({"id": self.next_id, "op": op, **fields})
        reply = await self.recv()
        assert reply["id"] == self.next_id
        return reply

    async def at_eof(self) -> bool:
        async with asyncio.timeout(30):
            return await self.reader.read() == b""

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def failed_with(reply: dict[str, Any], code: ErrorCode) -> bool:
    return reply["ok"] is False and reply["error"] == code and isinstance(reply["message"], str)


# -- 1. every operation ------------------------------------------------------------------------


async def test_hello_reply_describes_the_daemon(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, cpu_blocks=8, disk_blocks=32) as daemon,
        await connect(daemon, block_bytes=BLOCK) as client,
    ):
        info = client.info
        assert info["server"].startswith("tierd ")
        assert info["protocol"] == PROTOCOL_VERSION
        assert info["block_bytes"] == BLOCK
        assert info["tiers"] == [
            {"name": "cpu", "medium": "CPU", "policy": "lru", "capacity": 8},
            {"name": "disk", "medium": "DISK", "policy": "lru", "capacity": 32},
        ]
        assert info["entry"] == "cpu"
        pool = info["pool"]
        assert pool["num_blocks"] == 8
        assert pool["stride"] >= BLOCK
        assert pool["size"] >= pool["stride"] * pool["num_blocks"]
        assert "path" not in pool  # passed as a descriptor: nothing to open by name
        assert info["tenant"] == "default"
        assert info["namespace_id"] == xxhash.xxh3_64_digest(NS.encode()).hex()
        limits = daemon.config.limits
        assert info["max_frame_bytes"] == limits.max_frame_bytes
        assert info["max_keys_per_request"] == limits.max_keys_per_request
        assert info["max_key_bytes"] == 56
        assert client.pool is not None and client.pool.num_blocks == 8


async def test_lookup_reports_the_medium_of_each_hit(tmp_path: Path) -> None:
    keys = make_keys("k", 6)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as client,
    ):
        assert await client.store(keys[:4], [content(k) for k in keys[:4]]) == 4
        # Two more evict the two least recent, which are demoted to the disk tier.
        assert await client.store(keys[4:], [content(k) for k in keys[4:]]) == 2
        hit = await client.lookup(keys)
        assert (hit.count, hit.media, hit.in_flight) == (6, ("DISK",) * 2 + ("CPU",) * 4, False)
        hit = await client.lookup([keys[5], b"absent", keys[0]])
        assert (hit.count, hit.media, hit.in_flight) == (1, ("CPU",), False)
        assert (await client.lookup([b"absent"])).count == 0


async def test_lookup_reports_a_block_in_flight(tmp_path: Path) -> None:
    keys = make_keys("k", 2)
    async with (
        serve(tmp_path) as daemon,
        await connect(daemon) as writer,
        await connect(daemon) as reader,
    ):
        await store_via_pool(writer, keys[:1])
        lease = await writer.prepare_store(keys)
        assert lease.to_write == [1]
        hit = await reader.lookup(keys)
        assert (hit.count, hit.media, hit.in_flight) == (1, ("CPU",), True)
        lease.views()[0][:] = content(keys[1])
        assert await lease.commit() == 1
        hit = await reader.lookup(keys)
        assert (hit.count, hit.in_flight) == (2, False)
        assert await reader.load(keys) == [content(k) for k in keys]


async def test_touch_keeps_a_block_in_the_cpu_tier(tmp_path: Path) -> None:
    keys = make_keys("k", 5)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as client,
    ):
        await store_via_pool(client, keys[:4])
        await client.touch([keys[0]])  # now the most recent: keys[1] is the victim
        await store_via_pool(client, keys[4:])
        assert (await client.lookup([keys[0]])).media == ("CPU",)
        assert (await client.lookup([keys[1]])).media == ("DISK",)


async def test_a_touch_longer_than_a_request_keeps_its_order(tmp_path: Path) -> None:
    """A touch of more keys than ``max_keys_per_request`` goes as several requests (the
    daemon refused it whole), the tail's first: ``keys[0]`` still ends up most recent."""
    keys = make_keys("k", 7)
    options: dict[str, Any] = {"cpu_blocks": 6, "disk_blocks": 16}
    options["limits"] = {"max_keys_per_request": 2}
    async with serve(tmp_path, **options) as daemon, await connect(daemon) as client:
        for i in range(0, 6, 2):
            await store_via_pool(client, keys[i : i + 2])
        await client.touch(keys[:6][::-1])  # keys[5] most recent, keys[0] least
        await store_via_pool(client, keys[6:])  # evicts the least recent: keys[0]
        assert [(await client.lookup([k])).media for k in keys[:6]] == [
            ("DISK",),
            *[("CPU",)] * 5,
        ]


async def test_zero_copy_store_and_load(tmp_path: Path) -> None:
    keys = make_keys("k", 3)
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        lease = await client.prepare_store(keys)
        assert lease.lease is not None
        assert lease.to_write == [0, 1, 2]
        for view, key in zip(lease.views(), keys, strict=True):
            view[:] = content(key)
        assert await lease.commit() == 3
        # Keys already held need no write: no lease, no slot.
        again = await client.prepare_store(keys)
        assert (again.lease, again.slots, again.finished) == (None, [None] * 3, True)
        load = await client.prepare_load([*keys, b"absent"])
        assert load.count == 3
        assert [bytes(view) for view in load.views()] == [content(k) for k in keys]
        assert (await client.stats())["tiers"][0]["pinned"] == 3
        await load.release()
        missing = await client.prepare_load([b"absent"])
        assert (missing.lease, missing.count, missing.slots) == (None, 0, [])
        await assert_idle(daemon, client)


async def test_abort_store_drops_the_reservation(tmp_path: Path) -> None:
    keys = make_keys("k", 2)
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        lease = await client.prepare_store(keys)
        assert tier_stats(await client.stats(), "cpu")["writing"] == 2
        await lease.abort()
        hit = await client.lookup(keys)
        assert (hit.count, hit.in_flight) == (0, False)
        await assert_idle(daemon, client)
        assert await store_via_pool(client, keys) == 2


@pytest.mark.parametrize("map_pool", [True, False])
async def test_put_and_get_inline(tmp_path: Path, map_pool: bool) -> None:
    keys = make_keys("k", 3)
    async with serve(tmp_path) as daemon, await connect(daemon, map_pool=map_pool) as client:
        assert (client.pool is not None) is map_pool
        assert await client.put(keys[:2], [content(k) for k in keys[:2]]) == 2
        assert await client.put(keys, [content(k) for k in keys]) == 1  # two held
        assert await client.get([*keys, b"absent"]) == [content(k) for k in keys]
        assert await client.get([b"absent"]) == []
        # store/load pick the inline path when the pool is not mapped.
        more = make_keys("m", 2)
        assert await client.store(more, [content(k) for k in more]) == 2
        assert await client.load(more) == [content(k) for k in more]
        await assert_idle(daemon, client)


async def test_stats_count_what_happened(tmp_path: Path) -> None:
    keys = make_keys("k", 6)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as client,
    ):
        await store_via_pool(client, keys[:4])
        await client.lookup(keys[:4])  # 4 hits in the cpu tier
        await store_via_pool(client, keys[4:])  # evicts and demotes keys 0 and 1
        await client.lookup([keys[0], b"absent"])  # 1 hit on disk, 1 miss
        stats = await client.stats()
        assert stats["block_bytes"] == BLOCK
        cpu, disk = tier_stats(stats, "cpu"), tier_stats(stats, "disk")
        assert {k: cpu[k] for k in ("medium", "policy", "capacity", "used")} == {
            "medium": "CPU",
            "policy": "lru",
            "capacity": 4,
            "used": 4,
        }
        assert (cpu["stores"], cpu["evictions"], cpu["demotions"]) == (6, 2, 2)
        assert (cpu["hits"], cpu["misses"]) == (4, 1 + 1)  # the miss + the disk hit
        assert (cpu["pinned"], cpu["writing"], cpu["dropped"], cpu["io_errors"]) == (0,) * 4
        assert (disk["used"], disk["stores"], disk["evictions"]) == (2, 2, 0)
        assert (disk["hits"], disk["misses"], disk["refused"]) == (1, 1, 0)
        (route,) = [r for r in stats["routes"] if (r["src"], r["dst"]) == ("CPU", "DISK")]
        assert (route["blocks"], route["bytes"], route["failures"]) == (2, 2 * BLOCK, 0)
        chain = stats["chain"]
        assert (chain["lookups"], chain["hit_blocks"], chain["miss_blocks"]) == (2, 5, 1)
        assert chain["hit_ratio"] == pytest.approx(5 / 6, abs=1e-6)
        server = stats["server"]
        assert (server["connections"], server["leases"], server["subscribers"]) == (1, 0, 0)
        assert server["shutting_down"] is False
        # hello, 2 x (prepare_store + complete_store), 2 lookups, stats
        assert server["requests"] == 8
        assert server["errors"] == {}


async def test_health_config_and_metrics(tmp_path: Path) -> None:
    keys = make_keys("k", 3)
    options: dict[str, Any] = {
        "cpu_blocks": 4,
        "disk_blocks": 16,
        "limits": {"max_keys_per_request": 64},
    }
    async with serve(tmp_path, **options) as daemon, await connect(daemon) as client:
        health = await client.health()
        assert (health["status"], health["connections"]) == ("ok", 1)
        assert health["version"] == client.info["server"].removeprefix("tierd ")
        config = await client.config()
        assert config["block_bytes"] == BLOCK
        assert config["socket"]["path"] == socket_of(daemon)
        assert config["socket"]["mode"] == "0o600"
        assert config["limits"]["max_keys_per_request"] == 64
        assert [(t["name"], t["capacity"]) for t in config["tiers"]] == [
            ("cpu", 4),
            ("disk", 16),
        ]
        # The effective config is a valid config, the one the daemon runs.
        assert DaemonConfig.model_validate(config) == daemon.config

        await store_via_pool(client, keys)
        families = {f.name: f for f in text_string_to_metric_families(await client.metrics())}
        used = {s.labels["tier"]: s.value for s in families["tierd_tier_used_blocks"].samples}
        assert used == {"cpu": 3, "disk": 0}
        media = {
            s.labels["tier"]: s.labels["medium"] for s in families["tierd_tier_used_blocks"].samples
        }
        assert media == {"cpu": "CPU", "disk": "DISK"}
        (connections,) = families["tierd_connections"].samples
        assert connections.value == 1


async def test_flush_copies_dirty_blocks_down(tmp_path: Path) -> None:
    keys = make_keys("k", 3)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as client,
        await connect(daemon, None) as operator,
    ):
        await store_via_pool(client, keys)
        assert tier_stats(await client.stats(), "disk")["used"] == 0
        done = await client.flush()
        assert (done.copied, done.dirty, done.dirty_by_tier, done.reason) == (3, 0, {}, "")
        stats = await client.stats()
        assert (tier_stats(stats, "cpu")["used"], tier_stats(stats, "disk")["used"]) == (3, 3)
        (route,) = [r for r in stats["routes"] if (r["src"], r["dst"]) == ("CPU", "DISK")]
        assert route["blocks"] == 3
        assert (await client.flush()).copied == 0  # nothing dirty any more
        # The disk copies are whole: with the cpu tier cleared they still load.
        assert await operator.clear("cpu") == 3
        assert await client.load(keys) == [content(k) for k in keys]


async def test_clear_one_tier_all_tiers_and_an_unknown_tier(tmp_path: Path) -> None:
    keys = make_keys("k", 3)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as client,
        await connect(daemon, None) as operator,
    ):
        await store_via_pool(client, keys)
        await operator.flush()
        # clear drops every namespace's blocks: a namespaced client may not send it.
        await expect_error(ErrorCode.NOT_ALLOWED, client.clear("cpu"))
        await expect_error(ErrorCode.NOT_ALLOWED, client.clear())
        assert (await client.lookup(keys)).media == ("CPU",) * 3
        assert await operator.clear("cpu") == 3
        assert (await client.lookup(keys)).media == ("DISK",) * 3
        await expect_error(ErrorCode.UNKNOWN_TIER, operator.clear("nvme"))
        await expect_error(ErrorCode.BAD_REQUEST, operator.request("clear", tier=1))
        assert (await client.lookup(keys)).count == 3  # the failed clears changed nothing
        await store_via_pool(client, keys[:1])  # back in the cpu tier too
        assert await operator.clear() == 1 + 3
        assert (await client.lookup(keys)).count == 0
        stats = await client.stats()
        assert [t["used"] for t in stats["tiers"]] == [0, 0]


async def next_events(stream: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    async with asyncio.timeout(30):
        push = await anext(stream)
    assert push["push"] == "events"
    events: list[dict[str, Any]] = push["events"]
    return events


async def events_until(
    stream: AsyncIterator[dict[str, Any]], last: tuple[str, str, bytes]
) -> list[tuple[str, str, str, bytes]]:
    """Every event (kind, medium, tier, key) of the pushes up to the one holding ``last``
    (kind, medium, key)."""
    seen: list[tuple[str, str, str, bytes]] = []
    while last not in {(kind, medium, key) for kind, medium, _, key in seen}:
        for event in await next_events(stream):
            seen.extend((event["kind"], event["medium"], event["tier"], k) for k in event["keys"])
    return seen


async def test_event_stream_after_a_store_that_demotes(tmp_path: Path) -> None:
    keys = make_keys("k", 8)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as subscriber,
        await connect(daemon) as writer,
        await connect(daemon, None) as operator,
    ):
        assert (await subscriber.stats())["server"]["subscribers"] == 0
        await subscriber.subscribe()
        assert (await writer.stats())["server"]["subscribers"] == 1
        stream = subscriber.events()
        await writer.store(keys[:4], [content(k) for k in keys[:4]])
        await writer.store(keys[4:], [content(k) for k in keys[4:]])  # demotes 0..3
        await operator.clear("disk")  # the last push: the demoted blocks leave the disk
        seen = await events_until(stream, ("removed", "DISK", keys[3]))
        expected = (
            [("stored", "CPU", "cpu", k) for k in keys]
            + [("removed", "CPU", "cpu", k) for k in keys[:4]]
            + [("stored", "DISK", "disk", k) for k in keys[:4]]
            + [("removed", "DISK", "disk", k) for k in keys[:4]]
        )
        assert sorted(seen) == sorted(expected)
        # Order within the stream: a block is stored before it is removed.
        for key in keys[:4]:
            for medium, tier in (("CPU", "cpu"), ("DISK", "disk")):
                stored = seen.index(("stored", medium, tier, key))
                assert stored < seen.index(("removed", medium, tier, key))

        await subscriber.request("unsubscribe")
        assert (await writer.stats())["server"]["subscribers"] == 0
        await writer.put([b"late"], [content(b"late")])  # nobody subscribed: no push
        await subscriber.request("subscribe")
        await writer.put([b"sentinel"], [content(b"sentinel")])  # evicts keys[5]
        seen = await events_until(stream, ("stored", "CPU", b"sentinel"))
        # Nothing of the store made while unsubscribed ("late", which evicted keys[4]).
        assert sorted(seen) == [
            ("removed", "CPU", "cpu", keys[5]),
            ("stored", "CPU", "cpu", b"sentinel"),
            ("stored", "DISK", "disk", keys[5]),
        ]


async def test_unsubscribe_right_after_subscribe_leaves_no_subscriber(tmp_path: Path) -> None:
    """Regression: cancelling the event pump before it first ran leaked its subscription
    (the bus kept it, and counted drops for it, for as long as the daemon ran)."""
    async with serve(tmp_path, events={"queue_batches": 1}) as daemon:
        raw = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        # Both in one write: the daemon handles them in one go, before the pump starts.
        raw.send_bytes(
            encode({"id": 1, "op": "subscribe"}) + encode({"id": 2, "op": "unsubscribe"})
        )
        assert [(r["id"], r["ok"]) for r in (await raw.recv(), await raw.recv())] == [
            (1, True),
            (2, True),
        ]
        async with await connect(daemon) as client:
            assert (await client.stats())["server"]["subscribers"] == 0
            for key in make_keys("k", 4):
                await client.put([key], [content(key)])
            stats = await client.stats()
            assert stats["server"]["subscribers"] == 0
            assert stats["chain"]["events_dropped"] == 0
        await raw.close()


async def test_a_subscriber_that_closes_is_unsubscribed(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        watched, conn = await connect_watched(daemon)
        await watched.subscribe()
        assert (await client.stats())["server"]["subscribers"] == 1
        await watched.close()
        await daemon_noticed_close(conn)
        assert (await client.stats())["server"]["subscribers"] == 0


async def test_a_corrupt_disk_block_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    keys = make_keys("k", 8)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as client,
    ):
        await store_via_pool(client, keys[:4])
        await store_via_pool(client, keys[4:])  # keys 0..3 now only on disk
        disk = chain_of(daemon).levels[1]
        prefix = bytes.fromhex(client.info["namespace_id"])
        corrupt_disk_block(disk.store, disk.tier.slot_of(prefix + keys[1]))
        # The load stops before the bad block; the one before it is whole.
        assert await client.load(keys[:3]) == [content(keys[0])]
        assert await client.get(keys[1:3]) == []
        hit = await client.lookup(keys[:3])
        assert (hit.count, hit.media) == (1, ("CPU",))  # the bad copy was dropped
        assert tier_stats(await client.stats(), "disk")["io_errors"] == 1
        assert await client.load(keys[2:4]) == [content(k) for k in keys[2:4]]
        await assert_idle(daemon, client)


# -- 2. namespaces and the handshake ---------------------------------------------------------------


async def test_namespaces_keep_the_same_key_apart(tmp_path: Path) -> None:
    keys = make_keys("shared", 3)
    async with (
        serve(tmp_path) as daemon,
        await connect(daemon, "a") as a,
        await connect(daemon, "b") as b,
    ):
        data_a = [content(b"a:" + k) for k in keys]
        data_b = [content(b"b:" + k) for k in keys]
        assert await a.store(keys, data_a) == 3
        assert (await b.lookup(keys)).count == 0
        assert await b.store(keys, data_b) == 3  # not skipped: a different block
        assert await a.load(keys) == data_a
        assert await b.load(keys) == data_b
        assert await a.get(keys) == data_a
        assert await b.get(keys) == data_b
        assert tier_stats(await a.stats(), "cpu")["used"] == 6


async def test_events_of_one_namespace_do_not_reach_another(tmp_path: Path) -> None:
    key = b"same-key"
    async with (
        serve(tmp_path) as daemon,
        await connect(daemon, "a") as a,
        await connect(daemon, "b") as b,
        await connect(daemon, "b") as b_writer,
    ):
        await b.subscribe()
        stream = b.events()
        await a.put([key], [content(key)])  # namespace a: b must not see it
        await b_writer.put([b"sentinel"], [content(b"sentinel")])
        seen = await events_until(stream, ("stored", "CPU", b"sentinel"))
        assert seen == [("stored", "CPU", "cpu", b"sentinel")]
        await b_writer.put([key], [content(key)])  # the same key in b's own namespace
        assert await events_until(stream, ("stored", "CPU", key)) == [("stored", "CPU", "cpu", key)]


@pytest.mark.parametrize(
    ("namespace", "namespaces"),
    [
        ("has space", {}),
        ("", {}),
        ("x" * 129, {}),
        ("tenant-c", {"allowed": ["tenant-a", "tenant-b"]}),
        ("TENANT", {"pattern": "^[a-z]+$"}),
    ],
)
async def test_bad_namespace_is_refused(
    tmp_path: Path, namespace: str, namespaces: dict[str, Any]
) -> None:
    async with serve(tmp_path, namespaces=namespaces) as daemon:
        await expect_error(ErrorCode.BAD_NAMESPACE, connect(daemon, namespace))
        good = namespaces.get("allowed", ["tenant"])[0]
        async with await connect(daemon, good) as client:
            assert await client.put([b"k"], [content(b"k")]) == 1


async def test_data_operations_need_a_namespace(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon, None) as client:
        assert client.pool is None
        for op, fields in [
            ("lookup", {"keys": [b"k"]}),
            ("touch", {"keys": [b"k"]}),
            ("prepare_store", {"keys": [b"k"]}),
            ("prepare_load", {"keys": [b"k"]}),
            ("put", {"keys": [b"k"], "data": [content(b"k")]}),
            ("get", {"keys": [b"k"]}),
        ]:
            await expect_error(ErrorCode.NAMESPACE_REQUIRED, client.request(op, **fields))
        # Control operations need none.
        assert (await client.health())["status"] == "ok"
        assert tier_stats(await client.stats(), "cpu")["used"] == 0


async def test_handshake_errors(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon:
        await expect_error(ErrorCode.BLOCK_SIZE_MISMATCH, connect(daemon, block_bytes=2 * BLOCK))
        raw = await Raw.open(daemon)
        assert failed_with(await raw.call("lookup", keys=[b"k"]), ErrorCode.HELLO_REQUIRED)
        assert failed_with(await raw.call("stats"), ErrorCode.HELLO_REQUIRED)
        reply = await raw.call("hello", version=PROTOCOL_VERSION + 1, namespace=NS)
        assert failed_with(reply, ErrorCode.VERSION_MISMATCH)
        assert failed_with(await raw.call("hello", namespace=NS), ErrorCode.BAD_REQUEST)
        # A failed hello leaves the connection waiting for a good one.
        reply = await raw.call("hello", version=PROTOCOL_VERSION, namespace=NS)
        assert reply["ok"] is True
        reply = await raw.call("hello", version=PROTOCOL_VERSION, namespace="other")
        assert failed_with(reply, ErrorCode.BAD_REQUEST)
        reply = await raw.call("put", keys=[b"k"], data=[content(b"k")])
        assert reply["ok"] is True
        await raw.close()
        async with await connect(daemon) as client:
            # The second hello did not switch the namespace: the block is in NS.
            assert await client.get([b"k"]) == [content(b"k")]
            await expect_error(ErrorCode.BAD_REQUEST, client.request("hello", version=1))


# -- 3. leases -------------------------------------------------------------------------------------


async def test_leases_belong_to_their_connection(tmp_path: Path) -> None:
    keys = make_keys("k", 2)
    async with (
        serve(tmp_path) as daemon,
        await connect(daemon) as a,
        await connect(daemon) as b,
    ):
        await store_via_pool(a, keys[:1])
        load = await a.prepare_load(keys[:1])
        store = await a.prepare_store(keys[1:])
        for op, lease in [("complete_load", load.lease), ("complete_store", store.lease)]:
            await expect_error(ErrorCode.UNKNOWN_LEASE, b.request(op, lease=lease))
        await expect_error(ErrorCode.UNKNOWN_LEASE, b.request("abort_store", lease=store.lease))
        # Kinds do not mix, on the owning connection either.
        await expect_error(ErrorCode.UNKNOWN_LEASE, a.request("complete_store", lease=load.lease))
        await expect_error(ErrorCode.UNKNOWN_LEASE, a.request("complete_load", lease=store.lease))
        for lease_id in (10**9, 2**64 - 1):
            await expect_error(ErrorCode.UNKNOWN_LEASE, a.request("complete_load", lease=lease_id))
        # The owner's leases still work after all that.
        assert [bytes(v) for v in load.views()] == [content(keys[0])]
        await load.release()
        store.views()[0][:] = content(keys[1])
        assert await store.commit() == 1
        # Finished leases are unknown now.
        await expect_error(ErrorCode.UNKNOWN_LEASE, a.request("complete_load", lease=load.lease))
        await expect_error(ErrorCode.UNKNOWN_LEASE, a.request("complete_store", lease=store.lease))
        assert await b.load(keys) == [content(k) for k in keys]
        await assert_idle(daemon, a)


async def test_a_client_that_goes_away_gives_its_leases_back(tmp_path: Path) -> None:
    cpu_blocks = 4
    old, new, fill = make_keys("old", 2), make_keys("new", 2), make_keys("fill", cpu_blocks)
    async with (
        serve(tmp_path, cpu_blocks=cpu_blocks, disk_blocks=None) as daemon,
        await connect(daemon) as observer,
    ):
        await store_via_pool(observer, old)
        client, conn = await connect_watched(daemon)
        load = await client.prepare_load(old)
        store = await client.prepare_store(new)
        assert (load.count, len(store.to_write)) == (2, 2)
        stats = await observer.stats()
        assert (tier_stats(stats, "cpu")["pinned"], tier_stats(stats, "cpu")["writing"]) == (
            2,
            2,
        )
        assert stats["server"]["leases"] == 2
        # Every slot is pinned or reserved: no room for anything else.
        await expect_error(ErrorCode.CAPACITY, observer.prepare_store(fill[:1]))
        await client.close()  # without completing either lease
        await daemon_noticed_close(conn)
        await assert_idle(daemon, observer)
        assert (await observer.lookup(new)).count == 0  # the reservation was dropped
        assert (await observer.lookup(old)).count == 2  # the loaded blocks stay
        # The slots are free again: a store can fill the whole tier.
        assert await store_via_pool(observer, fill) == cpu_blocks
        assert await observer.load(fill) == [content(k) for k in fill]


async def test_a_client_that_goes_away_during_a_promotion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_keys("k", 8)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16) as daemon,
        await connect(daemon) as observer,
    ):
        await store_via_pool(observer, keys[:4])
        await store_via_pool(observer, keys[4:])  # keys 0..3 now only on disk
        assert (await observer.lookup(keys[:2])).media == ("DISK", "DISK")

        # Hold disk reads at a gate so the promotion is in flight when the client leaves.
        disk = chain_of(daemon).levels[1].store
        entered, gate = asyncio.Event(), asyncio.Event()
        read = disk._read

        async def gated_read(slots: Any, block_keys: Any, out: Any) -> list[bool]:
            entered.set()
            await gate.wait()
            result: list[bool] = await read(slots, block_keys, out)
            return result

        monkeypatch.setattr(disk, "_read", gated_read)
        client, conn = await connect_watched(daemon)
        pending = client.send("prepare_load", keys=keys[:2])
        async with asyncio.timeout(30):
            await entered.wait()
        stats = await observer.stats()
        assert tier_stats(stats, "cpu")["writing"] == 2  # the promotion's reservation
        await client.close()
        with pytest.raises(Unreachable):
            await pending
        async with asyncio.timeout(30):
            await conn.gone.wait()
        assert conn.running_at_close  # the prepare_load was still running
        gate.set()
        await daemon_noticed_close(conn)
        await assert_idle(daemon, observer)
        # The promotion itself completed; the blocks are usable, nothing is pinned.
        assert (await observer.lookup(keys[:2])).media == ("CPU", "CPU")
        assert await observer.load(keys[:2]) == [content(k) for k in keys[:2]]
        await assert_idle(daemon, observer)


# -- 4. concurrency --------------------------------------------------------------------------------


async def test_eight_clients_store_and_load_the_same_keys(tmp_path: Path) -> None:
    keyset = make_keys("shared", 48)
    stored: set[bytes] = set()
    loaded = 0

    async def worker(seed: int, daemon: Daemon) -> None:
        nonlocal loaded
        rng = random.Random(seed)
        async with await connect(daemon) as client:
            for _ in range(25):
                chosen = rng.sample(keyset, 2)
                if rng.random() < 0.5:
                    await client.store(chosen, [content(k) for k in chosen])
                    stored.update(chosen)
                else:
                    blocks = await client.load(chosen)
                    assert blocks == [content(k) for k in chosen[: len(blocks)]]
                    loaded += len(blocks)

    # cpu: room for every client's 2 blocks at once, far fewer than the keys; disk: all.
    async with serve(tmp_path, cpu_blocks=20, disk_blocks=64) as daemon:
        async with asyncio.timeout(120):
            await asyncio.gather(*(worker(seed, daemon) for seed in range(8)))
        async with await connect(daemon) as client:
            assert loaded > 0
            for key in sorted(stored):
                assert await client.load([key]) == [content(key)]
            stats = await client.stats()
            assert tier_stats(stats, "cpu")["evictions"] > 0
            assert tier_stats(stats, "cpu")["dropped"] == 0
            await assert_idle(daemon, client)


# -- 5. pipelining ---------------------------------------------------------------------------------


async def test_two_hundred_pipelined_lookups(tmp_path: Path) -> None:
    keys = make_keys("k", 4)
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        await store_via_pool(client, keys)
        futures = [client.send("lookup", keys=[*keys[i % 5 :], b"absent"]) for i in range(200)]
        replies = await asyncio.gather(*futures)
        for i, reply in enumerate(replies):
            count = len(keys[i % 5 :])
            assert (reply["count"], reply["media"]) == (count, ["CPU"] * count)
        assert (await client.stats())["chain"]["lookups"] == 200


# -- 6. limits and bad input -----------------------------------------------------------------------

LIMITS = {"max_keys_per_request": 8, "max_frame_bytes": 128 << 10}
GOOD_KEY = b"g" * 56


async def check_still_serving(daemon: Daemon, raw: Raw) -> None:
    reply = await raw.call("put", keys=[GOOD_KEY], data=[content(GOOD_KEY)])
    assert reply["ok"] is True, reply
    reply = await raw.call("get", keys=[GOOD_KEY])
    assert (reply["ok"], reply["data"]) == (True, [content(GOOD_KEY)])
    chain_of(daemon).check_invariants(idle=True)


BAD_REQUESTS: list[tuple[str, Any, ErrorCode]] = [
    ("a list", [1, 2, 3], ErrorCode.BAD_REQUEST),
    ("a string", "lookup", ErrorCode.BAD_REQUEST),
    ("nil", None, ErrorCode.BAD_REQUEST),
    ("no id", {"op": "health"}, ErrorCode.BAD_REQUEST),
    ("negative id", {"id": -1, "op": "health"}, ErrorCode.BAD_REQUEST),
    ("no op", {"id": 7}, ErrorCode.BAD_REQUEST),
    ("op not a string", {"id": 7, "op": 3}, ErrorCode.BAD_REQUEST),
    ("unknown op", {"id": 7, "op": "frobnicate"}, ErrorCode.UNKNOWN_OP),
    ("keys missing", {"id": 7, "op": "lookup"}, ErrorCode.BAD_REQUEST),
    ("keys not a list", {"id": 7, "op": "lookup", "keys": b"k"}, ErrorCode.BAD_REQUEST),
    ("key a str", {"id": 7, "op": "lookup", "keys": [b"k", "k"]}, ErrorCode.BAD_KEY),
    ("key empty", {"id": 7, "op": "prepare_store", "keys": [b""]}, ErrorCode.BAD_KEY),
    ("key 57 bytes", {"id": 7, "op": "put", "keys": [b"k" * 57]}, ErrorCode.BAD_KEY),
    ("key an int", {"id": 7, "op": "touch", "keys": [5]}, ErrorCode.BAD_KEY),
    ("9 keys", {"id": 7, "op": "get", "keys": make_keys("k", 9)}, ErrorCode.TOO_MANY_KEYS),
    (
        "put data short",
        {"id": 7, "op": "put", "keys": [b"k"], "data": [bytes(BLOCK - 1)]},
        ErrorCode.BAD_REQUEST,
    ),
    (
        "put data count",
        {"id": 7, "op": "put", "keys": [b"k", b"j"], "data": [bytes(BLOCK)]},
        ErrorCode.BAD_REQUEST,
    ),
    ("put data missing", {"id": 7, "op": "put", "keys": [b"k"]}, ErrorCode.BAD_REQUEST),
    ("lease a string", {"id": 7, "op": "complete_load", "lease": "1"}, ErrorCode.BAD_REQUEST),
    ("lease negative", {"id": 7, "op": "abort_store", "lease": -1}, ErrorCode.BAD_REQUEST),
    ("lease unknown", {"id": 7, "op": "complete_store", "lease": 99}, ErrorCode.UNKNOWN_LEASE),
    ("keys empty", {"id": 7, "op": "lookup", "keys": []}, ErrorCode.BAD_REQUEST),
    ("key twice", {"id": 7, "op": "prepare_store", "keys": [b"k", b"k"]}, ErrorCode.BAD_REQUEST),
    (
        "put key twice",
        {"id": 7, "op": "put", "keys": [b"k", b"k"], "data": [bytes(BLOCK)] * 2},
        ErrorCode.BAD_REQUEST,
    ),
    ("clear by a namespace", {"id": 7, "op": "clear"}, ErrorCode.NOT_ALLOWED),
]


@pytest.mark.parametrize(
    ("message", "code"),
    [pytest.param(m, c, id=name) for name, m, c in BAD_REQUESTS],
)
async def test_bad_requests_get_an_error_and_change_nothing(
    tmp_path: Path, message: Any, code: ErrorCode
) -> None:
    async with serve(tmp_path, limits=LIMITS) as daemon:
        raw = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        raw.send(message)
        reply = await raw.recv()
        request_id = message.get("id") if isinstance(message, dict) else None
        # The id is echoed when it is a valid one, else the reply carries 0.
        expected_id = request_id if isinstance(request_id, int) and request_id >= 0 else 0
        assert reply["id"] == expected_id
        assert failed_with(reply, code), reply
        await check_still_serving(daemon, raw)
        stats = (await raw.call("stats"))["stats"]
        assert stats["server"]["errors"] == {str(code): 1}
        assert [t["used"] for t in stats["tiers"]] == [1, 0]  # only the good block
        await raw.close()


async def test_garbage_msgpack_is_answered_and_the_connection_stays(tmp_path: Path) -> None:
    async with serve(tmp_path, limits=LIMITS) as daemon:
        raw = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        for body in (b"\xc1", b"", b"\x92\x01", b"\x81\x01\x01", b"\x91" * 5000):
            raw.send_bytes(HEADER.pack(len(body)) + body)
            reply = await raw.recv()
            assert reply["id"] == 0
            assert failed_with(reply, ErrorCode.BAD_FRAME), (body[:8], reply)
        await check_still_serving(daemon, raw)
        await raw.close()


async def test_a_frame_over_the_limit_closes_the_connection(tmp_path: Path) -> None:
    async with serve(tmp_path, limits=LIMITS) as daemon:
        raw = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        raw.send_bytes(HEADER.pack(LIMITS["max_frame_bytes"] + 1) + b"\x80" * 64)
        reply = await raw.recv()
        assert reply["id"] == 0
        assert failed_with(reply, ErrorCode.FRAME_TOO_LARGE)
        assert await raw.at_eof()
        await raw.close()
        fresh = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        await check_still_serving(daemon, fresh)
        stats = (await fresh.call("stats"))["stats"]
        assert stats["server"]["errors"] == {"frame_too_large": 1}
        await fresh.close()


async def test_requests_before_an_oversized_frame_are_answered(tmp_path: Path) -> None:
    """Regression: when whole frames and an oversized header arrived in one read, the
    daemon dropped the whole frames unanswered before it hung up."""
    async with serve(tmp_path, limits=LIMITS) as daemon:
        raw = await Raw.open(daemon)
        hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NS}
        lookup = {"id": 2, "op": "lookup", "keys": [b"k"]}
        raw.send_bytes(encode(hello) + encode(lookup) + HEADER.pack(LIMITS["max_frame_bytes"] + 1))
        replies = [await raw.recv() for _ in range(3)]
        assert [(r["id"], r["ok"]) for r in replies] == [(1, True), (2, True), (0, False)]
        assert replies[1]["count"] == 0
        assert failed_with(replies[2], ErrorCode.FRAME_TOO_LARGE)
        assert await raw.at_eof()
        await raw.close()


async def test_frames_split_into_single_bytes(tmp_path: Path) -> None:
    async with serve(tmp_path, limits=LIMITS) as daemon, await connect(daemon) as probe:
        await probe.put([b"k"], [content(b"k")])
        raw = await Raw.open(daemon)
        hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NS}
        for byte in encode(hello) + encode({"id": 2, "op": "get", "keys": [b"k"]}):
            raw.send_bytes(bytes([byte]))
            await raw.writer.drain()
            # A round trip on another connection: the daemon has read this byte (its
            # loop polls every ready socket each turn) before the probe's reply comes.
            await probe.health()
        hello_reply, get_reply = await raw.recv(), await raw.recv()
        assert (hello_reply["id"], hello_reply["ok"]) == (1, True)
        assert (get_reply["id"], get_reply["data"]) == (2, [content(b"k")])
        await raw.close()


async def test_a_frame_at_the_limit_is_read(tmp_path: Path) -> None:
    limit = LIMITS["max_frame_bytes"]
    async with serve(tmp_path, limits=LIMITS) as daemon:
        raw = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        pad = limit
        while len(frame := encode({"id": 5, "op": "health", "pad": bytes(pad)})) > limit + 4:
            pad -= 1
        assert len(frame) - HEADER.size == limit
        raw.send_bytes(frame)
        reply = await raw.recv()
        assert (reply["id"], reply["ok"]) == (5, True)
        await check_still_serving(daemon, raw)
        await raw.close()


async def test_complete_store_with_the_wrong_flags_keeps_the_lease(tmp_path: Path) -> None:
    keys = make_keys("k", 3)
    async with serve(tmp_path, limits=LIMITS) as daemon, await connect(daemon) as client:
        lease = await client.prepare_store(keys)
        for ok in ([True, True], [True] * 4, [True, 1, True], "yes", None):
            await expect_error(
                ErrorCode.BAD_REQUEST,
                client.request("complete_store", lease=lease.lease, ok=ok),
            )
        stats = await client.stats()
        assert (tier_stats(stats, "cpu")["writing"], stats["server"]["leases"]) == (3, 1)
        for view, key in zip(lease.views(), keys, strict=True):
            view[:] = content(key)
        # One flag per key: the middle block failed and is dropped.
        reply = await client.request("complete_store", lease=lease.lease, ok=[True, False, True])
        assert reply["stored"] == 2
        hit = await client.lookup(keys)
        assert hit.count == 1
        assert await client.get([keys[2]]) == [content(keys[2])]
        await assert_idle(daemon, client)


async def test_connections_over_the_limit_are_refused_busy(tmp_path: Path) -> None:
    async with serve(tmp_path, limits={"max_connections": 2}) as daemon:
        first, conn = await connect_watched(daemon)
        async with await connect(daemon) as second:
            await expect_error(ErrorCode.BUSY, connect(daemon))
            await first.close()
            await daemon_noticed_close(conn)
            async with await connect(daemon) as third:
                assert (await third.health())["connections"] == 2
            stats = await second.stats()
            assert stats["server"]["errors"] == {"busy": 1}


async def test_a_get_must_fit_in_one_frame(tmp_path: Path) -> None:
    # Room for (128 KiB - 4096) // (4096 + 16) = 30 blocks in one reply frame.
    keys = make_keys("k", 31)
    async with (
        serve(
            tmp_path, cpu_blocks=32, disk_blocks=None, limits={"max_frame_bytes": 128 << 10}
        ) as daemon,
        await connect(daemon) as client,
    ):
        for key in keys:
            await client.put([key], [content(key)])
        await expect_error(ErrorCode.TOO_MANY_KEYS, client.get(keys))
        assert await client.get(keys[:30]) == [content(k) for k in keys[:30]]
        await assert_idle(daemon, client)


async def test_an_entry_tier_without_a_pool_takes_put_and_get(tmp_path: Path) -> None:
    keys = make_keys("k", 3)
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16, entry="disk") as daemon,
        await connect(daemon) as client,
    ):
        assert (client.info["entry"], client.info["pool"], client.pool) == ("disk", None, None)
        await expect_error(ErrorCode.NO_POOL, client.request("prepare_store", keys=keys))
        await expect_error(ErrorCode.NO_POOL, client.request("prepare_load", keys=keys))
        # store/load fall back to put/get; the disk store has no views, so get reads.
        assert await client.store(keys, [content(k) for k in keys]) == 3
        assert await client.load([*keys, b"absent"]) == [content(k) for k in keys]
        stats = await client.stats()
        assert [t["used"] for t in stats["tiers"]] == [0, 3]
        await assert_idle(daemon, client)


async def test_requests_in_flight_limit_does_not_stall_the_connection(tmp_path: Path) -> None:
    keys = make_keys("k", 4)
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        await store_via_pool(client, keys)
        # More async requests than the per-connection limit, in one go.
        futures = [client.send("get", keys=keys) for _ in range(600)]
        replies = await asyncio.gather(*futures)
        assert all(r["data"] == [content(k) for k in keys] for r in replies)
        await assert_idle(daemon, client)


# -- 7. security -----------------------------------------------------------------------------------


def memfd_pools(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return [line for line in maps if "/memfd:tierd" in line]


def mode_of(path: str | os.PathLike[str]) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mode", [None, 0o660])
async def test_socket_has_the_configured_mode_and_the_pool_no_path(
    tmp_path: Path, mode: int | None
) -> None:
    options: dict[str, Any] = {} if mode is None else {"socket": {"mode": mode}}
    before = set(os.listdir("/dev/shm"))
    async with serve(tmp_path, **options) as daemon, await connect(daemon) as client:
        expected = 0o600 if mode is None else mode
        assert stat.S_ISSOCK(os.stat(socket_of(daemon)).st_mode)
        assert mode_of(socket_of(daemon)) == expected
        assert client.pool is not None
        # The pool is a memfd passed over the socket: no file anyone could open by name.
        assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("tierd")}
        assert memfd_pools(os.getpid())  # this process maps it from the descriptor


_CHILD = r"""
import json, os, socket, struct, sys
import msgpack

path, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(30)
sock.connect(path)


def frame(message):
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


try:
    sock.sendall(frame({"id": 1, "op": "hello", "version": 2, "namespace": "child"})
                 + frame({"id": 2, "op": "put", "keys": [b"k"], "data": [bytes(4096)]}))
except (BrokenPipeError, ConnectionResetError):
    pass  # refused: the daemon hung up after its answer
buf, replies = b"", []
while len(replies) < 2:
    try:
        chunk = sock.recv(65536)
    except ConnectionResetError:
        break  # the daemon closed with our requests unread (Linux reports a reset)
    if not chunk:
        break
    buf += chunk
    while len(buf) >= 4 and len(buf) - 4 >= struct.unpack(">I", buf[:4])[0]:
        size = struct.unpack(">I", buf[:4])[0]
        replies.append(msgpack.unpackb(buf[4 : 4 + size], raw=False))
        buf = buf[4 + size :]
print(json.dumps({"uid": os.getuid(), "replies": replies}, default=repr))
"""

NOBODY = 65534


async def run_as(path: str, uid: int, gid: int) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        path,
        str(uid),
        str(gid),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    assert result["uid"] == uid
    return result


needs_root = pytest.mark.skipif(
    os.getuid() != 0, reason="dropping to another uid (os.setuid) needs root"
)


@needs_root
@pytest.mark.parametrize(
    ("socket_options", "admitted"),
    [
        ({}, False),
        ({"allow_uids": [NOBODY]}, True),
        ({"allow_gids": [NOBODY]}, True),
        ({"allow_uids": [NOBODY + 1], "allow_gids": [NOBODY + 1]}, False),
    ],
)
async def test_peer_credentials_decide_who_may_connect(
    tmp_path: Path, socket_options: dict[str, Any], admitted: bool
) -> None:
    # Mode 0o666 so that the connect itself succeeds; the peer check is what refuses.
    async with serve(tmp_path, socket={"mode": 0o666, **socket_options}) as daemon:
        path = socket_of(daemon)
        os.chmod(os.path.dirname(path), 0o755)  # short_socket_path's directory is 0700
        result = await run_as(path, NOBODY, NOBODY)
        async with await connect(daemon, "child") as client:
            stats = await client.stats()
            if admitted:
                assert [r["ok"] for r in result["replies"]] == [True, True]
                assert result["replies"][1]["stored"] == 1
                assert await client.get([b"k"]) == [bytes(4096)]
                assert stats["server"]["errors"] == {}
            else:
                (reply,) = result["replies"]
                assert (reply["id"], reply["ok"], reply["error"]) == (0, False, "not_allowed")
                assert str(NOBODY) in reply["message"]
                assert (await client.lookup([b"k"])).count == 0
                assert stats["server"]["errors"] == {"not_allowed": 1}
                # The daemon hung up at once (the child saw the end of the stream).
                assert stats["server"]["connections"] == 1


# -- 8. flow control -------------------------------------------------------------------------------


async def test_a_subscriber_that_never_reads_does_not_stall_the_daemon(tmp_path: Path) -> None:
    options: dict[str, Any] = {"cpu_blocks": 16, "disk_blocks": 32, "events": {"queue_batches": 4}}
    async with serve(tmp_path, **options) as daemon:
        stuck = await Raw.open(daemon, hello={"version": PROTOCOL_VERSION, "namespace": NS})
        assert (await stuck.call("subscribe"))["ok"] is True
        async with await connect(daemon) as client:
            rounds = 0
            # Long keys make big event pushes: the stuck socket fills after some rounds.
            while (await client.stats())["chain"]["events_dropped"] == 0:
                rounds += 1
                assert rounds <= 2000, "the subscriber's queue never overflowed"
                keys = [f"{rounds:08d}-{i:02d}".encode().ljust(56, b"x") for i in range(16)]
                assert await store_via_pool(client, keys) == 16
                assert await client.load(keys[:4]) == [content(k) for k in keys[:4]]
            # The daemon keeps serving while the subscriber stays stuck.
            for extra in range(3):
                keys = make_keys(f"after-{extra}", 16)
                assert await store_via_pool(client, keys) == 16
                assert await client.load(keys) == [content(k) for k in keys]
            stats = await client.stats()
            assert stats["chain"]["events_dropped"] > 0
            assert stats["server"]["connections"] == 2
            await assert_idle(daemon, client)
        # Once it reads again, it is told how many events it lost.
        async with asyncio.timeout(60):
            while True:
                push = await stuck.recv()
                assert push["push"] == "events"
                if push["dropped"] > 0:
                    break
        await stuck.close()


def test_every_listed_operation_is_answered_and_no_other() -> None:
    from tierd.control.protocol import OPERATIONS
    from tierd.control.serving.session import Session
    from tierd.control.state.context import ServerContext
    from tierd.control.state.tenant_table import TenantTable

    session = Session(ServerContext(TenantTable()), lambda message: None)
    assert set(session._sync) | set(session._async) == set(OPERATIONS)
    assert not set(session._sync) & set(session._async)
