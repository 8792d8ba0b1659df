"""Block stores: fixed-size slots on one medium (memory, pinned CPU, CUDA, disk).

:class:`GpuStore` is the only store that needs torch (the GPU extra, ``pip install
'tierd[gpu]'``): it is imported on first use of the name, so importing this package never
loads torch.
"""

from typing import Any

from tierd.lazy import lazy_attribute
from tierd.stores.base import BlockStore, Buffer, StoreStats
from tierd.stores.cpu import CpuStore
from tierd.stores.disk.store import DiskStore
from tierd.stores.memory import HostPoolStore, MemoryStore

__all__ = [
    "BlockStore",
    "Buffer",
    "CpuStore",
    "DiskStore",
    "GpuStore",
    "HostPoolStore",
    "MemoryStore",
    "StoreStats",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, name, {"GpuStore": "tierd.stores.gpu"})
