#!/usr/bin/env python
"""A bystander beside a neighbour filling a big CPU tier for the first time: what the
tier's own dicts cost the bystander as they grow (a benchmark, not a test; issue 34).

A daemon (``tierd serve`` in a child process) has a CPU tier of ``--capacity`` blocks of
``--block-bytes`` (default 1,000,000 of 1 KiB), no disk. The bystander (this process)
stores 32 blocks, then sends 32-key ``lookup`` round trips, one at a time, while a
neighbour (a second child process) stores ``--total`` blocks of its own, 4,096 a
request: the tier fills (past its capacity it churns, and the bystander's blocks may be
evicted: its lookups are counted as missed, and timed the same). Reported: the
bystander's p50, p99 and max (ms), and each round trip over ``--over`` ms with the
seconds into the run (and about how many blocks the neighbour had stored by then, at its
mean rate).

A dict that outgrows its table is copied whole in the put that overflowed it: as the
tier first fills, its index and its policy's order do so at about 175,000, 350,000 and
700,000 blocks (docs/BENCHMARKS.md). The neighbour's rounds and the run are bounded; the
daemon and the neighbour are stopped by PID. Usage: ``scripts/bench neighbours_fill
[--capacity 1000000] [--total 1000000] [--block-bytes 1024] [--policy lru] [--over 20]
[--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.neighbours_loop import figures
from tierd.client import Client
from tierd.testing import daemon_config, start_daemon_async

BURST = 4096  # blocks of one neighbour store
LIMIT_S = 600.0  # the longest a run goes on


async def neighbour(socket: str, total: int, block_bytes: int) -> int:
    """Store ``total`` blocks of its own, :data:`BURST` a request; how many it stored."""
    stored = 0
    async with await Client.connect(socket, namespace="crowd", block_bytes=block_bytes) as c:
        row = b"\x07" * block_bytes
        print("started", flush=True)
        end = time.monotonic() + LIMIT_S
        while stored < total and time.monotonic() < end:
            names = [b"crowd-%d" % i for i in range(stored, min(total, stored + BURST))]
            await c.store(names, [row] * len(names))
            stored += len(names)
    return stored


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierd-fill-") as name:
        home = Path(name)
        config = daemon_config(
            home, cpu_blocks=args.capacity, disk_blocks=None, block_bytes=args.block_bytes
        )
        config["tiers"][0]["policy"] = args.policy
        proc = await start_daemon_async(config, log=home / "tierd.log")
        child: subprocess.Popen[str] | None = None
        try:
            socket = config["socket"]["path"]
            wanted = [b"mine-%d" % i for i in range(32)]
            bb = args.block_bytes
            async with await Client.connect(socket, namespace="mine", block_bytes=bb) as me:
                await me.store(wanted, [b"\x01" * bb] * len(wanted))
                command = [sys.executable, "-m", "bench.neighbours_fill", "--neighbour"]
                command += ["--socket", socket, "--total", str(args.total)]
                command += ["--block-bytes", str(bb)]
                child = await asyncio.to_thread(
                    subprocess.Popen, command, stdout=subprocess.PIPE, text=True
                )
                if child.stdout is None:
                    raise RuntimeError("no pipe from the neighbour")
                if (await asyncio.to_thread(child.stdout.readline)).strip() != "started":
                    raise RuntimeError("the neighbour did not start")
                began = time.monotonic()
                trips: list[float] = []
                slow: list[tuple[float, float]] = []  # (seconds in, ms)
                missed = 0  # lookups that found fewer than 32 (evicted once the tier churns)
                while child.poll() is None and time.monotonic() - began < LIMIT_S:
                    t0 = time.perf_counter()
                    found = await me.lookup(wanted)
                    trips.append((time.perf_counter() - t0) * 1e3)
                    missed += found.count != len(wanted)
                    if trips[-1] > args.over:
                        slow.append((round(time.monotonic() - began, 1), round(trips[-1], 1)))
                seconds = time.monotonic() - began
                out, _ = await asyncio.to_thread(child.communicate, timeout=60)
                stored = int((out or "0").split()[-1])
            return {
                **figures(trips),
                "seconds": round(seconds, 1),
                "neighbour_blocks": stored,
                "missed": missed,
                "slow": slow,
            }
        finally:
            if child is not None and child.poll() is None:
                child.terminate()
                child.wait(timeout=30)
            proc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--total", type=int, default=1_000_000)
    parser.add_argument("--block-bytes", type=int, default=1024)
    parser.add_argument("--policy", default="lru", help="the CPU tier's policy")
    parser.add_argument("--over", type=float, default=20.0, help="list round trips over this")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.neighbour:
        print(asyncio.run(neighbour(args.socket, args.total, args.block_bytes)))
        return 0
    row = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(
        f"bystander: {row['trips']} lookups in {row['seconds']} s, p50 {row['p50_ms']} ms,"
        f" p99 {row['p99_ms']} ms, max {row['max_ms']} ms; the neighbour stored"
        f" {row['neighbour_blocks']} blocks; lookups that missed: {row['missed']}"
    )
    rate = row["neighbour_blocks"] / max(row["seconds"], 1e-9)
    for at, ms in row["slow"]:  # the neighbour's blocks then, at its mean rate
        print(f"  {at:>6} s (about {round(at * rate, -4):,.0f} blocks stored): {ms} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
