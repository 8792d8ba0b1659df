"""tierd's pool as vLLM's CPU tier (issue 58), through vLLM's own seams: its offloading
config, ``OffloadingSpec``, ``OffloadingManager`` and ``OffloadingWorker`` (vLLM 0.33),
KV blocks in host memory, and a real ``tierd serve`` process.

vLLM's connector is played by ``pool_engine_kit.Engine`` (lookups step after step until
no RETRY, a job's copy, then its completion), as ``OffloadingConnector`` drives a
manager. The real engine, vLLM's CPU build generating, is
``tests/e2e_vllm/test_vllm_pool_engines.py``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed: scripts/setup_vllm")

from pool_engine_kit import PAGE, STEP, Engine, keys, page

from tierd.client import Client
from tierd.integrations.core.pool_leases import mapped_pool
from tierd.testing import daemon_config

LIVENESS_S = 30.0  # a bound on what must come back (many times every deadline)


def config(tmp_path: Path, cpu_blocks: int = 16, **limits: Any) -> dict[str, Any]:
    return daemon_config(
        tmp_path, cpu_blocks=cpu_blocks, disk_blocks=None, block_bytes=PAGE, limits=limits
    )


async def cpu_tier(socket: str) -> dict[str, Any]:
    async with await Client.connect(socket) as client:
        return dict((await client.stats())["tiers"][0])


def fill(engine: Engine, blocks: list[int], seed: int) -> None:
    for i, block in enumerate(blocks):
        engine.kv[block] = page(seed + i).to(engine.kv.device)


def same(engine: Engine, blocks: list[int], seed: int) -> bool:
    kv = engine.kv.cpu()
    return all(bool((kv[b] == page(seed + i)).all()) for i, b in enumerate(blocks))


@pytest.fixture
def engines() -> Any:
    made: list[Engine] = []

    def make(socket: str, device: str = "cpu", **tierd: Any) -> Engine:
        engine = Engine(socket, device=device, **tierd)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


async def test_a_prefix_one_engine_stored_is_a_pool_hit_for_another_held_once(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    a, b = engines(daemon.socket_path), engines(daemon.socket_path)
    names = keys("shared", 4)
    fill(a, [0, 1, 2, 3], seed=10)
    assert len(a.store(a.ctx("ra"), names, [0, 1, 2, 3])) == 4
    rb = b.ctx("rb")
    assert b.lookup(rb, names) == 4
    spec = b.load(rb, names, [20, 21, 22, 23])
    assert same(b, [20, 21, 22, 23], seed=10)
    assert (await cpu_tier(daemon.socket_path))["pinned"] == 4  # until vLLM's copy is done
    b.manager.complete_load(names, rb)
    b.manager.on_schedule_end(STEP)
    tier = await cpu_tier(daemon.socket_path)
    assert (tier["used"], tier["stores"], tier["pinned"]) == (4, 4, 0)  # one copy on the node
    # B's own store of the same prefix stores nothing: the node holds it already.
    assert b.store(b.ctx("rb2"), names, [20, 21, 22, 23]) == []
    assert mapped_pool(spec.pool) is not None  # B's rows were rows of the daemon's pool


async def test_a_hit_stays_pinned_until_vllm_has_loaded_it(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    """A lookup's HIT is a pin: stores that fill the pool meanwhile never take its rows,
    so vLLM's load (which cannot fail) copies the bytes the HIT promised."""
    daemon = await spawn(config(tmp_path, cpu_blocks=8))
    a, b = engines(daemon.socket_path), engines(daemon.socket_path)
    names = keys("held", 4)
    fill(a, [0, 1, 2, 3], seed=30)
    assert len(a.store(a.ctx("ra"), names, [0, 1, 2, 3])) == 4
    rb = b.ctx("rb")
    assert b.lookup(rb, names) == 4
    for round_ in range(3):  # twelve other blocks through the four rows left
        others = keys(f"other{round_}", 4)
        fill(a, [4, 5, 6, 7], seed=100 + 4 * round_)
        assert len(a.store(a.ctx(f"o{round_}"), others, [4, 5, 6, 7])) == 4
    b.load(rb, names, [20, 21, 22, 23])
    assert same(b, [20, 21, 22, 23], seed=30)
    b.manager.complete_load(names, rb)


async def test_a_store_is_seen_by_other_engines_only_once_committed(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    a, b = engines(daemon.socket_path), engines(daemon.socket_path)
    names = keys("late", 3)
    ra = a.ctx("ra")
    out = a.manager.prepare_store(names, ra)
    assert out is not None and len(out.keys_to_store) == 3
    assert b.lookup(b.ctx("early"), names) == 0  # reserved, not written: never a hit
    assert a.manager.prepare_store(names, a.ctx("twice")).keys_to_store == []  # in flight
    a.manager.complete_store(out.keys_to_store, ra)
    assert b.lookup(b.ctx("after"), names) == 3


async def test_a_stopped_daemon_costs_a_deadline_then_misses_and_the_engine_goes_on(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    # Two blocks a connection: the pins the daemon grants late, once resumed, must be
    # ended before the next ask, or it is refused for the bound.
    daemon = await spawn(config(tmp_path, lease_blocks_per_connection=2))
    # Deadlines short beside LIVENESS_S, long enough for the first lookup after the resume
    # on a busy machine (0.3 s missed there once: the daemon had its backlog to answer)
    deadlines = {"load_deadline_s": 1.0, "job_deadline_s": 1.0, "probe_interval_s": 0.1}
    a = engines(daemon.socket_path, **deadlines)
    names = keys("stopped", 2)
    fill(a, [0, 1], seed=50)
    assert len(a.store(a.ctx("ra"), names, [0, 1])) == 2
    daemon.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert a.lookup(a.ctx("while-stopped"), names) == 0  # a miss once the deadline passed
        assert a.store(a.ctx("store-while-stopped"), keys("more", 2), [2, 3]) == []
        assert time.monotonic() - started < LIVENESS_S
        assert a.manager.get_stats() is not None
    finally:
        daemon.signal(signal.SIGCONT)
    assert a.manager._link.breaker.wait_closed(LIVENESS_S)
    # The engine goes on: its lookups hit again. The first may still miss: the daemon
    # answers the backlog of its connections in the order it reads them, and the pins it
    # granted late count against the connection's bound until the engine has read that
    # answer and ended them (it ends them before it asks anything more, once read).
    deadline = time.monotonic() + LIVENESS_S
    for attempt in range(1000):  # bounded: by the deadline as well
        again = a.ctx(f"again-{attempt}")
        if a.lookup(again, names) == 2:
            break
        assert time.monotonic() < deadline, "the engine's lookups never hit after the resume"
        await asyncio.sleep(0.05)
    async with await Client.connect(daemon.socket_path) as client:
        # Only its pins: the ones the daemon granted late were ended, none left behind.
        assert (await client.stats())["leases"]["leases_held_blocks"] == 2
        a.manager.on_request_finished(again)
        a.manager.on_schedule_end(STEP)
        for _ in range(100):  # bounded: until the daemon has read the release
            if (await client.stats())["leases"]["leases_held_blocks"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await client.stats())["leases"]["leases_held_blocks"] == 0


async def test_a_daemon_killed_after_a_pin_serves_the_pinned_bytes_then_its_successors(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    """The daemon dies between a HIT and vLLM's load: its pool, still mapped here, is
    written by nobody any more, so the load copies the bytes the HIT promised. The
    restarted daemon's pool is another, mapped when the next rows name it."""
    cfg = config(tmp_path)
    daemon = await spawn(cfg)
    a, b = engines(daemon.socket_path), engines(daemon.socket_path)
    names = keys("killed", 4)
    fill(a, [0, 1, 2, 3], seed=70)
    assert len(a.store(a.ctx("ra"), names, [0, 1, 2, 3])) == 4
    rb = b.ctx("rb")
    assert b.lookup(rb, names) == 4
    daemon.signal(signal.SIGKILL)
    assert await daemon.wait() != 0
    again = await spawn(cfg)
    old = b.load(rb, names, [20, 21, 22, 23])
    assert same(b, [20, 21, 22, 23], seed=70)
    b.manager.complete_load(names, rb)  # its lease went with the daemon: nothing to end
    fill(a, [0, 1, 2, 3], seed=80)
    deadline = time.monotonic() + LIVENESS_S
    while len(a.store(a.ctx(f"ra-{time.monotonic()}"), names, [0, 1, 2, 3])) != 4:
        assert time.monotonic() < deadline, "the engine never stored into the new daemon"
        await asyncio.sleep(0.1)
    rb2 = b.ctx("rb2")
    assert b.lookup(rb2, names) == 4
    new = b.load(rb2, names, [30, 31, 32, 33])
    assert new.pool != old.pool
    assert same(b, [30, 31, 32, 33], seed=80)
    b.manager.complete_load(names, rb2)
    assert (await cpu_tier(again.socket_path))["pinned"] == 0


async def test_a_reset_releases_the_rows_of_jobs_in_flight_only_after_the_workers(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    """vLLM's reset drops its jobs in flight without completing them while its workers
    may still copy them: their rows stay pinned or reserved for the steps the workers
    take to finish, then go back."""
    daemon = await spawn(config(tmp_path))
    a = engines(daemon.socket_path)
    names = keys("reset", 4)
    fill(a, [0, 1, 2, 3], seed=90)
    assert len(a.store(a.ctx("ra"), names, [0, 1, 2, 3])) == 4
    rb = a.ctx("rb")
    assert a.lookup(rb, names) == 4
    a.manager.prepare_load(names, rb)  # the load job is handed to the workers
    reserved = a.manager.prepare_store(keys("reset-store", 2), a.ctx("rs"))
    assert reserved is not None and len(reserved.keys_to_store) == 2
    a.manager.reset_cache()
    tier = await cpu_tier(daemon.socket_path)
    assert (tier["pinned"], tier["writing"]) == (4, 2)
    assert a.manager.has_pending_work()
    a.manager.on_schedule_end(STEP)
    assert (await cpu_tier(daemon.socket_path))["pinned"] == 4  # one step: not yet
    a.manager.on_schedule_end(STEP)
    a.manager.on_schedule_end(STEP)  # the ends, posted, are read by now
    tier = await cpu_tier(daemon.socket_path)
    assert (tier["pinned"], tier["writing"], tier["used"]) == (0, 0, 4)
    assert a.lookup(a.ctx("after-reset"), names) == 4  # the node's blocks stay


async def test_a_broken_lease_connection_keeps_its_rows_until_the_copies_are_done(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    """The connection that holds a load's pins breaks (a send cut by its deadline): the
    daemon ends a connection's leases when its socket closes, so it stays open until
    vLLM reports the copy done, and new requests go on a new one."""
    daemon = await spawn(config(tmp_path))
    a = engines(daemon.socket_path)
    names = keys("broken", 4)
    fill(a, [0, 1, 2, 3], seed=110)
    assert len(a.store(a.ctx("ra"), names, [0, 1, 2, 3])) == 4
    rb = a.ctx("rb")
    assert a.lookup(rb, names) == 4
    a.manager.prepare_load(names, rb)
    leases = a.manager._leases
    line = leases._line
    assert line is not None
    line.client._broken()  # what a send past its deadline does to it
    assert len(a.store(a.ctx("rc"), keys("meanwhile", 2), [4, 5])) == 2  # a new connection
    assert (await cpu_tier(daemon.socket_path))["pinned"] == 4  # the broken one's, still
    a.manager.complete_load(names, rb)
    assert line.client._sock_closed
    for _ in range(100):  # bounded: until the daemon has read the close
        if (await cpu_tier(daemon.socket_path))["pinned"] == 0:
            break
        await asyncio.sleep(0.02)
    assert (await cpu_tier(daemon.socket_path))["pinned"] == 0


async def test_a_store_whose_lease_expired_under_the_copy_is_never_served(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    """vLLM's workers stall past ``store_lease_ttl_s`` between the reservation and the
    completion: the commit is refused (nothing of it is served), the rows were never
    given to another block meanwhile, and they come back once the commit was told."""
    daemon = await spawn(config(tmp_path, cpu_blocks=8, store_lease_ttl_s=0.3))
    a, b = engines(daemon.socket_path), engines(daemon.socket_path)
    fill(b, [4, 5, 6, 7], seed=140)
    assert len(b.store(b.ctx("base"), keys("base", 4), [4, 5, 6, 7])) == 4  # half the rows
    names = keys("expired", 4)
    ra = a.ctx("ra")
    out = a.manager.prepare_store(names, ra)  # the other half: no row is unused now
    assert out is not None and len(out.keys_to_store) == 4
    await asyncio.sleep(1.0)  # past the lease's ttl: the daemon withdrew the write
    fill(b, [0, 1, 2, 3], seed=120)
    assert len(b.store(b.ctx("rb"), keys("other", 4), [0, 1, 2, 3])) == 4  # base's rows
    assert b.lookup(b.ctx("rb-miss"), names) == 0
    fill(a, [0, 1, 2, 3], seed=130)
    a.worker.submit_store(99, _gpu([0, 1, 2, 3]), out.store_spec)  # the late copy
    a.finish(99)
    a.manager.complete_store(out.keys_to_store, ra)
    rc = b.ctx("rc")
    assert b.lookup(rc, keys("other", 4)) == 4
    b.load(rc, keys("other", 4), [20, 21, 22, 23])
    assert same(b, [20, 21, 22, 23], seed=120)  # the late copy never reached them
    b.manager.complete_load(keys("other", 4), rc)
    assert b.lookup(b.ctx("rd"), names) == 0
    deadline = time.monotonic() + LIVENESS_S
    while (await cpu_tier(daemon.socket_path))["quarantined"]:
        a.manager.on_schedule_end(STEP)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def _gpu(blocks: list[int]) -> Any:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(blocks, [len(blocks)], [0])


@pytest.mark.cuda
async def test_on_a_gpu_vllms_own_copies_move_the_rows_of_the_page_locked_pool(
    tmp_path: Path, spawn: Any, engines: Any
) -> None:
    """The GPU path: each engine page-locks the pool mapping in its process and vLLM's
    own copy handlers move KV pages between GPU memory and the pool's rows on their
    streams (an event per job); A's blocks stored from its GPU are B's, loaded into B's
    GPU, byte for byte."""
    daemon = await spawn(config(tmp_path))
    a = engines(daemon.socket_path, device="cuda")
    b = engines(daemon.socket_path, device="cuda")
    names = keys("gpu", 4)
    fill(a, [0, 1, 2, 3], seed=200)
    assert len(a.store(a.ctx("ra"), names, [0, 1, 2, 3])) == 4
    rb = b.ctx("rb")
    assert b.lookup(rb, names) == 4
    b.load(rb, names, [20, 21, 22, 23])
    assert same(b, [20, 21, 22, 23], seed=200)
    b.manager.complete_load(names, rb)
