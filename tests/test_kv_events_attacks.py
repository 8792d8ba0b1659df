"""The events sockets attacked as a hostile local user would (issue 59, items 7-9).

A real ``tierd serve`` publishes on tcp:// (the opt-in, ``anyone_may_read``: every local
user may connect), in a memory cgroup of 1 GiB, with 1,024 descriptors (``prlimit``), its
replay buffer filled with some 8 MiB of batches. Each attack runs while a bystander
client looks blocks up over the control socket; the daemon must stay alive, keep its
resident memory within 64 MiB of what it was, and answer every lookup.

- Replay floods: 100 peers send 40 "replay from 0" requests each and never read (each
  request once queued the whole kept history for its peer: 120 to 892 MiB), and one
  sends a 300 MiB message (no message size bound: a 1.5 GiB one OOM-killed the daemon).
- Subscriptions: one of 128 MiB (kept whole), and 5,000 distinct ones from one peer.
- Connections: 1,100 plain TCP connections to the events port held the daemon at its
  descriptor limit, and no client could reach the control socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from cgroup_kit import memory_cgroup

from tests.daemon_kit import DaemonProcess, Spawn
from tierd.client import Client
from tierd.kvevents.wire import END_SEQ
from tierd.testing import daemon_config

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="a memory cgroup needs root")

NS = "attacked"
BATCHES = 2000  # described blocks announced one batch each: the replay buffer's content
TOKENS = 1024  # per block: a batch of some 4 KiB
RSS_SLACK = 64 << 20
LOOKUPS = 400  # the bystander's, during an attack


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A fresh memory cgroup limited to 1 GiB, removed at the end."""
    with memory_cgroup(1 << 30, prefix="tierd-events-") as group:
        yield group


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def _description(i: int) -> dict[str, Any]:
    return {
        "hashes": [10_000 + i],
        "parent": None,
        "tokens": [i % 50_000] * TOKENS,
        "block_size": TOKENS,
    }


async def _daemon(
    tmp_path: Path, spawn: Spawn, cgroup: Path
) -> tuple[DaemonProcess, dict[str, Any]]:
    kv = {
        "enabled": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "anyone_may_read": True,
        "max_batch_events": 1,
        "batch_s": 0.001,
    }
    config = daemon_config(tmp_path, cpu_blocks=BATCHES + 64, disk_blocks=None, kv_events=kv)
    join = f'echo $$ > {cgroup / "cgroup.procs"} && exec "$@"'
    wrap = ["prlimit", "--nofile=1024:1024", "sh", "-c", join, "sh"]
    daemon = await spawn(config, wrap=wrap)
    async with await Client.connect(daemon.socket_path, namespace=NS) as client:
        keys = [b"block-%d" % i for i in range(BATCHES)]
        for start in range(0, BATCHES, 256):
            part = keys[start : start + 256]
            assert await client.put(part, [b"b" * 4096] * len(part)) == len(part)
        for start in range(0, BATCHES, 64):  # held already: each announced at once
            ids = range(start, min(start + 64, BATCHES))
            await client.describe([keys[i] for i in ids], [_description(i) for i in ids])
        for _ in range(200):  # bounded: until every batch is out
            kv_stats = (await client.stats())["kv_events"]
            if kv_stats["buffered"] >= BATCHES:
                break
            await asyncio.sleep(0.05)
        assert kv_stats["buffered"] >= BATCHES, kv_stats
    return daemon, kv_stats


async def _bystander(daemon: DaemonProcess, stop: asyncio.Event) -> list[float]:
    """Lookups over the control socket until ``stop`` (at most ``LOOKUPS``): each time."""
    took = []
    async with await Client.connect(daemon.socket_path, namespace=NS) as client:
        for i in range(LOOKUPS):
            begun = time.perf_counter()
            found = await client.lookup([b"block-%d" % (i % BATCHES)])
            took.append(time.perf_counter() - begun)
            assert found.count == 1
            if stop.is_set():
                break
            await asyncio.sleep(0.005)
    return took


async def _beside(daemon: DaemonProcess, attack: Any) -> dict[str, Any]:
    """Run ``attack`` (blocking, in a thread) beside a bystander; the daemon's RSS
    before and after, and the bystander's lookups."""
    before = _rss(daemon.pid)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_bystander(daemon, stop))
    try:
        result = await asyncio.to_thread(attack)
        await asyncio.sleep(1.0)  # what the attack left queued, settled
        after = _rss(daemon.pid)
    finally:
        stop.set()
    took = await watcher
    assert daemon.process.returncode is None, daemon.stderr()
    took.sort()
    p99 = took[int(0.99 * (len(took) - 1))] * 1000
    print(
        f"rss {before >> 20} -> {after >> 20} MiB; bystander {len(took)} lookups,"
        f" median {statistics.median(took) * 1000:.2f} ms, p99 {p99:.2f} ms"
    )
    return {"before": before, "after": after, "result": result}


def _flood_replays(endpoint: str, peers: int, requests: int) -> int:
    """``peers`` DEALERs, each asking ``requests`` times for everything, never reading."""
    ctx = zmq.Context()
    try:
        socks = []
        for _ in range(peers):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 4096)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            socks.append(dealer)
        for _ in range(requests):
            for dealer in socks:
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(3.0)  # the daemon answers what it will
        return len(socks)
    finally:
        ctx.destroy(linger=0)


def _huge_message(endpoint: str, size: int) -> None:
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", bytes(size)])
        time.sleep(3.0)
    finally:
        ctx.destroy(linger=0)


async def test_replay_floods_cost_the_daemon_a_bounded_amount(
    tmp_path: Path, spawn: Spawn, cgroup: Path
) -> None:
    daemon, kv = await _daemon(tmp_path, spawn, cgroup)
    endpoint = kv["replay_endpoint"]
    flood = await _beside(daemon, lambda: _flood_replays(endpoint, 100, 40))
    assert flood["after"] - flood["before"] < RSS_SLACK, flood
    huge = await _beside(daemon, lambda: _huge_message(endpoint, 300 << 20))
    assert huge["after"] - huge["before"] < RSS_SLACK, huge
    async with await Client.connect(daemon.socket_path) as operator:
        kv = (await operator.stats())["kv_events"]
    assert kv["replays_refused"] > 0  # past the replays answered at once
    batches = await asyncio.to_thread(_replay_all, kv["replay_endpoint"])  # an honest one
    assert len(batches) == kv["buffered"]
    assert await daemon.stop() == 0


def _replay_all(endpoint: str) -> list[int]:
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        seqs: list[int] = []
        for attempt in range(20):  # bounded: a replay refused while others run is retried
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while dealer.poll(2000):
                frames = dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    return seqs
                seqs.append(int.from_bytes(frames[2], "big"))
            seqs = []
            time.sleep(0.5 * attempt)
        raise AssertionError("no replay was answered")
    finally:
        ctx.destroy(linger=0)


def _subscribe(endpoint: str, prefixes: list[bytes]) -> None:
    ctx = zmq.Context()
    try:
        xsub = ctx.socket(zmq.XSUB)
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.setsockopt(zmq.SNDHWM, 0)
        xsub.connect(endpoint)
        for prefix in prefixes:
            xsub.send(b"\x01" + prefix)
        time.sleep(3.0)
    finally:
        ctx.destroy(linger=0)


def _raw_subscription(endpoint: str, size: int) -> None:
    """One subscription of ``size`` bytes, spoken as ZMTP 3.0 on a plain socket (ZMQ's own
    SUB keeps a subscription in a tree one level a byte: at 128 MiB it overflows the
    attacker's stack before anything is sent)."""
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    body = b"\x01" + b"s" * (size - 1)
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(greeting)
        conn.sendall(b"\x04" + bytes((len(ready),)) + ready)
        with contextlib.suppress(OSError):  # the daemon may hang up part way
            conn.sendall(b"\x02" + len(body).to_bytes(8, "big") + body)
        time.sleep(3.0)


async def test_subscriptions_cost_the_daemon_a_bounded_amount(
    tmp_path: Path, spawn: Spawn, cgroup: Path
) -> None:
    daemon, kv = await _daemon(tmp_path, spawn, cgroup)
    endpoint = kv["endpoint"]
    one_big = await _beside(daemon, lambda: _raw_subscription(endpoint, 128 << 20))
    assert one_big["after"] - one_big["before"] < RSS_SLACK, one_big
    many = [b"%08d" % i + b"y" * 400 for i in range(5000)]
    distinct = await _beside(daemon, lambda: _subscribe(endpoint, many))
    assert distinct["after"] - distinct["before"] < RSS_SLACK, distinct
    # An honest subscriber still gets the stream.
    async with await Client.connect(daemon.socket_path, namespace=NS) as client:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            for i in range(100):  # bounded: until its subscription is taken
                key = b"honest-%d" % i
                await client.put([key], [b"h" * 4096])
                await client.describe([key], [_description(BATCHES + i)])
                if await asyncio.to_thread(sub.poll, 100):
                    break
            frames = sub.recv_multipart(zmq.NOBLOCK)
            assert msgpack.unpackb(frames[2])[1][0]["type"] == "BlockStored"
        finally:
            ctx.destroy(linger=0)
    assert await daemon.stop() == 0


def _connections(port: int, count: int) -> int:
    """``count`` plain TCP connections to ``port``, held 3 s; how many connected."""
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    held = []
    try:
        for _ in range(count):
            conn = socket.socket()
            try:
                conn.connect(("127.0.0.1", port))
            except OSError:
                conn.close()
                continue
            held.append(conn)
        time.sleep(3.0)
        return len(held)
    finally:
        for conn in held:
            conn.close()


async def test_connections_to_the_events_ports_never_take_the_control_socket(
    tmp_path: Path, spawn: Spawn, cgroup: Path
) -> None:
    daemon, kv = await _daemon(tmp_path, spawn, cgroup)
    port = int(kv["endpoint"].rsplit(":", 1)[1])
    replay_port = int(kv["replay_endpoint"].rsplit(":", 1)[1])

    def both() -> tuple[int, int]:
        return _connections(port, 1100), _connections(replay_port, 1100)

    async def control_during() -> None:
        await asyncio.sleep(1.5)  # the connections are held now
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            assert (await client.lookup([b"block-1"])).count == 1
            async with await Client.connect(daemon.socket_path) as operator:
                stats = (await operator.stats())["kv_events"]
        assert stats["peers"] <= 2 * 64, stats

    attack = asyncio.create_task(_beside(daemon, both))
    await control_during()
    result = await attack
    assert result["result"][0] > 1024  # more than the daemon has descriptors
    async with await Client.connect(daemon.socket_path) as operator:
        assert (await operator.stats())["kv_events"]["peers_refused"] > 0
    assert await daemon.stop() == 0
