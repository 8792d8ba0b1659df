"""Store blocks into a running tierd and load them back, from a second process.

    python examples/client_demo.py store --count 64      # write 64 blocks
    python examples/client_demo.py load --count 64       # read them back, check every byte

Block contents are derived from the key, so ``load`` can verify them even after the
daemon was restarted. ``--socket`` defaults to ``$TIERD_SOCKET``, else
``$TIERD_SOCKET__PATH`` (the daemon's own setting), else the daemon's default socket path.
Exit status: 0 ok; 1 a block missing or wrong; 3 no daemon answers.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys

from tierd.cli.connection import unreachable_reason
from tierd.client import Client, Unreachable
from tierd.config import default_socket_path

NAMESPACE = "demo/client"
BATCH = 16


def key_of(index: int) -> bytes:
    return hashlib.sha256(f"demo-block-{index}".encode()).digest()


def content_of(key: bytes, block_bytes: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (block_bytes // len(seed) + 1))[:block_bytes]


def batch_of(client: Client) -> int:
    """Blocks per load: at most what the daemon lets one connection hold in leases."""
    return min(BATCH, int(client.info.get("max_lease_blocks") or BATCH))


async def store(client: Client, count: int) -> None:
    # Batches of 16 (Client.store splits one further when the daemon takes fewer at once).
    stored = 0
    for start in range(0, count, BATCH):
        keys = [key_of(i) for i in range(start, min(count, start + BATCH))]
        stored += await client.store(keys, [content_of(k, client.block_bytes) for k in keys])
    print(f"stored {stored} new blocks ({count - stored} were cached already)")


async def load(client: Client, count: int) -> int:
    keys = [key_of(i) for i in range(count)]
    found = await client.lookup(keys)
    media = {m: found.media.count(m) for m in sorted(set(found.media))}
    print(f"lookup: {found.count} of {count} cached {media}")
    good = bad = 0
    step = batch_of(client)
    for start in range(0, found.count, step):
        batch = keys[start : min(found.count, start + step)]
        for key, data in zip(batch, await client.load(batch), strict=False):
            if data == content_of(key, client.block_bytes):
                good += 1
            else:
                bad += 1
    print(f"loaded {good} blocks byte-identical, {bad} wrong")
    return 1 if bad or found.count < count else 0


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["store", "load"])
    parser.add_argument("--count", type=int, default=64)
    env = os.environ
    socket = env.get("TIERD_SOCKET") or env.get("TIERD_SOCKET__PATH") or str(default_socket_path())
    parser.add_argument("--socket", default=socket)
    args = parser.parse_args(argv)
    try:
        client = await Client.connect(args.socket, namespace=NAMESPACE)
    except Unreachable as exc:
        # The words `tierd stats` uses: whether a daemon runs there, and how to start one.
        reason = unreachable_reason(exc)
        print(f"client_demo: cannot reach tierd at {args.socket}: {reason}", file=sys.stderr)
        return 3
    async with client:
        if args.action == "store":
            await store(client, args.count)
            return 0
        return await load(client, args.count)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
