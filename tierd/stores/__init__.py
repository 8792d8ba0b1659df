"""Block stores: fixed-size slots on one medium (memory, pinned CPU, CUDA, disk)."""

from tierd.stores.base import BlockStore, Buffer, StoreStats
from tierd.stores.cpu import CpuStore
from tierd.stores.disk import DiskStore
from tierd.stores.gpu import GpuStore
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
