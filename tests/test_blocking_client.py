"""The blocking client: one round trip from the calling thread, never past its deadline.

Real ``tierd serve`` processes: blocks stored with the async client are found and
copied into a memfd region by the blocking one, byte for byte; an error answer leaves the
connection usable; a missing daemon fails at once; a stopped one (SIGSTOP: the kernel
still accepts the connection) costs the deadline, connecting included, and leaves the
client closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import signal
import time

import numpy as np
import pytest

from tierd.client import Client, DaemonError, Unreachable
from tierd.control.clients.blocking_client import BlockingClient
from tierd.control.clients.handshake import DaemonSilent
from tierd.testing import daemon_config

BLOCK = 4096
NS = "blocking"
DEADLINE_S = 0.2
BOUND_S = 5.0  # a liveness bound: a loaded machine must not make these flaky


def block(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(BLOCK)


def connect(path: str, deadline_s: float = 10.0) -> BlockingClient:
    return BlockingClient.connect(
        path, namespace=NS, block_bytes=BLOCK, deadline=time.monotonic() + deadline_s
    )


def soon(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


async def test_lookups_and_region_loads_are_byte_exact(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    keys = [f"k{i}".encode() for i in range(5)]
    async with await Client.connect(daemon.socket_path, namespace=NS) as writer:
        await writer.store(keys[:3], [block(k) for k in keys[:3]])

    def blocking_side() -> tuple[list[bool], list[bool], bytes]:
        client = connect(daemon.socket_path)
        try:
            present = client.lookup_each([keys[0], keys[3], keys[2], keys[1]], soon())
            fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, 4 * BLOCK)
                memory = mmap.mmap(fd, 4 * BLOCK)
                memory[:] = bytes(4 * BLOCK)  # the engine's memory exists (no hole)
                region = client.register_region(fd, 4 * BLOCK, soon())
            finally:
                os.close(fd)
            offsets = np.asarray([3, 0, 1], dtype=np.uint64) * BLOCK
            done = client.region_load(region, [keys[0], keys[4], keys[2]], offsets, soon())
            return present, done, bytes(memory)
        finally:
            client.close()

    present, done, memory = await asyncio.to_thread(blocking_side)
    assert present == [True, False, True, True]
    assert done == [True, False, True]
    assert memory[3 * BLOCK :] == block(keys[0])
    assert memory[BLOCK : 2 * BLOCK] == block(keys[2])
    assert memory[:BLOCK] == bytes(BLOCK)  # the miss left its row alone


async def test_an_error_answer_leaves_the_connection_usable(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))

    def blocking_side() -> tuple[str, list[bool], bool]:
        client = connect(daemon.socket_path)
        try:
            with pytest.raises(DaemonError) as refused:
                client.region_load(7, [b"x"], np.zeros(1, dtype=np.uint64), soon())
            # Two requests sent together, both refused: both answers are read.
            offsets = np.zeros(1, dtype="<u8").tobytes()
            parts = [{"region": r, "keys": [b"x"], "offsets": offsets} for r in (7, 8)]
            with pytest.raises(DaemonError):
                client.requests("region_load", parts, soon())
            return refused.value.code, client.lookup_each([b"x"], soon()), client.closed
        finally:
            client.close()

    code, present, closed = await asyncio.to_thread(blocking_side)
    assert code == "unknown_region"
    assert present == [False] and not closed


def test_no_daemon_fails_at_once(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(Unreachable) as failed:
        connect(str(tmp_path / "absent.sock"))
    assert not isinstance(failed.value, DaemonSilent)
    assert time.monotonic() - start < BOUND_S


async def test_a_stopped_daemon_costs_the_deadline(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    client = await asyncio.to_thread(connect, daemon.socket_path)
    daemon.signal(signal.SIGSTOP)
    try:

        def timed(call) -> float:
            start = time.monotonic()
            with pytest.raises(DaemonSilent):
                call()
            return time.monotonic() - start

        took = await asyncio.to_thread(
            timed, lambda: client.lookup_each([b"a"], time.monotonic() + DEADLINE_S)
        )
        assert DEADLINE_S * 0.9 <= took < BOUND_S
        assert client.closed  # a late answer could not be told from the next one
        with pytest.raises(Unreachable):
            client.lookup_each([b"a"], soon())
        # Connecting to it: the kernel accepts, nobody says hello back.
        took = await asyncio.to_thread(timed, lambda: connect(daemon.socket_path, DEADLINE_S))
        assert DEADLINE_S * 0.9 <= took < BOUND_S
    finally:
        daemon.signal(signal.SIGCONT)
    again = await asyncio.to_thread(connect, daemon.socket_path)
    try:
        assert await asyncio.to_thread(again.lookup_each, [b"a"], soon()) == [False]
    finally:
        again.close()


@pytest.mark.parametrize("bound", ["50%", "100%"])
async def test_a_load_past_the_lease_bound_is_served_whole(tmp_path, spawn, bound: str) -> None:
    # Issue 35, 1: a load is split at the connection's lease bound (by default half of a
    # 12-block CPU tier: 6 blocks; or the whole tier); its requests must not race for that
    # bound, and every one counts, the blocks promoted from disk included.
    cfg = daemon_config(tmp_path, block_bytes=BLOCK, cpu_blocks=12, disk_blocks=64)
    cfg["limits"] = {"lease_blocks_per_connection": bound, "lease_blocks_per_tenant": bound}
    daemon = await spawn(cfg)
    keys = [f"long{i}".encode() for i in range(16)]  # more than the CPU tier: disk hits too
    async with await Client.connect(daemon.socket_path, namespace=NS) as writer:
        await writer.store(keys, [block(k) for k in keys])

    def blocking_side() -> tuple[int, list[bool], bytes]:
        client = connect(daemon.socket_path)
        try:
            fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, len(keys) * BLOCK)
                memory = mmap.mmap(fd, len(keys) * BLOCK)
                memory[:] = bytes(len(memory))
                region = client.register_region(fd, len(memory), soon())
            finally:
                os.close(fd)
            offsets = np.arange(len(keys), dtype=np.uint64) * BLOCK
            done = client.region_load(region, keys, offsets, soon())
            return int(client.info["max_lease_blocks"]), done, bytes(memory)
        finally:
            client.close()

    bound, done, memory = await asyncio.to_thread(blocking_side)
    assert bound < len(keys)  # the load took several requests
    assert done == [True] * len(keys)
    assert memory == b"".join(block(k) for k in keys)


async def test_started_requests_are_collected_later_and_a_wait_that_runs_out_breaks_nothing(
    tmp_path, spawn
) -> None:
    """A scheduler step starts its requests and goes on; a later step collects what has
    come. A collect whose deadline passes (the daemon stopped) leaves the connection
    usable: the replies are matched by id when they come, a given-up one goes to its
    handler (a late grant is still seen), and plain requests work again."""
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    keys = [f"s{i}".encode() for i in range(3)]
    async with await Client.connect(daemon.socket_path, namespace=NS) as writer:
        await writer.store(keys, [block(k) for k in keys])
    client = connect(daemon.socket_path)
    late: list[dict] = []
    try:
        first, second = client.start("lookup", [{"keys": keys}, {"keys": keys[:1]}], soon())
        got: dict = {}
        while len(got) < 2:  # bounded by the loop below's safety net
            got.update(client.collect([first, second], soon(BOUND_S)))
        assert got[first]["count"] == 3 and got[second]["count"] == 1
        assert client.lookup(keys, soon()) == 3  # a plain request between two started ones
        daemon.signal(signal.SIGSTOP)
        try:
            (pin,) = client.start("prepare_load", [{"keys": keys, "wait_s": 0}], soon())
            assert client.collect([pin], time.monotonic() + DEADLINE_S) == {}
            assert not client.closed  # the wait ran out: nothing broke
            client.forget([pin], late.append)
        finally:
            daemon.signal(signal.SIGCONT)
        # Its reply is read along with later calls; the daemon may answer the lookup
        # first (a load's grant waits on no other request of the connection's).
        for _ in range(50):
            assert client.lookup(keys, soon(BOUND_S)) == 3
            if late:
                break
            await asyncio.sleep(0.02)
        assert len(late) == 1 and late[0]["ok"] and late[0]["count"] == 3
        client.request("complete_load", soon(), lease=late[0]["lease"])
    finally:
        client.close()


async def test_a_retained_connection_keeps_its_socket_when_it_breaks(tmp_path, spawn) -> None:
    """``retain``: a connection that breaks (a wait past its deadline on a plain request)
    can send nothing more, but its socket, and so its leases in the daemon, stay until
    its owner closes it."""
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    keys = [f"r{i}".encode() for i in range(2)]
    async with await Client.connect(daemon.socket_path, namespace=NS) as writer:
        await writer.store(keys, [block(k) for k in keys])
    client = BlockingClient.connect(
        daemon.socket_path, namespace=NS, block_bytes=BLOCK, deadline=soon(), retain=True
    )
    pinned = client.request("prepare_load", soon(), keys=keys)
    assert pinned["count"] == 2
    daemon.signal(signal.SIGSTOP)
    try:
        with pytest.raises(DaemonSilent):
            client.lookup(keys, time.monotonic() + DEADLINE_S)
    finally:
        daemon.signal(signal.SIGCONT)
    assert client.closed
    with pytest.raises(Unreachable):
        client.lookup(keys, soon())
    async with await Client.connect(daemon.socket_path, namespace=NS) as watcher:
        assert (await watcher.stats())["tiers"][0]["pinned"] == 2  # the lease holds
        client.close()
        for _ in range(200):  # bounded: until the daemon has read the close
            if (await watcher.stats())["tiers"][0]["pinned"] == 0:
                break
            await asyncio.sleep(0.01)
        assert (await watcher.stats())["tiers"][0]["pinned"] == 0
