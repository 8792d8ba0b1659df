"""A vLLM engine in miniature over tierd's pool as its CPU tier, for the tests of
``tierd.integrations.vllm.pool_spec``: vLLM's own config, spec and manager seams, the
worker over KV tensors in host memory, and the connector's part (the job specs, the
step's end, completion after the copies) written out small.

Importing this module needs vLLM (``scripts/setup_vllm``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
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

from tierd.integrations.vllm.pool_manager import TierdPoolManager
from tierd.integrations.vllm.pool_spec import TierdPoolSpec

PAGE = 4096  # one KV block of the engine, one row of the pool (blocks_per_chunk 1)
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
WAIT_S = 30.0  # safety net for an answer the daemon owes


def pool_config(socket: str, *, blocks: int = 1, **tierd: Any) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0.attn",), 0),),
        worker_kv_bytes_per_block=PAGE // blocks,
        enable_kv_cache_events=False,
        extra_config={"tierd": {"socket": socket, **tierd}},
        engine_id="engine",
        model=OffloadingModelConfig(name="tiny-pool-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def keys(prefix: str, count: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]


def page(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 127, (PAGE,), dtype=torch.int8, generator=generator)


BUSY_DEADLINE_S = 1.0


class Engine:
    """One engine: its spec, manager and worker, and KV blocks in host memory."""

    def __init__(self, socket: str, kv_blocks: int = 64, device: str = "cpu", **tierd: Any) -> None:
        # A store's commit is sent within the lookup deadline and answered within the job
        # deadline and a second (50 ms each by default): on a machine busy with the
        # suite's two workers, a store was once lost that way (vLLM keeps its copy, as it
        # should), which a test that only sets up a store did not mean to test. Tests of
        # deadlines set their own.
        tierd = {"lookup_deadline_s": BUSY_DEADLINE_S, "job_deadline_s": BUSY_DEADLINE_S, **tierd}
        self.spec = TierdPoolSpec(pool_config(socket, **tierd))
        self.manager: TierdPoolManager = self.spec.get_manager()  # type: ignore[assignment]
        self.kv = torch.zeros((kv_blocks, PAGE), dtype=torch.int8, device=device)
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(self.kv, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]]
        )
        self.worker = self.spec.get_worker(caches)
        self.jobs = 0

    def ctx(self, req_id: str) -> ReqContext:
        ctx = ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        return ctx

    def _job(self) -> int:
        self.jobs += 1
        return self.jobs

    def store(self, req: ReqContext, names: list[OffloadKey], blocks: list[int]) -> list[bytes]:
        """vLLM's store of the KV blocks ``blocks`` under ``names``: reserve, copy, then
        (the workers done) complete; the keys stored."""
        out = self.manager.prepare_store(names, req)
        if out is None or not out.keys_to_store:
            return []
        at = {bytes(k): b for k, b in zip(names, blocks, strict=True)}
        ids = [at[bytes(k)] for k in out.keys_to_store]
        job = self._job()
        gpu = GPULoadStoreSpec(ids, [len(ids)], [0])
        assert self.worker.submit_store(job, gpu, out.store_spec)
        self.finish(job)
        self.manager.complete_store(out.keys_to_store, req)
        self.manager.on_schedule_end(STEP)
        return [bytes(k) for k in out.keys_to_store]

    def lookup(self, req: ReqContext, names: list[OffloadKey]) -> int:
        """vLLM's lookups, step after step, until no key says RETRY: the leading hits."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = []
            for key in names:
                result = self.manager.lookup(key, req)
                found.append(result)
                if result is LookupResult.MISS:
                    break
            if LookupResult.RETRY not in found:
                return sum(r is LookupResult.HIT for r in found)
            self.manager.on_schedule_end(STEP)
            time.sleep(0.002)
        raise AssertionError(f"lookups still RETRY: {found}")

    def load(self, req: ReqContext, names: list[OffloadKey], blocks: list[int]) -> Any:
        """vLLM's load of pinned ``names`` into ``blocks``, the copy started; its spec."""
        spec = self.manager.prepare_load(names, req)
        job = self._job()
        gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
        assert self.worker.submit_load(job, spec, gpu)
        self.finish(job)
        return spec

    def finish(self, job: int) -> None:
        """Until the job's copy is done (a GPU's: its event), then its result."""
        self.worker.wait({job})
        done = {r.job_id: r for r in self.worker.get_finished()}
        assert done[job].success

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()
