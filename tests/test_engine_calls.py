"""The engines' one transport (``tierd.integrations.core.engine_calls``) against a real daemon.

Every engine call runs on the calling thread's own blocking connection and goes down the
data path ``tierd.integrations.core.route`` picks: each way moves blocks byte for byte, each
thread has its connection, and a way the daemon refuses is routed around at once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierd.integrations.core.data_paths import RowBlocks
from tierd.integrations.core.engine_calls import EngineCalls, EngineMemfd
from tierd.integrations.core.link import DaemonLink, LinkSettings
from tierd.integrations.core.route import PREFERENCES, Way, way
from tierd.integrations.sglang.pages import PageBlocks
from tierd.testing import daemon_config

BLOCK = 16 << 10
DEADLINE_S = 5.0


def rows_of(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, BLOCK), dtype=np.uint8)


def link_to(socket_path: str, namespace: str = "calls") -> DaemonLink:
    settings = LinkSettings(socket_path, namespace, BLOCK, job_deadline_s=DEADLINE_S)
    return DaemonLink(settings, name="tierd-test-link", map_pool=False)


def keys(name: str, count: int) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(count)]


def test_the_route_is_the_documented_table() -> None:
    """The first way an engine prefers that a connection offers; loads never read into
    the engine's own memfd, whatever is offered."""
    offered = {"regions": True, "engine_region": True, "pool": True}
    assert way("vllm", "load", **offered) is Way.STAGED
    assert way("vllm", "store", **offered) is Way.STAGED
    assert way("sglang", "load", **offered) is Way.LEASE
    assert way("sglang", "store", **offered) is Way.LEASE
    assert way("sglang", "store", regions=True, engine_region=True, pool=False) is Way.ENGINE_REGION
    assert way("sglang", "store", regions=True, engine_region=False, pool=False) is Way.STAGED
    assert way("vllm", "load", regions=False, engine_region=False, pool=True) is Way.LEASE
    assert way("sglang", "load", regions=True, engine_region=True, pool=False) is Way.STAGED
    for (_, op), ways in PREFERENCES.items():
        assert ways[-1] is Way.INLINE  # always offered: every call has a way
        assert op == "store" or Way.ENGINE_REGION not in ways


@pytest.mark.parametrize(
    ("regions", "map_pool", "expected"),
    [(True, False, Way.STAGED), (False, True, Way.LEASE), (False, False, Way.INLINE)],
)
async def test_each_way_stores_and_loads_byte_for_byte(
    tmp_path: Path, spawn: Any, regions: bool, map_pool: bool, expected: Way
) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK))
    link = link_to(daemon.socket_path)
    calls = EngineCalls(link, "vllm", staging_rows=3, map_pool=map_pool, regions=regions)
    try:
        source = rows_of(8, seed=1)
        ks = keys("w", 8)
        held = calls.store(ks, RowBlocks(source, np.arange(8, dtype=np.intp)), DEADLINE_S)
        assert held == [True] * 8
        assert calls.present([*ks, b"absent"], DEADLINE_S) == [True] * 8 + [False]
        assert calls.leading([*ks, b"absent"], DEADLINE_S) == 8
        target = np.zeros((10, BLOCK), dtype=np.uint8)
        ids = np.asarray([9, 1, 8, 2, 7, 3, 6, 4], dtype=np.intp)  # scattered rows
        outcome = calls.load(ks, RowBlocks(target, ids), DEADLINE_S)
        assert outcome.error is None and outcome.loaded == tuple(range(8))
        assert np.array_equal(target[ids], source)
        # A miss in the middle: skipped (vLLM's jobs), or the end of the load (leading).
        gap = [ks[0], b"absent", ks[2]]
        skipped = calls.load(gap, RowBlocks(target, ids[:3]), DEADLINE_S)
        assert skipped.loaded == (0, 2), skipped
        assert calls.load(gap, RowBlocks(target, ids[:3]), DEADLINE_S, leading=True).loaded == (0,)
        conn = calls.channel.here()
        assert conn is not None
        took = (
            Way.STAGED
            if "staging" in conn.held
            else Way.LEASE
            if conn.client.pool is not None
            else Way.INLINE
        )
        assert took is expected
    finally:
        calls.close()
        link.close()


async def test_each_thread_calls_on_a_connection_of_its_own(tmp_path: Path, spawn: Any) -> None:
    """Two threads at once, each with its own connection (and its own staging); the
    daemon sees both, and both threads' blocks are right."""
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK))
    link = link_to(daemon.socket_path)
    calls = EngineCalls(link, "vllm", staging_rows=4, map_pool=False)
    together = threading.Barrier(2, timeout=DEADLINE_S)
    seen: dict[str, Any] = {}

    def engine_thread(name: str, seed: int) -> None:
        source = rows_of(4, seed)
        ks = keys(name, 4)
        together.wait()
        calls.store(ks, RowBlocks(source, np.arange(4, dtype=np.intp)), DEADLINE_S)
        target = np.zeros_like(source)
        outcome = calls.load(ks, RowBlocks(target, np.arange(4, dtype=np.intp)), DEADLINE_S)
        together.wait()  # both connections open at once
        seen[name] = (calls.channel.here(), len(calls.channel.snapshot()), outcome)
        seen[name + " bytes"] = np.array_equal(target, source)

    threads = [threading.Thread(target=engine_thread, args=(n, s)) for n, s in [("a", 1), ("b", 2)]]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * DEADLINE_S)
        (conn_a, open_a, loaded_a), (conn_b, open_b, loaded_b) = seen["a"], seen["b"]
        assert conn_a is not None and conn_b is not None and conn_a is not conn_b
        assert open_a == open_b == 2
        assert loaded_a.loaded == loaded_b.loaded == (0, 1, 2, 3)
        assert seen["a bytes"] and seen["b bytes"]
        assert conn_a.held["staging"].array is not conn_b.held["staging"].array
    finally:
        calls.close()
        link.close()
    assert not calls.channel.connected  # close() closed every thread's connection


def _pages(path: Path | None, count: int) -> tuple[int, np.ndarray]:
    """An engine's pages as a file (a memfd, or the file at ``path``), mapped here."""
    size = count * BLOCK
    if path is None:
        fd = os.memfd_create("test-engine-pages")
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    memory = np.memmap(f"/proc/self/fd/{fd}", dtype=np.uint8, mode="r+", shape=(size,))
    memory[:] = rows_of(count, seed=5).reshape(-1)
    return fd, memory


def _page_blocks(memory: np.ndarray, count: int) -> PageBlocks:
    """Page ``i`` in two pieces (K and V, as SGLang's ``page_first``), pages in reverse."""
    half = BLOCK // 2
    starts = np.arange(count - 1, -1, -1, dtype=np.uint64) * np.uint64(BLOCK)
    offsets = np.stack([starts, starts + np.uint64(half)], axis=1)
    return PageBlocks(memory, offsets, (half, half))


@pytest.mark.parametrize("case", ["pool", "memfd", "file-on-disk"])
async def test_sglang_stores_copy_through_the_pool_and_hand_the_memfd_to_a_daemon_without_one(
    tmp_path: Path, spawn: Any, case: str
) -> None:
    """SGLang's store copies into the daemon's pool on the calling thread when the daemon
    offers one, even with the engine's memfd at hand (``pool``: nothing registered); a
    daemon whose entry tier has no pool (a disk tier) is handed the memfd and reads it
    itself (``memfd``); a file that is not memory (``file-on-disk``) is refused and the
    same call goes through the connection's staging memfd, and so does every later one."""
    config = daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK)
    if case != "pool":
        config["tiers"] = [t for t in config["tiers"] if t["kind"] == "disk"]
    daemon = await spawn(config)
    fd, memory = _pages(tmp_path / "pages" if case == "file-on-disk" else None, 6)
    link = link_to(daemon.socket_path, "sglang-like")
    calls = EngineCalls(
        link, "sglang", staging_rows=4, map_pool=True, memfd=EngineMemfd(fd, 6 * BLOCK)
    )
    try:
        blocks = _page_blocks(memory, 6)
        ks = keys("p", 6)
        assert calls.store(ks, blocks, DEADLINE_S) == [True] * 6
        conn = calls.channel.here()
        assert conn is not None
        assert (conn.client.pool is not None) is (case == "pool")
        assert ("engine" in conn.held) is (case == "memfd")
        assert calls.zero_copy is (case != "file-on-disk")
        expected = memory.copy()
        memory[:] = 0
        outcome = calls.load(ks, blocks, DEADLINE_S, leading=True)
        assert outcome.loaded == tuple(range(6)) and outcome.error is None
        assert np.array_equal(memory, expected)
        # Loads copy on this thread: out of the pool, else out of the staging memfd.
        assert ("staging" in conn.held) is (case != "pool")
        assert calls.store(keys("q", 2), _page_blocks(memory, 2), DEADLINE_S) == [True, True]
    finally:
        calls.close()
        link.close()
        del memory
        os.close(fd)


async def test_a_thread_that_only_posts_never_stalls_its_connection(
    tmp_path: Path, spawn: Any
) -> None:
    """Touches are posted, their replies never waited for. Left unread, the replies fill
    the socket and the daemon's output bound (4 KiB here), the daemon stops reading the
    connection, and the next send waits out its deadline: each post reads what has come
    first, so 20,000 touches leave the connection as it was."""
    limits = {"output_buffer_bytes": 4096, "output_stall_s": 1.0}
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK, limits=limits))
    link = link_to(daemon.socket_path)
    calls = EngineCalls(link, "vllm", staging_rows=2, map_pool=False)
    try:
        ks = keys("t", 2)
        assert calls.store(ks, RowBlocks(rows_of(2, 3), np.arange(2, dtype=np.intp)), DEADLINE_S)
        first = calls.channel.here()
        for _ in range(20_000):  # bounded: each is one send
            calls.touch(ks, DEADLINE_S)
        assert calls.present(ks, DEADLINE_S) == [True, True]
        assert calls.channel.here() is first  # the same connection throughout
        assert link.breaker.snapshot().failures == 0
    finally:
        calls.close()
        link.close()


async def test_every_threads_connection_shares_one_mapping_of_the_pool(
    tmp_path: Path, spawn: Any
) -> None:
    """Leases on two threads' connections: one mapping of the daemon's pool (its page
    tables filled once), and a restarted daemon's new pool replaces it."""
    config = daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK)
    daemon = await spawn(config)
    link = link_to(daemon.socket_path)
    calls = EngineCalls(link, "sglang", staging_rows=2, map_pool=True)
    pools: list[Any] = []

    def engine_thread(seed: int) -> None:
        source = rows_of(2, seed)
        calls.store(keys(f"s{seed}", 2), RowBlocks(source, np.arange(2, dtype=np.intp)), 5.0)
        conn = calls.channel.here()
        pools.append(conn.client.pool if conn is not None else None)

    try:
        for seed in (1, 2):
            thread = threading.Thread(target=engine_thread, args=(seed,))
            thread.start()
            thread.join(4 * DEADLINE_S)
        assert pools[0] is not None and pools[0] is pools[1]
        assert len(calls.channel.snapshot()) == 2
        daemon.proc.kill()
        await daemon.wait()
        await spawn(config)  # the same socket, a new pool
        engine_thread(3)  # this thread connects to the new daemon
        assert pools[2] is not None and pools[2] is not pools[0]
    finally:
        calls.close()
        link.close()
