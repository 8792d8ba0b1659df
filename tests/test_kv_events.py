"""KV events for routers, through a real daemon: blocks that describe themselves, the
publisher's stream and replay, incarnations across a restart, the existence query
(docs/events.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
import zmq
from kv_events_kit import BS, NS, described_chain, description, events_config, put_blocks

from tierd.cli.control_text import stats_text
from tierd.client import Client, DaemonError
from tierd.testing import config_check, daemon_config, kv_replay, running_daemon

pytestmark = pytest.mark.asyncio


async def _connect(daemon: Any, namespace: str | None = NS) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=namespace)


async def _kv(client: Client) -> dict[str, Any]:
    return dict((await client.stats())["kv_events"])


def _replay(endpoint: str, start: int) -> list[tuple[bytes, int, Any]]:
    """Every batch the publisher still keeps from ``start`` on, asked of its ROUTER."""
    return [(topic, seq, msgpack.unpackb(p)) for topic, seq, p in kv_replay(endpoint, start)]


def _events(batches: list[tuple[bytes, int, Any]]) -> list[dict[str, Any]]:
    return [event for _, _, payload in batches for event in payload[1]]


async def _replayed(client: Client, start: int = 0) -> list[tuple[bytes, int, Any]]:
    endpoint = (await _kv(client))["replay_endpoint"]
    return await asyncio.to_thread(_replay, endpoint, start)


async def _until(client: Client, predicate: Any, what: str) -> list[dict[str, Any]]:
    for _ in range(200):  # bounded: up to ~10 s on a loaded machine
        events = _events(await _replayed(client))
        if predicate(events):
            return events
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {what}: {events}")


def _by(events: list[dict[str, Any]], kind: str, medium: str) -> list[list[Any]]:
    return [e["block_hashes"] for e in events if e["type"] == kind and e.get("medium") == medium]


async def test_described_blocks_are_announced_as_they_enter_move_and_leave(tmp_path: Path) -> None:
    keys, descs = described_chain(6)
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        assert await client.describe(keys, descs) == 6
        await put_blocks(client, keys)  # 4 CPU slots: 2 demoted
        events = await _until(
            client, lambda ev: len(_by(ev, "BlockStored", "DISK")) >= 2, "demotions"
        )
        assert events[0] == {"type": "AllBlocksCleared"}
        stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
        first = next(e for e in stored if e["block_hashes"] == [1000])
        assert first["parent_block_hash"] is None
        assert first["token_ids"] == [0, 1, 2, 3] and first["block_size"] == BS
        assert first["locality"] == "LOCAL" and first["lora_id"] is None
        second = next(e for e in stored if e["block_hashes"] == [1001])
        assert second["parent_block_hash"] == 1000
        moved = _by(events, "BlockStored", "DISK")
        assert all(h in _by(events, "BlockRemoved", "CPU") for h in moved)
        assert (await client.delete(keys[:1]))["removed"] == 1
        async with await _connect(daemon, None) as operator:
            await operator.clear()
        events = await _until(
            client,
            lambda ev: (
                sum(len(h) for h in _by(ev, "BlockRemoved", "DISK"))
                + sum(len(h) for h in _by(ev, "BlockRemoved", "CPU"))
                >= 6 + len(moved)
            ),
            "every removal",
        )
        for _ in range(200):  # the CPU tier's removals wait out the demotion grace (2 s)
            kv = await _kv(client)
            if kv["described"] == 0:
                break
            await asyncio.sleep(0.05)
        assert kv["described"] == 0 and kv["undescribed"] == 0
        batches = await _replayed(client)
        first = batches[0][1]
        assert [seq for _, seq, _ in batches] == list(range(first, first + len(batches)))  # no gap
        async with await _connect(daemon, None) as operator:
            text = stats_text(await operator.stats(), as_json=False)
        assert f"incarnation {kv['incarnation']}" in text and "0 batches dropped" in text
        assert {topic for topic, _, _ in batches} == {b"kv@node:n1@m"}


async def test_a_block_described_after_its_store_is_announced_at_once(tmp_path: Path) -> None:
    keys, descs = described_chain(2)
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        await client.put(keys, [b"x" * 4096] * 2)
        assert (await _kv(client))["undescribed"] == 2
        assert _by(_events(await _replayed(client)), "BlockStored", "CPU") == []
        await client.describe(keys, descs)
        events = await _until(client, lambda ev: len(_by(ev, "BlockStored", "CPU")) == 2, "both")
        assert sorted(_by(events, "BlockStored", "CPU")) == [[1000], [1001]]


async def test_blocks_held_answers_the_longest_prefix_and_each_medium(tmp_path: Path) -> None:
    keys, descs = described_chain(6)
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        await client.describe(keys, descs)
        await put_blocks(client, keys)
        asked = [[1000 + i for i in range(6)], [1000, 1001, 999, 1003], [555], []]
        for _ in range(200):  # the feed follows the chain's events within a batch
            media = await client.blocks_held(asked)
            if len(media[0]) == 6:
                break
            await asyncio.sleep(0.05)
        assert len(media[0]) == 6 and set(media[0]) == {"CPU", "DISK"}
        assert media[0].count("DISK") == 2  # the two the CPU tier demoted
        assert [len(m) for m in media[1:]] == [2, 0, 0]
        async with await _connect(daemon, None) as operator:
            assert await operator.blocks_held([[1000, 1001]]) == [media[0][:2]]
        with pytest.raises(DaemonError, match="integer or bytes"):
            await client.blocks_held([[[1]]])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"hashes": [], "tokens": [], "block_size": 4}, "hashes"),
        ({"hashes": [1], "tokens": [1, 2], "block_size": 4}, "tokens"),
        ({"hashes": [1], "tokens": [1, 2, 3, 4], "block_size": 0}, "block_size"),
        ({"hashes": [1.5], "tokens": [1, 2, 3, 4], "block_size": 4}, "got `float`"),
        (
            {"hashes": [1], "tokens": [1, 2, 3, -4], "block_size": 4},
            r"`int` >= 0 - at `\$.tokens\[3\]`",
        ),
        (
            {"hashes": [1], "tokens": [1, 2, 3, 1 << 32], "block_size": 4},
            r"`int` <= 4294967295 - at `\$.tokens\[3\]`",
        ),
        ({"hashes": [1], "tokens": [1, 2, 3, 4], "block_size": 4, "evil": 1}, "unknown field"),
        ({"hashes": [1], "tokens": [1, 2, 3, 4], "block_size": 4, "extra_keys": [[{}]]}, "extra"),
        ("not a map", "Expected `object`, got `str`"),
    ],
)
async def test_a_bad_description_is_refused_and_nothing_is_kept(
    tmp_path: Path, bad: Any, said: str
) -> None:
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        with pytest.raises(DaemonError, match=said):
            await client.describe([b"a", b"b"], [description(0), bad])
        assert (await _kv(client))["described"] == 0
        assert await client.describe([b"a"], [description(0)]) == 1  # still serving


async def test_a_description_nested_100000_deep_is_a_bad_request_and_the_daemon_serves_on(
    tmp_path: Path,
) -> None:
    head = msgpack.packb({"hashes": [1], "tokens": [1, 2, 3, 4], "block_size": 4})
    deep = b"\x84" + head[1:] + msgpack.packb("extra_keys") + b"\x91" * 100_000 + b"\xc0"
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        with pytest.raises(
            DaemonError, match="bad_request: a description: its containers nest too deep"
        ):
            await client.request("describe", keys=[b"a"], blocks=[deep])
        assert (await _kv(client))["described"] == 0
        assert await client.describe([b"a"], [description(0)]) == 1  # still serving


async def test_off_by_default_nothing_is_kept_and_the_query_says_why(tmp_path: Path) -> None:
    config = daemon_config(tmp_path, cpu_blocks=4, disk_blocks=None)
    async with running_daemon(config) as daemon, await _connect(daemon) as client:
        assert await client.describe([b"a"], [description(0)]) == 0
        assert "kv_events" not in await client.stats()
        with pytest.raises(DaemonError, match="KV events are off"):
            await client.blocks_held([[1000]])


async def test_a_restart_is_a_new_incarnation_and_kept_blocks_are_announced_again(
    tmp_path: Path,
) -> None:
    keys, descs = described_chain(3)
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        await client.describe(keys, descs)
        await client.put(keys, [b"z" * 4096] * 3)
        before = (await _kv(client))["incarnation"]
        await _until(client, lambda ev: len(_by(ev, "BlockStored", "CPU")) == 3, "stores")
        last = (await _replayed(client))[-1][1]
    # The shutdown flushed the CPU tier down: the disk tier keeps all three.
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        assert (await _kv(client))["incarnation"] != before
        events = await _until(
            client, lambda ev: len(_by(ev, "BlockStored", "DISK")) == 3, "kept blocks"
        )
        batches = await _replayed(client)
        # numbered past the last incarnation's: a consumer sees a gap forward, no step back
        assert batches[0][1] > last and events[0] == {"type": "AllBlocksCleared"}
        assert sorted(_by(events, "BlockStored", "DISK")) == [[1000], [1001], [1002]]
        assert await client.blocks_held([[1000, 1001, 1002]]) == [["DISK"] * 3]


async def test_an_unreadable_descriptions_file_costs_the_descriptions_not_the_start(
    tmp_path: Path,
) -> None:
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "disk" / "kv-descriptors.log").write_bytes(b"\xc1garbage" * 100)
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        assert (await _kv(client))["described"] == 0
        assert await client.describe([b"a"], [description(0)]) == 1


@contextlib.contextmanager
def _subscriber(endpoint: str, *, hwm: int = 1000) -> Iterator[zmq.Socket[bytes]]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()


async def test_a_subscriber_that_never_reads_costs_the_daemon_nothing(tmp_path: Path) -> None:
    """A connected SUB that never reads: the daemon keeps answering and its publisher's
    queue and replay buffer stay within their bounds."""
    config = events_config(tmp_path, queue_batches=8, buffer_batches=16, hwm=4, max_batch_events=1)
    n = 64
    keys = [f"s{i}".encode() for i in range(n)]
    descs = [description(i) for i in range(n)]
    async with running_daemon(config) as daemon, await _connect(daemon) as client:
        with _subscriber((await _kv(client))["endpoint"], hwm=1):
            await client.describe(keys, descs)
            for i in range(0, n, 4):  # bounded: 16 puts, each evicting and demoting
                await client.put(keys[i : i + 4], [b"q" * 4096] * 4)
            await client.health()
            kv = await _kv(client)
            assert kv["queued"] <= 8
            assert len(await _replayed(client)) <= 16
            assert kv["sequence"] > 16  # more batches went out than the buffer keeps


async def test_a_subscriber_that_joins_gets_what_the_chain_holds_at_most_once_a_second(
    tmp_path: Path,
) -> None:
    """A snapshot (``AllBlocksCleared``, then every held block on each medium) follows a
    subscription, so a router that (re)joins learns what it missed; 40 subscribers
    joining over 3 s cost a few snapshots, not 40."""
    keys, descs = described_chain(6)
    async with running_daemon(events_config(tmp_path)) as daemon, await _connect(daemon) as client:
        await client.describe(keys, descs)
        await put_blocks(client, keys)  # 4 CPU, 2 on disk only
        await _until(client, lambda ev: len(_by(ev, "BlockStored", "DISK")) >= 2, "demotions")
        with _subscriber((await _kv(client))["endpoint"]) as sub:
            heard: list[dict[str, Any]] = []
            for _ in range(100):  # bounded: until the snapshot came whole
                if await asyncio.to_thread(sub.poll, 100):
                    heard += msgpack.unpackb(sub.recv_multipart()[2])[1]
                stored = {h for e in heard if e["type"] == "BlockStored" for h in e["block_hashes"]}
                if len(stored) == 6:
                    break
        assert heard[0] == {"type": "AllBlocksCleared"}
        assert stored == {1000 + i for i in range(6)}
        began = (await _kv(client))["snapshots"]
        for _ in range(40):  # bounded: 40 subscribers joining, one every 75 ms
            with _subscriber((await _kv(client))["endpoint"]):
                await asyncio.sleep(0.075)
        await asyncio.sleep(1.5)
        assert 1 <= (await _kv(client))["snapshots"] - began <= 5


async def test_an_owner_identity_is_refused_saying_no_router_credits_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    config = events_config(tmp_path)
    config["kv_events"]["ownership"] = "tierd-node-1"
    path.write_text(yaml.safe_dump(config))
    out = await asyncio.to_thread(config_check, path)
    assert out.returncode == 78, out
    assert "kv_events.ownership" in out.stderr and "no router credits" in out.stderr
