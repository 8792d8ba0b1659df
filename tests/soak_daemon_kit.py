"""A soak daemon process (:class:`soak_kit.DaemonProcess`) with leases bounded by its tiers
alone, and the keys, blocks and tier figures the soak and recovery tests store and read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import soak_kit
from soak_daemon import content

from tierd.client import Client
from tierd.testing import short_socket_path

BLOCK = 4096
NS = soak_kit.NAMESPACE


def make_keys(tag: str, count: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(count)]


def blocks(keys: Sequence[bytes]) -> list[bytes]:
    return [content(k, BLOCK) for k in keys]


async def store_batches(client: Client, keys: Sequence[bytes], batch: int = 8) -> None:
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        assert await client.store(part, blocks(part)) == len(part)


def unleashed_daemon(tmp_path: Path, cpu_blocks: int, disk_blocks: int) -> soak_kit.DaemonProcess:
    """A soak daemon process (not started) over a CPU and a disk tier, its leases
    limited by nothing but the tiers."""
    settings = soak_kit.Settings(
        block_bytes=BLOCK,
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        lease_per_connection="100%",
        lease_per_tenant="100%",
    )
    return soak_kit.DaemonProcess(
        tmp_path, soak_kit.soak_config(tmp_path, short_socket_path(), settings)
    )


def tier(stats: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [t for t in stats["tiers"] if t["name"] == name]
    return found
