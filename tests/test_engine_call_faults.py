"""Errors in an engine's calls are never quiet (issue 60, item 13), against a real daemon:

- a store answers, per key, only what the daemon holds: a key another writer is still
  writing (which may abort) is no key of this store, and a lease the daemon stored short
  is not reported stored;
- whatever a call raises counts for the breaker and closes its connection (its state is
  unknown);
- a restarted daemon's pool does not unmap the old one under a thread still copying
  into it, and the old one goes once no thread uses it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierd.client import Client
from tierd.control.clients.handshake import Unreachable
from tierd.errors import TierdError
from tierd.integrations.core.channel import ThreadConnection
from tierd.integrations.core.data_paths import RowBlocks, inline_store
from tierd.integrations.core.engine_calls import EngineCalls, leased_store
from tierd.integrations.core.link import DaemonLink, LinkSettings
from tierd.testing import daemon_config

BLOCK = 16 << 10
DEADLINE_S = 5.0
NAMESPACE = "faults"


def rows_of(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, BLOCK), dtype=np.uint8)


def keys(name: str, count: int) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(count)]


def link_to(socket_path: str) -> DaemonLink:
    settings = LinkSettings(socket_path, NAMESPACE, BLOCK, job_deadline_s=DEADLINE_S)
    return DaemonLink(settings, name="tierd-test-link", map_pool=False)


def pool_calls(link: DaemonLink) -> EngineCalls:
    """SGLang's calls: stores and loads through leases on the daemon's pool."""
    return EngineCalls(link, "sglang", staging_rows=2, map_pool=True)


async def test_a_store_reports_no_key_another_writer_may_still_abort(
    tmp_path: Path, spawn: Any
) -> None:
    """Four of six keys are being written by another connection (its lease open): the
    daemon gives them no slot. The store used to answer True for them; the writer then
    aborted, and the daemon held none of the four."""
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK))
    other = await Client.connect(daemon.socket_path, namespace=NAMESPACE, block_bytes=BLOCK)
    link = link_to(daemon.socket_path)
    calls = pool_calls(link)
    ks = keys("w", 6)
    try:
        writing = await other.prepare_store(ks[:4])
        assert len(writing.to_write) == 4
        source = RowBlocks(rows_of(6, seed=1), np.arange(6, dtype=np.intp))
        held = await asyncio.to_thread(calls.store, ks, source, DEADLINE_S)
        assert held == [False] * 4 + [True] * 2
        await writing.abort()
        assert await other.lookup_each(ks) == held  # what the store said is what is held
        # Once held (and ready), a key given no slot is reported held.
        assert await asyncio.to_thread(calls.store, ks[4:], source, DEADLINE_S) == [True] * 2
    finally:
        calls.close()
        link.close()
        await other.close()


class _Pool:
    """Slots of a pool, for :class:`_ShortDaemon`."""

    def __init__(self, slots: int) -> None:
        self.rows = np.zeros((slots, BLOCK), dtype=np.uint8)

    def view(self, slot: int) -> memoryview:
        return memoryview(self.rows[slot])


class _ShortDaemon:
    """A blocking client whose daemon, as the protocol allows, stores fewer blocks of a
    lease than it reserved (``complete_store``'s ``stored``), and holds ready only the
    keys in ``ready``."""

    closed = False

    def __init__(self, ready: set[bytes]) -> None:
        self.info: dict[str, Any] = {}
        self.pool = _Pool(8)
        self.ready = ready
        self.asked: list[str] = []

    def require_pool(self) -> _Pool:
        return self.pool

    def request(self, op: str, deadline: float, **fields: Any) -> dict[str, Any]:
        self.asked.append(op)
        if op == "prepare_store":
            return {"lease": 7, "slots": [0, None, 1, 2][: len(fields["keys"])]}
        if op == "complete_store":
            return {"stored": 2}  # of the three reserved
        raise AssertionError(f"unexpected {op}")

    def lookup_each(self, ks: list[bytes], deadline: float) -> list[bool]:
        self.asked.append("lookup_each")
        return [k in self.ready for k in ks]


def test_a_lease_stored_short_reports_only_the_keys_the_daemon_holds() -> None:
    """The daemon stored two of a lease's three blocks without saying which: the three
    are looked up, as is the key it gave no slot; each is reported as the daemon holds
    it (the store used to answer True for all four)."""
    ks = keys("s", 4)
    daemon = _ShortDaemon(ready={ks[0], ks[1]})
    conn = ThreadConnection(daemon)  # type: ignore[arg-type]
    source = RowBlocks(rows_of(4, seed=2), np.arange(4, dtype=np.intp))
    assert leased_store(conn, ks, source, deadline=0.0) == [True, True, False, False]
    assert daemon.asked == ["prepare_store", "complete_store", "lookup_each"]
    assert np.array_equal(daemon.pool.rows[:3], source.rows[[0, 2, 3]])


class _ShortPut:
    """A daemon without a pool whose ``put`` stores some of the blocks it is sent."""

    def __init__(self, ready: set[bytes]) -> None:
        self.info: dict[str, Any] = {}
        self.block_bytes = BLOCK
        self.ready = ready
        self.asked: list[str] = []

    def request(self, op: str, deadline: float, **fields: Any) -> dict[str, Any]:
        self.asked.append(op)
        assert op == "put", op
        return {"stored": len(self.ready & set(fields["keys"]))}

    def lookup_each(self, ks: list[bytes], deadline: float) -> list[bool]:
        self.asked.append("lookup_each")
        return [k in self.ready for k in ks]


def test_an_inline_store_stored_short_reports_only_the_keys_the_daemon_holds() -> None:
    """``put`` stored two of four blocks (another writer holds a key, or no room): the four
    are looked up and reported as held or not (the inline way used to answer True for
    every key it sent)."""
    ks = keys("i", 4)
    daemon = _ShortPut(ready={ks[0], ks[2]})
    conn = ThreadConnection(daemon)  # type: ignore[arg-type]
    source = RowBlocks(rows_of(4, seed=4), np.arange(4, dtype=np.intp))
    assert inline_store(conn, ks, source, deadline=0.0) == [True, False, True, False]
    assert daemon.asked == ["put", "lookup_each"]
    whole = _ShortPut(ready=set(ks))
    assert inline_store(ThreadConnection(whole), ks, source, deadline=0.0) == [True] * 4  # type: ignore[arg-type]
    assert whole.asked == ["put"]


class _Faulty:
    """Blocks whose copy fails in the engine's own code (a bug)."""

    def fill(self, positions: Any, source: Any) -> None:
        raise TypeError("a bug in the engine's copy")

    gather = fill

    def fill_one(self, position: int, block: memoryview) -> None:
        raise TypeError("a bug in the engine's copy")

    gather_one = fill_one


async def test_any_error_in_a_call_counts_for_the_breaker_and_drops_the_connection(
    tmp_path: Path, spawn: Any
) -> None:
    """A store whose copy raises a TypeError: it used to pass the channel uncounted and
    leave the connection as it was, whatever the daemon had been sent."""
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK))
    link = link_to(daemon.socket_path)
    calls = pool_calls(link)
    try:
        ks = keys("f", 2)
        source = RowBlocks(rows_of(2, seed=3), np.arange(2, dtype=np.intp))
        assert calls.store(ks, source, DEADLINE_S) == [True, True]
        assert calls.channel.here() is not None
        failures = link.breaker.snapshot().failures
        with pytest.raises(TypeError):
            calls.store(keys("g", 2), _Faulty(), DEADLINE_S)
        assert link.breaker.snapshot().failures == failures + 1
        assert calls.channel.here() is None  # closed: the daemon ended its lease
        assert calls.present(keys("g", 2), DEADLINE_S) == [False, False]
        assert calls.store(keys("g", 2), source, DEADLINE_S) == [True, True]  # reconnected
    finally:
        calls.close()
        link.close()


class _Held:
    """Rows copied into the pool one at a time, the second copy held until ``go`` is set
    (a thread of the engine's, slow, while the daemon restarts)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.waiting = threading.Event()
        self.go = threading.Event()

    def fill(self, positions: Any, source: Any) -> None:
        raise AssertionError("stores only")

    fill_one = fill

    def gather(self, positions: Any, out: Any) -> None:
        for position, row in zip(positions.tolist(), out, strict=True):
            row[:] = self.rows[position]

    def gather_one(self, position: int, out: memoryview) -> None:
        if position == 1:
            self.waiting.set()
            assert self.go.wait(4 * DEADLINE_S)
        np.frombuffer(out, dtype=np.uint8)[:] = self.rows[position]


async def test_a_restarted_daemons_pool_never_unmaps_the_old_one_under_a_copy(
    tmp_path: Path, spawn: Any
) -> None:
    """Thread A copies into the old pool while the daemon restarts and thread B maps the
    new one. The old mapping used to be closed then: A's next slot raised ValueError
    (uncounted, its connection kept). A now finds its daemon gone, as any call would,
    and the old mapping goes with A's connection."""
    config = daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK)
    daemon = await spawn(config)
    link = link_to(daemon.socket_path)
    calls = pool_calls(link)
    slow = _Held(rows_of(3, seed=4))
    outcome: dict[str, Any] = {}

    def thread_a() -> None:
        try:
            outcome["a"] = calls.store(keys("a", 3), slow, 6 * DEADLINE_S)
        except BaseException as exc:  # what the store raised is what the test looks at
            outcome["a"] = exc
        outcome["conn a"] = calls.channel.here()

    def thread_b() -> None:
        source = RowBlocks(rows_of(2, seed=5), np.arange(2, dtype=np.intp))
        outcome["b"] = calls.store(keys("b", 2), source, DEADLINE_S)
        conn = calls.channel.here()
        outcome["pool b"] = conn.client.pool if conn is not None else None

    a = threading.Thread(target=thread_a)
    try:
        a.start()
        assert await asyncio.to_thread(slow.waiting.wait, 4 * DEADLINE_S)
        (busy,) = calls.channel.snapshot()
        old = busy.client.pool
        assert old is not None
        daemon.proc.kill()
        await daemon.wait()
        await spawn(config)  # the same socket, a new pool
        await asyncio.to_thread(thread_b)
        assert outcome["b"] == [True, True]
        assert outcome["pool b"] is not None and outcome["pool b"] is not old
        old.view(2)  # still mapped: A copies into it
        slow.go.set()
        await asyncio.to_thread(a.join, 4 * DEADLINE_S)
        assert isinstance(outcome["a"], Unreachable), repr(outcome["a"])
        assert outcome["conn a"] is None  # its connection closed
        with pytest.raises(ValueError, match="released memoryview"):
            old.view(0)  # unmapped once no thread used it
        outcome["pool b"].view(0)  # the new one stays
    finally:
        slow.go.set()
        calls.close()
        link.close()
    assert isinstance(outcome["a"], TierdError)


class _SlowRows:
    """The engine's rows, each block's copy in taking ``each_s`` (a busy engine thread)."""

    def __init__(self, rows: np.ndarray, each_s: float) -> None:
        self.rows = rows
        self.each_s = each_s
        self._blocks = RowBlocks(rows, np.arange(len(rows), dtype=np.intp))

    def fill(self, positions: Any, source: Any) -> None:
        for i in range(len(positions)):
            time.sleep(self.each_s)
            self._blocks.fill(positions[i : i + 1], source[i : i + 1])

    def fill_one(self, position: int, block: memoryview) -> None:
        time.sleep(self.each_s)
        self._blocks.fill_one(position, block)

    def gather(self, positions: Any, out: Any) -> None:
        raise AssertionError("loads only")

    gather_one = gather


@pytest.mark.parametrize("calls_of", ["pool", "staged"])
async def test_a_load_ends_within_its_deadline_and_one_block_however_slow_the_copy(
    tmp_path: Path, spawn: Any, calls_of: str
) -> None:
    """A load of 24 blocks whose copy into the engine takes 20 ms a block, under a 100 ms
    deadline: it used to run the round under way to its end (480 ms); now it stops
    copying at the deadline, returns the blocks copied whole, and the connection (and
    the lease it held) goes. Nothing is copied in after the call returned."""
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, block_bytes=BLOCK))
    link = link_to(daemon.socket_path)
    if calls_of == "pool":
        calls = pool_calls(link)
    else:
        calls = EngineCalls(link, "vllm", staging_rows=32, map_pool=False, regions=True)
    try:
        ks, source = keys("slow", 24), rows_of(24, seed=9)
        stored = calls.store(ks, RowBlocks(source, np.arange(24, dtype=np.intp)), DEADLINE_S)
        assert stored == [True] * 24
        target = _SlowRows(np.zeros_like(source), each_s=0.02)
        started = time.monotonic()
        outcome = calls.load(ks, target, 0.1, cut_off=True)
        took = time.monotonic() - started
        assert took < 0.1 + 0.02 + 0.05, took  # the deadline, one block, the reply's close
        copied = sorted(outcome.loaded)
        assert len(copied) < 24 and outcome.error is not None
        if calls_of == "pool":  # a block at a time: each one copied in time counts
            assert copied
        # (A staging round counts once whole: one cut short reports none of its rows.)
        assert np.array_equal(target.rows[copied], source[copied])
        after = target.rows.copy()
        await asyncio.sleep(0.2)  # nothing lands late
        assert np.array_equal(target.rows, after)
        assert calls.load(
            ks[:2], RowBlocks(np.zeros_like(source[:2]), np.arange(2)), DEADLINE_S
        ).loaded == (0, 1)
    finally:
        calls.close()
        link.close()
