"""What the tests of daemons sharing one remote level (Redis or S3) have in common: the
block size and namespace they store under, the blocks themselves (derived from their
keys), a client of a spawned daemon, and ``tierd`` commands run in-process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import random

from tests.test_daemon_lifecycle import DaemonProcess
from tierd.cli import main
from tierd.client import Client
from tierd.keys import BlockKey

BLOCK = 16 << 10
NAMESPACE = "model-x"


def block(key: bytes) -> bytes:
    return random.Random(key).randbytes(BLOCK)


def names(prefix: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{prefix}-{i}".encode()) for i in range(count)]


async def connect(daemon: DaemonProcess, namespace: str = NAMESPACE) -> Client:
    return await Client.connect(daemon.socket_path, namespace=namespace, block_bytes=BLOCK)


async def cli(*argv: str) -> tuple[int, str]:
    """``tierd ARGV`` run in a worker thread (it runs its own event loop): (status, stdout)."""
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return main(list(argv))

    status = await asyncio.to_thread(run)
    return status, out.getvalue()
