"""Tier chains in the test's own loop: a small chain config (a CPU tier over a disk tier), the
deterministic content of a key, and storing, reading back and finding blocks through a chain."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tierd.chain import TierChain
from tierd.keys import BlockKey, Medium, int_key

BLOCK = 4096


def content(key: BlockKey, block_bytes: int = BLOCK) -> bytes:
    """Deterministic bytes for a key, different for every key."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (block_bytes // len(seed) + 1))[:block_bytes]


def keys_of(*ids: int) -> list[BlockKey]:
    return [int_key(i) for i in ids]


def chain_config(tmp_path: Path, *tiers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    specs = []
    for i, spec in enumerate(tiers):
        spec = {"name": f"{spec['kind']}{i}", **spec}
        if spec["kind"] == "disk":
            spec.setdefault("directories", [str(tmp_path / f"disk{i}")])
            Path(spec["directories"][0]).mkdir(parents=True, exist_ok=True)
        if spec["kind"] == "gpu":
            spec.setdefault("device", "cpu")
        specs.append(spec)
    return {"block_bytes": BLOCK, "tiers": specs, **extra}


def cpu_over_disk(tmp_path: Path, cpu: int, disk: int, **cpu_options: Any) -> dict[str, Any]:
    """The usual two-level chain: a CPU tier of ``cpu`` blocks over a disk tier of ``disk``."""
    return chain_config(
        tmp_path,
        {"kind": "cpu", "capacity": cpu, **cpu_options},
        {"kind": "disk", "capacity": disk},
    )


async def store_all(chain: TierChain, keys: list[BlockKey]) -> list[BlockKey]:
    return await chain.store(keys, [content(k) for k in keys])


async def read_back(
    chain: TierChain, keys: list[BlockKey], into: Medium | str | None = None
) -> None:
    """Load ``keys`` (all must load) and check every byte."""
    async with chain.loading(keys, into) as handle:
        assert handle.keys == keys
        for key, view in zip(handle.keys, handle.views(), strict=True):
            assert bytes(memoryview(view).cast("B")) == content(key), key


async def load_bytes(chain: TierChain, keys: list[BlockKey]) -> list[bytes]:
    async with chain.loading(keys) as handle:
        return [bytes(view) for view in handle.views()]


async def assert_found_below(
    chain: TierChain, keys: list[BlockKey], medium: Medium, data: list[bytes]
) -> None:
    """A node that never stored them finds the first ``len(data)`` of ``keys`` in the level
    of ``medium`` alone, loads ``data`` from it and promotes the blocks into its local tier."""
    count = len(data)
    found = await chain.find(keys)
    assert found.count == count
    assert found.media == (medium,) * count
    assert chain.lookup(keys).count == 0  # the local lookup alone sees nothing
    assert await load_bytes(chain, keys[:count]) == data
    assert chain.lookup(keys[:count]).count == count  # promoted into the local tier
