"""Part (b) of ``scripts/bench remote``: what the remote existence check adds to a
lookup of 32 keys, in-process (``TierChain.find``) and through a daemon
(``Client.lookup``), each without a remote level and with one (local hits; local misses
the server holds; local misses it does not hold), the cases interleaved call by call.
The case names (:data:`LOOKUP_CASES`, :data:`REMOTE_CASES`) are the report's rows."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import uvloop

from bench.figures import Figure, median_of
from bench.remote_servers import Daemon, RedisServer, daemons
from bench.remote_stats import KiB, block_keys
from tierd.client import Client
from tierd.keys import BlockKey
from tierd.library import open_chain
from tierd.remote.calls import RemoteSettings
from tierd.remote.redis_level import RedisLevel

LOOKUP_CASES = ("no remote, 32 local hits", "remote, 32 local hits")
REMOTE_CASES = ("remote, 32 local misses held remotely", "remote, 32 local misses held nowhere")


async def _chain_lookups(url: str, calls: int) -> dict[str, float]:
    """Median seconds of ``TierChain.find`` of 32 keys in each case (one run)."""
    block = 4 * KiB
    base = {"block_bytes": block, "tiers": [{"name": "mem", "kind": "memory", "capacity": 64}]}
    remote = {**base, "remote": {"url": url, "deadline": "1s"}}
    local, there, nowhere = (
        block_keys("local", 32),
        block_keys("remote", 32),
        block_keys("absent", 32),
    )
    data = [os.urandom(block) for _ in range(32)]
    async with open_chain(base) as plain, open_chain(remote) as chain:
        await plain.store(local, data)
        await chain.store(local, data)
        assert chain.remote is not None
        await chain.remote.level.put(there, data)
        cases = [
            (LOOKUP_CASES[0], plain, local, 32),
            (LOOKUP_CASES[1], chain, local, 32),
            (REMOTE_CASES[0], chain, there, 32),
            (REMOTE_CASES[1], chain, nowhere, 0),
        ]
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for call in range(calls):
            turn = call % len(cases)  # the order rotates: no case always follows another
            for name, target, keys, expect in cases[turn:] + cases[:turn]:
                started = time.perf_counter()
                found = await target.find(keys)
                times[name].append(time.perf_counter() - started)
                assert found.count == expect, (name, found)
    return {name: median_of(values) for name, values in times.items()}


async def _daemon_lookups(plain: Daemon, remote: Daemon, url: str, calls: int) -> dict[str, float]:
    """Median seconds of ``Client.lookup`` of 32 keys through each daemon (one run)."""
    block = 4 * KiB
    local, there, nowhere = (
        block_keys("local", 32),
        block_keys("remote", 32),
        block_keys("absent", 32),
    )
    data = [os.urandom(block) for _ in range(32)]
    await asyncio.gather(plain.ready(), remote.ready())
    async with (
        await Client.connect(plain.socket, namespace="bench", block_bytes=block) as a,
        await Client.connect(remote.socket, namespace="bench", block_bytes=block) as b,
    ):
        await a.store(local, data)
        await b.store(local, data)
        # The remote-only keys: the level writes them under the daemon's own key layout
        # (key prefix + namespace id + key), as a flush from another daemon would.
        namespace_id = bytes.fromhex(b.info["namespace_id"])
        settings = RemoteSettings(name="remote", block_bytes=block, url=url, deadline_s=5.0)
        writer = await RedisLevel(settings).open()
        assert await writer.put([BlockKey(namespace_id + k) for k in there], data) == 32
        await writer.close()
        cases = [
            (LOOKUP_CASES[0], a, local, 32),
            (LOOKUP_CASES[1], b, local, 32),
            (REMOTE_CASES[0], b, there, 32),
            (REMOTE_CASES[1], b, nowhere, 0),
        ]
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for call in range(calls):
            turn = call % len(cases)
            for name, client, keys, expect in cases[turn:] + cases[:turn]:
                started = time.perf_counter()
                found = await client.lookup(keys)
                times[name].append(time.perf_counter() - started)
                assert found.count == expect, (name, found)
    return {name: median_of(values) for name, values in times.items()}


def part_b(
    server: RedisServer, args: argparse.Namespace, base: Path
) -> tuple[dict[str, Figure], dict[str, Figure]]:
    chain_runs: dict[str, list[float]] = {}
    daemon_runs: dict[str, list[float]] = {}
    block = 4 * KiB
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": 64}]
    configs = [
        {"block_bytes": block, "tiers": tiers},
        {"block_bytes": block, "tiers": tiers, "remote": {"url": server.url, "deadline": "1s"}},
    ]
    with daemons(configs, base) as (plain, remote):
        for run in range(args.runs):
            server.sync.flushdb()
            for name, value in uvloop.run(_chain_lookups(server.url, args.calls)).items():
                chain_runs.setdefault(name, []).append(value)
            server.sync.flushdb()
            found = uvloop.run(_daemon_lookups(plain, remote, server.url, args.calls))
            for name, value in found.items():
                daemon_runs.setdefault(name, []).append(value)
            print(f"(b) run {run + 1}/{args.runs} done", file=sys.stderr)
    return (
        {k: Figure(v) for k, v in chain_runs.items()},
        {k: Figure(v) for k, v in daemon_runs.items()},
    )
