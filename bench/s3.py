#!/usr/bin/env python
"""Object-store level benchmark, on a real S3 server (SeaweedFS ``weed mini`` on
loopback, started and stopped here by its PID): tierd's S3 level against the raw client
library in the same run, the choice of one object per block, and a fresh node's warm
start.

(a) One block, and a batch of 32 blocks, of 64 KiB and of 1 MiB: ``S3Level.put`` (values
framed and checksummed, create-only ``PUT``) against obstore's plain ``put`` of the bare
payloads, and ``S3Level.get`` (every value checked before it is handed on) against
obstore's ``get`` of the same objects. New keys each repetition; the order of the two
alternates. Reported as time and as throughput tier / raw (target: at least 0.8x).

(b) Packing: the same 32 blocks as 32 objects or as one object (raw obstore), written and
read back, to show what packing a run of a prefix's blocks would save.

(c) Warm start: node A (a memory tier over the S3 level) sends ``--warm-blocks`` blocks of
64 KiB down; a fresh node B (a memory tier of that many blocks over the same bucket) then
finds and loads them all, 32 per call, into its own tier: blocks/s, against raw obstore
``get`` of the same objects with the same concurrency.

Every figure is the median of ``--runs`` runs (spread min-max in brackets). Markdown to
stdout; ``--quick`` is a smoke run. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for extra in (str(ROOT / "tests"),):
    if extra not in sys.path:
        sys.path.insert(0, extra)

import obstore  # noqa: E402
import uvloop  # noqa: E402
from s3_kit import SeaweedServer  # noqa: E402

from bench.figures import Figure, median_of  # noqa: E402
from bench.remote_stats import block_keys  # noqa: E402
from tierd.config import ChainConfig  # noqa: E402
from tierd.keys import BlockKey  # noqa: E402
from tierd.library import open_chain  # noqa: E402
from tierd.remote.s3_calls import S3Settings  # noqa: E402
from tierd.remote.s3_level import S3Level  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32


def settings(server: SeaweedServer, block: int, prefix: str) -> S3Settings:
    return S3Settings(
        name="s3",
        block_bytes=block,
        bucket=server.bucket,
        endpoint=server.endpoint,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        key_prefix=prefix,
        deadline_s=30.0,
    )


async def timed(call: Callable[..., Awaitable[Any]], *args: Any) -> float:
    start = time.perf_counter()
    await call(*args)
    return time.perf_counter() - start


async def raw_read(raw: Any, path: str) -> Any:
    return await (await obstore.get_async(raw, path)).bytes_async()


async def raw_puts(raw: Any, paths: list[str], payloads: list[bytes]) -> None:
    await asyncio.gather(
        *(obstore.put_async(raw, p, d) for p, d in zip(paths, payloads, strict=True))
    )


async def raw_gets(raw: Any, paths: list[str]) -> None:
    await asyncio.gather(*(raw_read(raw, p) for p in paths))


async def tier_put(level: S3Level, keys: list[BlockKey], payloads: list[bytes]) -> None:
    if await level.put(keys, payloads) != len(keys):
        raise RuntimeError("the tier wrote fewer blocks than asked")


async def tier_get(level: S3Level, keys: list[BlockKey]) -> None:
    if len(await level.get(keys)) != len(keys):
        raise RuntimeError("the tier read fewer blocks than asked")


async def part_a(server: SeaweedServer, block: int, count: int, reps: int) -> dict[str, float]:
    """Median seconds of each of: tier put/get, raw put/get (one run of ``reps``)."""
    level = await S3Level(settings(server, block, f"a{os.getpid()}/")).open()
    raw = server.store()
    payloads = [os.urandom(block) for _ in range(count)]
    times: dict[str, list[float]] = {"tier_put": [], "tier_get": [], "raw_put": [], "raw_get": []}
    for rep in range(reps + 1):  # the first warms the connections up: not counted
        keys = block_keys(f"r{rep}-{time.time_ns()}", count)
        paths = [f"raw{os.getpid()}/{k.hex()}" for k in keys]
        steps = [
            ("tier", (tier_put, level, keys, payloads), (tier_get, level, keys)),
            ("raw", (raw_puts, raw, paths, payloads), (raw_gets, raw, paths)),
        ]
        for name, put, get in steps if rep % 2 else steps[::-1]:
            put_s, get_s = await timed(*put), await timed(*get)
            if rep:
                times[f"{name}_put"].append(put_s)
                times[f"{name}_get"].append(get_s)
        # Not timed: the server's volumes stay small.
        await obstore.delete_async(raw, [level.path(k) for k in keys] + paths)
    await level.close()
    return {name: median_of(values) for name, values in times.items()}


async def part_b(server: SeaweedServer, reps: int) -> dict[str, float]:
    """Median seconds to write and read 32 blocks of 64 KiB as 32 objects and as one."""
    raw = server.store()
    payloads = [os.urandom(64 * KiB) for _ in range(BATCH)]
    packed = b"".join(payloads)
    times: dict[str, list[float]] = {"many_put": [], "many_get": [], "one_put": [], "one_get": []}
    for rep in range(reps):
        tag = f"pack{os.getpid()}-{rep}-{time.time_ns()}"
        paths = [f"{tag}/{i}" for i in range(BATCH)]
        times["many_put"].append(await timed(raw_puts, raw, paths, payloads))
        times["many_get"].append(await timed(raw_gets, raw, paths))
        times["one_put"].append(await timed(raw_puts, raw, [f"{tag}/all"], [packed]))
        times["one_get"].append(await timed(raw_gets, raw, [f"{tag}/all"]))
        await obstore.delete_async(raw, [*paths, f"{tag}/all"])
    return {name: median_of(values) for name, values in times.items()}


def chain_config(server: SeaweedServer, blocks: int, prefix: str) -> ChainConfig:
    secret = Path(tempfile.mkstemp(prefix="tierd-bench-secret-")[1])
    secret.write_text(server.secret_key)
    secret.chmod(0o600)
    return ChainConfig.model_validate(
        {
            "block_bytes": 64 * KiB,
            "tiers": [{"name": "mem", "kind": "memory", "capacity": blocks}],
            "remote": {
                "kind": "s3",
                "endpoint": server.endpoint,
                "bucket": server.bucket,
                "key_prefix": prefix,
                "access_key_id": server.access_key,
                "secret_access_key_file": str(secret),
                "deadline": "30s",
                "max_pending_writes": "1GiB",
            },
        }
    )


async def part_c(server: SeaweedServer, count: int) -> tuple[float, float]:
    """(blocks/s of a fresh node's warm start through its chain, blocks/s of raw gets)."""
    prefix = f"warm{os.getpid()}-{time.time_ns()}/"
    keys = block_keys("warm", count)
    async with open_chain(chain_config(server, BATCH, prefix)) as a:
        for start in range(0, count, BATCH):
            part = keys[start : start + BATCH]
            await a.store(part, [os.urandom(64 * KiB) for _ in part])
        await a.flush()
        assert a.remote is not None
        await a.remote.level.drain()
    async with open_chain(chain_config(server, count, prefix)) as b:
        start_t = time.perf_counter()
        for start in range(0, count, BATCH):
            part = keys[start : start + BATCH]
            found = await b.find(part)
            if found.count != len(part):
                raise RuntimeError(f"warm start found {found.count} of {len(part)}")
            async with b.loading(part) as handle:
                handle.views()
        chain_s = time.perf_counter() - start_t
        if b.lookup(keys).count != count:
            raise RuntimeError("the warm blocks are not all in the fresh node's tier")
        assert b.remote is not None
        level = b.remote.level
        assert isinstance(level, S3Level)
        raw = server.store()
        paths = [level.path(k) for k in keys]
        start_t = time.perf_counter()
        for start in range(0, count, BATCH):
            await raw_gets(raw, paths[start : start + BATCH])
        raw_s = time.perf_counter() - start_t
    return count / chain_s, count / raw_s


def row(name: str, tier: Figure, raw: Figure) -> str:
    ratio = Figure([r / t for t, r in zip(tier.runs, raw.runs, strict=True)])
    return f"| {name} | {tier.text(1e3, 2)} | {raw.text(1e3, 2)} | {ratio.text(1, 2)} |"


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="tierd-bench-s3-") as tmp:
        server = SeaweedServer(Path(tmp) / "weed", volume_mb=256, volumes=32).start()
        try:
            await report(server, args)
        finally:
            server.stop()


async def report(server: SeaweedServer, args: argparse.Namespace) -> None:
    print("| blocks | tier ms | raw obstore ms | throughput tier / raw |")
    print("|---|---|---|---|")
    for block in (64 * KiB, MiB):
        for count in (1, BATCH):
            runs = [await part_a(server, block, count, args.reps) for _ in range(args.runs)]
            for op in ("put", "get"):
                tier = Figure([r[f"tier_{op}"] for r in runs])
                raw = Figure([r[f"raw_{op}"] for r in runs])
                print(row(f"{op} {count} x {block // KiB} KiB", tier, raw))
    packs = [await part_b(server, args.reps) for _ in range(args.runs)]
    print("\n| 32 x 64 KiB | 32 objects ms | one object ms |")
    print("|---|---|---|")
    for op in ("put", "get"):
        many = Figure([p[f"many_{op}"] for p in packs])
        one = Figure([p[f"one_{op}"] for p in packs])
        print(f"| {op} | {many.text(1e3, 2)} | {one.text(1e3, 2)} |")
    warm = [await part_c(server, args.warm_blocks) for _ in range(args.runs)]
    chain, raw = Figure([w[0] for w in warm]), Figure([w[1] for w in warm])
    ratio = Figure([w[0] / w[1] for w in warm])
    print(f"\nwarm start of a fresh node, {args.warm_blocks} blocks of 64 KiB, {BATCH} per call:")
    print(f"- through the chain (find + load into its tier): {chain.text(1, 0)} blocks/s")
    print(f"- raw obstore gets: {raw.text(1, 0)} blocks/s; chain / raw {ratio.text(1, 2)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=9, help="repetitions per run (median)")
    parser.add_argument("--warm-blocks", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="one short run")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.reps, args.warm_blocks = 1, 2, 64
    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
