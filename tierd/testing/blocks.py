"""Keys and block bytes for tests: a key per slot, seeded random blocks, and the bytes of
any buffer or tensor (on any device) to compare them with."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from tierd.keys import BlockKey, int_key
from tierd.stores.base import is_tensor, tensor_memoryview

__all__ = ["as_bytes", "keys_for", "random_blocks"]


def as_bytes(buf: Any) -> bytes:
    """The bytes of a buffer or a tensor on any device."""
    if is_tensor(buf):  # torch is loaded: only its users hand tensors in
        import torch

        flat = buf.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        return bytes(tensor_memoryview(flat))
    return bytes(memoryview(buf).cast("B"))


def keys_for(slots: Iterable[int]) -> list[BlockKey]:
    return [int_key(slot) for slot in slots]


def random_blocks(rng: random.Random, count: int, block_bytes: int) -> list[bytes]:
    return [rng.randbytes(block_bytes) for _ in range(count)]
