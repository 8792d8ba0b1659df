#!/usr/bin/env python
"""A bystander beside a neighbour storing into a full CPU tier over a disk (a benchmark).

A real ``tierd serve`` per round: a CPU tier of ``--cpu-mib`` over a disk tier in
``--dir``, ``write_behind`` off or on, the rounds alternating (off, on, off, on, ...).
A neighbour process stores fresh blocks as fast as it can, ``--batch`` blocks of
``--block-kib`` per request, so that every store evicts; a bystander in this process
looks up 32 keys it stored first, one request every 2 ms, for ``--seconds``. Prints,
per setting, the medians over its rounds of the bystander's p50, p99 and max (ms) and
of the neighbour's store rate (GB/s).

    scripts/bench write_behind --rounds 4 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

from bench.disk_path import cpu_over_disk
from bench.figures import median_of


def neighbour(
    socket: str, block: int, batch: int, until: float, out: multiprocessing.Queue
) -> None:
    """Store fresh blocks until ``until`` (CLOCK_MONOTONIC); puts the bytes stored."""
    from tierd.client import Client

    async def run() -> int:
        async with await Client.connect(socket, namespace="neighbour") as client:
            data = [os.urandom(block)] * batch
            stored = 0
            while time.monotonic() < until:
                keys = [os.urandom(16) for _ in range(batch)]
                await client.store(keys, data)
                stored += batch * block
            return stored

    out.put(asyncio.run(run()))


async def bystander(socket: str, block: int, seconds: float) -> list[float]:
    """Round trips (ms) of 32-key lookups, one every 2 ms, for ``seconds``."""
    from tierd.client import Client

    async with await Client.connect(socket, namespace="bystander") as client:
        keys = [b"bystander-%d" % i for i in range(32)]
        await client.store(keys, [os.urandom(block)] * len(keys))
        times: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            await client.lookup(keys)
            times.append((time.perf_counter() - started) * 1e3)
            await asyncio.sleep(0.002)
        return times


def one_round(args: argparse.Namespace, behind: bool) -> dict[str, float]:
    block = args.block_kib << 10
    with tempfile.TemporaryDirectory(prefix="tierd-write-behind-", dir=args.dir) as tmp:
        work = Path(tmp)
        child = cpu_over_disk(work, block, args.cpu_mib, args.disk_mib, "always", behind)
        socket = str(work / "tierd.sock")
        try:
            out: multiprocessing.Queue = multiprocessing.Queue()
            until = time.monotonic() + args.seconds + 1.0
            proc = multiprocessing.Process(
                target=neighbour, args=(socket, block, args.batch, until, out)
            )
            proc.start()
            try:
                time.sleep(0.5)  # the neighbour is storing
                times = sorted(asyncio.run(bystander(socket, block, args.seconds)))
                stored = out.get(timeout=args.seconds + 60)
            finally:
                proc.join(60)
        finally:
            child.stop()
    return {
        "p50": times[len(times) // 2],
        "p99": times[min(len(times) - 1, int(len(times) * 0.99))],
        "max": times[-1],
        "neighbour GB/s": stored / (args.seconds + 1.0) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="per setting, alternating")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cpu-mib", type=int, default=64)
    parser.add_argument("--disk-mib", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    args = parser.parse_args(argv)
    figures: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for _ in range(args.rounds):
        for behind in (False, True):
            for name, value in one_round(args, behind).items():
                figures[behind].setdefault(name, []).append(value)
    print(
        f"blocks of {args.block_kib} KiB, neighbour stores {args.batch} per request, CPU tier"
        f" {args.cpu_mib} MiB over a disk tier; medians of {args.rounds} rounds of"
        f" {args.seconds:g} s"
    )
    print("| write_behind | bystander p50 ms | p99 ms | max ms | neighbour GB/s |")
    print("|---|---:|---:|---:|---:|")
    for behind in (False, True):
        med = {name: median_of(values) for name, values in figures[behind].items()}
        print(
            f"| {'on' if behind else 'off'} | {med['p50']:.2f} | {med['p99']:.2f}"
            f" | {med['max']:.2f} | {med['neighbour GB/s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
