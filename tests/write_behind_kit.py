"""A chain whose disk tier is written behind the CPU tier: its config, the chain in the test's
loop, the content of a key, and disk writes held at a gate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tierd.chain import TierChain
from tierd.library import open_chain
from tierd.stores.disk.store import DiskStore

BLOCK = 4096


def block(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def chain_config(tmp_path: Path, *, behind: bool = True, admission: str = "always") -> dict:
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700, exist_ok=True)
    return {
        "block_bytes": BLOCK,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 8, "write_behind": behind},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": 64,
                "directories": [str(directory)],
                "admission": admission,
            },
        ],
    }


@asynccontextmanager
async def chain_at(tmp_path: Path, **options: Any) -> AsyncIterator[TierChain]:
    async with asyncio.timeout(60), open_chain(chain_config(tmp_path, **options)) as chain:
        yield chain


def held_disk_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Every disk-tier write waits for the second event; the first is set when one does."""
    writing, gate = asyncio.Event(), asyncio.Event()
    real = DiskStore._write

    async def held(store: DiskStore, slots: Any, keys: Any, data: Any) -> list[bool]:
        writing.set()
        await gate.wait()
        return await real(store, slots, keys, data)

    monkeypatch.setattr(DiskStore, "_write", held)
    return writing, gate
