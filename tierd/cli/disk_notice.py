"""The line a replay or a what-if prints (on stderr) before it starts, when a disk tier is
in the chain: how much it will store, and how much of that it will write to which disk.

A replay of the shared trace through the shipped config writes tens of GiB to the disk tier
in a few minutes: the operator is told before, not after. The figure is a floor, not a
promise: every distinct block of the replayed requests is stored at least once, and what
the tiers above the disk cannot keep is written down to it; a block evicted from the disk
and stored again is written again, so the real figure is often higher.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierd.config import ChainConfig, TierKind
from tierd.keys import Medium
from tierd.units import format_bytes
from tierd.workload.trace import Trace

__all__ = ["DiskTier", "announce", "chain_disks", "daemon_disks", "disk_notice"]


@dataclass(frozen=True, slots=True)
class DiskTier:
    """A disk tier a run will write to, and where (for the message)."""

    name: str
    where: str


def chain_disks(cfg: ChainConfig, stem: str, warm: Path | None) -> tuple[list[DiskTier], int]:
    """A what-if's disk tiers (where :mod:`tierd.cli.whatif` puts them), and the blocks
    the tiers that are not on disk hold."""
    if warm is None:
        where = f"a private directory in {tempfile.gettempdir()}, removed afterwards"
    else:
        where = str(warm / stem)
    disks = [DiskTier(t.name, where) for t in cfg.tiers if t.kind is TierKind.DISK]
    above = sum(t.num_blocks(cfg.block_bytes) for t in cfg.tiers if t.kind is not TierKind.DISK)
    return disks, above


def daemon_disks(info: dict[str, Any], socket: str) -> tuple[list[DiskTier], int]:
    """The disk tiers of the daemon whose hello said ``info``, and the blocks of the others."""
    tiers: list[dict[str, Any]] = info.get("tiers") or []
    where = f"the daemon's at {socket}"
    disks = [DiskTier(str(t["name"]), where) for t in tiers if t["medium"] == str(Medium.DISK)]
    above = sum(int(t["capacity"]) for t in tiers if t["medium"] != str(Medium.DISK))
    return disks, above


def disk_notice(
    trace: Trace,
    limit: int | None,
    block_bytes: int,
    disks: Sequence[DiskTier],
    above_blocks: int,
) -> str | None:
    """The line to print before the run (``None``: no disk tier, nothing to say)."""
    if not disks:
        return None
    requests = trace.requests if limit is None else trace.requests[:limit]
    blocks = len({key for request in requests for key in request.keys})
    spill = max(0, blocks - above_blocks) * block_bytes
    named = "; ".join(f"'{disk.name}' ({disk.where})" for disk in disks)
    return (
        f"tierd: this run stores {blocks:,} distinct blocks of {format_bytes(block_bytes)} "
        f"({format_bytes(blocks * block_bytes)}); what the tiers above the disk cannot keep "
        f"({format_bytes(above_blocks * block_bytes)}) goes to disk tier {named}: expect "
        f"{format_bytes(spill)} of disk writes or more (a block stored again is written again)"
    )


def announce(
    trace: Trace, limit: int | None, block_bytes: int, found: tuple[list[DiskTier], int]
) -> None:
    """Print :func:`disk_notice` on stderr, when there is a disk tier to speak of."""
    line = disk_notice(trace, limit, block_bytes, *found)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
