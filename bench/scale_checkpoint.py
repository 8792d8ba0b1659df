#!/usr/bin/env python
"""What checkpoints of a big disk index cost the writes beside them and the event loop.

A disk store of N slots gets an index of N synthetic entries (no block data is written
for them: a checkpoint only reads the index), then a bystander writes one real block at a
time into a few slots, ``--writes`` times, while a ticker measures how late the event
loop runs a 1 ms timer. Two runs per size, in the same process:

- ``baseline``: the journal never reaches its limit, so no checkpoint is taken;
- ``checkpoints``: the limit is ``--limit-records`` journal records, so checkpoints of the
  whole index follow one another for the whole run.

Figures: the bystander's write latency (p50, p99, max) and the loop's lateness (p99,
max), and how many checkpoints each run finished (snapshots written). Run it with
``PYTHONPATH=<an older checkout>`` to measure an older store the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from bench.figures import median_of
from tierd.keys import int_key
from tierd.stores.disk.store import DiskStore

ROOT = Path(__file__).resolve().parent.parent
BB = 4096
RECORD = 88  # bytes per journal record


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _ticker(stop: asyncio.Event, lateness: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + 0.001
        await asyncio.sleep(0.001)
        lateness.append(max(0.0, loop.time() - due))


def _snapshots(directory: Path) -> int:
    path = directory / "tierd-index.msgpack"
    return path.stat().st_mtime_ns if path.exists() else 0


async def run(
    directory: Path, n: int, writes: int, limit_records: int | None, o_direct: Any = "auto"
) -> dict[str, Any]:
    limit = (limit_records or 1 << 40) * RECORD
    store = DiskStore(
        num_blocks=n,
        block_bytes=BB,
        directories=[directory],
        o_direct=o_direct,
        fsync="never",
        journal_limit_bytes=limit,  # "never": what older stores call "none"
    )
    await store.open()
    direct = store.stats().details["o_direct"]
    slab = store._slabs[0]  # the index, filled the way a long-running store fills it
    slab.entries.update((i, (int_key(i + 1_000_000_000), i + 1)) for i in range(n))
    slab.next_gen = n + 1
    # As the daemon does once it is ready (tierd.daemon.lifecycle): what exists now lives
    # as long as the store, and no collection need walk it again.
    gc.collect()
    gc.freeze()
    data = [bytes(BB)]
    latencies: list[float] = []
    lateness: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(stop, lateness))
    seen, changes = _snapshots(directory), 0
    started = time.perf_counter()
    for i in range(writes):
        t0 = time.perf_counter()
        await store.write([i % 8], [int_key(i)], data)
        latencies.append(time.perf_counter() - t0)
        now = _snapshots(directory)
        changes, seen = changes + (now != seen), now
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - started
    stop.set()
    await ticker
    await store.close()
    gc.unfreeze()
    del store, slab
    gc.collect()  # this store's index is freed here, not in the next run's timing
    ms = 1000.0
    return {
        "blocks": n,
        "checkpoints": limit_records is not None,
        "writes": writes,
        "o_direct": direct,
        "seconds": round(elapsed, 2),
        "snapshots_seen": changes,
        "write_p50_ms": round(median_of(latencies) * ms, 2),
        "write_p99_ms": round(_pct(latencies, 0.99) * ms, 2),
        "write_max_ms": round(max(latencies) * ms, 2),
        "loop_late_p99_ms": round(_pct(lateness, 0.99) * ms, 2),
        "loop_late_max_ms": round(max(lateness) * ms, 2),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rows = []
    for n in args.blocks:
        for limit in (None, args.limit_records):
            where = Path(tempfile.mkdtemp(prefix=f".ckpt-{n}-", dir=args.dir))
            try:
                rows.append(await run(where, n, args.writes, limit, args.o_direct))
            finally:
                shutil.rmtree(where, ignore_errors=True)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--writes", type=int, default=3000)
    parser.add_argument("--limit-records", type=int, default=200)
    parser.add_argument(
        "--buffered",
        dest="o_direct",
        action="store_const",
        const=False,
        default="auto",
        help="block writes through the page cache",
    )
    parser.add_argument("--dir", type=Path, default=ROOT, help="where the slabs go")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file of the rows")
    args = parser.parse_args(argv)
    rows = asyncio.run(main_async(args))
    if args.out:
        args.out.write_text(
            json.dumps(
                {"python": sys.version.split()[0], "cpus": os.cpu_count(), "rows": rows}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
