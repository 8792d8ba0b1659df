"""Host buffers that are not tensors, on their way into or out of the GPU pool.

A batch of plain host buffers (bytes, memoryviews, numpy rows) cannot be the source or
target of a DMA: the GPU store packs it into a page-locked ``[count, block_bytes]``
staging tensor before a write, and unpacks a read's staging rows into it afterwards.
Staging is bounded: a batch goes in pieces of at most :data:`STAGING_BYTES` per launch.
Tensors (host or device) and numpy arrays (as tensors over the same memory) move whole,
without staging.

This module owns that packing, unpacking and cutting into pieces; it holds no state
(torch's pinned allocator caches the staging memory). torch is the GPU extra's: only
:mod:`tierd.stores.gpu` imports this module.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from tierd.stores.base import BlockBatch, tensor_memoryview

__all__ = ["STAGING_BYTES", "new_staging", "pack", "pieces", "tensor_if_array", "unpack"]

# Per launch, host buffers that are not tensors are packed into pinned staging of at most
# this much; torch's pinned allocator rounds each size up to a power of two and caches it.
STAGING_BYTES = 64 << 20


def tensor_if_array(batch: Any) -> BlockBatch:
    """A numpy batch as a tensor over the same memory (the launch code takes tensors)."""
    return torch.from_numpy(batch) if isinstance(batch, np.ndarray) else batch


def pieces(batch: BlockBatch, count: int, block_bytes: int) -> list[tuple[int, int]]:
    """Host buffers that are not tensors go through pinned staging: at most
    :data:`STAGING_BYTES` of it per launch; tensors go whole."""
    if not isinstance(batch, list) or not batch or isinstance(batch[0], torch.Tensor):
        return [(0, count)]
    step = max(1, STAGING_BYTES // block_bytes)
    return [(i, min(i + step, count)) for i in range(0, count, step)]


def new_staging(count: int, block_bytes: int, device: torch.device) -> torch.Tensor:
    """Host rows for ``count`` blocks, page-locked when ``device`` is a CUDA device."""
    pinned = device.type == "cuda"
    return torch.empty((count, block_bytes), dtype=torch.uint8, pin_memory=pinned)


def pack(src: BlockBatch, count: int, block_bytes: int, device: torch.device) -> torch.Tensor:
    """One ``[count, block_bytes]`` host or device tensor holding the blocks to write."""
    if isinstance(src, torch.Tensor):
        return src
    staging = new_staging(count, block_bytes, device)
    flat = tensor_memoryview(staging)
    for i, view in enumerate(cast(list[memoryview], src)):
        flat[i * block_bytes : (i + 1) * block_bytes] = view
    return staging


def unpack(staging: torch.Tensor, dst: BlockBatch) -> None:
    """Copy a read's staging rows into the caller's host buffers."""
    flat, size = tensor_memoryview(staging), staging.shape[1]
    for i, view in enumerate(cast(list[memoryview], dst)):
        view[:] = flat[i * size : (i + 1) * size]
