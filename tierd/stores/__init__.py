"""Block stores: fixed-size slots on one medium (memory, pinned CPU, CUDA, disk)."""

from tierd.stores.base import BlockStore, Buffer, StoreStats

__all__ = ["BlockStore", "Buffer", "StoreStats"]
