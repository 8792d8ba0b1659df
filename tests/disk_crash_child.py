"""Child process for the disk store's crash test: writes blocks forever, reports acks.

Usage: ``python disk_crash_child.py DIR[,DIR...] NUM_BLOCKS BLOCK_BYTES FSYNC`` (the mode:
``always``, ``batch`` or ``none``). Block ``i`` goes to slot ``i % NUM_BLOCKS`` under key
:func:`int_key(i) <tierd.keys.int_key>` with the bytes :func:`content` gives for ``i``;
after each batch it prints ``ack I`` for every block whose write the store acknowledged.
The parent kills it with SIGKILL: :func:`kill_after_acks` runs a child that speaks this
``ack I`` protocol (this one, or another writer) and returns the blocks it acknowledged.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from pathlib import Path

from tierd.keys import int_key
from tierd.stores.disk.store import DiskStore

BATCH = 4


async def kill_after_acks(argv: list[str], cwd: Path, acks: int) -> list[int]:
    """Run ``argv``, SIGKILL it once it printed ``acks`` lines ``ack I``; the ``I``s it
    printed. Bounded: two minutes for the acks."""
    child = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, cwd=str(cwd)
    )
    acked: list[int] = []
    try:
        if child.stdout is None:
            raise RuntimeError("the child's stdout is not a pipe")
        async with asyncio.timeout(120):
            while len(acked) < acks and (line := await child.stdout.readline()):
                if line.startswith(b"ack "):
                    acked.append(int(line.split()[1]))
        child.send_signal(signal.SIGKILL)
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    assert len(acked) >= acks, "the child died before it acknowledged enough blocks"
    return acked


def content(i: int, block_bytes: int) -> bytes:
    """The deterministic bytes of block ``i``."""
    return random.Random(i).randbytes(block_bytes)


async def main(dirs: list[str], num_blocks: int, block_bytes: int, fsync: str) -> None:
    store = DiskStore(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        directories=dirs,
        fsync=fsync,
        blocks_per_task=2,
        journal_limit_bytes=4096,  # checkpoint often, so kills land in checkpoints too
    )
    await store.open()
    print("ready", flush=True)
    i = 0
    while True:
        ids = range(i, i + BATCH)
        ok = await store.write(
            [n % num_blocks for n in ids],
            [int_key(n) for n in ids],
            [content(n, block_bytes) for n in ids],
        )
        print("\n".join(f"ack {n}" for n, good in zip(ids, ok, strict=True) if good), flush=True)
        i += BATCH


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
