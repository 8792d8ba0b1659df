#!/usr/bin/env python
"""I/O benchmark: the TransferEngine's routes against raw baselines on the same bytes.

For 2 MiB and 256 KiB blocks, in one run:

(a) CPU <-> MEMORY through the engine vs a plain per-block memoryview copy;
(b) CPU -> DISK and DISK -> CPU through the engine and the DiskStore vs a raw loop of
    ``os.pwrite`` / ``os.pread`` on the same file system, same block size, same O_DIRECT
    setting (the DiskStore's probe result) and the same number of I/Os in flight;
(c) CPU <-> GPU vs a raw pinned ``tensor.copy_(non_blocking=True)`` per block, when CUDA
    is available;
(d) CPU -> DISK through the engine in each durability mode of the disk tier (``fsync``:
    ``always``, ``batch``, ``none``), against ``none`` in the same run, with the syncs
    each made (``--fsync-only`` runs this part alone).

Each figure is the median of several repetitions in GB/s (10**9 bytes per second); the
ratio is engine / baseline (target >= 0.8). The markdown fragment goes to
docs/bench/io.md (``--out``). A benchmark, not a test: ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import random
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from bench.figures import median_of, ratio, side_by_side_async
from bench.fragment import default_out, write_fragment
from tierd.keys import BlockKey, int_key
from tierd.stores.base import BlockStore
from tierd.stores.cpu import CpuStore
from tierd.stores.disk.io import FileIO
from tierd.stores.disk.store import DiskStore
from tierd.stores.gpu import GpuStore
from tierd.stores.memory import MemoryStore
from tierd.transfer import TransferEngine

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SIZES = (2 * MiB, 256 * 1024)


@dataclass(frozen=True, slots=True)
class Row:
    case: str
    block_bytes: int
    engine_gbps: float
    base_gbps: float

    note: str = ""

    @property
    def ratio(self) -> float:
        return ratio(self.engine_gbps, self.base_gbps)


@dataclass(frozen=True, slots=True)
class Plan:
    volume: int  # bytes per repetition
    reps: int
    directory: Path


# -- timing ------------------------------------------------------------------------------


async def _medians(nbytes: int, reps: int, *fns: Callable[[], Awaitable[object]]) -> list[float]:
    """Median GB/s of each of ``fns`` over ``reps`` timed runs after one warm-up run each,
    interleaved side by side (:func:`bench.figures.side_by_side_async`)."""
    figures = await side_by_side_async(reps, *fns)
    return [median_of([nbytes / t / 1e9 for t in f.runs]) for f in figures]


def _keys(n: int) -> list[BlockKey]:
    return [int_key(i) for i in range(n)]


def _fill_random(store: BlockStore, n: int) -> None:
    # CpuStore/MemoryStore expose their pool; random bytes so checksums do real work.
    pool = store.pool_tensor()[:n]  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(n)
    pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=gen))


# -- (a) cpu <-> memory ------------------------------------------------------------------


async def bench_cpu_memory(plan: Plan, engine: TransferEngine, bb: int) -> list[Row]:
    """Engine vs the stronger of two plain copies of the same bytes: one torch ``copy_``
    of the whole region, and a per-block memoryview loop (both on the calling thread)."""
    n = plan.volume // bb
    keys, slots = _keys(n), list(range(n))
    rows = []
    async with (
        CpuStore(num_blocks=n, block_bytes=bb) as cpu,
        MemoryStore(num_blocks=n, block_bytes=bb) as mem,
    ):
        _fill_random(cpu, n)
        for src, dst in ((cpu, mem), (mem, cpu)):
            s_views, d_views = [src.view(i) for i in slots], [dst.view(i) for i in slots]
            s_pool, d_pool = src.pool_tensor()[:n, :bb], dst.pool_tensor()[:n, :bb]

            async def via_engine(a: BlockStore = src, b: BlockStore = dst) -> object:
                return await engine.copy(a, slots, b, slots, keys)

            async def torch_copy(a: torch.Tensor = s_pool, b: torch.Tensor = d_pool) -> None:
                b.copy_(a)

            async def views_copy(a: list[Any] = s_views, b: list[Any] = d_views) -> None:
                for x, y in zip(a, b, strict=True):
                    y[:] = x

            eng, base_t, base_v = await _medians(
                n * bb, plan.reps, via_engine, torch_copy, views_copy
            )
            name = f"{src.medium.lower()} -> {dst.medium.lower()}"
            note = f"torch copy_ {base_t:.2f}, memoryview loop {base_v:.2f}"
            rows.append(Row(name, bb, eng, max(base_t, base_v), note))
    return rows


# -- (b) disk ----------------------------------------------------------------------------


def _preallocate(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _raw_io(path: str, o_direct: bool, bufs: list[Any], threads: int, write: bool) -> None:
    """The raw baseline: one pwrite/pread per block, ``threads`` I/Os in flight."""
    flags = os.O_RDWR | (os.O_DIRECT if o_direct else 0)
    fd = os.open(path, flags)
    bb = len(bufs[0])
    try:

        def run(part: range) -> None:
            for i in part:
                done = os.pwrite(fd, bufs[i], i * bb) if write else os.preadv(fd, [bufs[i]], i * bb)
                if done != bb:
                    raise OSError(f"short {'write' if write else 'read'}: {done} of {bb}")

        with ThreadPoolExecutor(threads) as pool:
            # Interleaved shares: thread t does blocks t, t + threads, ...
            parts = [range(t, len(bufs), threads) for t in range(threads)]
            for future in [pool.submit(run, part) for part in parts]:
                future.result()
    finally:
        os.close(fd)


async def bench_disk(
    plan: Plan, engine: TransferEngine, bb: int
) -> tuple[list[Row], dict[str, Any]]:
    n = plan.volume // bb
    keys, slots = _keys(n), list(range(n))
    threads = {"write": 2, "read": 4}  # DiskStore defaults: write_threads, read_threads
    where = Path(tempfile.mkdtemp(prefix=f"disk-{bb}-", dir=plan.directory))
    disk = DiskStore(
        num_blocks=n,
        block_bytes=bb,
        directories=[where],
        fsync="none",
        write_threads=threads["write"],
        read_threads=threads["read"],
    )
    async with CpuStore(num_blocks=n, block_bytes=bb) as cpu, disk:
        _fill_random(cpu, n)
        details = disk.stats().details
        o_direct = bool(details["o_direct"])
        raw_path = str(where / "raw.bin")
        _preallocate(raw_path, n * bb)
        bufs = [cpu.view(i) for i in slots]
        loop = asyncio.get_running_loop()

        async def eng_write() -> object:
            return await engine.copy(cpu, slots, disk, slots, keys)

        async def eng_read() -> object:
            return await engine.copy(disk, slots, cpu, slots, keys)

        async def raw(write: bool) -> None:
            t = threads["write" if write else "read"]
            await loop.run_in_executor(None, _raw_io, raw_path, o_direct, bufs, t, write)

        w_eng, w_raw = await _medians(n * bb, plan.reps, eng_write, lambda: raw(True))
        r_eng, r_raw = await _medians(n * bb, plan.reps, eng_read, lambda: raw(False))
        rows = [
            Row("cpu -> disk", bb, w_eng, w_raw, f"{threads['write']} threads, pwrite"),
            Row("disk -> cpu", bb, r_eng, r_raw, f"{threads['read']} threads, pread"),
        ]
    shutil.rmtree(where, ignore_errors=True)
    return rows, {"o_direct": o_direct, "reason": details.get("reason", "")}


# -- (d) durability modes ----------------------------------------------------------------

FSYNC_MODES = ("always", "batch", "none")


class _SyncCount(FileIO):
    """Counts the fsync and fdatasync calls a store makes."""

    def __init__(self) -> None:
        self.syncs = 0

    def fsync(self, fd: int) -> None:
        self.syncs += 1
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        super().fdatasync(fd)


async def bench_fsync(
    plan: Plan, engine: TransferEngine, bb: int
) -> tuple[list[Row], dict[str, Any]]:
    """Store throughput (cpu -> disk through the engine) in each ``fsync`` mode, the runs
    interleaved; the baseline is ``none`` of the same run."""
    n = plan.volume // bb
    keys, slots = _keys(n), list(range(n))
    where = Path(tempfile.mkdtemp(prefix=f"fsync-{bb}-", dir=plan.directory))
    counts = {mode: _SyncCount() for mode in FSYNC_MODES}
    disks = {
        mode: DiskStore(
            num_blocks=n,
            block_bytes=bb,
            directories=[where / mode],
            fsync=mode,
            fileio=counts[mode],
        )
        for mode in FSYNC_MODES
    }
    for mode in FSYNC_MODES:
        (where / mode).mkdir()
    try:
        async with CpuStore(num_blocks=n, block_bytes=bb) as cpu:
            _fill_random(cpu, n)
            for disk in disks.values():
                await disk.open()
            opened = {mode: c.syncs for mode, c in counts.items()}
            details = disks["none"].stats().details

            def write(disk: DiskStore) -> Callable[[], Awaitable[object]]:
                return lambda: engine.copy(cpu, slots, disk, slots, keys)

            rates = await _medians(n * bb, plan.reps, *(write(disks[m]) for m in FSYNC_MODES))
            runs = plan.reps + 1  # the warm-up too
            syncs = {m: (counts[m].syncs - opened[m]) / runs for m in FSYNC_MODES}
    finally:
        for disk in disks.values():
            if disk.is_open:
                await disk.close()
        shutil.rmtree(where, ignore_errors=True)
    base = rates[FSYNC_MODES.index("none")]
    facts = {"o_direct": details["o_direct"], "reason": details.get("reason", "")}
    return [
        Row(
            f"cpu -> disk, fsync: {mode}",
            bb,
            rate,
            base,
            f"vs fsync: none; {syncs[mode]:.0f} syncs per {plan.volume // MiB} MiB",
        )
        for mode, rate in zip(FSYNC_MODES, rates, strict=True)
    ], facts


# -- (c) gpu -----------------------------------------------------------------------------


async def bench_gpu(plan: Plan, engine: TransferEngine, bb: int) -> list[Row]:
    """Engine vs per-block ``copy_(non_blocking=True)`` between the same pinned pool and
    GPU rows, one synchronize at the end; consecutive and scattered slots."""
    n = plan.volume // bb
    keys, slots = _keys(n), list(range(n))
    scattered = random.Random(0).sample(slots, n)
    rows = []
    async with (
        CpuStore(num_blocks=n, block_bytes=bb) as cpu,
        GpuStore(num_blocks=n, block_bytes=bb, device="cuda") as gpu,
    ):
        _fill_random(cpu, n)
        host, dev = cpu.pool_tensor()[:n, :bb], gpu.pool_tensor()
        for label, order in (("consecutive", slots), ("scattered", scattered)):
            for src, dst in ((cpu, gpu), (gpu, cpu)):
                to_gpu = dst is gpu

                async def via_engine(
                    a: BlockStore = src, b: BlockStore = dst, o: list[int] = order
                ) -> object:
                    return await engine.copy(a, o, b, o, keys)

                async def raw(to_gpu: bool = to_gpu, o: list[int] = order) -> None:
                    for i in o:
                        if to_gpu:
                            dev[i].copy_(host[i], non_blocking=True)
                        else:
                            host[i].copy_(dev[i], non_blocking=True)
                    torch.cuda.synchronize()

                name = f"{src.medium.lower()} -> {dst.medium.lower()} ({label})"
                eng, base = await _medians(n * bb, plan.reps, via_engine, raw)
                rows.append(Row(name, bb, eng, base, f"pinned: {cpu.pinned}"))
    return rows


# -- report ------------------------------------------------------------------------------


def _fs_type(path: Path) -> str:
    real, best, fstype = str(path.resolve()), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, fstype = mount, parts[2]
    return fstype


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _markdown(rows: list[Row], machine: dict[str, str], plan: Plan, gpu_note: str) -> str:
    lines = [
        "## I/O: transfer engine vs raw baselines (`scripts/bench io`)",
        "",
        "Machine: " + ", ".join(f"{k}: {v}" for k, v in machine.items()) + ".",
        f"{plan.volume // MiB} MiB per repetition, median of {plan.reps} repetitions after a "
        "warm-up; GB/s = 10^9 bytes/s; ratio = engine / baseline (target >= 0.8). Engine and "
        "baseline runs interleave, so drift on a shared machine hits both; on a shared VM the "
        "absolute figures still vary by tens of percent from run to run.",
        "",
        "| case | block | engine GB/s | baseline GB/s | ratio | baseline notes |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        kib = r.block_bytes >> 10
        size = f"{kib >> 10} MiB" if kib >= 1024 else f"{kib} KiB"
        lines.append(
            f"| {r.case} | {size} | {r.engine_gbps:.2f} | {r.base_gbps:.2f} | "
            f"{r.ratio:.2f} | {r.note} |"
        )
    lines += ["", gpu_note, ""]
    return "\n".join(lines)


PARTS = ("memory", "disk", "gpu", "fsync")


async def main_async(args: argparse.Namespace) -> int:
    plan = Plan(
        volume=(64 if args.quick else args.mib) * MiB,
        reps=3 if args.quick else args.reps,
        directory=args.dir,
    )
    # The stores log at debug level (e.g. views outliving a pool); keep the report clean.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parts = {"fsync"} if args.fsync_only else set(args.parts)
    has_gpu = torch.cuda.is_available() and "gpu" in parts
    rows: list[Row] = []
    disk_facts: dict[str, Any] = {}
    async with TransferEngine() as engine:
        for bb in [kib << 10 for kib in args.block_kib]:
            if "memory" in parts:
                rows += await bench_cpu_memory(plan, engine, bb)
            if "disk" in parts:
                disk_rows, disk_facts = await bench_disk(plan, engine, bb)
                rows += disk_rows
            if "fsync" in parts:
                fsync_rows, fsync_facts = await bench_fsync(plan, engine, bb)
                rows += fsync_rows
                disk_facts = disk_facts or fsync_facts
            if has_gpu:
                rows += await bench_gpu(plan, engine, bb)
    if has_gpu:
        gpu_note = f"GPU: {torch.cuda.get_device_name()}."
    elif "gpu" not in parts:
        gpu_note = "GPU: (c) gpu <-> cpu was not asked for (--parts)."
    else:
        gpu_note = "GPU: no CUDA device was present, so (c) gpu <-> cpu was not measured."
    machine = {
        "CPU": _cpu_model(),
        "cores": str(os.cpu_count()),
        "disk dir file system": _fs_type(plan.directory),
        "O_DIRECT": f"{disk_facts.get('o_direct')} ({disk_facts.get('reason')})",
        "DiskStore fsync": "none in (b), as the raw loop does not fsync either (the"
        " daemon runs it with `fsync: none`); (d) compares the modes",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    text = _markdown(rows, machine, plan, gpu_note)
    write_fragment(text, args.out or None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repetitions")
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per repetition")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk files go")
    parser.add_argument("--out", type=Path, default=default_out("io"))
    parser.add_argument("--fsync-only", action="store_true", help="only (d): the fsync modes")
    parser.add_argument(
        "--block-kib",
        type=int,
        nargs="+",
        default=[size >> 10 for size in SIZES],
        help="block sizes in KiB (default: 2048 256)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which parts to run: memory (a), disk (b), gpu (c), fsync (d); all by default",
    )
    args = parser.parse_args(argv)
    made = args.dir is None
    if made:  # a temp dir under the project: a real file system, not /dev/shm
        args.dir = Path(tempfile.mkdtemp(prefix=".bench-io-", dir=ROOT))
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(main_async(args))
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
