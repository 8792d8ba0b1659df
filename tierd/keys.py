"""Block keys and storage media.

A block key is opaque bytes (an engine's block hash, say) of at most
:data:`MAX_KEY_BYTES`. Inside tierd a key is a plain ``bytes`` object: bytes cache their
hash, so the hot paths pay nothing for it. Validation happens once, where keys enter
from outside (:func:`block_key`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import NewType

__all__ = ["MAX_KEY_BYTES", "BlockKey", "Medium", "block_key", "int_key"]

MAX_KEY_BYTES = 64

BlockKey = NewType("BlockKey", bytes)


class Medium(StrEnum):
    """Where a tier keeps its bytes; events are tagged with it."""

    MEMORY = "MEMORY"
    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"
    REMOTE = "REMOTE"  # a shared server (Redis, Valkey) below the local tiers
    OBJECT = "OBJECT"  # an object store (S3) below the local tiers, or below REMOTE


def block_key(raw: bytes | bytearray | memoryview) -> BlockKey:
    """Validate ``raw`` as a block key: non-empty bytes of at most 64 bytes."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise TypeError(f"a block key must be bytes, not {type(raw).__name__}")
    key = bytes(raw)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a block key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    return BlockKey(key)


def int_key(value: int) -> BlockKey:
    """The 8-byte little-endian key for an integer block id (trace hash ids, tests)."""
    return BlockKey(value.to_bytes(8, "little", signed=value < 0))
