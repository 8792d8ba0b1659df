"""TierdSecondaryTier inside vLLM's own TieringOffloadingManager (proof 2 of docs/vllm.md).

The set-up follows vLLM's tests/v1/kv_offload/tiering/ (a CPU primary tier over a small
region, secondary tiers built on its view), with tierd's tier, talking to a real
``tierd serve``, in place of vLLM's example tier: cascade, promotion, failed promotion and
touch forwarding go through vLLM's orchestration code, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.manager", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm_kit import ROW, fill, keys, make_tier, primary_rows

from tierd.client import Client
from tierd.integrations.vllm import TierdSecondaryTier
from tierd.testing import daemon_config

CHUNKS = 6
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


class _Region:
    """The shared region vLLM's CPU tier lives in, as plain memory (the tests' stand-in
    for SharedOffloadRegion)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.rows)

    def cleanup(self) -> None:
        return


@dataclass
class Setup:
    manager: TieringOffloadingManager
    primary: CPUPrimaryTierOffloadingManager
    tier: TierdSecondaryTier
    rows: np.ndarray
    socket: str

    def step(self) -> None:
        """One scheduler step's end: vLLM's own hook, then drain what it submitted."""
        with self.manager.lock:
            self.manager.on_schedule_end(STEP)
            list(self.manager.take_events())
        self.tier.drain_jobs()

    def lookup(self, key_list: list[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """Lookups as vLLM's scheduler makes them, step after step, until no tier says
        RETRY (the tier's answers arrive between steps)."""
        results = self.tier._lookups._pending_results
        for _ in range(len(key_list) + 2):  # each round resolves the tier's pending lookups
            with self.manager.lock:
                found = [self.manager.lookup(k, ctx) for k in key_list]
            if LookupResult.RETRY not in found:
                return found
            before = results.puts
            self.step()
            results.wait_for(before + 1)
        raise AssertionError(f"lookups still RETRY: {found}")

    def primary_bytes(self, key_list: list[OffloadKey], ctx: ReqContext) -> np.ndarray:
        with self.manager.lock:
            spec = self.primary.prepare_load(key_list, ctx)
            self.primary.complete_load(key_list, ctx)
        return self.rows[spec.block_ids].copy()

    async def daemon_blocks(self, key_list: list[OffloadKey]) -> list[bytes]:
        async with await Client.connect(self.socket, namespace=self.tier.namespace) as c:
            return await c.load([bytes(k) for k in key_list])


@pytest.fixture
async def setup(tmp_path, spawn) -> Iterator[Setup]:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=4, disk_blocks=None, block_bytes=ROW))
    rows = primary_rows(CHUNKS)
    region = _Region(rows)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)
    tier = make_tier(daemon.socket_path, rows)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    yield Setup(manager, primary, tier, rows, daemon.socket_path)
    manager.shutdown()


def store_through_vllm(s: Setup, key_list: list[OffloadKey], ctx: ReqContext, seed: int) -> None:
    """GPU -> CPU as vLLM's worker would do it, then the cascade to tierd."""
    with s.manager.lock:
        out = s.manager.prepare_store(key_list, ctx)
        assert out is not None
        fill(s.rows, out.store_spec.block_ids.tolist(), seed)
        s.manager.complete_store(key_list, ctx, success=True)
    s.tier.drain_jobs()
    s.step()


async def test_cascade_puts_vllm_bytes_in_tierd(setup: Setup) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys("cascade", 3)
    setup.manager.on_new_request(ctx)
    store_through_vllm(setup, ks, ctx, seed=1)
    expected = setup.primary_bytes(ks, ctx)
    blocks = await setup.daemon_blocks(ks)
    assert [bytes(row.tobytes()) for row in expected] == blocks


async def test_promotion_from_tierd_into_vllms_cpu_tier(setup: Setup) -> None:
    ks = keys("promote", 3)
    data = [bytes([i + 1]) * ROW for i in range(3)]
    async with await Client.connect(setup.socket, namespace=setup.tier.namespace) as engine2:
        assert await engine2.store([bytes(k) for k in ks], data) == 3  # another engine's
    ctx = ReqContext(req_id="r")
    setup.manager.on_new_request(ctx)
    assert setup.lookup(ks, ctx) == [LookupResult.HIT_PENDING] * 3  # promotions started
    setup.step()  # submits the batched load
    setup.step()  # takes its result
    assert setup.lookup(ks, ctx) == [LookupResult.HIT] * 3
    got = setup.primary_bytes(ks, ctx)
    assert [row.tobytes() for row in got] == data


async def test_failed_promotion_is_a_miss_not_a_retry(setup: Setup) -> None:
    ks = keys("gone", 2)
    async with await Client.connect(setup.socket, namespace=setup.tier.namespace) as engine2:
        await engine2.store([bytes(k) for k in ks], [b"\x07" * ROW] * 2)
    ctx = ReqContext(req_id="r")
    setup.manager.on_new_request(ctx)
    assert setup.lookup(ks, ctx) == [LookupResult.HIT_PENDING] * 2
    async with await Client.connect(setup.socket) as operator:
        assert await operator.clear() == 2  # evicted before the load is submitted
    setup.step()
    setup.step()
    with setup.manager.lock:
        assert [setup.primary.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 2
    assert setup.lookup(ks, ctx) == [LookupResult.MISS] * 2


async def test_touch_is_forwarded_to_the_daemon(setup: Setup) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys("touch", 4)  # fills the daemon's 4-block CPU tier, k0 the oldest
    setup.manager.on_new_request(ctx)
    for i, k in enumerate(ks):
        store_through_vllm(setup, [k], ctx, seed=10 + i)
    with setup.manager.lock:
        setup.manager.touch([ks[0]], ctx)  # vLLM's touch: tierd makes k0 the newest
    async with await Client.connect(setup.socket, namespace=setup.tier.namespace) as c:
        # The touch went out on the tier's link before this health request did.
        setup.tier._link.ask(lambda link_client: link_client.health(), time.monotonic() + 10.0)
        await c.store([b"newcomer"], [b"\x01" * ROW])  # evicts the least recent: k1
        present = [(await c.lookup([bytes(k)])).count for k in ks]
    assert present == [1, 0, 1, 1]
