"""Loads run on the tier's load threads, not on vLLM's scheduler thread, against real
daemons.

``submit_load`` used to run the load right there, so the scheduler waited for the daemon
(4-24 ms a served request in ``scripts/bench vllm``, a whole load deadline on a stopped
daemon) and a step's loads ran one after another. Now it returns at once, several loads
run side by side, and ``get_finished_jobs`` reports each later, with the daemon's bytes in
vLLM's rows; a load that ``drain_jobs`` stopped writes nothing into them afterwards, and
shutdown lets go of vLLM's memory with such a load still waiting for the daemon.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm_kit import (
    DEADLINE_S,
    ROW,
    ask,
    fill,
    keys,
    make_tier,
    primary_rows,
    run_job,
    transfer_job,
)

from tierd.integrations.vllm import TierdSecondaryTier
from tierd.integrations.vllm.tier_jobs import LOAD_THREADS
from tierd.testing import daemon_config

HIT = LookupResult.HIT
LOAD_S = 5.0  # far longer than the daemon stays stopped in these tests
SUBMIT_S = 0.1  # a submit returns within this (it used to wait LOAD_S on a stopped daemon)
LOADS = LOAD_THREADS  # loads of one "step"
BLOCKS = 8  # blocks per load


def poll(tier: TierdSecondaryTier, count: int) -> dict[int, JobResult]:
    """``get_finished_jobs`` as vLLM's scheduler calls it, step after step, until
    ``count`` jobs are reported (bounded)."""
    done: dict[int, JobResult] = {}
    limit = time.monotonic() + DEADLINE_S
    while len(done) < count:
        assert time.monotonic() < limit, f"only {sorted(done)} reported"
        done.update((r.job_id, r) for r in tier.get_finished_jobs())
        time.sleep(0.002)
    return done


@pytest.fixture
def stopped() -> Iterator[list]:
    """Daemons a test stopped: resumed at its end, whatever failed."""
    daemons: list = []
    yield daemons
    for daemon in daemons:
        daemon.signal(signal.SIGCONT)


async def test_submit_load_returns_at_once_and_the_loads_are_reported_later(
    tmp_path, spawn, stopped
) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=ROW))
    rows = primary_rows(2 * LOADS * BLOCKS)
    tier = make_tier(daemon.socket_path, rows, load_deadline_s=LOAD_S)
    try:
        prefixes = [keys(f"p{i}", BLOCKS) for i in range(LOADS)]
        sources = [list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(LOADS)]
        for i, (ks, row_ids) in enumerate(zip(prefixes, sources, strict=True)):
            fill(rows, row_ids, seed=i)
            assert run_job(tier, 100 + i, ks, row_ids, load=False).success
            assert ask(tier, ks, f"warm-{i}") == [HIT] * BLOCKS
        expected = rows[: LOADS * BLOCKS].copy()
        rows[:] = 0

        daemon.signal(signal.SIGSTOP)  # every load now waits on the daemon
        stopped.append(daemon)
        targets = [
            list(range((LOADS + i + 1) * BLOCKS - 1, (LOADS + i) * BLOCKS - 1, -1))
            for i in range(LOADS)
        ]
        for i in range(LOADS):
            start = time.monotonic()
            tier.submit_load(transfer_job(i, prefixes[i], targets[i], load=True))
            took = time.monotonic() - start
            assert took < SUBMIT_S, f"submit_load {i} took {took:.3f}s"  # was LOAD_S
        assert tier.has_pending_work()
        assert list(tier.get_finished_jobs()) == []  # the daemon answered nothing yet
        assert not rows.any()

        daemon.signal(signal.SIGCONT)
        stopped.remove(daemon)
        done = poll(tier, LOADS)
        assert sorted(done) == list(range(LOADS))
        for i in range(LOADS):
            assert done[i].success and done[i].transfer_bytes == BLOCKS * ROW
            assert np.array_equal(rows[targets[i]], expected[sources[i]])
        # Side by side: more than one load thread, each on a connection of its own.
        staged = [c for c in tier._calls.channel.snapshot() if "staging" in c.held]
        assert len(staged) >= 1 + 2  # the store thread's, and at least two load threads'
        assert not tier._link.breaker.is_open
    finally:
        tier.shutdown()


async def test_a_load_stopped_by_drain_writes_nothing_into_vllms_rows_afterwards(
    tmp_path, spawn, stopped
) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=ROW))
    rows = primary_rows(2 * BLOCKS)
    tier = make_tier(daemon.socket_path, rows, load_deadline_s=LOAD_S)
    try:
        ks = keys("late", BLOCKS)
        fill(rows, range(BLOCKS), seed=7)
        assert run_job(tier, 1, ks, range(BLOCKS), load=False).success
        assert ask(tier, ks, "warm") == [HIT] * BLOCKS
        assert run_job(tier, 2, ks, range(BLOCKS, 2 * BLOCKS), load=True).success  # connected
        rows[:] = 0

        daemon.signal(signal.SIGSTOP)
        stopped.append(daemon)
        start = time.monotonic()
        tier.submit_load(transfer_job(3, ks, range(BLOCKS, 2 * BLOCKS), load=True))
        assert time.monotonic() - start < SUBMIT_S
        start = time.monotonic()
        tier.drain_jobs()  # reset_prefix_cache: a lookup deadline, a quarter job deadline
        settings = tier.settings
        window = settings.lookup_deadline_s + settings.job_deadline_s / 4
        assert time.monotonic() - start < window + 1.0
        (result,) = tier.get_finished_jobs()
        assert result.job_id == 3 and not result.success
        assert not tier.has_pending_work()

        # The daemon resumes within the load's deadline and answers it: the load thread
        # gets the blocks into its staging region, and none into vLLM's rows.
        daemon.signal(signal.SIGCONT)
        stopped.remove(daemon)
        (late,) = tier._jobs._stopped
        outcome = late.future.result(timeout=DEADLINE_S)
        assert outcome.ok_keys == () and "stopped by drain_jobs" in str(outcome.error)
        assert not rows.any()
    finally:
        tier.shutdown()


async def test_shutdown_with_a_load_waiting_on_a_stopped_daemon_lets_go_of_vllms_rows(
    tmp_path, spawn, stopped
) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=ROW))
    rows = primary_rows(2 * BLOCKS)
    tier = make_tier(daemon.socket_path, rows, load_deadline_s=LOAD_S)
    ks = keys("gone", BLOCKS)
    fill(rows, range(BLOCKS), seed=9)
    assert run_job(tier, 1, ks, range(BLOCKS), load=False).success
    assert ask(tier, ks, "warm") == [HIT] * BLOCKS
    rows[BLOCKS:] = 0
    daemon.signal(signal.SIGSTOP)
    stopped.append(daemon)
    tier.submit_load(transfer_job(2, ks, range(BLOCKS, 2 * BLOCKS), load=True))

    start = time.monotonic()
    tier.shutdown()
    took = time.monotonic() - start
    assert took < tier.settings.lookup_deadline_s + tier.settings.job_deadline_s / 4 + 1.0
    # What the bound is about: the stopped load still waits for its answer, on a load
    # thread that holds no view of vLLM's rows any more (vLLM closes their mapping next).
    assert any(t.is_alive() for t in tier._jobs._loads._threads)
    (late,) = tier._jobs._stopped
    assert late.rows is not None and late.rows._blocks is None
    assert tier._jobs._rows.size == 0
    daemon.signal(signal.SIGCONT)
    stopped.remove(daemon)
    assert late.future.result(timeout=DEADLINE_S).ok_keys == ()
    assert not rows[BLOCKS:].any()
