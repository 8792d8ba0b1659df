#!/usr/bin/env python
"""Chain benchmark: demotion and promotion throughput against the raw stores, same run.

A CPU tier over a disk tier (a directory on the project's file system, not /dev/shm):

- store under eviction pressure: every store into the full CPU tier demotes as many dirty
  blocks to disk; baseline: ``DiskStore.write`` of the same number of blocks straight from
  CPU-pool views (the disk write is the work a demotion cannot avoid);
- promotion: ``chain.load`` of blocks held only on disk; baseline: ``DiskStore.read`` of
  the same blocks straight into CPU-pool views;
- latency from a lookup hit on disk to the block being readable in the CPU tier: one
  ``lookup`` + ``load`` of a single block (median and p99).

Throughput is the median of several repetitions in GB/s (10**9 bytes per second); ratios
are chain / baseline (target >= 0.7). The markdown fragment goes to docs/bench/chain.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

import tierd
from bench.figures import median_of
from bench.fragment import default_out, write_fragment
from tierd.chain import TierChain
from tierd.keys import BlockKey, int_key
from tierd.stores.cpu import CpuStore
from tierd.stores.disk.store import DiskStore

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def chain_config(directory: Path, block_bytes: int, cpu_blocks: int, disk_blocks: int) -> Any:
    return {
        "block_bytes": block_bytes,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": cpu_blocks},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": disk_blocks,
                "directories": [str(directory)],
            },
        ],
    }


async def raw_disk(
    directory: Path, block_bytes: int, blocks: int, batch: int
) -> tuple[float, float]:
    """GB/s of DiskStore.write then .read, batch blocks per call, from/into CPU views."""
    keys = [int_key(i) for i in range(blocks)]
    async with (
        CpuStore(num_blocks=batch, block_bytes=block_bytes) as cpu,
        DiskStore(num_blocks=blocks, block_bytes=block_bytes, directories=[str(directory)]) as disk,
    ):
        views = [cpu.view(s) for s in range(batch)]
        for view in views:
            view[:] = os.urandom(64) * (block_bytes // 64)
        started = time.perf_counter()
        for i in range(0, blocks, batch):
            ok = await disk.write(list(range(i, i + batch)), keys[i : i + batch], views)
            assert all(ok)
        wrote = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(0, blocks, batch):
            ok = await disk.read(list(range(i, i + batch)), keys[i : i + batch], views)
            assert all(ok)
        read = time.perf_counter() - started
    total = blocks * block_bytes / 1e9
    return total / wrote, total / read


async def chain_run(
    directory: Path, block_bytes: int, blocks: int, batch: int, probes: int
) -> tuple[float, float, list[float]]:
    """GB/s of stores under pressure and of promotions; lookup->readable latencies (s)."""
    cpu_blocks = batch
    filler = [os.urandom(64) * (block_bytes // 64) for _ in range(batch)]
    keys = [int_key(i) for i in range(blocks + batch)]
    config = chain_config(directory, block_bytes, cpu_blocks, blocks + batch)
    async with tierd.open(config) as chain:
        await chain.store(keys[:batch], filler)  # fill the CPU tier
        started = time.perf_counter()
        for i in range(batch, blocks + batch, batch):
            await chain.store(keys[i : i + batch], filler)  # each evicts + demotes `batch`
        stored = time.perf_counter() - started
        demoted = chain.levels[0].demotions
        chain.clear(0)
        started = time.perf_counter()
        for i in range(0, blocks, batch):
            async with chain.loading(keys[i : i + batch]) as handle:
                assert len(handle.keys) == batch
        promoted = time.perf_counter() - started
        latencies = await _latencies(chain, keys[:probes])
    gb = blocks * block_bytes / 1e9
    assert demoted >= blocks, f"only {demoted} of {blocks} blocks were demoted"
    return gb / stored, gb / promoted, latencies


async def _latencies(chain: TierChain, keys: list[BlockKey]) -> list[float]:
    out = []
    for key in keys:
        chain.clear(0)
        started = time.perf_counter()
        found = chain.lookup([key])
        assert found.media == (tierd.Medium.DISK,)
        async with chain.loading([key]):
            out.append(time.perf_counter() - started)
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def measure(args: argparse.Namespace, block_bytes: int) -> dict[str, Any]:
    blocks = max(args.batch, (args.mib * MiB) // block_bytes) // args.batch * args.batch
    rows: dict[str, list[float]] = {k: [] for k in ("raw_w", "raw_r", "store", "promote")}
    latencies: list[float] = []
    for _ in range(args.repeat):
        for which in ("raw", "chain"):
            directory = Path(tempfile.mkdtemp(prefix=f"bench-{which}-", dir=args.dir))
            try:
                if which == "raw":
                    w, r = await raw_disk(directory, block_bytes, blocks, args.batch)
                    rows["raw_w"].append(w)
                    rows["raw_r"].append(r)
                else:
                    s, p, lat = await chain_run(
                        directory, block_bytes, blocks, args.batch, min(50, blocks)
                    )
                    rows["store"].append(s)
                    rows["promote"].append(p)
                    latencies.extend(lat)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    med = {k: median_of(v) for k, v in rows.items()}
    return {
        "block_bytes": block_bytes,
        "blocks": blocks,
        **med,
        "lat_p50_ms": median_of(latencies) * 1e3,
        "lat_p99_ms": p99(latencies) * 1e3,
    }


def machine(directory: str) -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")]
    mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
    best = max((m for m in mounts if directory.startswith(m[1])), key=lambda m: len(m[1]))
    cpu = models[0] if models else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, dir on {best[2]}"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "## Chain: demotion and promotion vs the raw disk store (scripts/bench chain)",
        "",
        f"Machine: {machine(args.dir)}.",
        f"Medians of {args.repeat} runs, {args.batch} blocks per call.",
        "",
        "| block | blocks | raw write GB/s | store+demote GB/s | ratio | raw read GB/s "
        "| promote GB/s | ratio | disk hit -> readable p50 / p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['block_bytes'] // 1024} KiB | {r['blocks']} | {r['raw_w']:.2f}"
            f" | {r['store']:.2f} | {r['store'] / r['raw_w']:.2f} | {r['raw_r']:.2f}"
            f" | {r['promote']:.2f} | {r['promote'] / r['raw_r']:.2f}"
            f" | {r['lat_p50_ms']:.2f} / {r['lat_p99_ms']:.2f} ms |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(ROOT / ".bench"), help="where the disk files go")
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per case and run")
    parser.add_argument("--batch", type=int, default=16, help="blocks per store/load call")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", default=str(default_out("chain")))
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.repeat = 32, 1
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = [asyncio.run(measure(args, size)) for size in (2 * MiB, 256 * 1024)]
    text = report(results, args)
    write_fragment(text, None if args.quick else args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
