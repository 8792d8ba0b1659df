"""Two real ``tierd serve`` processes over one shared redis-server: a block stored through
one daemon is found and loaded byte-exact through the other, which names the remote level
as where it was, counts the hit in its stats, and shows the level in ``tierd top``.

Each daemon is a child process with its own socket, its own CPU tier (shared memory) and
its own disk tier directory; both name the same ``remote: url``. The blocks reach the
server deterministically: ``flush`` through daemon A copies its CPU tier down to its disk
tier and then sends the disk tier's blocks to the remote level, waiting for the writes.
Start-up is awaited by polling for a hello answer under a deadline (a process start is not
something a test can hook into); every process is stopped by its PID.

The last tests check the write path the daemons share through the level itself: a write
asks ``EXISTS`` first only while that pays, and the value buffers it reuses never mix
blocks up.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis_kit import RedisServer, redis_server

from tierd.cli import main
from tierd.client import Client, Unreachable
from tierd.keys import BlockKey
from tierd.remote.redis_level import RedisLevel, RemoteSettings
from tierd.testing import short_socket_path

BLOCK = 16 << 10
NAMESPACE = "model-x"
START_DEADLINE_S = 30.0  # a loaded CI machine starting Python and mapping a pool
EXIT_DEADLINE_S = 60.0


def block(key: bytes) -> bytes:
    return random.Random(key).randbytes(BLOCK)


def names(prefix: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{prefix}-{i}".encode()) for i in range(count)]


def child_env() -> dict[str, str]:
    """This environment without anything that would configure the daemon."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("TIERD_") and k != "NOTIFY_SOCKET"
    }


class Serve:
    """One ``tierd serve`` child process; its output goes to a file (no pipe to fill)."""

    def __init__(self, home: Path, remote_url: str) -> None:
        home.mkdir(mode=0o700)
        disk = home / "disk"
        disk.mkdir(mode=0o700)
        socket_path = home / "tierd.sock"
        # A Unix socket path has at most 107 bytes; pytest's tmp_path can be long.
        self.socket = str(socket_path) if len(str(socket_path)) < 100 else short_socket_path()
        self.config: dict[str, Any] = {
            "block_bytes": BLOCK,
            "tiers": [
                {"name": "cpu", "kind": "cpu", "capacity": 16},
                {"name": "disk", "kind": "disk", "capacity": 64, "directories": [str(disk)]},
            ],
            "socket": {"path": self.socket},
            # A generous deadline: this asserts hits, not latency, on a busy CI machine.
            "remote": {"url": remote_url, "deadline": "2s"},
            "logging": {"level": "warning"},
        }
        config_file = home / "tierd.yaml"
        config_file.write_text(yaml.safe_dump(self.config))
        self.log = home / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierd", "serve", "-c", str(config_file)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=child_env(),
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_ready(self) -> None:
        """Poll until the socket answers a hello; fail at once if the process exits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_DEADLINE_S
        while True:
            status = self.proc.poll()
            if status is not None:
                raise AssertionError(f"tierd serve exited with {status}:\n{self.output()}")
            try:
                client = await Client.connect(self.socket)
            except Unreachable:
                if loop.time() > deadline:
                    message = f"no hello within {START_DEADLINE_S}s:\n{self.output()}"
                    raise AssertionError(message) from None
                await asyncio.sleep(0.05)  # start-up: nothing to wait on but the socket
                continue
            await client.close()
            return

    async def client(self, namespace: str = NAMESPACE) -> Client:
        return await Client.connect(self.socket, namespace=namespace, block_bytes=BLOCK)

    def stop(self) -> int:
        """SIGTERM by PID, then wait for the exit (SIGKILL only past the deadline)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(EXIT_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(EXIT_DEADLINE_S)
                raise AssertionError(f"tierd serve ignored SIGTERM:\n{self.output()}") from None
        return self.proc.returncode


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@asynccontextmanager
async def two_daemons(tmp_path: Path, url: str) -> AsyncIterator[tuple[Serve, Serve]]:
    """Daemons A and B over the server at ``url``, both ready; stopped (status 0) on exit."""
    started: list[Serve] = []
    try:
        for name in ("a", "b"):
            started.append(Serve(tmp_path / name, url))
        await asyncio.gather(*(daemon.wait_ready() for daemon in started))
        yield started[0], started[1]
    finally:
        statuses = [await asyncio.to_thread(daemon.stop) for daemon in started]
    assert statuses == [0] * len(started), [d.output() for d in started]


async def cli(*argv: str) -> tuple[int, str]:
    """``tierd ARGV`` run in a worker thread (it runs its own event loop): (status, stdout)."""
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return main(list(argv))

    status = await asyncio.to_thread(run)
    return status, out.getvalue()


async def test_a_block_stored_through_one_daemon_loads_byte_exact_through_another(
    tmp_path: Path, server: RedisServer
) -> None:
    keys = names("shared", 6)
    async with two_daemons(tmp_path, server.url) as (a, b):
        async with await a.client() as client:
            assert await client.store(keys, [block(k) for k in keys]) == len(keys)
            flushed = await client.flush()
            assert flushed.dirty == 0, flushed
            a_remote = (await client.stats())["remote"]
        assert a_remote["stores"] == len(keys) and a_remote["write_errors"] == 0
        assert server.cli("DBSIZE").strip() == str(len(keys))

        async with await b.client() as client:
            before = await client.stats()
            assert before["remote"]["hits"] == 0
            assert all(tier["used"] == 0 for tier in before["tiers"])  # B holds nothing
            # One more key that nobody stored: the run of hits stops before it.
            found = await client.lookup([*keys, b"nobody-stored-this"])
            assert found.count == len(keys)
            assert found.media == ("REMOTE",) * len(keys)
            assert await client.load(keys) == [block(k) for k in keys]
            # Promoted into B's own CPU tier: the next lookup is local.
            assert (await client.lookup(keys)).media == ("CPU",) * len(keys)
            after = await client.stats()

        remote = after["remote"]
        assert remote["medium"] == "REMOTE" and remote["state"] == "closed"
        assert remote["endpoint"] == server.url
        assert remote["lookup_hits"] == len(keys)  # lookups found them only remotely
        assert remote["hits"] == len(keys)  # read, verified
        assert remote["promotions"] == len(keys)
        assert remote["corrupt"] == remote["errors"] == remote["timeouts"] == 0
        assert remote["bytes_read"] >= len(keys) * BLOCK
        cpu = next(tier for tier in after["tiers"] if tier["name"] == "cpu")
        assert cpu["promotions"] == len(keys) and cpu["used"] == len(keys)

        # Another namespace is another key prefix: B finds nothing of model-x's there.
        async with await b.client("model-y") as client:
            assert (await client.lookup(keys)).count == 0

        status, out = await cli("stats", "--json", "--socket", b.socket)
        assert status == 0
        assert '"lookup_hits": 6' in out and '"medium": "REMOTE"' in out
        status, out = await cli("stats", "--socket", b.socket)
        assert status == 0
        assert f"remote remote (REMOTE) {server.url}: breaker closed, 6 lookup hits" in out
        status, out = await cli(
            "top", "--socket", b.socket, "--plain", "--count", "1", "--interval", "0.05"
        )
        assert status == 0, out
        assert f"remote remote (REMOTE) {server.url}" in out
        assert "breaker closed" in out and "lookup hits 6" in out


# -- the write path both daemons use (tierd/remote/redis_level.py) -------------------------


def exists_calls(server: RedisServer) -> int:
    """How many EXISTS commands the server has run."""
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_exists:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def open_level(server: RedisServer, block_bytes: int) -> RedisLevel:
    settings = RemoteSettings(name="remote", block_bytes=block_bytes, url=server.url)
    return await RedisLevel(settings).open()


async def test_writes_ask_which_blocks_are_there_only_while_that_pays(
    server: RedisServer,
) -> None:
    size = 256 << 10  # EXISTS first pays when more than 1/8 of written blocks are there
    payload = random.Random(1).randbytes(size)
    level = await open_level(server, size)
    try:
        assert level.check_above == 1 / 8 and level.held_share > level.check_above
        new = names("new", 7)
        assert await level.put(new[:1], [payload]) == 1
        assert exists_calls(server) == 1  # a fresh level asks first
        for i in range(1, 6):  # new blocks, written: the share of held ones falls
            assert await level.put(new[i : i + 1], [payload]) == 1
        asked = exists_calls(server)
        assert level.held_share < level.check_above
        assert await level.put(new[6:], [payload]) == 1
        assert exists_calls(server) == asked  # no EXISTS round trip for new blocks
        # Blocks another node wrote: SET NX says they were there, and writes ask again.
        assert await level.put(new[:2], [payload, payload]) == 0
        assert level.held_share > level.check_above
        assert await level.put(new[2:3], [payload]) == 0
        assert exists_calls(server) == asked + 1
        stats = level.stats()
        assert stats["stores"] == 7 and stats["skipped"] == 3
    finally:
        await level.close()


async def test_small_blocks_are_written_once_without_asking(server: RedisServer) -> None:
    size = 4096  # a check costs more than sending such a block again
    keys = names("small", 40)
    first, second = await open_level(server, size), await open_level(server, size)
    try:
        assert first.held_share <= first.check_above == 1.0
        # Many writes in a row: the value buffers are reused; every value reads back whole.
        for start in range(0, len(keys), 8):
            part = keys[start : start + 8]
            assert await first.put(part, [block(k)[:size] for k in part]) == len(part)
        assert await second.put(keys, [block(k)[:size] for k in keys]) == 0  # SET NX
        assert exists_calls(server) == 0
        assert second.stats()["skipped"] == len(keys)
        got = await second.get(keys)
        assert [bytes(view) for view in got] == [block(k)[:size] for k in keys]
    finally:
        await first.close()
        await second.close()
