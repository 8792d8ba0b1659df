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
import test_daemon_lifecycle

from tierd.client import Client, DaemonError, Unreachable
from tierd.control.blocking_client import BlockingClient
from tierd.control.handshake import DaemonSilent
from tierd.testing import daemon_config

spawn = test_daemon_lifecycle.spawn
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
            fd = os.memfd_create("test-region", os.MFD_CLOEXEC)
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
            fd = os.memfd_create("test-region", os.MFD_CLOEXEC)
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
