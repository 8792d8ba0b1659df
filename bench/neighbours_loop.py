#!/usr/bin/env python
"""A bystander beside a hostile neighbour: what the neighbour's loop work costs the
bystander's lookups (a benchmark, not a test; issue 34, findings 4 to 6).

A daemon (``tierd serve`` in a child process) holds ``--blocks`` blocks of 4 KiB of the
neighbour's namespace in a CPU tier, and 32 of the bystander's. The bystander (this
process) sends 32-key ``lookup`` round trips, one at a time, and its round trips are
reported (p50, p99, max, in ms): alone, then while the neighbour (a second child
process, so that its client work does not share the bystander's loop) loops one attack:

- ``loads``: ``prepare_load`` of 4,096 keys, then ``complete_load``;
- ``hellos``: a new connection per hello, each naming a fresh namespace;
- ``namespaces``: ``namespaces`` then ``stats`` with namespaces, on its tenant;
- ``delete``: ``delete --prefix`` of a prefix none of its keys has (a walk of the index);
- ``describe``: descriptions of its blocks for the KV events (``describe``, 256 blocks a
  request, each with hashes of its own, over and over: its book fills, then churns);
- ``unstored``: descriptions of 256 blocks it never stores (they wait 60 s for their
  store in its book), and a store of one block, each round (its events follow);
- ``closes``: a new connection per round that pins eight loads of 4,096 of its blocks
  and reserves four stores of 4,096 fresh keys, and closes with all twelve leases open
  (the daemon ends them);
- ``aborts``: a store of 4,096 fresh keys reserved (``prepare_store``), then aborted;
- ``deletes``: a store of 4,096 fresh keys, then a ``delete`` of them by name;
- ``touches``: a ``touch`` of 4,096 of its blocks;
- ``flushes``: a store of 4,096 fresh keys, then a ``flush`` (it is the daemon's user: an
  operator), which walks the whole CPU tier and copies what is dirty down to the disk
  tier (``--attacks flushes`` gives the daemon a disk tier of twice the CPU tier's blocks;
  the other attacks run without one).

The daemon publishes KV events (to an ipc endpoint nobody reads) in every phase.

Every phase lasts ``--seconds`` or ``--trips`` bystander round trips, whichever ends
first; the neighbour's rounds are bounded too. The daemon and the neighbour are stopped
by PID. Usage: ``scripts/bench neighbours_loop [--blocks 240000] [--trips 50000]
[--seconds 10] [--json] [--probe] [--book-mib N]`` (``--book-mib``: each tenant's book of
descriptions, to churn at its budget within a phase). With ``--probe`` the daemon runs in
this process instead, and what is reported is the loop's longest turns in CPU time while each
neighbour attacks (a machine shared with other work stretches wall-clock round trips
by however long the kernel runs something else). To measure another checkout, run it
with that checkout on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.figures import median_of
from tierd.client import Client, DaemonError
from tierd.testing import DaemonProcess, daemon_config, running_daemon, start_daemon_async

BLOCK = 4096
ATTACKS = (
    "loads",
    "hellos",
    "namespaces",
    "delete",
    "describe",
    "unstored",
    "closes",
    "aborts",
    "deletes",
    "touches",
    "flushes",
)
CROWD, MINE = "crowd", "bystander"
BURST = 4096  # keys of one load
DESCRIBED = 256  # blocks of one description request


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


async def connect(socket: str, namespace: str | None) -> Client:
    return await Client.connect(socket, namespace=namespace, block_bytes=BLOCK)


async def start(config: dict[str, Any], home: Path) -> DaemonProcess:
    """``tierd serve`` of ``config`` (YAML and log in ``home``), once it sent READY=1."""
    return await start_daemon_async(config, log=home / "tierd.log")


def loop_config(
    home: Path, blocks: int, book_mib: int | None = None, disk: bool = False
) -> dict[str, Any]:
    """The daemon: a CPU tier of ``blocks`` and room for loads, KV events published (each
    tenant's book of descriptions ``book_mib``, or the default); with ``disk``, a disk tier
    of twice as many blocks below it."""
    events: dict[str, Any] = {
        "enabled": True,
        "endpoint": f"ipc://{home}/kv.pub",
        "replay_endpoint": None,
    }
    if book_mib is not None:
        events["descriptor_bytes"] = book_mib << 20
    cpu = blocks + 4 * BURST
    return daemon_config(
        home, cpu_blocks=cpu, disk_blocks=2 * cpu if disk else None, kv_events=events
    )


async def fill(socket: str, blocks: int) -> None:
    """The neighbour's blocks and the bystander's 32, through the pool."""
    row = b"\x07" * BLOCK
    async with await connect(socket, CROWD) as crowd:
        names = keys("crowd", blocks)
        for start in range(0, blocks, BURST):
            part = names[start : start + BURST]
            await crowd.store(part, [row] * len(part))
    async with await connect(socket, MINE) as mine:
        await mine.store(keys("mine", 32), [row] * 32)


async def bystander(socket: str, trips: int, seconds: float) -> list[float]:
    """Round trips of 32-key lookups, in ms, until ``trips`` or ``seconds``."""
    wanted = keys("mine", 32)
    out: list[float] = []
    async with await connect(socket, MINE) as client:
        end = time.monotonic() + seconds
        while len(out) < trips and time.monotonic() < end:
            began = time.perf_counter()
            found = await client.lookup(wanted)
            out.append((time.perf_counter() - began) * 1e3)
            if found.count != len(wanted):
                raise RuntimeError(f"the bystander lost blocks: {found.count} of 32")
    return out


def figures(trips: list[float]) -> dict[str, float]:
    ordered = sorted(trips)
    return {
        "trips": len(ordered),
        "p50_ms": round(median_of(ordered), 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
        "max_ms": round(ordered[-1], 3),
    }


# -- the neighbour, in its own process ------------------------------------------------


async def neighbour(attack: str, socket: str, seconds: float) -> int:
    """Loop ``attack`` for ``seconds`` (at most 100,000 rounds); how many rounds ran."""
    end = time.monotonic() + seconds
    rounds = 0
    stopped = asyncio.Event()  # SIGTERM: the bystander is done
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    async with await connect(socket, CROWD) as client:
        wanted = keys("crowd", BURST)
        print("started", flush=True)
        while rounds < 100_000 and time.monotonic() < end and not stopped.is_set():
            if attack == "loads":
                reply = await client.request("prepare_load", keys=wanted)
                if reply.get("lease") is not None:
                    await client.request("complete_load", lease=reply["lease"])
            elif attack == "hellos":
                try:
                    async with await connect(socket, f"fresh-{rounds}-{time.time_ns()}"):
                        pass
                except DaemonError as refused:  # past the bound: refused, and cheap
                    if refused.code != "too_many_namespaces":
                        raise
            elif attack == "namespaces":
                await client.namespaces()
                await client.stats(namespaces=True)
            elif attack == "describe":
                await describe_round(client, rounds)
            elif attack == "unstored":
                await unstored_round(client, rounds)
            elif attack == "closes":
                await closed_round(socket, rounds)
            elif attack == "aborts":
                reply = await client.request("prepare_store", keys=keys(f"a{rounds}-", BURST))
                if reply.get("lease") is not None:
                    await client.request("abort_store", lease=reply["lease"])
            elif attack == "deletes":
                fresh = keys(f"d{rounds}-", BURST)
                await client.store(fresh, [b"\x07" * BLOCK] * BURST)
                await client.delete(fresh)
            elif attack == "touches":
                await client.request("touch", keys=wanted)
            elif attack == "flushes":
                fresh = keys(f"f{rounds}-", BURST)
                await client.store(fresh, [b"\x07" * BLOCK] * BURST)
                await client.flush()
            else:
                await client.delete(prefix=b"no-key-starts-so")
            rounds += 1
    return rounds


async def closed_round(socket: str, round_no: int) -> None:
    """A connection that opens twelve leases of :data:`BURST` keys (eight loads of the
    neighbour's first blocks, four stores of fresh keys) and closes with them open."""
    client = await connect(socket, CROWD)
    try:
        crowd = keys("crowd", 8 * BURST)
        for start in range(0, len(crowd), BURST):
            await client.request("prepare_load", keys=crowd[start : start + BURST])
        for part in range(4):
            await client.request("prepare_store", keys=keys(f"c{round_no}-{part}-", BURST))
    finally:
        await client.close()


async def describe_round(client: Client, round_no: int) -> None:
    """Describe the next :data:`DESCRIBED` of the neighbour's blocks (round robin over
    the first 240,000), 16 tokens each, with hashes no earlier round used."""
    first = round_no * DESCRIBED % 240_000
    names = [f"crowd-{i}".encode() for i in range(first, first + DESCRIBED)]
    base = round_no * DESCRIBED + 1
    blocks = [
        {
            "hashes": [base + i],
            "parent": base + i - 1,
            "tokens": [i % 50_000] * 16,
            "block_size": 16,
        }
        for i in range(DESCRIBED)
    ]
    await client.describe(names, blocks)


async def unstored_round(client: Client, round_no: int) -> None:
    """Describe :data:`DESCRIBED` keys that are never stored, then store one block."""
    names = [f"ahead-{round_no}-{i}".encode() for i in range(DESCRIBED)]
    base = (1 << 40) + round_no * DESCRIBED
    blocks = [
        {"hashes": [base + i], "parent": None, "tokens": [1] * 16, "block_size": 16}
        for i in range(DESCRIBED)
    ]
    await client.describe(names, blocks)
    await client.store([f"one-{round_no}".encode()], [b"\x01" * BLOCK])


# -- the phases -----------------------------------------------------------------------


async def phase(attack: str | None, socket: str, args: argparse.Namespace) -> dict[str, Any]:
    child = None
    if attack is not None:
        command = [
            sys.executable,
            "-m",
            "bench.neighbours_loop",
            "--neighbour",
            attack,
            "--socket",
            socket,
        ]
        command += ["--seconds", str(args.seconds)]
        child = await asyncio.to_thread(
            subprocess.Popen, command, stdout=subprocess.PIPE, text=True
        )
        if child.stdout is None:
            raise RuntimeError("no pipe from the neighbour")
        started = await asyncio.to_thread(child.stdout.readline)  # connected: under way
        if started.strip() != "started":
            raise RuntimeError(f"the neighbour did not start: {started!r}")
    trips = await bystander(socket, args.trips, args.seconds)
    out: dict[str, Any] = {"attack": attack or "alone", **figures(trips)}
    if child is not None:
        child.terminate()  # it stops after its round under way and says how many it ran
        stdout, _ = await asyncio.to_thread(child.communicate, timeout=60)
        out["neighbour_rounds"] = int(stdout.split()[-1]) if stdout.split() else None
    return out


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="tierd-loop-") as name:
        home = Path(name)
        config = loop_config(home, args.blocks, args.book_mib, "flushes" in args.attacks)
        proc = await start(config, home)
        try:
            socket = config["socket"]["path"]
            began = time.monotonic()
            await fill(socket, args.blocks)
            print(f"filled {args.blocks} blocks in {time.monotonic() - began:.1f} s", flush=True)
            rows = []
            for attack in (None, *args.attacks):
                rows.append(await phase(attack, socket, args))
                print(json.dumps(rows[-1]), flush=True)
            return rows
        finally:
            proc.stop()


async def probe(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The daemon in this process's loop, beside a coroutine that takes one step per turn
    of the loop and times each turn in this thread's CPU time (so a turn the kernel gave
    to another process does not count): the loop's longest steps while each neighbour
    attacks. No bystander: the figure is the loop's own work, not the machine's load."""
    with tempfile.TemporaryDirectory(prefix="tierd-loop-") as name:
        home = Path(name)
        config = loop_config(home, args.blocks, args.book_mib, "flushes" in args.attacks)
        async with running_daemon(config):
            socket = config["socket"]["path"]
            await fill(socket, args.blocks)
            rows = []
            for attack in args.attacks:
                rows.append(await probed(attack, socket, args))
                print(json.dumps(rows[-1]), flush=True)
            return rows


async def probed(attack: str, socket: str, args: argparse.Namespace) -> dict[str, Any]:
    turns: list[float] = []

    async def tick() -> None:
        last = time.thread_time()
        while len(turns) < 10_000_000:
            await asyncio.sleep(0)
            now = time.thread_time()
            turns.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    command = [
        sys.executable,
        "-m",
        "bench.neighbours_loop",
        "--neighbour",
        attack,
        "--socket",
        socket,
    ]
    child = await asyncio.create_subprocess_exec(
        *command, "--seconds", str(args.seconds), stdout=subprocess.PIPE
    )
    stdout, _ = await child.communicate()
    ticker.cancel()
    ordered = sorted(turns)
    return {
        "attack": attack,
        "turns": len(ordered),
        "p999_turn_ms": round(ordered[int(len(ordered) * 0.999)] * 1e3, 3),
        "longest_turn_ms": round(ordered[-1] * 1e3, 3),
        "neighbour_rounds": int(stdout.split()[-1]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=240_000)
    parser.add_argument("--trips", type=int, default=50_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--book-mib", type=int, help="each tenant's book of descriptions (at its budget sooner)"
    )
    parser.add_argument("--probe", action="store_true", help="time the loop's turns instead")
    parser.add_argument(
        "--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS), help="the phases to run"
    )
    parser.add_argument("--neighbour", choices=ATTACKS, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.neighbour:
        print(asyncio.run(neighbour(args.neighbour, args.socket, args.seconds)))
        return
    if args.probe:
        for row in asyncio.run(probe(args)):
            print(
                f"{row['attack']:<12}{row['neighbour_rounds']:>8} rounds, longest loop turn"
                f" {row['longest_turn_ms']} ms, p99.9 {row['p999_turn_ms']} ms"
            )
        return
    rows = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'neighbour':<12}{'trips':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for row in rows:
        print(
            f"{row['attack']:<12}{row['trips']:>7}{row['p50_ms']:>9}{row['p99_ms']:>9}"
            f"{row['max_ms']:>9}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
