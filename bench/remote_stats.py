"""What the parts of ``scripts/bench remote`` (and ``s3``) share to measure with: the block
keys (:func:`block_keys`) and ``KiB``; their figures are :class:`bench.figures.Figure`."""

from __future__ import annotations

from tierd.keys import BlockKey

KiB = 1 << 10


def block_keys(tag: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{tag}-{i}".encode()) for i in range(count)]
