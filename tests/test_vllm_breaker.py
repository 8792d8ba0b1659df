"""A hung or dead daemon costs vLLM at most a deadline, then nothing (issue 24, point 3).

Real ``tierd serve`` processes, stopped with SIGSTOP (connected but silent) or killed
with SIGKILL. The bounds asserted are liveness bounds, ten times the configured deadline,
so a loaded machine does not make them flaky; the old tier waited 30 s per call.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_kit import DEADLINE_S, ROW, STEP, ask, fill, keys, make_tier, primary_rows, run_job

from tierd.integrations.vllm import TierdSecondaryTier
from tierd.testing import daemon_config

HIT, MISS = LookupResult.HIT, LookupResult.MISS

LOOKUP_S = 0.1
JOB_S = 0.5
BOUND = 10  # a call returns within BOUND times its deadline


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def tier_for(socket_path: str, rows: np.ndarray) -> TierdSecondaryTier:
    return make_tier(
        socket_path,
        rows,
        lookup_deadline_s=LOOKUP_S,
        job_deadline_s=JOB_S,
        breaker_failures=3,
        probe_interval_s=0.05,
    )


def submit(tier: TierdSecondaryTier, job_id: int, ks: list, row_ids: list, *, load: bool) -> None:
    job = TransferJob(
        job_id=job_id,
        keys=ks,
        chunk_ids=np.asarray(row_ids, dtype=np.int64),
        is_promotion=load,
        req_context=ReqContext(req_id=f"job-{job_id}"),
    )
    (tier.submit_load if load else tier.submit_store)(job)


async def test_a_stopped_daemon_costs_a_deadline_then_nothing(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW))
    rows = primary_rows(8)
    tier = tier_for(daemon.socket_path, rows)
    stopped = False
    try:
        ks = keys("s", 3)
        fill(rows, [0, 1, 2], seed=1)
        expected = rows[:3].copy()
        assert run_job(tier, 1, ks, [0, 1, 2], load=False).success
        assert ask(tier, ks, "warm") == [HIT, HIT, HIT]
        channel = tier._calls.channel
        # The store went through a region, on the store thread's connection.
        storing = [c for c in channel.snapshot() if "staging" in c.held]
        assert storing
        assert run_job(tier, 9, ks, [3, 4, 5], load=True).success
        # The load went through a load thread's connection, a region of its own.
        loading = [c for c in channel.snapshot() if "staging" in c.held and c not in storing]
        assert len(loading) == 1
        before = list(channel.snapshot())
        daemon.signal(signal.SIGSTOP)
        stopped = True
        # A lookup waits at most its deadline, then misses; the daemon said nothing for
        # a whole deadline, so the breaker opens at once.
        answer, took = timed(lambda: ask(tier, ks, "r1"))
        assert answer == [MISS, MISS, MISS]
        assert took < BOUND * LOOKUP_S
        assert tier._link.breaker.is_open
        # Now every call answers at once, unsent: lookups miss, jobs fail.
        refused = tier._link.breaker.snapshot().refused
        for i in range(3):
            answer, took = timed(lambda i=i: ask(tier, ks, f"more-{i}"))
            assert answer == [MISS, MISS, MISS]
            assert took < BOUND * LOOKUP_S
        result, took = timed(lambda: run_job(tier, 2, ks, [3, 4, 5], load=True))
        assert not result.success and took < BOUND * LOOKUP_S
        assert tier._link.breaker.snapshot().refused >= refused + 4
        tier.touch(ks, ReqContext(req_id="t"))  # dropped, not queued behind the daemon

        daemon.signal(signal.SIGCONT)
        stopped = False
        assert tier._link.breaker.wait_closed(DEADLINE_S)  # the probe got its answer
        rows[:] = 0
        assert ask(tier, ks, "back") == [HIT, HIT, HIT]
        assert run_job(tier, 3, ks, [5, 6, 7], load=True).success
        assert np.array_equal(rows[5:8], expected)
        # The connection whose lookup went unanswered (the tier's lookup thread's) was
        # dropped with its staging region: a copy the daemon owed it can only land in
        # memory nobody reads again. The load thread's, which was owed nothing, goes on.
        silent = [c for c in before if c.client.closed]
        assert silent and loading[0] not in silent
        for now in [c for c in channel.snapshot() if "staging" in c.held]:
            for gone in silent:
                if "staging" in gone.held:
                    assert not np.shares_memory(
                        now.held["staging"].array, gone.held["staging"].array
                    )
    finally:
        if stopped:
            daemon.signal(signal.SIGCONT)
        tier.shutdown()


async def test_jobs_and_drain_on_a_stopped_daemon_are_bounded(tmp_path, spawn) -> None:
    """A job in flight when the daemon stops fails within its deadline; ``drain_jobs``
    (what ``reset_prefix_cache`` calls) and ``shutdown`` do not wait on the daemon."""
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW))
    rows = primary_rows(8)
    tier = tier_for(daemon.socket_path, rows)
    stopped = False
    try:
        assert run_job(tier, 1, keys("warm", 1), [0], load=False).success  # connected
        daemon.signal(signal.SIGSTOP)
        stopped = True
        fill(rows, [1, 2], seed=2)
        result, took = timed(lambda: run_job(tier, 2, keys("j", 2), [1, 2], load=False))
        assert not result.success
        assert took < BOUND * JOB_S

        tier._link.breaker.close()  # as if the daemon had just answered: calls are sent
        submit(tier, 3, keys("d", 2), [1, 2], load=False)
        submit(tier, 4, keys("warm", 1), [3], load=True)
        _, took = timed(tier.drain_jobs)
        assert took < BOUND * JOB_S
        done = {r.job_id: r for r in tier.get_finished_jobs()}
        assert set(done) == {3, 4}
        assert not done[3].success and not done[4].success
        assert tier._link.breaker.is_open  # drain asked for health: no answer
    finally:
        _, took = timed(tier.shutdown)
        assert took < BOUND * JOB_S
        if stopped:
            daemon.signal(signal.SIGCONT)


async def test_a_killed_daemon_opens_the_breaker_and_a_new_one_closes_it(tmp_path, spawn) -> None:
    config = daemon_config(tmp_path, block_bytes=ROW)
    daemon = await spawn(config)
    rows = primary_rows(8)
    tier = tier_for(daemon.socket_path, rows)
    try:
        ks = keys("k", 2)
        fill(rows, [0, 1], seed=3)
        assert run_job(tier, 1, ks, [0, 1], load=False).success
        daemon.signal(signal.SIGKILL)
        await daemon.wait()
        for i in range(3):  # refused connections: three failures open the breaker
            answer, took = timed(lambda i=i: ask(tier, ks, f"dead-{i}"))
            assert answer == [MISS, MISS]
            assert took < BOUND * LOOKUP_S
        assert tier._link.breaker.is_open
        assert not run_job(tier, 2, ks, [2, 3], load=True).success

        await spawn(config)  # a fresh daemon on the same socket: the probe reconnects
        assert tier._link.breaker.wait_closed(DEADLINE_S)
        assert ask(tier, ks, "fresh") == [MISS, MISS]  # its pool is new and empty
        assert run_job(tier, 3, ks, [0, 1], load=False).success
        assert ask(tier, ks, "stored") == [HIT, HIT]
    finally:
        tier.shutdown()


async def test_a_scheduler_step_never_waits_a_lookup_deadline_on_a_stopped_daemon(
    tmp_path, spawn
) -> None:
    """vLLM's step flushes its lookups without blocking: with the daemon stopped (the
    breaker still closed) the step used to wait the whole lookup deadline for its answer;
    now it waits at most ``STEP_WAIT_S`` (2 ms), and the answer (misses, after the deadline) comes
    at a later step."""
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW))
    rows = primary_rows(4)
    tier = tier_for(daemon.socket_path, rows)
    stopped = False
    try:
        ks = keys("n", 3)
        assert ask(tier, ks, "warm") == [MISS, MISS, MISS]  # connected, fast: one step
        daemon.signal(signal.SIGSTOP)
        stopped = True
        ctx = ReqContext(req_id="stopped")
        tier.on_new_request(ctx)
        assert {tier.lookup(k, ctx) for k in ks} == {LookupResult.RETRY}
        results = tier._lookups._pending_results
        before = results.puts
        _, took = timed(lambda: tier.on_schedule_end(STEP))
        assert took < LOOKUP_S / 2, took  # far below a lookup deadline (STEP_WAIT_S: 2 ms)
        assert results.puts == before  # no answer yet: the next steps retry
        results.wait_for(before + 1)
        assert [tier.lookup(k, ctx) for k in ks] == [MISS, MISS, MISS]
        tier.on_request_finished(ctx)
    finally:
        if stopped:
            daemon.signal(signal.SIGCONT)
        tier.shutdown()
