"""What the tests of daemons sharing one remote level (Redis or S3) have in common: the
block size and namespace they store under, the blocks themselves (derived from their
keys), a client of a spawned daemon, and ``tierd`` commands run in-process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from pathlib import Path
from typing import Any

from tests.daemon_kit import DaemonProcess
from tierd.cli import main
from tierd.client import Client
from tierd.keys import BlockKey
from tierd.testing import daemon_config

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


def node_config(home: Path, remote_url: str) -> dict[str, Any]:
    """A daemon of its own CPU and disk tiers over the shared remote level at ``remote_url``."""
    home.mkdir(mode=0o700)
    config = daemon_config(home, cpu_blocks=16, disk_blocks=64, block_bytes=BLOCK)
    # A generous deadline: this asserts hits, not latency, on a busy CI machine.
    config["remote"] = {"url": remote_url, "deadline": "2s"}
    config["logging"] = {"level": "warning"}
    return config
