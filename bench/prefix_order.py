"""Whole-prefix hits when a client tells the chain its sequences (issue 35, item 11).

The shared conversation trace through a CPU + disk chain (in-process, ``tierd.open``),
driven the way SGLang's backend drives the daemon: per request, the leading blocks held
are loaded, then the rest is stored in pieces of ``--piece`` blocks (a lease bound's
worth), head first. ``before``: nothing else (what the backend did). ``after``: after
each load and each piece, the request's blocks up to there are touched, head most recent
(the backend's touch of SGLang's prefix keys plus the call's pages). A hit is a block of
the leading run a lookup finds, so a kept block whose prefix head is gone is never one.

    scripts/bench prefix_order [--requests 12031] [--capacity 0.05,0.10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import tierd
from tierd.keys import int_key

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
BLOCK = 512


async def replay(requests: list[list[int]], cpu: int, disk: int, piece: int, touch: bool) -> int:
    """Whole-prefix hit blocks over ``requests``."""
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "disk").mkdir()
        config = {
            "block_bytes": BLOCK,
            "tiers": [
                {"name": "cpu", "kind": "memory", "capacity": cpu},
                {"name": "disk", "kind": "disk", "capacity": disk},
            ],
        }
        config["tiers"][1]["directories"] = [str(Path(work) / "disk")]
        async with tierd.open(config) as chain:
            hits = 0
            for ids in requests:
                keys = [int_key(i) for i in ids]
                held = chain.lookup(keys).count
                hits += held
                if held:
                    async with chain.loading(keys[:held]):
                        pass
                    if touch:
                        chain.touch(keys[:held])
                for start in range(held, len(keys), piece):
                    part = keys[start : start + piece]
                    await chain.store(part, [bytes(BLOCK)] * len(part))
                    if touch:
                        chain.touch(keys[: start + len(part)])
            return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12_031)
    parser.add_argument("--capacity", default="0.05,0.10", help="fractions of unique blocks")
    parser.add_argument("--piece", type=int, default=6)
    args = parser.parse_args(argv)
    if not TRACE.exists():
        sys.exit(f"the shared trace is missing: {TRACE}")
    lines = TRACE.read_text().splitlines()[: args.requests]
    requests = [json.loads(line)["hash_ids"] for line in lines]
    unique = len({i for ids in requests for i in ids})
    accesses = sum(map(len, requests))
    print(f"{len(requests):,} requests, {unique:,} unique blocks, {accesses:,} accesses")
    print("| capacity (CPU + disk) | before: hits | after: hits | after / before |")
    print("|---|---:|---:|---:|")
    for fraction in (float(f) for f in args.capacity.split(",")):
        capacity = max(16, int(unique * fraction))
        cpu, disk = capacity // 4, capacity - capacity // 4
        started = time.monotonic()
        before, after = (
            asyncio.run(replay(requests, cpu, disk, args.piece, touch)) for touch in (False, True)
        )
        print(
            f"| {fraction:.0%} ({cpu:,} + {disk:,}) | {before:,} ({before / accesses:.1%}) "
            f"| {after:,} ({after / accesses:.1%}) | {after / before:.3f} |",
            f"({time.monotonic() - started:.0f} s)",
            file=sys.stdout,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
