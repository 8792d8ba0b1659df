"""Events and figures that tell the truth (issue 24, point 5), against real daemons.

Stored and removed events carry the tier's configured medium and locality; a block this
engine stored that the daemon evicts from its last tier is reported removed (a demotion to
disk is not a removal); the figures are this engine's own (no daemon-wide gauge that a sum
over engines would count N times), and hits are loads, not lookups.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium
from vllm_kit import (
    DEADLINE_S,
    ROW,
    ask,
    fill,
    keys,
    make_tier,
    offloading_spec,
    primary_rows,
    run_job,
)

from tierd.client import Client
from tierd.integrations.vllm import TierdSecondaryTier
from tierd.testing import daemon_config

HIT = LookupResult.HIT


def events_tier(socket_path: str, rows: np.ndarray, **config: object) -> TierdSecondaryTier:
    spec = offloading_spec()
    spec.kv_events_config = dataclasses.replace(spec.kv_events_config, enable_kv_cache_events=True)
    return make_tier(
        socket_path,
        rows,
        spec,
        enable_kv_events=True,
        medium="STORAGE",
        locality="LOCAL",
        **config,
    )


def wait_until(tier: TierdSecondaryTier, predicate) -> None:
    """Wait push by push until ``predicate()`` holds (a pending removal is decided after
    its grace, without a push: then the wait for a push ends at that grace)."""
    residency = tier.report.residency
    assert residency is not None
    give_up = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < give_up, "the condition never held"
        residency.wait_pushes(residency.pushes + 1, residency.grace_s)


async def test_evictions_of_this_engines_blocks_are_removed_events(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW, cpu_blocks=4, disk_blocks=None))
    rows = primary_rows(8)
    tier = events_tier(daemon.socket_path, rows)
    try:
        ks = keys("ev", 6)
        fill(rows, range(6), seed=1)
        assert run_job(tier, 1, ks[:4], range(4), load=False).success
        (stored,) = tier.take_events()
        assert (stored.removed, stored.medium, stored.locality) == (
            False,
            Medium.STORAGE,
            Locality.LOCAL,
        )
        assert list(stored.keys) == ks[:4]
        # Two more blocks in a four-block daemon: two of the first leave tierd.
        assert run_job(tier, 2, ks[4:], [4, 5], load=False).success
        removed: list = []

        def two_removed() -> bool:
            removed.extend(e for e in tier.take_events() if e.removed)
            return sum(len(e.keys) for e in removed) >= 2

        wait_until(tier, two_removed)
        gone = [k for e in removed for k in e.keys]
        assert sorted(gone) == sorted(ks[:2])  # LRU: the oldest two
        assert all((e.medium, e.locality) == (Medium.STORAGE, Locality.LOCAL) for e in removed)
    finally:
        tier.shutdown()


async def test_a_store_job_that_evicts_its_own_first_rounds_tells_each_removal(
    tmp_path, spawn
) -> None:
    # Issue 35, 2: a job of 12 blocks in rounds of 2 into a 4-block daemon evicts its own
    # first rounds while it runs, before it ends: every eviction is a removed event.
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW, cpu_blocks=4, disk_blocks=None))
    rows = primary_rows(16)
    tier = events_tier(daemon.socket_path, rows, staging_bytes=2 * 2 * ROW)
    residency = tier.report.residency
    assert residency is not None
    try:
        ks = keys("own", 13)
        fill(rows, range(13), seed=4)
        assert run_job(tier, 1, ks[:12], range(12), load=False).success
        # A barrier: once the stream has the last store, it has every earlier eviction.
        assert run_job(tier, 2, ks[12:], [12], load=False).success
        wait_until(tier, lambda: residency.holds(bytes(ks[12])))
        async with await Client.connect(daemon.socket_path) as operator:
            (cpu,) = (await operator.stats())["tiers"]
        assert cpu["evictions"] == 9
        removed: list = []

        def all_removed() -> bool:
            removed.extend(k for e in tier.take_events() if e.removed for k in e.keys)
            return len(removed) >= cpu["evictions"]

        wait_until(tier, all_removed)
        assert sorted(removed) == sorted(ks[:9])  # each eviction once, the oldest first
    finally:
        tier.shutdown()


async def test_a_demotion_is_not_a_removal_and_a_clear_is(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW, cpu_blocks=2, disk_blocks=8))
    rows = primary_rows(8)
    tier = events_tier(daemon.socket_path, rows)
    residency = tier.report.residency
    assert residency is not None
    try:
        ks = keys("dm", 4)
        fill(rows, range(4), seed=2)
        assert run_job(tier, 1, ks[:3], range(3), load=False).success  # one demoted to disk
        # A barrier: the stream is in order, so once the daemon's event for a later store
        # is in, every event of the demotion is too.
        assert run_job(tier, 2, ks[3:], [3], load=False).success
        wait_until(tier, lambda: residency.holds(bytes(ks[3])))
        assert [e for e in tier.take_events() if e.removed] == []
        async with await Client.connect(daemon.socket_path) as operator:
            assert await operator.clear() >= 4
        removed: list = []

        def all_removed() -> bool:
            removed.extend(e for e in tier.take_events() if e.removed)
            return sum(len(e.keys) for e in removed) >= 4

        wait_until(tier, all_removed)
        assert sorted(k for e in removed for k in e.keys) == sorted(ks)  # each once
    finally:
        tier.shutdown()


async def test_figures_are_this_engines_own_and_hits_are_loads(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW))
    rows = primary_rows(8)
    a = make_tier(daemon.socket_path, rows)
    b = make_tier(daemon.socket_path, primary_rows(8))
    try:
        ks = keys("fig", 3)
        fill(rows, range(3), seed=3)
        assert run_job(a, 1, ks, range(3), load=False).success
        for _ in range(3):  # lookups that find the blocks are not hits
            assert ask(b, ks, "look") == [HIT, HIT, HIT]
        assert run_job(b, 2, ks[:2], [0, 1], load=True).success
        fa, fb = a.get_stats().reduce(), b.get_stats().reduce()
        assert fa["vllm:kv_offload_tierd_blocks_stored"] == 3
        assert fb["vllm:kv_offload_tierd_blocks_loaded"] == 2  # the hits: loads
        assert fb.get("vllm:kv_offload_tierd_blocks_stored", 0) == 0
        # No daemon-wide gauge: what a sum over engines would count twice.
        definitions = TierdSecondaryTier.build_metric_definitions({})
        assert not any("daemon" in name for name in definitions)
        assert set(fa) <= set(definitions) and set(fb) <= set(definitions)
        assert fa["vllm:kv_offload_tierd_breaker_open"] == 0
    finally:
        a.shutdown()
        b.shutdown()
