"""The growth parts of ``scripts/bench scale``: how each cost grows with its size.

- ``disk``: a disk tier's index at N blocks, measured in a fresh process per size: memory
  per block (RSS growth), clean open and crash open (CPU seconds, index recovery plus
  adopting the blocks into the tier), lookup and store cost per block. The index is
  synthetic: N entries checkpointed by the store's own code over a preallocated slab whose
  data pages were never written (reads of them would miss). It measures the index, which
  is all a restart touches; ``restart`` measures real blocks.
- ``keys``: one daemon, lookups of 1 to 4096 keys: microseconds per request and per key.
- ``clients``: 1 to 64 connections acting like engines (per step: a lookup of 32 keys, a
  ``get`` of 2 blocks, a ``put`` of 2 new blocks): steps per second, p50/p99 step latency,
  daemon CPU per request.
- ``pool``: a daemon with a CPU pool of 256 MiB to a few GiB: READY time, RSS at READY,
  and first touch: the time to store 64 MiB into the fresh pool and the RSS after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.figures import median_of
from bench.scale_restart import START_TIMEOUT_S, proc_costs
from tierd.client import Client
from tierd.testing import DaemonProcess, start_daemon

BB = 4096
NS = "bench-scale"

# -- disk -----------------------------------------------------------------------------

_CHILD = r"""
import asyncio, json, os, random, signal, sys, time
from tierd.keys import Medium, int_key
from tierd.library import restore_tier
from tierd.stores.disk.store import DiskStore
from tierd.tier import Tier

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

mode, directory, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def store():
    return DiskStore(num_blocks=n, block_bytes=4096, directories=[directory], o_direct=False)

async def main():
    st = store()
    if mode == "make":  # a clean snapshot of n entries, through the store's own close
        await st.open()
        slab = st._slabs[0]
        slab.entries.update((i, (int_key(i) * 4, i + 1)) for i in range(n))
        slab.next_gen = n + 1
        await st.close()
        return {}
    if mode == "crash":  # open, write through the journal, die without closing
        await st.open()
        ids = range(n - 64, n)
        await st.write(list(ids), [int_key(i) * 4 for i in ids], [bytes(4096)] * 64)
        await st.sync()
        print("{}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    r0, c0, t0 = rss(), time.process_time(), time.perf_counter()
    await st.open()
    tier = Tier(n, "lru", name="disk", medium=Medium.DISK)
    adopted = len(restore_tier(tier, st))
    out = {"open_cpu_s": time.process_time() - c0, "open_wall_s": time.perf_counter() - t0,
           "bytes_per_block": (rss() - r0) / max(1, adopted), "blocks": adopted,
           "recovery": st.stats().details["recovery"][0]}
    keys = [int_key(i) * 4 for i in random.Random(1).sample(range(n - 64), min(n - 64, 20000))]
    c = time.process_time()
    for i in range(0, len(keys), 1024):
        tier.lookup(keys[i:i + 1024][:1])  # one key: the cost of a lookup that hits
        tier.lookup(keys[i:i + 1024])
    out["lookup_us_per_key"] = (time.process_time() - c) / len(keys) * 1e6
    c = time.process_time()
    for i in range(0, 4096, 512):
        await st.write(list(range(i, i + 512)),
                       [b"w" * 8 + int_key(n + i + j) for j in range(512)], [bytes(4096)] * 512)
    out["store_us_per_block"] = (time.process_time() - c) / 4096 * 1e6
    await st.close()
    return out

print(json.dumps(asyncio.run(main())), flush=True)
"""


def _child(mode: str, directory: Path, n: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(directory), str(n)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if mode != "crash" and proc.returncode != 0:
        raise RuntimeError(f"{mode} {n}: {proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1])) if lines else {}


def disk_growth(work: Path, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        directory = work / f"disk-{n}"
        directory.mkdir(parents=True, mode=0o700)
        _child("make", directory, n)
        clean = _child("open", directory, n)
        _child("crash", directory, n)
        crash = _child("open", directory, n)
        rows.append({"blocks": n, "clean": clean, "crash": crash})
        print(json.dumps(rows[-1]), flush=True)
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()
    return rows


# -- daemons --------------------------------------------------------------------------


def _yaml(work: Path, cpu: str) -> Path:
    path = work / "tierd.yaml"
    path.write_text(
        f"""block_bytes: {BB}
tiers: [{{name: cpu, kind: cpu, capacity: {cpu}, policy: lru}}]
socket: {{path: {work / "t.sock"}}}
limits: {{max_keys_per_request: 4096}}
logging: {{level: warning, format: json}}
shutdown: {{grace: 10s, write_back: none}}
"""
    )
    return path


def _start(work: Path, config: Path, run: int) -> DaemonProcess:
    """``tierd serve`` of ``config``, once it sent READY=1; its log in ``work``."""
    return start_daemon(config, log=work / f"daemon-{run}.log", timeout_s=START_TIMEOUT_S)


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


async def _keys_per_lookup(sock: Path, counts: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    async with await Client.connect(sock, namespace=NS, block_bytes=BB) as c:
        await c.put([_key(i) for i in range(4096)], [bytes(BB)] * 4096)
        for k in counts:
            keys = [_key(i) for i in range(k)]
            lats = []
            for _ in range(reps):
                t = time.perf_counter()
                found = await c.lookup(keys)
                lats.append(time.perf_counter() - t)
            if found.count != k:
                raise RuntimeError(f"lookup of {k} found {found.count}")
            p50 = median_of(lats) * 1e6
            rows.append({"keys": k, "p50_us": round(p50, 1), "us_per_key": round(p50 / k, 2)})
    return rows


def keys_growth(work: Path, counts: list[int], reps: int = 200) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    started = _start(work, _yaml(work, "64MiB"), 0)
    try:
        return asyncio.run(_keys_per_lookup(work / "t.sock", counts, reps))
    finally:
        started.stop()


async def _engine(sock: Path, who: int, steps: int, lats: list[float]) -> int:
    rng = random.Random(who)
    async with await Client.connect(sock, namespace=NS, block_bytes=BB) as c:
        base = 1_000_000 * (who + 1)
        for step in range(steps):
            t = time.perf_counter()
            await c.lookup([_key(rng.randrange(4096)) for _ in range(32)])
            await c.get([_key(rng.randrange(4096)) for _ in range(2)])
            await c.put([_key(base + 2 * step), _key(base + 2 * step + 1)], [bytes(BB)] * 2)
            lats.append(time.perf_counter() - t)
    return steps * 3


async def _clients(sock: Path, n: int, steps: int) -> tuple[float, list[float], int]:
    lats: list[float] = []
    t = time.perf_counter()
    done = await asyncio.gather(*(_engine(sock, i, steps, lats) for i in range(n)))
    return time.perf_counter() - t, lats, sum(done)


def clients_growth(work: Path, counts: list[int], requests: int = 3000) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    started = _start(work, _yaml(work, "256MiB"), 1)
    sock = work / "t.sock"
    rows = []
    try:
        asyncio.run(_keys_per_lookup(sock, [1], 1))  # stores the 4096 looked-up blocks
        for n in counts:
            steps = max(5, requests // 3 // n)
            before = proc_costs(started.pid)["cpu_s"]
            wall, lats, reqs = asyncio.run(_clients(sock, n, steps))
            cpu = proc_costs(started.pid)["cpu_s"] - before
            lats.sort()
            rows.append(
                {
                    "clients": n,
                    "steps_per_s": round(len(lats) / wall, 1),
                    "p50_ms": round(lats[len(lats) // 2] * 1e3, 2),
                    "p99_ms": round(lats[int(len(lats) * 0.99)] * 1e3, 2),
                    "daemon_cpu_us_per_request": round(cpu / reqs * 1e6, 1),
                    "daemon_cpu_share": round(cpu / wall, 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        started.stop()
    return rows


async def _touch(sock: Path, blocks: int) -> float:
    """Seconds to store ``blocks`` new blocks into a fresh pool (pages touched first)."""
    async with await Client.connect(sock, namespace=NS, block_bytes=BB) as c:
        t = time.perf_counter()
        for i in range(0, blocks, 1024):
            ids = range(i, min(blocks, i + 1024))
            await c.put([_key(j) for j in ids], [bytes(BB)] * len(ids))
        return time.perf_counter() - t


def pool_growth(work: Path, sizes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for run, size in enumerate(sizes):
        where = work / f"pool-{run}"
        where.mkdir(parents=True)
        started = _start(where, _yaml(where, size), 10 + run)
        try:
            costs = proc_costs(started.pid)
            first = asyncio.run(_touch(where / "t.sock", 16384))  # 64 MiB
            after = proc_costs(started.pid)
        finally:
            started.stop()
        rows.append(
            {
                "pool": size,
                "ready_s": round(started.ready_s or 0.0, 2),
                "rss_at_ready_mib": costs["rss_mib"],
                "cpu_to_ready_s": costs["cpu_s"],
                "store_first_64mib_s": round(first, 3),
                "rss_after_64mib": after["rss_mib"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def environment() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]}
