"""vLLM's tiering offload on vLLM's CPU build: its GPU <-> CPU copies done in plain torch.

vLLM's own offload worker (``CPUOffloadingWorker``) drives CUDA streams and refuses any
platform that is not CUDA-alike or XPU, so on vLLM's CPU build (no GPU: the "GPU" KV cache
lives in host memory) nothing reaches the CPU tier, nor tierd behind it.
:class:`TierdCpuTieringSpec` keeps everything of ``TieringOffloadingSpec`` (the scheduler's
``TieringOffloadingManager``, its shared CPU region and the secondary tiers, tierd's among
them) and swaps only the worker for :class:`TorchCopyWorker`, which copies the same rows
synchronously with tensor indexing. The rows are vLLM's direct layout: chunk ``c`` holds,
for each KV tensor in order, ``blocks_per_chunk`` consecutive pages of that tensor.

``TIERD=1`` picks it on a CPU platform (:mod:`tierd.integrations.vllm.plugin`); by hand:
``"spec_name": "TierdCpuTieringSpec", "spec_module_path": "tierd.integrations.vllm.cpu_spec"``.
Needs vLLM (and its torch); nothing else in tierd imports it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["RowCopies", "TierdCpuTieringSpec", "TorchCopyWorker"]

# Per KV group: (group, engine block ids, host chunk ids, block index inside the chunk),
# the last three torch tensors. torch comes with vLLM; imported where used, as tierd
# declares it only in its `gpu` extra.
_Pairs = list[tuple[int, Any, Any, Any]]


class RowCopies:
    """Copies KV pages between vLLM's KV cache tensors and host rows with plain torch:
    ``hosts[t]`` is KV tensor ``t``'s part of every row, viewed ``(rows, bytes)`` (any
    row stride), holding ``blocks_per_chunk`` consecutive pages of that tensor. Every
    copy is done when :meth:`copy` returns."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, hosts: list[Any]) -> None:
        import torch

        self._per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._engine: list[Any] = []
        self._host: list[Any] = []  # (rows, blocks_per_chunk, page) per tensor
        for cache, host in zip(kv_caches.tensors, hosts, strict=True):
            page = cache.page_size_bytes
            self._engine.append(cache.tensor.view(torch.int8).view(-1, page))
            self._host.append(host.unflatten(1, (blocks_per_chunk, page)))

    def _pairs(self, engine_spec: Any, host_spec: Any) -> _Pairs:
        import torch

        out: _Pairs = []
        engine_at = host_at = 0
        per = self._per_chunk
        for group, (size, first) in enumerate(
            zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = first % per
            n_chunks = -(-(size + skip) // per)
            chunks = torch.from_numpy(host_spec.block_ids[host_at : host_at + n_chunks]).long()
            flat = (chunks[:, None] * per + torch.arange(per)).reshape(-1)[skip : skip + size]
            ids = engine_spec.block_ids[engine_at : engine_at + size]
            out.append((group, torch.from_numpy(ids).long(), flat // per, flat % per))
            engine_at += size
            host_at += n_chunks
        return out

    def copy(self, engine_spec: Any, host_spec: Any, *, store: bool) -> int:
        """Copy the pages of one job (``store``: engine to host); the bytes moved."""
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"unexpected offload spec {type(host_spec).__name__}")
        moved = 0
        for group, blocks, chunks, subs in self._pairs(engine_spec, host_spec):
            for ref in self._refs[group]:
                size = ref.page_size_bytes
                engine = self._engine[ref.tensor_idx]
                host = self._host[ref.tensor_idx]
                if store:
                    host[chunks, subs, :size] = engine[blocks, :size]
                else:
                    engine[blocks, :size] = host[chunks, subs, :size]
                moved += size * len(blocks)
        return moved

    def release(self) -> None:
        """Let go of every view (of the engine's tensors and of the host rows)."""
        self._engine.clear()
        self._host.clear()


class TorchCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies KV pages between vLLM's KV cache tensors and the CPU tier's shared region;
    every job is done when ``submit_*`` returns."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any) -> None:
        self._region = region
        hosts = [
            region.create_next_worker_view(cache.page_size_bytes * blocks_per_chunk)
            for cache in kv_caches.tensors
        ]
        self._copies = RowCopies(kv_caches, blocks_per_chunk, hosts)
        self._finished: list[Any] = []

    def _copy(self, job_id: int, engine_spec: Any, host_spec: Any, *, store: bool) -> bool:
        moved = self._copies.copy(engine_spec, host_spec, store=store)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[Any]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submit_* returns

    def shutdown(self) -> None:
        self._copies.release()
        self._region.cleanup()


class TierdCpuTieringSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """``TieringOffloadingSpec`` whose worker copies with plain torch (any platform)."""

    def get_worker(self, kv_caches: Any) -> Any:
        worker: Any = self.__dict__.get("_worker")  # set to None by vLLM's spec
        if worker is None:
            worker = self._worker = self.create_worker(kv_caches)
        return worker

    def create_worker(self, kv_caches: Any) -> TorchCopyWorker:
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return TorchCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise
