"""A test-only offloading spec: vLLM's tiering spec with its GPU <-> CPU copies in plain torch.

vLLM's stock offload worker (``CPUOffloadingWorker``) drives CUDA streams and refuses any
platform that is not CUDA-alike or XPU, so on vLLM's CPU build the "GPU" KV cache (which
lives in host memory) cannot reach the CPU tier. :class:`TorchCopyTieringSpec` keeps
everything of ``TieringOffloadingSpec`` (the scheduler-side ``TieringOffloadingManager``,
its shared-memory CPU tier and the secondary tiers, tierd's among them) and swaps only the
worker for :class:`TorchCopyWorker`, which copies the same rows with ``index_put_``,
synchronously. The byte layout is vLLM's direct layout: chunk ``c`` of the CPU tier holds,
for each KV tensor in order, ``blocks_per_chunk`` consecutive pages of that tensor.

Loaded by vLLM through ``"spec_name": "TorchCopyTieringSpec", "spec_module_path":
"cpu_offload_spec"`` with this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class TorchCopyWorker(OffloadingWorker):
    """Copies KV pages between vLLM's KV cache tensors and the CPU tier's shared region."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region = region
        self._per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._device: list[torch.Tensor] = []
        # (num_chunks, blocks_per_chunk, page) views of the region, one per KV tensor.
        self._host: list[torch.Tensor] = []
        for cache in kv_caches.tensors:
            page = cache.page_size_bytes
            device = cache.tensor.view(torch.int8).view(-1, page)
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._device.append(device)
            self._host.append(host.unflatten(1, (blocks_per_chunk, page)))
        self._finished: list[TransferResult] = []

    def _pairs(
        self, device_spec: GPULoadStoreSpec, host_spec: BlockIDsLoadStoreSpec
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per KV group: (group, device block ids, host chunk ids, host sub-block ids)."""
        out = []
        device_at = 0
        host_at = 0
        for group, (size, first) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = first % self._per_chunk
            n_chunks = -(-(size + skip) // self._per_chunk)
            chunks = torch.from_numpy(host_spec.block_ids[host_at : host_at + n_chunks]).long()
            flat = (chunks[:, None] * self._per_chunk + torch.arange(self._per_chunk)).reshape(-1)
            flat = flat[skip : skip + size]
            blocks = torch.from_numpy(device_spec.block_ids[device_at : device_at + size]).long()
            out.append((group, blocks, flat // self._per_chunk, flat % self._per_chunk))
            device_at += size
            host_at += n_chunks
        return out

    def _copy(
        self, job_id: int, device_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, *, store: bool
    ) -> bool:
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"unexpected offload spec {type(host_spec).__name__}")
        moved = 0
        for group, blocks, chunks, subs in self._pairs(device_spec, host_spec):
            for ref in self._refs[group]:
                size = ref.page_size_bytes
                device = self._device[ref.tensor_idx]
                host = self._host[ref.tensor_idx]
                if store:
                    host[chunks, subs, :size] = device[blocks, :size]
                else:
                    device[blocks, :size] = host[chunks, subs, :size]
                moved += size * len(blocks)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submit_* returns

    def shutdown(self) -> None:
        self._device.clear()
        self._host.clear()
        self._region.cleanup()


class TorchCopyTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies with plain torch (any platform)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]

    def create_worker(self, kv_caches: CanonicalKVCaches) -> TorchCopyWorker:  # type: ignore[override]
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
