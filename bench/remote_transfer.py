"""Part (a) of ``scripts/bench remote``: blocks through the tier against raw redis-py,
same server, same run. ``RedisLevel.put`` against a pipelined ``SET``, ``RedisLevel.get``
against a pipelined ``GET`` and one ``MGET``, plus the tier's write path in its two other
states (``EXISTS`` asked first; blocks the server already holds). Returns the seconds of
each operation per block size as :class:`Figure` values; the report turns them into GB/s."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Awaitable, Sequence

import uvloop
from redis.asyncio import Redis

from bench.figures import Figure, median_of
from bench.remote_servers import RedisServer
from bench.remote_stats import block_keys
from tierd.keys import BlockKey
from tierd.remote.calls import RemoteSettings
from tierd.remote.redis_level import RedisLevel


async def _transfer_run(
    url: str, size: int, batch: int, reps: int, warmup: int
) -> dict[str, list[float]]:
    """One run at one block size: per repetition, seconds of each operation."""
    settings = RemoteSettings(name="remote", block_bytes=size, url=url, deadline_s=10.0)
    level = await RedisLevel(settings).open()
    raw = Redis.from_url(url)
    payloads = [os.urandom(size) for _ in range(batch)]
    names = ("raw_set", "tier_set", "tier_set_checked", "raw_get", "raw_mget", "tier_get")
    times: dict[str, list[float]] = {k: [] for k in (*names, "raw_resend", "tier_held")}

    async def raw_set(keys: list[bytes]) -> None:
        pipe = raw.pipeline(transaction=False)
        for key, value in zip(keys, payloads, strict=True):
            pipe.set(key, value)
        await pipe.execute()

    async def raw_get(keys: list[bytes]) -> None:
        pipe = raw.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = await pipe.execute()
        assert all(len(v) == size for v in values)

    async def raw_mget(keys: list[bytes]) -> None:
        values = await raw.mget(keys)
        assert all(v is not None and len(v) == size for v in values)

    async def tier_set(keys: list[BlockKey]) -> None:
        assert await level.put(keys, payloads) == batch

    async def tier_set_checked(keys: list[BlockKey]) -> None:
        # The write path while writes find their blocks on the server: EXISTS first.
        learned, level.held_share = level.held_share, 1.0
        try:
            assert await level.put(keys, payloads) == batch
        finally:
            level.held_share = learned

    async def tier_held(keys: list[BlockKey]) -> None:
        learned, level.held_share = level.held_share, 1.0
        try:
            assert await level.put(keys, payloads) == 0  # all there: no bytes sent
        finally:
            level.held_share = learned

    async def tier_get(keys: list[BlockKey]) -> None:
        assert len(await level.get(keys)) == batch

    async def timed(name: str, call: Awaitable[None], record: bool) -> None:
        started = time.perf_counter()
        await call
        if record:
            times[name].append(time.perf_counter() - started)

    def rotated(
        items: Sequence[tuple[str, Awaitable[None]]], by: int
    ) -> list[tuple[str, Awaitable[None]]]:
        by %= len(items)
        return [*items[by:], *items[:by]]

    try:
        for rep in range(warmup + reps):
            # Each group's order rotates from one repetition to the next: the first write
            # after FLUSHDB, say, pays for the server's memory coming back.
            record = rep >= warmup
            await raw.flushdb(asynchronous=False)
            tier_keys, checked_keys = block_keys(f"t{rep}", batch), block_keys(f"c{rep}", batch)
            raw_keys = [b"raw:" + k for k in block_keys(f"r{rep}", batch)]
            writes = [
                ("raw_set", raw_set(raw_keys)),
                ("tier_set", tier_set(tier_keys)),
                ("tier_set_checked", tier_set_checked(checked_keys)),
            ]
            for name, call in rotated(writes, rep):
                await timed(name, call, record)
            reads = [
                ("raw_get", raw_get(raw_keys)),
                ("raw_mget", raw_mget(raw_keys)),
                ("tier_get", tier_get(tier_keys)),
            ]
            for name, call in rotated(reads, rep):
                await timed(name, call, record)
            again = [("raw_resend", raw_set(raw_keys)), ("tier_held", tier_held(tier_keys))]
            for name, call in rotated(again, rep):
                await timed(name, call, record)
    finally:
        await level.close()
        await raw.aclose()
    return times


def part_a(server: RedisServer, args: argparse.Namespace) -> dict[int, dict[str, Figure]]:
    results: dict[int, dict[str, list[float]]] = {}
    for run in range(args.runs):
        for size in args.sizes:
            times = uvloop.run(_transfer_run(server.url, size, args.batch, args.reps, 6))
            for name, values in times.items():
                results.setdefault(size, {}).setdefault(name, []).append(median_of(values))
        print(f"(a) run {run + 1}/{args.runs} done", file=sys.stderr)
    return {size: {k: Figure(v) for k, v in by.items()} for size, by in results.items()}
