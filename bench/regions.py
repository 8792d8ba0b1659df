"""Engine host regions against the lease path: one job of 32 blocks of 128 KiB.

A real ``tierd serve`` (a CPU tier only) in its own process, one client in this one. The
engine's KV memory is a memfd of rows; a job stores or loads 32 rows:

- **regions**: ``region_store`` / ``region_load`` of (key, offset) descriptors; the daemon
  copies between the memfd and its pool with ``preadv``/``pwritev`` in its own threads;
- **leases**: ``Client.storing`` / ``Client.loading``, the way SGLang's loads take
  (``tierd.integrations.core.route``): a lease per job, and this process copies each row into
  or out of the mapped pool slots.

With ``--busy``, a thread of this process runs Python without pause meanwhile, as an
engine's scheduler loop does: every step the client takes must then win the GIL from it
(``sys.getswitchinterval()``, 5 ms by default), which is what the regions are for.

Each round stores 32 fresh keys with each path, then loads 32 stored keys with each path
(alternating which path goes first); figures are medians over the rounds, per path, of
the time one job takes in the client (``time.perf_counter`` around the awaited call) and
of the CPU time this process's thread spent on it (``time.thread_time``: the work that,
in an engine, holds its GIL). Prints a Markdown table.

    scripts/bench regions [--busy] [--rounds 30] [--blocks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.figures import median_of

if TYPE_CHECKING:
    from tierd.testing import DaemonProcess


def start_daemon(workdir: Path, block_bytes: int, capacity: int) -> DaemonProcess:
    """``tierd serve`` of one CPU tier, its config and log in ``workdir``, once ready."""
    from tierd.testing import start_daemon as serve

    config = {
        "block_bytes": block_bytes,
        "tiers": [{"name": "cpu", "kind": "cpu", "capacity": capacity}],
        "socket": {"path": str(workdir / "tierd.sock")},
        "limits": {"lease_blocks_per_connection": "100%", "lease_blocks_per_tenant": "100%"},
        "logging": {"level": "warning"},
    }
    return serve(config, log=workdir / "tierd.log")


async def measure(socket_path: str, args: argparse.Namespace) -> dict[str, list[float]]:
    from tierd.client import Client

    block = args.block_kib << 10
    n = args.blocks
    fd = os.memfd_create("bench-engine-kv", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * n * block)
    os.pwrite(fd, os.urandom(2 * n * block), 0)
    rows = np.memmap(f"/proc/self/fd/{fd}", dtype=np.uint8, mode="r+").reshape(2 * n, block)
    times: dict[str, list[float]] = {}
    try:
        async with await Client.connect(socket_path, namespace="bench") as client:
            region = await client.register_region(fd, 2 * n * block)
            for r in range(args.rounds + args.warmup):
                took = await one_round(client, region, rows, r, n, block)
                if r >= args.warmup:
                    for name, seconds in took.items():
                        times.setdefault(name, []).append(seconds)
            last = args.rounds + args.warmup - 1  # the newest keys: the tier still holds them
            keys = [f"region-{last}-{i}".encode() for i in range(n)]
            offsets = np.arange(n, 2 * n, dtype=np.uint64).reshape(n, 1) * np.uint64(block)
            done = await client.region_load(region, keys, offsets)
            if not all(done) or os.pread(fd, n * block, n * block) != os.pread(fd, n * block, 0):
                raise RuntimeError("the region round trip is not byte-exact")
    finally:
        del rows
        os.close(fd)
    return times


async def one_round(
    client: Any, region: int, rows: np.ndarray, r: int, n: int, block: int
) -> dict[str, float]:
    """Store 32 fresh keys with each path, then load them back with each (into the
    second half of the rows); which path goes first alternates between rounds."""
    region_keys = [f"region-{r}-{i}".encode() for i in range(n)]
    lease_keys = [f"lease-{r}-{i}".encode() for i in range(n)]
    front = np.arange(n, dtype=np.uint64).reshape(n, 1) * np.uint64(block)
    back = front + np.uint64(n * block)
    jobs: list[dict[str, Callable[[], Awaitable[object]]]] = [
        {
            "region store": lambda: client.region_store(region, region_keys, front),
            "lease store": lambda: lease_store(client, lease_keys, rows[:n]),
        },
        {
            "region load": lambda: client.region_load(region, region_keys, back),
            "lease load": lambda: lease_load(client, lease_keys, rows[n:]),
        },
    ]
    took: dict[str, float] = {}
    for group in jobs:
        for name in list(group) if r % 2 else list(reversed(group)):
            started, cpu = time.perf_counter(), time.thread_time()
            await group[name]()
            took[name] = time.perf_counter() - started
            took[f"{name} cpu"] = time.thread_time() - cpu
    return took


async def lease_store(client: Any, keys: list[bytes], rows: np.ndarray) -> None:
    async with client.storing(keys) as lease:
        for view, i in zip(lease.views(), lease.to_write, strict=True):
            view[:] = rows[i].data


async def lease_load(client: Any, keys: list[bytes], rows: np.ndarray) -> None:
    async with client.loading(keys) as lease:
        for i, view in enumerate(lease.views()):
            rows[i] = np.frombuffer(view, dtype=np.uint8)


def spin(stop: threading.Event) -> None:
    """Pure Python work, holding the GIL but for the interpreter's forced switches."""
    while not stop.is_set():
        total = 0
        for i in range(10_000):
            total += i


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--block-kib", type=int, default=128)
    parser.add_argument("--busy", action="store_true", help="a busy Python thread beside")
    args = parser.parse_args(argv)
    block = args.block_kib << 10
    capacity = 8 * args.blocks  # slots are reused: page faults of a fresh pool are not timed
    with tempfile.TemporaryDirectory(prefix="tierd-bench-", dir="/tmp") as tmp:
        child = start_daemon(Path(tmp), block, capacity)
        stop = threading.Event()
        if args.busy:
            threading.Thread(target=spin, args=(stop,), daemon=True).start()
        try:
            times = asyncio.run(measure(str(Path(tmp) / "tierd.sock"), args))
        finally:
            stop.set()
            child.stop()
    mib = args.blocks * block / (1 << 20)
    beside = "a busy Python thread beside" if args.busy else "nothing else running"
    print(f"{args.blocks} blocks of {args.block_kib} KiB per job, {args.rounds} rounds, {beside}")
    print()
    print("| job | regions: wall | leases: wall | regions: client CPU | leases: client CPU |")
    print("|---|---:|---:|---:|---:|")
    for op in ("store", "load"):
        cells = []
        for kind in ("", " cpu"):
            for path in ("region", "lease"):
                seconds = median_of(times[f"{path} {op}{kind}"])
                rate = f" ({mib / seconds / 1024:.1f} GiB/s)" if not kind else ""
                cells.append(f"{seconds * 1e3:.2f} ms{rate}")
        print(f"| {op} | " + " | ".join(cells) + " |")
    print(f"\nload average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
