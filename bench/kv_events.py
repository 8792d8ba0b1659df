#!/usr/bin/env python3
"""KV events for routers: what they cost the daemon, and how late a router hears.

Eight engines (clients, each its own connection and namespace) store described blocks at a
fixed rate (``--rate`` blocks/s each, in stores of ``--batch`` keys, each preceded by its
``describe``) into a daemon run as a process, once with ``kv_events`` off and once on, in
alternating rounds. The CPU tier is small enough that the stores evict and demote, so
removals and moves are published too. Figures per round:

- the daemon's CPU time (utime + stime from /proc) per stored block, and the ratio on/off;
  and its loop's alone (the main thread's: where the events' work is; the disk tier's
  threads, the same both ways, add their share, and the noise of their I/O, to the whole);
- the blocks stored per second, against the engines' rate (``--engines`` x ``--rate``);
- with events on, when a subscriber received each block's ``BlockStored`` (CPU; the
  subscriber is a process of its own, so that decoding the batches takes nothing from
  the engines' loop here; CLOCK_MONOTONIC is the node's), p50 and p99: after the store
  returned to its engine (0 when it came before the reply), and after the describe was
  sent;
- the time of a describe + put, p50, both ways.

The engines all start at once: each round, their stores bunch in each period as their
connections' timing puts them, and a round's CPU per block moves with that (its batches a
second with it: 60-93 in rounds of one run). ``--spread`` spreads them evenly over the
period instead (independent engines at a steady rate): every store then comes in a turn
of the loop of its own, and is a batch of its own.

``--baseline DIR`` runs, in the same rounds, a daemon from the ``tierd`` package in DIR
as well, off and on (another checkout: ``git worktree add /tmp/before HEAD~1``): on this
shared VM a run's CPU figures move by a fifth from one run to the next, so a change is
measured against its baseline in one run. The order of the daemons rotates each round.

Medians over ``--rounds``; the ratio on/off is given twice: of the medians, and the
median of each round's (its "on" and "off" ran back to back: the VM's speed, which drifts
by a fifth within minutes, moves both alike). Results: docs/BENCHMARKS.md ("KV events").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
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


def _cpu_s(pid: int, thread: int | None = None) -> float:
    """utime + stime of process ``pid`` (all its threads), or of its thread ``thread``."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _config(tmp: Path, on: bool, batch_s: float | None = None) -> dict[str, Any]:
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
            **({} if batch_s is None else {"batch_s": batch_s}),
        },
    }


def _listen(endpoint: str, ready: Any, stop: Any, out: Any) -> None:
    """The subscriber's process: until ``stop``, when each hash's ``BlockStored`` (CPU)
    arrived; then ``(seen, batches)`` to ``out``."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 100)
    sock.connect(endpoint)
    ready.set()
    seen: dict[int, float] = {}
    batches = 0
    while not stop.is_set():
        try:
            _, _, payload = sock.recv_multipart()
        except zmq.Again:
            continue
        now = time.monotonic()
        batches += 1
        for event in msgpack.unpackb(payload)[1]:
            if event.get("type") == "BlockStored" and event.get("medium") == "CPU":
                for h in event["block_hashes"]:
                    seen.setdefault(h, now)
    sock.close(linger=0)
    out.send((seen, batches))


class Listener:
    """A subscriber in a process of its own (:func:`_listen`)."""

    def __init__(self, endpoint: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        ready, self._stop = ctx.Event(), ctx.Event()
        self._out, sent = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_listen, args=(endpoint, ready, self._stop, sent))
        self._process.start()
        if not ready.wait(30):
            self._process.kill()
            raise RuntimeError("the subscriber's process did not start")

    def close(self) -> tuple[dict[int, float], int]:
        """Stop it: when each hash was heard, and the batches heard."""
        self._stop.set()
        try:
            if not self._out.poll(30):
                raise RuntimeError("the subscriber's process gave no answer")
            seen, batches = self._out.recv()
        finally:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
        return seen, batches


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
        # --spread: each engine's first store a share of the period after the last's.
        next_at = time.monotonic() + (period * n / args.engines if args.spread else 0.0)
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


async def _round(on: bool, args: argparse.Namespace, tree: Path | None) -> dict[str, float]:
    """One round, events ``on`` or off, of a daemon of this checkout or of ``tree``'s."""
    with tempfile.TemporaryDirectory(prefix="tierd-kvb-", dir="/tmp") as d:
        tmp = Path(d)
        config = _config(tmp, on, args.batch_s)
        env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
        with start_daemon(config, log=tmp / "tierd.log", env=env, cwd=tree) as daemon:
            listener = Listener(config["kv_events"]["endpoint"]) if on else None
            await asyncio.sleep(0.2)  # the subscription reaches the publisher
            sent: dict[int, float] = {}
            acked: dict[int, float] = {}
            cpu0, loop0 = _cpu_s(daemon.pid), _cpu_s(daemon.pid, daemon.pid)
            deadline = time.monotonic() + args.seconds
            sock = config["socket"]["path"]
            counts = await asyncio.gather(
                *(_engine(sock, n, args, sent, acked, deadline) for n in range(args.engines))
            )
            cpu = _cpu_s(daemon.pid) - cpu0
            loop = _cpu_s(daemon.pid, daemon.pid) - loop0
            blocks = sum(counts)
            out = {
                "blocks": float(blocks),
                "rate": blocks / args.seconds,
                "cpu_us_per_block": 1e6 * cpu / blocks,
                "loop_us_per_block": 1e6 * loop / blocks,
            }
            stores = sorted(acked[h] - sent[h] for h in acked)
            out["store_p50_ms"] = 1e3 * _at(stores, 0.5)
            if listener is not None:
                await asyncio.sleep(0.5)  # the last batches reach the subscriber
                seen, batches = listener.close()
                heard = [h for h in acked if h in seen]
                out["heard"] = len(heard) / len(acked)
                out["batches_per_s"] = batches / args.seconds
                after_send = sorted(seen[h] - sent[h] for h in heard)
                after_ack = sorted(max(0.0, seen[h] - acked[h]) for h in heard)
                out["lag_p50_ms"] = 1e3 * _at(after_ack, 0.5)
                out["lag_p99_ms"] = 1e3 * _at(after_ack, 0.99)
                out["sent_p50_ms"] = 1e3 * _at(after_send, 0.5)
                out["sent_p99_ms"] = 1e3 * _at(after_send, 0.99)
            return out


def _at(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (NaN when there are none)."""
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


async def run(args: argparse.Namespace) -> None:
    daemons: list[tuple[str, bool, Path | None]] = [("off", False, None), ("on", True, None)]
    if args.baseline is not None:
        daemons += [("baseline off", False, args.baseline), ("baseline on", True, args.baseline)]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in daemons}
    for r in range(args.rounds):  # bounded: --rounds rounds of --seconds each
        k = r % len(daemons)
        for name, on, tree in daemons[k:] + daemons[:k]:
            rows[name].append(await _round(on, args, tree))
            print(f"round {r}: {name} {rows[name][-1]}", flush=True)

    def med(name: str, figure: str) -> float:
        return median_of(row[figure] for row in rows[name])

    def paired(on: str, off: str, figure: str) -> float:
        """The median of each round's ratio (its "on" and "off" back to back)."""
        return median_of(a[figure] / b[figure] for a, b in zip(rows[on], rows[off], strict=True))

    target = args.engines * args.rate
    lines = [
        f"\n{args.engines} engines x {args.rate} blocks/s, {args.rounds} rounds (medians):",
        "| events | blocks/s | daemon CPU per block | its loop's | on/off, each round's"
        " | lag after the store returned p50 | p99 | after the describe was sent p50 | p99"
        " | heard | batches/s | describe+put p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, on, _ in daemons:
        rate = f"{med(name, 'rate'):,.0f} of {target:,}"
        cpu = f"{med(name, 'cpu_us_per_block'):.1f} us"
        loop = f"{med(name, 'loop_us_per_block'):.1f} us"
        store = f"{med(name, 'store_p50_ms'):.2f} ms"
        if not on:
            lines.append(f"| {name} | {rate} | {cpu} | {loop} | | | | | | | | {store} |")
            continue
        off = name.replace("on", "off")
        ratio = med(name, "cpu_us_per_block") / med(off, "cpu_us_per_block")
        loop_ratio = med(name, "loop_us_per_block") / med(off, "loop_us_per_block")
        each = paired(name, off, "cpu_us_per_block")
        each_loop = paired(name, off, "loop_us_per_block")
        lines.append(
            f"| {name} | {rate} | {cpu} ({ratio:.2f}x) | {loop} ({loop_ratio:.2f}x) "
            f"| {each:.2f}x ({each_loop:.2f}x) "
            f"| {med(name, 'lag_p50_ms'):.2f} ms | {med(name, 'lag_p99_ms'):.2f} ms "
            f"| {med(name, 'sent_p50_ms'):.2f} ms | {med(name, 'sent_p99_ms'):.2f} ms "
            f"| {med(name, 'heard'):.3f} | {med(name, 'batches_per_s'):.0f} | {store} |"
        )
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--rate", type=int, default=256, help="blocks/s per engine")
    parser.add_argument("--batch", type=int, default=16, help="keys per store")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch-s", type=float, default=None, help="kv_events.batch_s (default: the daemon's)"
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="the engines' stores spread evenly over each period (by default they all start"
        " at once, each period's stores as close together as their connections put them)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a directory holding another tierd package: its daemon too, in the same rounds",
    )
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
