"""What a soak campaign is: its :class:`Settings` (length, load, the daemon's small
tiers), the daemon's config (:func:`soak_config`), the kinds of fault it injects, and the
constants every part of the kit shares (namespaces, deadlines, the daemon runner)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soak_daemon import FaultPlan
from soak_hostile import GUARD_LIMITS

TESTS = Path(__file__).resolve().parent
RUNNER = TESTS / "soak_daemon.py"
NAMESPACE = "soak"
FUZZ_NAMESPACE = "soak-fuzz"
DEADLINE_S = 60.0  # safety net for one request, one quiescence, one holder
START_DEADLINE_S = 180.0  # a daemon's start: imports torch, may rebuild the disk index

DISK_EPISODES: dict[str, FaultPlan] = {
    "disk_write_eio": FaultPlan(write_rate=0.3, write_mode="eio"),
    "disk_write_enospc": FaultPlan(write_rate=0.3, write_mode="enospc"),
    "disk_full": FaultPlan(write_rate=0.5, write_mode="short", journal_rate=0.5),
    "disk_read_eio": FaultPlan(read_rate=0.3),
    "disk_slow": FaultPlan(slow_s=0.02),
    "disk_real_full": FaultPlan(),  # no injection: a real tmpfs filled up (root only)
}
# The fault layer's counter that shows an episode really injected something.
EPISODE_COUNTERS = {
    "disk_write_eio": "write_eio",
    "disk_write_enospc": "write_enospc",
    "disk_full": "write_short",
    "disk_read_eio": "read_eio",
    "disk_slow": "slow",
}
PROCESS_FAULTS = ("daemon_sigkill_checkpoint", "daemon_sigkill_hot")
CLIENT_FAULTS = ("client_killed_mid_store", "client_killed_mid_load")
STEADY_FAULTS = ("stuck_subscriber", "fuzz_connection")
FAULT_KINDS = (*PROCESS_FAULTS, *CLIENT_FAULTS, *DISK_EPISODES, *STEADY_FAULTS)


@dataclass(frozen=True, slots=True)
class Settings:
    """One campaign: its length, its load and the daemon's (small) tiers."""

    seconds: float = 600.0
    clients: int = 16
    seed: int = 1
    block_bytes: int = 64 << 10
    cpu_blocks: int = 64
    disk_blocks: int = 512
    sequences: int = 384  # prefix chains: 1536 keys against 576 slots in all
    seq_len: int = 4
    # Lease bounds (the daemon's defaults; a tiny tier of a focused test, filled by one
    # lease, lifts them: they are tested in tests/test_leases.py).
    lease_per_connection: str = "50%"
    lease_per_tenant: str = "75%"
    fuzz_frames_per_s: float = 100.0

    @property
    def key_space(self) -> int:
        return self.sequences * self.seq_len


def soak_config(
    workdir: Path, socket_path: str, settings: Settings, full_disk: Path | None = None
) -> dict[str, Any]:
    """The daemon's config: a CPU pool over a disk tier in ``workdir``, both small (with
    ``full_disk``, a second directory of the disk tier: a tmpfs that episodes fill)."""
    disk = workdir / "disk"
    disk.mkdir(mode=0o700, parents=True, exist_ok=True)
    directories = [str(disk)] + ([str(full_disk)] if full_disk is not None else [])
    return {
        "block_bytes": settings.block_bytes,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": settings.cpu_blocks},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": settings.disk_blocks,
                "directories": directories,
            },
        ],
        "socket": {"path": socket_path},
        "limits": {
            "max_frame_bytes": max(256 << 10, 2 * settings.block_bytes + (64 << 10)),
            "lease_blocks_per_connection": settings.lease_per_connection,
            "lease_blocks_per_tenant": settings.lease_per_tenant,
            **GUARD_LIMITS,
        },
        "shutdown": {"write_back": "flush", "grace": 30},
        "events": {"queue_batches": 64},
        "logging": {"format": "json", "level": "info"},
    }
