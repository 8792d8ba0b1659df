#!/usr/bin/env python3
"""KV events for routers: what they cost the daemon, and how late a router hears.

Eight engines (clients, each its own connection and namespace) store described blocks at a
fixed rate (``--rate`` blocks/s each, in stores of ``--batch`` keys, each preceded by its
``describe``) into a daemon run as a process, once with ``kv_events`` off and once on, in
alternating rounds. The CPU tier is small enough that the stores evict and demote, so
removals and moves are published too. Figures per round:

- the daemon's CPU time (utime + stime from /proc) per stored block, and the ratio on/off;
- with events on, the lag from a store's sending to a subscriber's receipt of its
  ``BlockStored`` (the subscriber is in this process: the same clock), p50 and p99.

Medians over ``--rounds``. Results: docs/BENCHMARKS.md ("KV events").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.figures import median_of
from tierd.client import Client
from tierd.testing.process import start_daemon

BLOCK = 16 << 10
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _config(tmp: Path, on: bool) -> dict[str, Any]:
    (tmp / "disk").mkdir(mode=0o700, exist_ok=True)
    return {
        "block_bytes": BLOCK,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 1024},
            {"name": "disk", "kind": "disk", "capacity": 8192, "directories": [str(tmp / "disk")]},
        ],
        "socket": {"path": str(tmp / "t.sock")},
        "kv_events": {
            "enabled": on,
            "endpoint": f"ipc://{tmp}/kv.pub",
            "replay_endpoint": None,
        },
    }


class Listener:
    """A subscriber in a thread: when each hash's ``BlockStored`` (CPU) arrived."""

    def __init__(self, endpoint: str) -> None:
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            now = time.monotonic()
            for event in msgpack.unpackb(payload)[1]:
                if event.get("type") == "BlockStored" and event.get("medium") == "CPU":
                    for h in event["block_hashes"]:
                        self.seen.setdefault(h, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


async def _engine(
    sock: str,
    n: int,
    args: argparse.Namespace,
    sent: dict[int, float],
    acked: dict[int, float],
    deadline: float,
) -> int:
    stored, i = 0, 0
    data = [bytes([n]) * BLOCK] * args.batch
    async with await Client.connect(sock, namespace=f"engine{n}") as client:
        period = args.batch / args.rate
        next_at = time.monotonic()
        while time.monotonic() < deadline and i < 1_000_000:  # bounded in time and count
            hashes = [(n << 40) | (i + j) for j in range(args.batch)]
            keys = [h.to_bytes(8, "big") for h in hashes]
            descs = [
                {"hashes": [h], "parent": None, "tokens": list(range(16)), "block_size": 16}
                for h in hashes
            ]
            now = time.monotonic()
            for h in hashes:
                sent[h] = now
            await client.describe(keys, descs)
            stored += await client.put(keys, data)
            done = time.monotonic()
            for h in hashes:
                acked[h] = done
            i += args.batch
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return stored


async def _round(on: bool, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tierd-kvb-", dir="/tmp") as d:
        tmp = Path(d)
        config = _config(tmp, on)
        with start_daemon(config, log=tmp / "tierd.log") as daemon:
            listener = Listener(config["kv_events"]["endpoint"]) if on else None
            await asyncio.sleep(0.2)  # the subscription reaches the publisher
            sent: dict[int, float] = {}
            acked: dict[int, float] = {}
            cpu0 = _cpu_s(daemon.pid)
            deadline = time.monotonic() + args.seconds
            sock = config["socket"]["path"]
            counts = await asyncio.gather(
                *(_engine(sock, n, args, sent, acked, deadline) for n in range(args.engines))
            )
            cpu = _cpu_s(daemon.pid) - cpu0
            out = {"blocks": float(sum(counts)), "cpu_us_per_block": 1e6 * cpu / sum(counts)}
            if listener is not None:
                await asyncio.sleep(0.5)  # the last batches reach the subscriber
                listener.close()
                lags = sorted(listener.seen[h] - t for h, t in sent.items() if h in listener.seen)
                out["heard"] = len(lags) / len(sent)
                out["lag_p50_ms"] = 1e3 * lags[len(lags) // 2]
                out["lag_p99_ms"] = 1e3 * lags[int(len(lags) * 0.99)]
                stores = sorted(acked[h] - t for h, t in sent.items())
                out["store_p50_ms"] = 1e3 * stores[len(stores) // 2]
            return out


async def run(args: argparse.Namespace) -> None:
    off: list[dict[str, float]] = []
    on: list[dict[str, float]] = []
    for r in range(args.rounds):
        off.append(await _round(False, args))
        on.append(await _round(True, args))
        print(f"round {r}: off {off[-1]}  on {on[-1]}", flush=True)

    def med(rows: list[dict[str, float]], name: str) -> float:
        return median_of(row[name] for row in rows)

    ratio = med(on, "cpu_us_per_block") / med(off, "cpu_us_per_block")
    print(
        f"\n{args.engines} engines x {args.rate} blocks/s, {args.rounds} rounds (medians):\n"
        f"| events | blocks stored | daemon CPU per block | lag p50 | lag p99 | heard "
        f"| describe+put p50 |\n"
        f"|---|---|---|---|---|---|---|\n"
        f"| off | {med(off, 'blocks'):.0f} | {med(off, 'cpu_us_per_block'):.1f} us | | | | |\n"
        f"| on | {med(on, 'blocks'):.0f} | {med(on, 'cpu_us_per_block'):.1f} us "
        f"({ratio:.2f}x) | {med(on, 'lag_p50_ms'):.2f} ms | {med(on, 'lag_p99_ms'):.2f} ms "
        f"| {med(on, 'heard'):.3f} | {med(on, 'store_p50_ms'):.2f} ms |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--rate", type=int, default=256, help="blocks/s per engine")
    parser.add_argument("--batch", type=int, default=16, help="keys per store")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
