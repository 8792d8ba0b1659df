"""The restart part of ``scripts/bench scale``: a real daemon over a disk tier of N
blocks, restarted after a clean stop and after a SIGKILL.

The slab is filled through the library (a :class:`~tierd.stores.disk.store.DiskStore` of the
daemon's geometry, keys prefixed with the namespace's id as the daemon prefixes them) and
closed cleanly. Then, per restart kind: the daemon is started, the time to READY and to
the first block served to a client (``get`` of a filled key, bytes checked) is taken,
every filled key is looked up (blocks lost: those the daemon no longer finds) and a
sample is read back. Before the SIGKILL, clients keep storing blocks that spill to the
disk tier, so the kill lands with the journal busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import xxhash

from tierd.client import Client
from tierd.keys import int_key
from tierd.stores.disk.store import DiskStore
from tierd.testing import start_daemon

BB = 4096
NAMESPACE = "bench-scale"
PREFIX = xxhash.xxh3_64_digest(NAMESPACE.encode())  # the daemon's namespace id
SPARE = 20_000  # disk slots beyond the filled ones, for the blocks stored before the kill
START_TIMEOUT_S = 900.0


def content(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4 + bytes(BB - 32)


def daemon_yaml(work: Path, blocks: int) -> Path:
    path = work / "tierd.yaml"
    path.write_text(
        f"""block_bytes: {BB}
tiers:
  - {{name: cpu, kind: cpu, capacity: 32MiB, policy: lru}}
  - {{name: disk, kind: disk, capacity: {blocks + SPARE}, policy: lru,
      directories: [{work / "disk"}]}}
socket: {{path: {work / "t.sock"}}}
logging: {{level: info, format: json}}
shutdown: {{grace: 30s, write_back: none}}
"""
    )
    return path


async def fill(work: Path, blocks: int) -> float:
    """Write ``blocks`` blocks into the daemon's slab through the library; seconds."""
    (work / "disk").mkdir(mode=0o700, exist_ok=True)
    store = DiskStore(
        num_blocks=blocks + SPARE,
        block_bytes=BB,
        directories=[work / "disk"],
        o_direct=False,
        fsync="none",
        blocks_per_task=256,
    )
    t0 = time.perf_counter()
    async with store:
        for start in range(0, blocks, 4096):
            ids = range(start, min(blocks, start + 4096))
            ok = await store.write(
                list(ids), [PREFIX + int_key(i) for i in ids], [content(i) for i in ids]
            )
            if not all(ok):
                raise RuntimeError(f"fill: {ok.count(False)} writes failed")
    return time.perf_counter() - t0


async def first_block(path: Path, t0: float, key: int) -> float:
    """Seconds from the spawn until a ``get`` of ``key`` returns its bytes (a block kept
    across the restart and not adopted yet is a miss: asked again, for up to 10 minutes)."""
    async with await Client.connect(path, namespace=NAMESPACE, block_bytes=BB) as c:
        while time.monotonic() - t0 < 600:
            (data,) = await c.get([int_key(key)])
            if data:
                break
            await asyncio.sleep(0.01)
    if data != content(key):
        raise RuntimeError("the first block read back wrong")
    return time.monotonic() - t0


async def adopted(path: Path, t0: float) -> float:
    """Seconds from the spawn until the disk tier has adopted every kept block."""
    async with await Client.connect(path, namespace=NAMESPACE, block_bytes=BB) as c:
        while time.monotonic() - t0 < 600:
            tiers = (await c.stats())["tiers"]
            if not any(t.get("adopting") for t in tiers):
                break
            await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def census(path: Path, blocks: int, sample: int) -> dict[str, Any]:
    """Blocks the daemon no longer finds among the filled ones; a sample read back."""
    lost = 0
    t0 = time.perf_counter()
    async with await Client.connect(path, namespace=NAMESPACE, block_bytes=BB) as c:
        for start in range(0, blocks, 4096):
            keys = [int_key(i) for i in range(start, min(blocks, start + 4096))]
            found = (await c.lookup(keys)).count
            while found < len(keys):  # a lookup stops at the first miss: find each
                lost += 1
                keys = keys[found + 1 :]
                found = (await c.lookup(keys)).count if keys else 0
        lookup_s = time.perf_counter() - t0
        ids = random.Random(7).sample(range(blocks), min(sample, blocks))
        bad = 0
        for start in range(0, len(ids), 256):
            part = ids[start : start + 256]
            got = await c.get([int_key(i) for i in part])
            bad += sum(1 for i, data in zip(part, got, strict=True) if data != content(i))
    return {"lost": lost, "lookup_all_s": round(lookup_s, 2), "sample": len(ids), "bad": bad}


async def churn(path: Path, blocks: int, count: int) -> int:
    """Store ``count`` new blocks (they spill to the disk tier); the number acknowledged."""
    stored = 0
    async with await Client.connect(path, namespace=NAMESPACE, block_bytes=BB) as c:
        for start in range(0, count, 512):
            ids = range(blocks + start, blocks + min(count, start + 512))
            stored += await c.put([int_key(i) for i in ids], [content(i) for i in ids])
    return stored


def restart(work: Path, config: Path, blocks: int, run: int, kind: str) -> dict[str, Any]:
    """One daemon start over the filled slab; then stop it (SIGTERM, or SIGKILL after
    storing more blocks). The figures of this start."""
    log = work / f"daemon-{run}.log"
    daemon = start_daemon(config, log=log, timeout_s=START_TIMEOUT_S)  # READY=1 (sd_notify)
    t0 = daemon.started_at  # just before the spawn
    sock = work / "t.sock"
    try:
        at_ready = proc_costs(daemon.pid)
        first = asyncio.run(first_block(sock, t0, 0))
        all_adopted = asyncio.run(adopted(sock, t0))
        found = asyncio.run(census(sock, blocks, 2000))
        if kind == "kill":
            found["stored_before_kill"] = asyncio.run(churn(sock, blocks, SPARE // 2))
            daemon.kill()
        else:
            daemon.stop(timeout_s=120)
    finally:
        daemon.kill()  # by PID, if it still runs
        for pool in Path("/dev/shm").glob(f"tierd-{daemon.pid}-*"):
            pool.unlink(missing_ok=True)
    return {
        "ready_s": round(daemon.ready_s or 0.0, 3),  # set by a start that returned
        "first_block_s": round(first, 3),
        "all_adopted_s": round(all_adopted, 3),
        "disk_open_s": disk_open_s(log),
        **at_ready,
        **found,
    }


def proc_costs(pid: int) -> dict[str, Any]:
    """What the daemon spent up to now: CPU seconds, read syscalls, bytes read (from the
    page cache or the drive) and its RSS. Unlike wall time on a shared machine, these do
    not depend on what else runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return {
        "cpu_s": round((int(fields[11]) + int(fields[12])) / ticks, 2),
        "read_syscalls": int(io["syscr"]),
        "read_mib": round(int(io["rchar"]) / 2**20, 1),
        "rss_mib": round(rss / 1024, 1),
    }


def disk_open_s(log: Path) -> float | None:
    """Seconds between the CPU tier's and the disk tier's "tier opened" lines: opening
    the slab, recovering its index and adopting its blocks (the part that can grow)."""
    opened: dict[str, datetime] = {}
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("event") == "tier opened":
                opened[rec["tier"]] = datetime.fromisoformat(rec["timestamp"])
    if {"cpu", "disk"} <= opened.keys():
        return round((opened["disk"] - opened["cpu"]).total_seconds(), 3)
    return None


def run_restarts(work: Path, blocks: int) -> dict[str, Any]:
    """A start over a tier of 100 blocks (what every start costs: imports, the CPU pool),
    then fill and: clean start (stopped by SIGKILL under load), crash start, clean start."""
    base = work / "base"
    base.mkdir(parents=True, exist_ok=True)
    asyncio.run(fill(base, 100))
    out: dict[str, Any] = {"blocks": blocks}
    out["empty_tier"] = restart(base, daemon_yaml(base, 100), 100, 9, "term")
    shutil.rmtree(base)
    config = daemon_yaml(work, blocks)
    out["fill_s"] = round(asyncio.run(fill(work, blocks)), 1)
    out["after_clean_close"] = restart(work, config, blocks, 0, "kill")
    out["after_sigkill"] = restart(work, config, blocks, 1, "term")
    out["after_sigterm"] = restart(work, config, blocks, 2, "term")
    return out
