"""A big pool ready in seconds: the daemon's pool allocated and mapped, every page, against
a plain memset of the same size; one run.

    scripts/bench pool_start [--gib 4] [--runs 5] [--json]

Each round, one after the other (each freed before the next):

- ``pool``: ``CpuStore(memfd=True, pin=False)`` opened, as the daemon opens its pool:
  every page allocated and mapped by :func:`tierd.prefault.populate` (64 MiB steps, one
  thread per CPU, at most 16);
- ``chunked``: what the daemon did before, a memfd allocated a GiB at a time by one thread
  (``posix_fallocate``) then mapped with ``MAP_POPULATE``;
- ``memset``: an anonymous private mapping of the same size, every byte set by one
  ``memset`` (its pages faulted in as it goes): the baseline.

GiB/s of each and its ratio to ``memset`` (goal for ``pool``: at least 0.8x), medians of
``--runs`` rounds. The page-locking a GPU adds (``cudaHostRegister``) is not here: it
needs a GPU (``scripts/gpu_probe``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import os
import sys
import time
from typing import Any

from bench.figures import median_of

BLOCK = 2 << 20  # 2 MiB blocks: the stride is the block


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="the pool's size (GiB)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.runs < 1:
        parser.error("--gib must be positive and --runs at least 1")
    return args


async def pool(size: int) -> float:
    from tierd.stores.cpu import CpuStore

    store = CpuStore(num_blocks=size // BLOCK, block_bytes=BLOCK, memfd=True, pin=False)
    started = time.perf_counter()
    await store.open()
    took = time.perf_counter() - started
    await store.close()
    return took


def chunked(size: int) -> float:
    started = time.perf_counter()
    fd = os.memfd_create("bench-chunked", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        for offset in range(0, size, 1 << 30):
            os.posix_fallocate(fd, offset, min(1 << 30, size - offset))
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        took = time.perf_counter() - started
        mapping.close()
    finally:
        os.close(fd)
    return took


def memset(size: int) -> float:
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(mapping)
    started = time.perf_counter()
    ctypes.memset(ctypes.addressof(anchor), 1, size)
    took = time.perf_counter() - started
    del anchor
    mapping.close()
    return took


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = int(args.gib * (1 << 30)) // BLOCK * BLOCK
    samples: dict[str, list[float]] = {"pool": [], "chunked": [], "memset": []}
    for run in range(args.runs):
        print(f"bench pool_start: round {run}", file=sys.stderr, flush=True)
        samples["memset"].append(memset(size))
        samples["pool"].append(asyncio.run(pool(size)))
        samples["chunked"].append(chunked(size))
    gib = size / (1 << 30)
    base = median_of(samples["memset"])
    result: dict[str, Any] = {"gib": gib, "cpus": os.cpu_count(), "runs": args.runs}
    for name, times in samples.items():
        seconds = median_of(times)
        result[name] = {
            "median_s": round(seconds, 3),
            "gib_per_s": round(gib / seconds, 2),
            "runs_s": [round(t, 3) for t in times],
            "ratio_to_memset": round(base / seconds, 3),  # speed, as GiB/s: higher is faster
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{gib:.1f} GiB, {result['cpus']} CPUs, medians of {args.runs} rounds")
        for name in samples:
            row = result[name]
            print(
                f"  {name:<8} {row['median_s']:7.3f} s  {row['gib_per_s']:6.2f} GiB/s"
                f"  {row['ratio_to_memset']:5.2f}x memset's speed  runs {row['runs_s']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
