#!/usr/bin/env python
"""The hash index built at a tenant's first ``blocks_held``: what the build costs a
bystander's lookups.

A daemon (``tierd serve`` in a child process) publishes KV events. A neighbour's book
holds ``--described`` descriptions, of blocks it describes ahead of their store (each
waits in the book a minute for it, longer than the run). The bystander, in a namespace
of its own, holds 32 blocks and sends 32-key ``lookup`` round trips, one at a time. After
``--before`` seconds of them, the neighbour asks ``blocks_held`` for the first time: the
daemon builds the index from engine hashes to blocks, the whole book read a part per
turn of the loop, and that first request waits for it. A second ``blocks_held`` follows
at once (the index whole: nothing to build). Reported for each run: how long each ask
took, and the bystander's round trips (p50, p99, max, in ms) before the first ask and
during the build (the round trips begun between the first ask and its answer).
``--runs`` daemons in turn, each building once; medians over the runs. ``--baseline
DIR`` runs a daemon from the ``tierd`` package in DIR as well (another checkout: ``git
worktree add /tmp/before HEAD~1``), in turn with this one.

Usage: ``scripts/bench kv_index [--described 500000] [--runs 3] [--before 2]
[--baseline DIR]``.
Results: docs/BENCHMARKS.md ("KV events").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.figures import median_of
from bench.neighbours_loop import BLOCK, CROWD, MINE, connect, figures, keys, loop_config
from tierd.testing import start_daemon_async

REQUEST_KEYS = 4096  # descriptions in one describe request (the daemon's default bound)
MAX_TRIPS = 1_000_000  # the bystander's bound, whatever happens


async def describe_all(socket: str, count: int) -> None:
    """``count`` descriptions in the neighbour's book, of blocks not stored."""
    async with await connect(socket, CROWD) as client:
        for first in range(0, count, REQUEST_KEYS):
            n = min(REQUEST_KEYS, count - first)
            names = [f"ahead-{first + i}".encode() for i in range(n)]
            blocks = [
                {
                    "hashes": [first + i + 1],
                    "parent": first + i or None,
                    "tokens": [7] * 16,
                    "block_size": 16,
                }
                for i in range(n)
            ]
            if await client.describe(names, blocks) != n:
                raise RuntimeError("the daemon did not keep every description")


async def lookups(socket: str, stop: asyncio.Event, trips: list[tuple[float, float]]) -> None:
    """The bystander: (when it began, its round trip in ms) of each 32-key lookup, until
    ``stop`` (or :data:`MAX_TRIPS`)."""
    wanted = keys("mine", 32)
    async with await connect(socket, MINE) as client:
        while not stop.is_set() and len(trips) < MAX_TRIPS:
            began = time.perf_counter()
            found = await client.lookup(wanted)
            trips.append((began, (time.perf_counter() - began) * 1e3))
            if found.count != len(wanted):
                raise RuntimeError(f"the bystander lost blocks: {found.count} of 32")


async def run_once(args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    """One daemon (of this checkout, or of ``tree``'s), built once."""
    with tempfile.TemporaryDirectory(prefix="tierd-kvi-") as name:
        home = Path(name)
        config = loop_config(home, 64)
        env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
        proc = await start_daemon_async(config, log=home / "tierd.log", env=env, cwd=tree)
        try:
            socket = config["socket"]["path"]
            async with await connect(socket, MINE) as mine:
                await mine.store(keys("mine", 32), [b"\x07" * BLOCK] * 32)
            began = time.monotonic()
            await describe_all(socket, args.described)
            filled_s = time.monotonic() - began
            stop = asyncio.Event()
            trips: list[tuple[float, float]] = []
            bystander = asyncio.create_task(lookups(socket, stop, trips))
            await asyncio.sleep(args.before)
            async with await connect(socket, CROWD) as asker:
                asked = time.perf_counter()
                await asker.blocks_held([[1, 2, 3]])
                built = time.perf_counter()
                await asker.blocks_held([[1, 2, 3]])
                again = time.perf_counter()
            stop.set()
            await bystander
        finally:
            proc.stop()
    before = [ms for at, ms in trips if at < asked]
    during = [ms for at, ms in trips if asked <= at < built]
    return {
        "code": "this" if tree is None else "baseline",
        "described": args.described,
        "fill_s": round(filled_s, 1),
        "first_ask_ms": round((built - asked) * 1e3, 1),
        "second_ask_ms": round((again - built) * 1e3, 2),
        "before": figures(before),
        "during": figures(during) if during else None,
    }


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    trees = [None] if args.baseline is None else [None, args.baseline]
    rows = []
    for n in range(args.runs):  # bounded: --runs daemons of each code, in turn
        for tree in trees[n % len(trees) :] + trees[: n % len(trees)]:
            rows.append(await run_once(args, tree))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict[str, Any]], code: str) -> None:
    rows = [row for row in rows if row["code"] == code]

    def med(figure: str, phase: str | None = None) -> float:
        return median_of(row[figure] if phase is None else row[phase][figure] for row in rows)

    print(
        f"{code}: first blocks_held (the build) {med('first_ask_ms'):.0f} ms,"
        f" the next {med('second_ask_ms'):.2f} ms"
    )
    before = ", ".join(f"{f} {med(f + '_ms', 'before')}" for f in ("p50", "p99", "max"))
    print(f"  bystander before: {before} ms")
    during = [row["during"] for row in rows if row["during"] is not None]
    if during:
        figs = ", ".join(
            f"{f} {median_of(d[f + '_ms'] for d in during)}" for f in ("p50", "p99", "max")
        )
        trips = median_of(d["trips"] for d in during)
        print(f"  bystander during the build: {figs} ms ({trips:.0f} round trips)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--described", type=int, default=500_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", type=float, default=2.0)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="a directory holding another tierd package"
    )
    args = parser.parse_args(argv)
    rows = asyncio.run(bench(args))
    print(f"\n{args.described:,} descriptions, {args.runs} runs each (medians):")
    for code in ("this", "baseline") if args.baseline is not None else ("this",):
        report(rows, code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
