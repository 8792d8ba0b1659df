#!/usr/bin/env python
"""The engines' path to the disk tier, against the same device with O_DIRECT (a benchmark).

A real ``tierd serve`` in a child process: a CPU tier of ``--cpu-mib`` over a disk tier in
``--dir`` (default: a fresh directory under /var/tmp, on the machine's disk). A client
in this process holds its KV memory in a memfd, as an engine with a host region does,
and moves ``--total-mib`` through the daemon with region jobs of ``--job-mib`` each,
``--in-flight`` jobs at once:

- **store**: ``region_store`` of fresh keys (the CPU tier is far smaller than the data,
  so stores demote to disk as they go), then ``flush``: bytes / elapsed;
- **load**: ``region_load`` of every key, in a shuffled job order, into the memfd: the
  blocks come from the disk tier (promoted through the CPU tier); every byte is checked.

The reference is the same device read and written with O_DIRECT at the same block size
and as many requests in flight (``fio``, ``psync``, one job per request in flight, on a
file in the same directory), measured in the same run, before and after tierd's turn
(the device's speed drifts; their mean is the reference). Prints a Markdown table of GB/s
and the ratio tierd / device; ``--out`` writes JSON. Medians of ``--reps`` (the ratio's
is the median of each repetition's own ratio).

    scripts/bench disk_path --block-kib 1024 --in-flight 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.figures import median_of

if TYPE_CHECKING:
    from tierd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent


def start_daemon(workdir: Path, args: argparse.Namespace) -> DaemonProcess:
    disk_mib = 2 * args.total_mib + args.cpu_mib
    return cpu_over_disk(
        workdir, args.block_kib << 10, args.cpu_mib, disk_mib, args.fsync, args.write_behind
    )


def cpu_over_disk(
    workdir: Path, block: int, cpu_mib: int, disk_mib: int, fsync: str, write_behind: bool
) -> DaemonProcess:
    """A ``tierd serve`` of a CPU tier over a disk tier in ``workdir``, its socket there
    (``tierd.sock``), once ready."""
    from tierd.testing import start_daemon as serve

    disk = workdir / "disk"
    disk.mkdir(mode=0o700)
    config = {
        "block_bytes": block,
        "tiers": [
            {
                "name": "cpu",
                "kind": "cpu",
                "capacity": f"{cpu_mib}MiB",
                "write_behind": write_behind,
            },
            {
                "name": "disk",
                "kind": "disk",
                "capacity": f"{disk_mib}MiB",
                "directories": [str(disk)],
                "fsync": fsync,
            },
        ],
        "socket": {"path": str(workdir / "tierd.sock")},
        "limits": {"lease_blocks_per_connection": "100%", "lease_blocks_per_tenant": "100%"},
        "logging": {"level": "warning"},
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return serve(config, env=env, log=workdir / "tierd.log", timeout_s=120)  # once READY=1


async def through_tierd(socket: str, args: argparse.Namespace, rep: int) -> dict[str, float]:
    from tierd.client import Client

    block = args.block_kib << 10
    per_job = max(1, (args.job_mib << 20) // block)
    blocks = (args.total_mib << 20) // block // per_job * per_job
    size = blocks * block
    fd = os.memfd_create("bench-engine-kv", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    memory = np.memmap(f"/proc/self/fd/{fd}", dtype=np.uint8, mode="r+", shape=(size,))
    memory[:] = np.frombuffer(os.urandom(1 << 20), np.uint8).repeat(size >> 20)
    for i in range(blocks):  # each block's first bytes name it: a mix-up shows
        memory[i * block : i * block + 8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    expected = memory.copy()
    keys = [f"r{rep}-b{i}".encode() for i in range(blocks)]
    jobs = [range(j, j + per_job) for j in range(0, blocks, per_job)]
    try:
        async with await Client.connect(socket, namespace="bench") as client:
            region = await client.register_region(fd, size)

            async def run(op: str, order: list[range]) -> float:
                queue = list(order)
                started = time.perf_counter()

                async def worker() -> None:
                    while queue:
                        job = queue.pop()
                        offsets = np.arange(job.start, job.stop, dtype=np.uint64) * np.uint64(block)
                        move = client.region_store if op == "store" else client.region_load
                        done = await move(region, keys[job.start : job.stop], offsets[:, None])
                        if not all(done):
                            raise RuntimeError(f"a {op} job failed: {done.count(False)} keys")

                await asyncio.gather(*(worker() for _ in range(args.in_flight)))
                if op == "store":
                    await client.flush()
                return time.perf_counter() - started

            stored = await run("store", jobs)
            memory[:] = 0
            shuffled = list(jobs)
            random.Random(rep).shuffle(shuffled)
            loaded = await run("load", shuffled)
            if not np.array_equal(memory, expected):
                raise RuntimeError("a load is not byte-exact")
    finally:
        del memory
        os.close(fd)
    return {"store": size / stored / 1e9, "load": size / loaded / 1e9}


def device(directory: Path, args: argparse.Namespace) -> dict[str, float]:
    """fio with O_DIRECT on a file in ``directory``: GB/s written and read."""
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed: apt-get install fio (Debian's package)")
    out: dict[str, float] = {}
    target = directory / "fio.bin"
    for name, rw in (("store", "randwrite"), ("load", "randread")):
        command = [
            "fio",
            "--name=ref",
            f"--filename={target}",
            f"--rw={rw}",
            "--direct=1",
            "--ioengine=psync",
            f"--bs={args.block_kib}k",
            f"--numjobs={args.in_flight}",
            f"--size={args.total_mib // args.in_flight}m",
            "--group_reporting",
            "--output-format=json",
        ]
        if rw == "randwrite" and args.fsync != "none":
            command.append("--end_fsync=1")
        report = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
        job = report["jobs"][0]["write" if rw == "randwrite" else "read"]
        out[name] = job["bw_bytes"] / 1e9
    target.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--job-mib", type=int, default=8)
    parser.add_argument("--cpu-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    parser.add_argument(
        "--fsync",
        choices=["always", "batch", "none"],
        default="always",
        help="the disk tier's durability mode (fio syncs once at the end unless none)",
    )
    parser.add_argument(
        "--write-behind",
        action="store_true",
        help="the CPU tier copies stored blocks down behind the stores (write_behind)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    figures: dict[str, list[float]] = {}
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="tierd-disk-path-", dir=args.dir) as tmp:
            workdir = Path(tmp)
            before = device(workdir, args)
            child = start_daemon(workdir, args)
            try:
                ours = asyncio.run(through_tierd(str(workdir / "tierd.sock"), args, rep))
            finally:
                child.stop()
            after = device(workdir, args)
        for op in ("store", "load"):
            ref = (before[op] + after[op]) / 2  # the device drifts: measured on both sides
            figures.setdefault(f"tierd {op}", []).append(ours[op])
            figures.setdefault(f"device {op}", []).append(ref)
            figures.setdefault(f"ratio {op}", []).append(ours[op] / ref)
    med = {name: median_of(values) for name, values in figures.items()}
    print(
        f"blocks of {args.block_kib} KiB, jobs of {args.job_mib} MiB, {args.in_flight} in"
        f" flight, {args.total_mib} MiB moved, fsync {args.fsync},"
        f" write_behind {args.write_behind}, median of {args.reps}"
    )
    print("| | tierd GB/s | O_DIRECT GB/s | tierd / device |")
    print("|---|---:|---:|---:|")
    for op in ("store", "load"):
        ours, ref = med[f"tierd {op}"], med[f"device {op}"]
        print(f"| {op} | {ours:.2f} | {ref:.2f} | {med[f'ratio {op}']:.2f}x |")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"args": vars(args) | {"dir": str(args.dir)}, "runs": figures, "median": med},
                default=str,
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
