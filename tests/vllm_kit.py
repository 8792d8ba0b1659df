"""Helpers for the tests of tierd.integrations.vllm: vLLM's own objects, built small.

Importing this module needs vLLM (``scripts/setup_vllm``); the test modules skip, saying
so, when it is missing.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import structlog
import structlog.testing
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tierd.integrations.vllm import TierdSecondaryTier

ROW = 4096  # bytes of one offload chunk: the daemon's block_bytes in these tests
DEADLINE_S = 30.0  # safety net for anything a test waits on
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_spec(model: str = "tiny-llama", *, dtype: str = "float16", tp: int = 1) -> Any:
    """What vLLM's TieringOffloadingSpec hands a secondary tier: its config and events."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0.attn", "layers.1.attn"), 0),),
        worker_kv_bytes_per_block=ROW // tp,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="engine-0",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    events = OffloadingKVEventsConfig(enable_kv_cache_events=False, self_describing_kv_events=False)
    return types.SimpleNamespace(config=config, kv_events_config=events, blocks_per_chunk=1)


def primary_rows(count: int, row_bytes: int = ROW) -> np.ndarray:
    """vLLM's CPU tier in miniature: one int8 row per chunk."""
    return np.zeros((count, row_bytes), dtype=np.int8)


def make_tier(socket: str, rows: np.ndarray, spec: Any = None, **config: Any) -> TierdSecondaryTier:
    """The tier as vLLM builds it: through its factory, by module path."""
    tier_config = {
        "type": "TierdSecondaryTier",
        "module_path": "tierd.integrations.vllm",
        "socket": socket,
        "reconnect_max_s": 0.0,
        **config,
    }
    tier = SecondaryTierFactory.create_secondary_tier(
        tier_config, memoryview(rows), spec if spec is not None else offloading_spec()
    )
    assert isinstance(tier, TierdSecondaryTier)
    watch_lookups(tier)
    return tier


def keys(prefix: str, count: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}-{i}".encode(), 0) for i in range(count)]


def fill(rows: np.ndarray, row_ids: Iterable[int], seed: int) -> None:
    rng = random.Random(seed)
    for r in row_ids:
        rows[r] = np.frombuffer(rng.randbytes(rows.shape[1]), dtype=np.int8)


class _CountingQueue:
    """Stands in for the lookup manager's result queue and counts what arrives."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._puts = 0
        self._cond = threading.Condition()

    def put(self, item: Any) -> None:
        self._queue.put(item)
        with self._cond:
            self._puts += 1
            self._cond.notify_all()

    def get_nowait(self) -> Any:
        return self._queue.get_nowait()

    def wait_for(self, puts: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._puts >= puts, DEADLINE_S):
                raise AssertionError(f"no lookup answer within {DEADLINE_S}s")

    @property
    def puts(self) -> int:
        return self._puts


def watch_lookups(tier: TierdSecondaryTier) -> None:
    tier._lookups._pending_results = _CountingQueue()


def resolve(tier: TierdSecondaryTier, key_list: Sequence[OffloadKey], ctx: ReqContext) -> list:
    """One scheduler step of lookups (RETRY: sent to the daemon at step end), then the
    answers once they are in."""
    first = [tier.lookup(k, ctx) for k in key_list]
    assert set(first) <= {LookupResult.RETRY, LookupResult.HIT, LookupResult.MISS}
    results: _CountingQueue = tier._lookups._pending_results
    before = results.puts
    tier.on_schedule_end(STEP)
    if LookupResult.RETRY in first:
        results.wait_for(before + 1)
    return [tier.lookup(k, ctx) for k in key_list]


def transfer_job(
    job_id: int, key_list: Sequence[OffloadKey], row_ids: Sequence[int], *, load: bool
) -> TransferJob:
    """One transfer job as vLLM's scheduler makes it: a load (promotion) or a store."""
    return TransferJob(
        job_id=job_id,
        keys=list(key_list),
        chunk_ids=np.asarray(row_ids, dtype=np.int64),
        is_promotion=load,
        req_context=ReqContext(req_id=f"job-{job_id}"),
    )


def run_job(
    tier: TierdSecondaryTier,
    job_id: int,
    key_list: Sequence[OffloadKey],
    row_ids: Sequence[int],
    *,
    load: bool,
) -> JobResult:
    """Submit one job, wait for it (``drain_jobs``) and return its result."""
    job = transfer_job(job_id, key_list, row_ids, load=load)
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    assert [r.job_id for r in results] == [job_id]
    return results[0]


def ask(tier: TierdSecondaryTier, key_list: Sequence[OffloadKey], req_id: str) -> list:
    """One request's lookups, start to finish (``resolve``, then the request ends)."""
    ctx = ReqContext(req_id=req_id)
    tier.on_new_request(ctx)
    try:
        return resolve(tier, key_list, ctx)
    finally:
        tier.on_request_finished(ctx)


@contextlib.contextmanager
def captured_logs() -> Iterator[list[dict[str, Any]]]:
    """Every log line (with its level), whatever an earlier test's in-process daemon
    configured: capture_logs swaps structlog's processors but keeps its level filter."""
    structlog.reset_defaults()
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.reset_defaults()
