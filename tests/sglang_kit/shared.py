"""What the SGLang tests share: their engine pair, their daemon, page counts and checks.

The fixtures (``pair``: two engine processes for a module; ``sglang_daemon``: a ``tierd
serve`` of :func:`config` for one test) reach the tests through ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_kit import Spawn
from sglang_kit.engines import Engines, page_bytes

from tierd.client import Client
from tierd.testing import daemon_config

__all__ = [
    "BLOCK",
    "LIVENESS_S",
    "PAGES",
    "config",
    "loaded_all",
    "namespace_row",
    "pair",
    "sglang_daemon",
    "until",
]

PAGES = 24
BLOCK = page_bytes()  # 768: one page_first / layer_first page of the MHA geometry
LIVENESS_S = 30.0  # a call on a stopped daemon returns long before this (it used to hang)


@pytest.fixture(scope="module")
def pair() -> Any:
    """Two engine processes, ``a`` and ``b``, for the whole module (SGLang imports once)."""
    a, b = Engines(), Engines()
    yield a, b
    a.close()
    b.close()


def config(tmp_path: Path, **over: Any) -> dict[str, Any]:
    return daemon_config(
        tmp_path, block_bytes=BLOCK, **{"cpu_blocks": 64, "disk_blocks": 256, **over}
    )


@pytest.fixture
async def sglang_daemon(tmp_path: Path, spawn: Spawn) -> Any:
    """A ``tierd serve`` process of the default :func:`config`, for one test."""
    return await spawn(config(tmp_path))


def loaded_all(answer: dict[str, Any], pages: int) -> bool:
    return answer["hit_pages"] == answer["loaded_pages"] == answer["identical"] == pages


async def until(check: Any, what: str, within_s: float = LIVENESS_S) -> None:
    """Until ``check()`` (sync or async) is true, looked at every 20 ms, at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {within_s} s: {what}")


async def namespace_row(socket_path: str, namespace: str) -> dict[str, Any]:
    client = await Client.connect(socket_path)
    try:
        tenants = await client.namespaces()
    finally:
        await client.close()
    rows = [row for rows in tenants.values() for row in rows if row["namespace"] == namespace]
    assert len(rows) == 1, tenants
    return rows[0]
