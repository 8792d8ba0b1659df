#!/usr/bin/env python
"""What the second round's attacks cost a daemon, measured (a benchmark, not a test):

- ``stall``: a daemon whose remote level points at a server answering ``MGET`` with an
  array declared 2**31 long (``tests/fake_redis.py``); while one client loads four blocks
  the server claims to hold, another sends ``health`` round trips. Reported: the median and
  the longest round trip.
- ``pool``: N concurrent lookups of blocks held on a real redis-server (pool_size 16):
  how many were found, and how often the breaker opened.
- ``partial``: rounds of 4 connections each sending most of a 63 MiB frame, then closing;
  the daemon's RSS before, after, and after 2,000 lookups.
- ``scrape``: the control socket's median ``health`` round trip alone and with four
  threads scraping the metrics endpoint of a daemon with 1,000 tenants' worth of series.

Each part starts its own daemon (``tierd serve`` in a child process) and stops it by PID.
Usage: ``scripts/bench hostile stall|pool|partial|scrape``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.figures import median_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fake_redis import fake_redis  # noqa: E402
from redis_kit import redis_server  # noqa: E402

from tierd.client import Client  # noqa: E402
from tierd.testing import DaemonProcess, daemon_config, start_daemon_async  # noqa: E402

BLOCK = 4096
NAMESPACE = "bench"


async def start(config: dict[str, Any], home: Path) -> DaemonProcess:
    """``tierd serve`` of ``config`` (YAML and log in ``home``), once it is ready."""
    return await start_daemon_async(config, log=home / "tierd.log")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def stall(home: Path) -> None:
    with fake_redis("huge") as bad:
        config = daemon_config(home, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
        config["remote"] = {"url": bad.url, "deadline": "100ms", "breaker_failures": 1000}
        proc = await start(config, home)
        loader = await Client.connect(
            config["socket"]["path"], namespace=NAMESPACE, block_bytes=BLOCK
        )
        pinger = await Client.connect(config["socket"]["path"])
        done = asyncio.Event()
        trips: list[float] = []

        async def loads() -> None:
            for i in range(4):
                await loader.load([f"k{i}".encode()])
            done.set()

        async def pings() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await pinger.health()
                trips.append(time.perf_counter() - t)

        await asyncio.gather(loads(), pings())
        await loader.close()
        await pinger.close()
        proc.stop()
    print(
        f"stall: {len(trips)} health round trips, median {median_of(trips) * 1e3:.2f} ms,"
        f" longest {max(trips) * 1e3:.1f} ms"
    )


async def pool(home: Path) -> None:
    with redis_server(home / "redis") as server:
        for n in (32, 200):
            sub = home / f"pool{n}"
            sub.mkdir()
            config = daemon_config(sub, cpu_blocks=4 * n, disk_blocks=None, block_bytes=BLOCK)
            config["remote"] = {"url": server.url, "deadline": "1s"}
            proc = await start(config, sub)
            c = await Client.connect(
                config["socket"]["path"], namespace=NAMESPACE, block_bytes=BLOCK
            )
            keys = [f"p{n}-{i}".encode() for i in range(n)]
            await c.store(keys, [os.urandom(BLOCK) for _ in keys])
            await c.flush()
            proc.stop()
            proc = await start(config, sub)  # a fresh daemon: the blocks are on Redis only
            clients = [
                await Client.connect(
                    config["socket"]["path"], namespace=NAMESPACE, block_bytes=BLOCK
                )
                for _ in range(8)
            ]
            found = await asyncio.gather(*(clients[i % 8].lookup([k]) for i, k in enumerate(keys)))
            remote = (await clients[0].stats())["remote"]
            for client in clients:
                await client.close()
            proc.stop()
            print(
                f"pool: {n} concurrent lookups, found {sum(f.count for f in found)},"
                f" breaker opened {remote['breaker_opened']}, errors {remote['errors']},"
                f" busy {remote.get('busy', '-')}"
            )


async def partial(home: Path) -> None:
    config = daemon_config(home, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
    config["limits"] = {**config["limits"], "frame_deadline_s": 60}
    proc = await start(config, home)
    path = config["socket"]["path"]
    before = rss_mib(proc.pid)
    frame = 63 << 20
    chunk = b"\0" * (1 << 20)
    for _ in range(12):
        socks = []
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(struct.pack(">I", frame + 1024))
            socks.append(s)
        for s in socks:
            for _ in range(63):
                s.sendall(chunk)
        for s in socks:
            s.close()
    client = await Client.connect(path, namespace=NAMESPACE, block_bytes=BLOCK)
    after = rss_mib(proc.pid)
    for i in range(2000):
        await client.lookup([f"x{i}".encode()])
    later = rss_mib(proc.pid)
    await client.close()
    proc.stop()
    print(
        f"partial: RSS {before:.0f} MiB before, {after:.0f} after 12 rounds of 4 x 63 MiB,"
        f" {later:.0f} after 2,000 lookups"
    )


async def scrape(home: Path) -> None:
    config = daemon_config(home, cpu_blocks=2000, disk_blocks=None, block_bytes=BLOCK)
    uid = os.getuid()
    config["tenants"] = [{"name": "t0", "uids": [uid], "operator": True}] + [
        {"name": f"t{i}", "uids": [100000 + i]} for i in range(1, 1000)
    ]
    config["metrics"] = {"http_port": 0}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config["metrics"] = {"http_port": port}
    proc = await start(config, home)
    client = await Client.connect(config["socket"]["path"])

    async def median_trip(count: int) -> float:
        trips = []
        for _ in range(count):
            t = time.perf_counter()
            await client.health()
            trips.append(time.perf_counter() - t)
        return median_of(trips) * 1e3

    alone = await median_trip(500)
    stop_event = threading.Event()
    size = [0]

    def scraper() -> None:
        while not stop_event.is_set():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                size[0] = len(r.read())

    threads = [threading.Thread(target=scraper) for _ in range(4)]
    for t in threads:
        t.start()
    loaded = await median_trip(500)
    stop_event.set()
    for t in threads:
        t.join()
    await client.close()
    proc.stop()
    print(
        f"scrape: {size[0] / 1e6:.2f} MB per scrape; health median {alone:.2f} ms alone,"
        f" {loaded:.2f} ms with 4 scraping threads"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["stall", "pool", "partial", "scrape"])
    part = parser.parse_args(argv).part
    with tempfile.TemporaryDirectory(prefix="bh-") as tmp:
        home = Path(tmp)
        os.chmod(home, 0o700)
        asyncio.run(
            {"stall": stall, "pool": pool, "partial": partial, "scrape": scrape}[part](home)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
