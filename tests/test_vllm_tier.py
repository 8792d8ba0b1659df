"""TierdSecondaryTier against real ``tierd serve`` processes (proof 1 of docs/vllm.md).

Every tier is built the way vLLM builds it: by its factory, from ``module_path``. Every
failure of the daemon (down, killed, restarted, out of room, a block gone) must surface as
a failed job or a miss, never as an exception in vLLM's scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_kit import (
    DEADLINE_S,
    ROW,
    ask,
    captured_logs,
    fill,
    keys,
    make_tier,
    offloading_spec,
    primary_rows,
    resolve,
    run_job,
    transfer_job,
)

from tierd.client import Client
from tierd.integrations.core.naming import derive_namespace
from tierd.integrations.vllm import BlockSizeMismatch, TierdSecondaryTier
from tierd.testing import corrupt_disk_block, daemon_config, poll_until, running_daemon

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def config(tmp_path, **kw):
    kw.setdefault("block_bytes", ROW)
    return daemon_config(tmp_path, **kw)


@contextlib.contextmanager
def link_lines() -> Iterator[list[logging.LogRecord]]:
    """The link's lines (the daemon lost, back; the breaker) at INFO and above: records
    of standard logging (tierd.integrations.core.link), under vLLM's logger too if the tier
    hands the link vLLM's (whose records do not propagate to the root)."""
    lines: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lines.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(n) for n in ("tierd.integrations.core.link", "vllm.tierd")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def events_of(lines: list[logging.LogRecord], *levels: int) -> list[str]:
    """The event of each line at one of ``levels``: its text before the fields."""
    return [r.getMessage().split(":")[0] for r in lines if r.levelno in levels]


BACK = "tierd daemon reachable again"


def staged(tier: TierdSecondaryTier) -> bool:
    """Whether the tier's jobs went through its staging region (else through leases)."""
    return any("staging" in c.held for c in tier._calls.channel.snapshot())


# regions=False: the lease path, kept for daemons without engine regions.
@pytest.mark.parametrize("regions", [True, False])
async def test_factory_lookup_miss_retry_hit_and_byte_exact_load(
    tmp_path, spawn, regions: bool
) -> None:
    daemon = await spawn(config(tmp_path))
    rows = primary_rows(8)
    tier = make_tier(daemon.socket_path, rows, regions=regions)
    try:
        by_path = {"type": "TierdSecondaryTier", "module_path": "tierd.integrations.vllm"}
        assert SecondaryTierFactory.get_tier_class(by_path) is TierdSecondaryTier
        ks = keys("a", 3)
        ctx = ReqContext(req_id="r1")
        tier.on_new_request(ctx)
        assert tier.lookup(ks[0], ctx) is LookupResult.RETRY  # not asked yet
        assert resolve(tier, ks, ctx) == [MISS, MISS, MISS]
        tier.on_request_finished(ctx)

        fill(rows, [0, 1, 2], seed=1)
        expected = rows[:3].copy()
        result = run_job(tier, 1, ks, [0, 1, 2], load=False)
        assert result.success and result.transfer_bytes == 3 * ROW

        ctx2 = ReqContext(req_id="r2")
        assert resolve(tier, ks, ctx2) == [HIT, HIT, HIT]
        rows[:] = 0
        result = run_job(tier, 2, ks, [5, 3, 7], load=True)
        assert result.success and result.successful_keys is None
        assert np.array_equal(rows[[5, 3, 7]], expected)
        assert staged(tier) is regions
    finally:
        tier.shutdown()


async def test_engines_share_blocks_exactly_when_bytes_are_interchangeable(tmp_path, spawn) -> None:
    daemon = await spawn(config(tmp_path))
    rows_a, rows_b, rows_c = primary_rows(4), primary_rows(4), primary_rows(4)
    a = make_tier(daemon.socket_path, rows_a)
    b = make_tier(daemon.socket_path, rows_b)  # a second engine, same model
    c = make_tier(daemon.socket_path, rows_c, offloading_spec("other-model"))
    d = make_tier(daemon.socket_path, primary_rows(4), offloading_spec(dtype="bfloat16"))
    try:
        assert a.namespace == b.namespace
        assert len({a.namespace, c.namespace, d.namespace}) == 3
        ks = keys("shared", 2)
        fill(rows_a, [0, 1], seed=2)
        assert run_job(a, 1, ks, [0, 1], load=False).success
        assert ask(b, ks, "b") == [HIT, HIT]
        assert run_job(b, 2, ks, [2, 3], load=True).success
        assert np.array_equal(rows_b[2:4], rows_a[0:2])
        assert ask(c, ks, "c") == [MISS, MISS]
        assert ask(d, ks, "d") == [MISS, MISS]
        result = run_job(c, 3, ks, [0, 1], load=True)
        assert not result.success and result.successful_keys is None
        assert not rows_c.any()
    finally:
        for tier in (a, b, c, d):
            tier.shutdown()


@pytest.mark.parametrize("regions", [True, False])
async def test_partial_load_reports_the_keys_it_loaded(tmp_path, spawn, regions: bool) -> None:
    daemon = await spawn(config(tmp_path))
    rows = primary_rows(8)
    tier = make_tier(daemon.socket_path, rows, regions=regions)
    try:
        ks = keys("p", 4)
        fill(rows, range(4), seed=3)
        expected = rows[:4].copy()
        assert run_job(tier, 1, [ks[0], ks[2]], [0, 2], load=False).success
        ctx = ReqContext(req_id="r")
        assert resolve(tier, ks, ctx) == [HIT, MISS, HIT, MISS]
        rows[:] = 0
        result = run_job(tier, 2, ks, [4, 5, 6, 7], load=True)
        assert not result.success
        assert list(result.successful_keys) == [ks[0], ks[2]]
        assert np.array_equal(rows[4], expected[0]) and np.array_equal(rows[6], expected[2])
        assert not rows[5].any() and not rows[7].any()
        assert staged(tier) is regions
    finally:
        tier.shutdown()


async def test_block_evicted_between_lookup_and_load_is_a_failed_load(tmp_path, spawn) -> None:
    daemon = await spawn(config(tmp_path, cpu_blocks=4, disk_blocks=None))
    rows = primary_rows(8)
    tier = make_tier(daemon.socket_path, rows)
    try:
        ks = keys("e", 2)
        fill(rows, [0, 1], seed=4)
        assert run_job(tier, 1, ks, [0, 1], load=False).success
        ctx = ReqContext(req_id="r")
        assert resolve(tier, ks, ctx) == [HIT, HIT]
        async with await Client.connect(daemon.socket_path) as operator:
            assert await operator.clear() == 2  # gone between the lookup and the load
        result = run_job(tier, 2, ks, [2, 3], load=True)
        assert not result.success and result.successful_keys is None
        assert [tier.lookup(k, ctx) for k in ks] == [MISS, MISS]  # no retry livelock
    finally:
        tier.shutdown()


async def test_capacity_fails_the_store_and_nothing_else(tmp_path, spawn) -> None:
    daemon = await spawn(config(tmp_path, cpu_blocks=4, disk_blocks=None))
    rows = primary_rows(4)
    tier = make_tier(daemon.socket_path, rows, namespace="capacity-test")
    other = await Client.connect(daemon.socket_path, namespace="hog")
    try:
        hog = await other.prepare_store([b"h0", b"h1", b"h2", b"h3"])  # every slot reserved
        result = run_job(tier, 1, keys("c", 1), [0], load=False)
        assert not result.success
        await hog.abort()
        assert run_job(tier, 2, keys("c", 1), [0], load=False).success
    finally:
        await other.close()
        tier.shutdown()


async def test_daemon_down_at_start_then_up(tmp_path, spawn) -> None:
    cfg = config(tmp_path)
    rows = primary_rows(4)
    with link_lines() as lines:
        tier = make_tier(cfg["socket"]["path"], rows)  # nothing listens yet
        try:
            ks = keys("d", 2)
            assert ask(tier, ks, "r") == [MISS, MISS]
            assert not run_job(tier, 1, ks, [0, 1], load=False).success
            assert not run_job(tier, 2, ks, [0, 1], load=True).success
            tier.touch(ks, ReqContext(req_id="r"))
            assert tier._link.breaker.is_open  # three failures in a row
            await spawn(cfg)
            assert tier._link.breaker.wait_closed(DEADLINE_S)  # the probe got an answer
            fill(rows, [0, 1], seed=5)
            assert run_job(tier, 3, ks, [0, 1], load=False).success
            assert ask(tier, ks, "r2") == [HIT, HIT]
        finally:
            tier.shutdown()
    events = events_of(lines, logging.WARNING, logging.INFO)
    said = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
    # One line says the daemon is missing, at start-up (the link's own would repeat it).
    missing = [m for m in said if "no daemon answers at" in m or "daemon unreachable" in m]
    assert len(missing) == 1 and "no daemon answers at" in missing[0], said
    assert events.count("tierd daemon reachable again") == 1


async def test_killed_mid_run_then_restarted_with_write_back(tmp_path, spawn) -> None:
    cfg = config(tmp_path)
    daemon = await spawn(cfg)
    rows = primary_rows(8)
    with link_lines() as lines:
        tier = make_tier(daemon.socket_path, rows)
        try:
            ks = keys("k", 3)
            fill(rows, range(3), seed=6)
            expected = rows[:3].copy()
            assert run_job(tier, 1, ks, [0, 1, 2], load=False).success
            daemon.signal(signal.SIGKILL)
            await daemon.wait()
            # Jobs in flight or submitted now fail; lookups miss; nothing raises.
            assert not run_job(tier, 2, ks, [3, 4, 5], load=True).success
            assert not run_job(tier, 3, keys("x", 1), [6], load=False).success
            assert ask(tier, ks, "r") == [MISS, MISS, MISS]
            tier.touch(ks, ReqContext(req_id="r"))
            assert tier.get_stats() is not None

            daemon = await spawn(cfg)  # same socket: a fresh daemon, a fresh pool
            assert tier._link.breaker.wait_closed(DEADLINE_S)
            assert run_job(tier, 4, ks, [0, 1, 2], load=False).success
            await asyncio.wait_for(daemon.stop(), 60)  # SIGTERM: written back to disk
            daemon = await spawn(cfg)
            assert tier._link.breaker.wait_closed(DEADLINE_S)
            rows[:] = 0
            assert ask(tier, ks, "r2") == [HIT, HIT, HIT]
            assert run_job(tier, 5, ks, [5, 6, 7], load=True).success
            assert np.array_equal(rows[5:8], expected)
            # Lookups and loads have their own connection; stores find the restart too.
            assert run_job(tier, 6, keys("y", 1), [7], load=False).success
            # The connection that found the daemon gone has the link look now; the line
            # of its return comes from the link's thread: wait for it, not for shutdown.
            poll_until(
                lambda: events_of(lines, logging.INFO).count(BACK) == 2, DEADLINE_S, "the return"
            )
        finally:
            tier.shutdown()
    events = events_of(lines, logging.WARNING, logging.INFO)
    assert events.count("tierd daemon lost") == 2  # the kill and the clean stop
    assert events.count(BACK) == 2


async def test_block_size_mismatch_is_refused_at_start_up(tmp_path, spawn) -> None:
    daemon = await spawn(config(tmp_path))
    wanted = r"set `block_bytes: 8192` in tierd's config"
    with (
        captured_logs() as logs,
        link_lines() as lines,
        pytest.raises(BlockSizeMismatch, match=wanted),
    ):
        make_tier(daemon.socket_path, primary_rows(2, row_bytes=2 * ROW))
    # Refused with what to change, and no "unreachable" warning first: it answered.
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == []
    assert events_of(lines, logging.WARNING, logging.ERROR) == []


async def test_a_config_the_daemon_refuses_is_refused_at_start_up(tmp_path, spawn) -> None:
    daemon = await spawn(config(tmp_path))
    with pytest.raises(ValueError, match="refused the tier: bad_namespace"):
        make_tier(daemon.socket_path, primary_rows(2), namespace="spaces are not allowed")
    with pytest.raises(ValueError, match=r"unknown keys .*\['sokcet'\]"):
        make_tier(daemon.socket_path, primary_rows(2), sokcet="/tmp/x.sock")
    assert [t for t in threading.enumerate() if t.name.startswith("tierd-vllm")] == []


async def test_drain_jobs_stats_touch_and_shutdown(tmp_path, spawn) -> None:
    daemon = await spawn(config(tmp_path, cpu_blocks=4, disk_blocks=None))
    rows = primary_rows(8)
    tier = make_tier(daemon.socket_path, rows)
    try:
        ks = keys("t", 5)
        fill(rows, range(5), seed=7)
        for i in range(4):
            tier.submit_store(transfer_job(i, [ks[i]], [i], load=False))
        assert tier.has_pending_work()
        tier.drain_jobs()
        assert sorted(r.job_id for r in tier.get_finished_jobs() if r.success) == [0, 1, 2, 3]
        assert not tier.has_pending_work()
        # LRU after the stores: k0 is the oldest. A touch makes it the newest, so the next
        # store evicts k1 instead.
        tier.touch([ks[0]], ReqContext(req_id="r"))
        assert run_job(tier, 9, [ks[4]], [4], load=False).success
        assert ask(tier, ks[:2], "r2") == [HIT, MISS]
        stats = tier.get_stats()
        reduced = stats.reduce()
        assert reduced["vllm:kv_offload_tierd_blocks_stored"] == 5
        assert reduced["vllm:kv_offload_tierd_connected"] == 1
    finally:
        tier.shutdown()
    link_threads = [t for t in threading.enumerate() if t.name.startswith("tierd-vllm")]
    assert link_threads == []


async def test_a_block_failing_its_checksum_is_a_short_load(tmp_path) -> None:
    # An in-loop daemon, to reach its disk slab; the tier's blocking calls run in a
    # worker thread so that this loop keeps serving.
    cfg = config(tmp_path, cpu_blocks=4, disk_blocks=16)
    rows = primary_rows(12)
    async with running_daemon(cfg) as daemon:
        tier = await asyncio.to_thread(make_tier, cfg["socket"]["path"], rows)
        try:
            ks = keys("sum", 8)
            fill(rows, range(8), seed=8)
            expected = rows[:3].copy()
            assert (await asyncio.to_thread(run_job, tier, 1, ks[:4], range(4), load=False)).success
            assert (
                await asyncio.to_thread(run_job, tier, 2, ks[4:], range(4, 8), load=False)
            ).success
            disk = daemon.chain.levels[1]  # keys 0..3 are now only on disk
            prefix = bytes.fromhex(tier._link._client.info["namespace_id"])
            corrupt_disk_block(disk.store, disk.tier.slot_of(prefix + bytes(ks[1])))
            rows[:] = 0
            result = await asyncio.to_thread(run_job, tier, 3, ks[:3], [8, 9, 10], load=True)
            assert not result.success
            assert list(result.successful_keys) == [ks[0], ks[2]]  # never the bad bytes
            assert np.array_equal(rows[8], expected[0]) and np.array_equal(rows[10], expected[2])
            assert not rows[9].any()
        finally:
            await asyncio.to_thread(tier.shutdown)


def test_namespaces_follow_what_makes_bytes_interchangeable() -> None:
    base = derive_namespace(offloading_spec(), ROW)
    assert base.startswith("vllm/tiny-llama/") and len(base) <= 128
    assert derive_namespace(offloading_spec(), ROW) == base
    # The same facts in another process give the same name (no per-process hash seed).
    code = "from vllm_kit import *; "
    code += "from tierd.integrations.core.naming import derive_namespace as d; "
    code += f"print(d(offloading_spec(), {ROW}))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert other.stdout.strip() == base
    different = {
        derive_namespace(offloading_spec("meta-llama/Llama-3-8B"), ROW),
        derive_namespace(offloading_spec(dtype="bfloat16"), ROW),
        derive_namespace(offloading_spec(tp=2), ROW),
        derive_namespace(offloading_spec(), 2 * ROW),
    }
    assert len(different | {base}) == 5
    # Bytes vLLM declares independent of the parallel layout are shared across layouts.
    spec1, spec2 = offloading_spec(tp=1), offloading_spec(tp=2)
    for spec in (spec1, spec2):
        parallel = dataclasses.replace(spec.config.parallel, is_parallelism_agnostic=True)
        spec.config = dataclasses.replace(
            spec.config, parallel=parallel, worker_kv_bytes_per_block=ROW
        )
    assert derive_namespace(spec1, ROW) == derive_namespace(spec2, ROW)
    # A spec without the facts (vLLM's tests pass a MagicMock) still names a stable one.
    assert derive_namespace(MagicMock(), ROW) == derive_namespace(MagicMock(), ROW)


@pytest.mark.skipif(
    sys.platform != "linux" or os.getuid() != 0, reason="an impostor of another uid needs root"
)
def test_a_socket_served_by_another_user_is_refused_unless_trusted(impostor) -> None:
    """A squatter on the socket path gets not a byte: the tier refuses to start, naming
    the setting that trusts a daemon's service user."""
    with pytest.raises(ValueError, match=r"served by uid 65534.*server_uids"):
        make_tier(str(impostor.path), primary_rows(2))
    assert asyncio.run(impostor.received()) == 0


@pytest.mark.skipif(
    sys.platform != "linux" or os.getuid() != 0, reason="an impostor of another uid needs root"
)
def test_a_trusted_service_user_is_talked_to(impostor) -> None:
    # The impostor's hello names 4096-byte blocks: the tier got that far, and says so.
    with pytest.raises(BlockSizeMismatch):
        make_tier(str(impostor.path), primary_rows(2, row_bytes=2 * ROW), server_uids=[65534])
    assert asyncio.run(impostor.received()) > 0
