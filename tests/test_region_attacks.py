"""Engine host regions attacked: a region is hostile input like any frame.

Through a real daemon in the test's loop: descriptors that are not memory files (sockets,
pipes, directories, O_PATH, read-only, O_APPEND, a disk file, the daemon's own pool),
sizes the file does not have, offsets outside the region, a file truncated after it was
registered, a client that dies while the daemon copies for it, and raw clients that break
the registration exchange (no descriptor, two, frames pipelined behind the request). Each
gets a clear error or a dropped connection; the daemon keeps serving, leaks no descriptor,
and holds no pin or slot afterwards.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import tierd.control.engine_regions.requests as regions_module
from tests.loop_daemon_kit import assert_idle, connect, connect_watched, serve, socket_of
from tests.regions_kit import (
    held_disk_reads,
    memfd,
    open_descriptors,
    pattern,
    put,
    read,
    refused,
    rows,
)
from tierd.client import DaemonError, Unreachable
from tierd.control.protocol import HEADER, PROTOCOL_VERSION, encode
from tierd.daemon import Daemon

# The daemon's connections, watched (conftest's fixture).
pytestmark = pytest.mark.usefixtures("_watch_connections")

BLOCK = 4096


def tenants_of(daemon: Daemon) -> list[Any]:
    assert daemon.server is not None
    return list(daemon.server.ctx.tenants.tenants)


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- what a region may be --------------------------------------------------------------------


@contextmanager
def opened(path: str | os.PathLike[str], flags: int) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


async def test_descriptors_that_are_not_memory_files_are_refused(tmp_path: Path) -> None:
    disk_file = tmp_path / "on-disk"
    disk_file.write_bytes(bytes(8 * BLOCK))
    left, right = socket.socketpair()
    reader, writer = os.pipe()
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(8 * BLOCK, "attack-kinds") as mem:
            proc = f"/proc/self/fd/{mem}"
            cases: list[tuple[str, Callable[[], Any], str]] = [
                ("socket", lambda: left.fileno(), "not a socket"),
                ("pipe", lambda: writer, "not a pipe"),
                ("directory", lambda: os.open(tmp_path, os.O_RDONLY), "not a directory"),
                ("O_PATH", lambda: os.open(proc, os.O_PATH), "O_PATH"),
                ("read-only", lambda: os.open(proc, os.O_RDONLY), "O_RDWR"),
                ("O_APPEND", lambda: os.open(proc, os.O_RDWR | os.O_APPEND), "O_APPEND"),
                ("disk file", lambda: os.open(disk_file, os.O_RDWR), "in memory"),
            ]
            before = descriptors()
            for name, make, words in cases:
                fd = make()
                try:
                    message = await refused(client.register_region(fd, 4 * BLOCK))
                    assert words in message, (name, message)
                finally:
                    if fd not in (left.fileno(), writer):
                        os.close(fd)
            assert descriptors() == before  # the daemon closed every one it received
            # The connection still serves, and a good region still registers.
            region = await client.register_region(mem, 8 * BLOCK)
            assert await client.region_store(region, [b"ok"], rows(0)) == [True]
    for fd in (reader, writer):
        os.close(fd)
    left.close()
    right.close()


async def test_sizes_the_file_does_not_have_are_refused(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(8 * BLOCK, "attack-sizes") as fd:
            message = await refused(client.register_region(fd, 8 * BLOCK + 1))
            assert "larger than its file" in message
            for size in (0, 1 << 50, (1 << 64) - 1):
                await refused(client.register_region(fd, size))
            assert open_descriptors("attack-sizes") == 1
            assert await client.register_region(fd, 8 * BLOCK) == 1


async def test_the_daemons_own_pool_cannot_be_a_region(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        (tenant,) = tenants_of(daemon)
        assert tenant.pool is not None
        pool = os.dup(tenant.pool.fd)  # as a client that kept its pool descriptor has it
        try:
            message = await refused(client.register_region(pool, BLOCK))
            assert "own" in message
        finally:
            os.close(pool)


async def test_a_connection_holds_a_few_regions_at_most(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(BLOCK, "attack-count") as fd:
            ids = [
                await client.register_region(fd, BLOCK) for _ in range(regions_module.MAX_REGIONS)
            ]
            assert ids == list(range(1, regions_module.MAX_REGIONS + 1))
            await refused(client.register_region(fd, BLOCK), "capacity")
            assert open_descriptors("attack-count") == 1 + regions_module.MAX_REGIONS
            await client.unregister_region(ids[0])
            await client.register_region(fd, BLOCK)


# -- descriptors of a job --------------------------------------------------------------------


async def test_offsets_outside_the_region_are_refused_and_change_nothing(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        # The file is larger than the region: only the registered size may be reached.
        with memfd(16 * BLOCK) as fd:
            put(fd, pattern(b"outside", BLOCK), 8 * BLOCK)
            region = await client.register_region(fd, 8 * BLOCK)
            assert await client.region_store(region, [b"in"], rows(0)) == [True]
            bad = [
                rows(8),  # just past the end
                np.array([[8 * BLOCK - 1]], dtype=np.uint64),  # one byte over
                np.array([[(1 << 64) - 1]], dtype=np.uint64),  # wraps around
                np.array([[(1 << 64) - BLOCK]], dtype=np.uint64),
            ]
            for offsets in bad:
                await refused(client.region_store(region, [b"new"], offsets))
                await refused(client.region_load(region, [b"in"], offsets))
            assert await client.lookup_each([b"new"]) == [False]
            assert read(fd, 8 * BLOCK) == pattern(b"outside", BLOCK)
            # One bad key refuses the whole job, before anything moves.
            await refused(client.region_load(region, [b"in", b"in"], rows(1, 9)))
            assert read(fd, BLOCK) == bytes(BLOCK)
            await assert_idle(daemon, client)


async def test_malformed_jobs_are_refused(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(8 * BLOCK) as fd:
            region = await client.register_region(fd, 8 * BLOCK)
            good = rows(0).tobytes()
            for fields in (
                {"offsets": good[:-1]},  # short
                {"offsets": good + good},  # one key, two offsets
                {"offsets": [0]},  # not bin
                {"pieces": [BLOCK, 1], "offsets": good * 2},  # more than a block
                {"pieces": [BLOCK // 2], "offsets": good},  # less
                {"pieces": [0, BLOCK], "offsets": good * 2},
                {"pieces": [64] * 64 + [BLOCK - 64 * 64], "offsets": good * 65},
                {"pieces": "all", "offsets": good},
            ):
                request = {"region": region, "keys": [b"k"], "offsets": good, **fields}
                for op in ("region_store", "region_load"):
                    await refused(client.request(op, **request))
            await refused(client.request("region_load", keys=[b"k"], offsets=good), "bad_request")
            await refused(
                client.request("region_load", region=99, keys=[b"k"], offsets=good),
                "unknown_region",
            )
            await refused(client.unregister_region(99), "unknown_region")
            assert await client.lookup_each([b"k"]) == [False]


async def test_a_region_truncated_after_registering_fails_its_keys(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(8 * BLOCK) as fd:
            for i in range(8):
                put(fd, pattern(b"t%d" % i, BLOCK), i * BLOCK)
            region = await client.register_region(fd, 8 * BLOCK)
            assert await client.region_store(region, [b"early"], rows(6)) == [True]
            os.ftruncate(fd, 2 * BLOCK + 100)  # the engine shrinks its memory under us
            keys = [b"k0", b"k1", b"k2", b"k5"]
            assert await client.region_store(region, keys, rows(0, 1, 2, 5)) == [
                True,
                True,
                False,
                False,
            ]
            assert await client.lookup_each(keys) == [True, True, False, False]
            # A load into a file shrunk below its registered size is refused whole (the
            # daemon seals the file first: it can neither shrink further nor grow), and
            # never grows it.
            with pytest.raises(DaemonError, match="less than the 32768 registered"):
                await client.region_load(region, [b"k0", b"early", b"k1"], rows(1, 4, 2))
            assert os.fstat(fd).st_size == 2 * BLOCK + 100
            assert read(fd, BLOCK) == pattern(b"t1", BLOCK)  # untouched
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 8 * BLOCK)
            assert await client.region_store(region, [b"k0"], rows(0)) == [True]
            await assert_idle(daemon, client)


# -- a client that dies mid-job ----------------------------------------------------------------


@pytest.mark.parametrize("op", ["region_store", "region_load"])
async def test_a_client_that_dies_mid_job_costs_a_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    entered, gate = threading.Event(), threading.Event()
    name = "read_region" if op == "region_store" else "write_region"
    real = getattr(regions_module, name)

    def held(*args: Any) -> Any:
        entered.set()
        gate.wait(30)
        return real(*args)

    monkeypatch.setattr(regions_module, name, held)
    async with serve(tmp_path) as daemon:
        with memfd(8 * BLOCK, "attack-dies") as fd:
            put(fd, pattern(b"dies", BLOCK), 0)
            if op == "region_load":
                async with await connect(daemon) as setup:
                    await setup.store([b"k"], [pattern(b"dies", BLOCK)])
            client, conn = await connect_watched(daemon)
            region = await client.register_region(fd, 8 * BLOCK)
            pending = client.send(op, region=region, keys=[b"k"], offsets=rows(1).tobytes())
            try:
                await asyncio.to_thread(entered.wait, 30)
                await client.close()  # the client is gone while the daemon copies for it
                with pytest.raises(Unreachable):
                    await pending
                async with asyncio.timeout(30):
                    await conn.gone.wait()
                # The copy still runs: its descriptor stays open, its blocks held.
                assert open_descriptors("attack-dies") == 2
                chain = tenants_of(daemon)[0].chain
                assert chain.levels[0].tier.stats().pinned + chain.levels[0].tier.stats().writing
            finally:
                gate.set()
            async with asyncio.timeout(30):
                await asyncio.wait(conn.running_at_close)
            assert open_descriptors("attack-dies") == 1
            async with await connect(daemon) as after:
                await assert_idle(daemon, after)
            assert tenants_of(daemon)[0].held == 0  # no block counted against its bounds


# -- the registration exchange, broken by raw clients ------------------------------------------


class RawSocket:
    """A bare connection that can attach descriptors to what it sends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.next_id = 1

    @classmethod
    async def open(cls, daemon: Daemon) -> RawSocket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, socket_of(daemon))
        raw = cls(sock)
        await raw.send({"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "ns"})
        assert (await raw.recv())["ok"]
        return raw

    async def send(self, *messages: dict[str, Any]) -> None:
        data = b"".join(encode(m) for m in messages)
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    def send_fds(self, data: bytes, fds: list[int]) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))] if fds else []
        assert self.sock.sendmsg([data], ancillary) == len(data)

    async def recv(self) -> dict[str, Any] | None:
        """The next message, or None once the daemon closed the connection."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(30):
            while True:
                if len(self.buffer) >= HEADER.size:
                    (size,) = HEADER.unpack_from(self.buffer)
                    if len(self.buffer) >= HEADER.size + size:
                        body = self.buffer[HEADER.size : HEADER.size + size]
                        self.buffer = self.buffer[HEADER.size + size :]
                        message = msgpack.unpackb(body, raw=False)
                        assert isinstance(message, dict)
                        return message
                data = await loop.sock_recv(self.sock, 1 << 16)
                if not data:
                    return None
                self.buffer += data

    def close(self) -> None:
        self.sock.close()


async def ask_to_register(raw: RawSocket, size: int = BLOCK) -> None:
    await raw.send({"id": 2, "op": "register_region", "size": size})
    assert await raw.recv() == {"push": "send_fd", "request": 2}


async def test_a_byte_without_a_descriptor_drops_the_connection(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon:
        raw = await RawSocket.open(daemon)
        await ask_to_register(raw)
        raw.send_fds(b"\0", [])
        dropped = await raw.recv()
        assert dropped is not None and dropped["error"] == "bad_request"
        assert "descriptor" in dropped["message"]
        assert await raw.recv() is None
        raw.close()
        async with await connect(daemon) as client:  # the daemon serves on
            await assert_idle(daemon, client)


async def test_no_descriptor_in_time_drops_the_connection(tmp_path: Path) -> None:
    async with serve(tmp_path, limits={"hello_timeout_s": 0.3}) as daemon:
        raw = await RawSocket.open(daemon)
        await ask_to_register(raw)
        dropped = await raw.recv()  # nothing sent: the deadline passes
        assert dropped is not None and "no descriptor came" in dropped["message"]
        assert await raw.recv() is None
        raw.close()


async def test_two_descriptors_are_both_closed_and_refused(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon:
        with memfd(BLOCK, "attack-two") as one, memfd(BLOCK, "attack-two") as two:
            raw = await RawSocket.open(daemon)
            await ask_to_register(raw)
            raw.send_fds(b"\0", [one, two])
            reply = await raw.recv()
            assert reply is not None and reply["id"] == 2 and reply["error"] == "bad_request"
            assert "exactly one descriptor" in reply["message"]
            assert open_descriptors("attack-two") == 2  # ours only
            # Framing held: the connection still serves.
            await raw.send({"id": 3, "op": "lookup_each", "keys": [b"k"]})
            assert await raw.recv() == {"id": 3, "ok": True, "present": [False]}
            raw.close()


async def test_frames_pipelined_behind_register_region_are_refused(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon:
        with memfd(BLOCK, "attack-pipelined") as fd:
            server = daemon.server
            assert server is not None
            before = set(server.connections)
            raw = await RawSocket.open(daemon)
            (conn,) = server.connections - before
            # The request and, without waiting to be asked, the byte with the descriptor
            # and another request.
            await raw.send({"id": 2, "op": "register_region", "size": BLOCK})
            raw.send_fds(b"\0", [fd])
            await raw.send({"id": 3, "op": "lookup_each", "keys": [b"k"]})
            first = await raw.recv()
            assert first is not None
            # Either the daemon saw the rest behind the request (refused, then the stray
            # byte breaks framing: the connection is closed), or it read nothing yet.
            if first.get("push") == "send_fd":  # it did not: the byte was read as asked
                reply = await raw.recv()
                assert reply is not None and reply["ok"] and reply["region"] == 1
            else:
                assert first["id"] == 2 and first["error"] == "bad_request"
                assert "behind register_region" in first["message"]
            raw.close()
            async with asyncio.timeout(30):
                await conn.gone.wait()  # type: ignore[attr-defined]
            async with await connect(daemon) as client:
                await assert_idle(daemon, client)
            assert open_descriptors("attack-pipelined") == 1


async def test_a_user_without_a_namespace_cannot_register(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon, None) as operator:
        with memfd(BLOCK, "attack-operator") as fd:
            message = await refused(operator.register_region(fd, BLOCK), "namespace_required")
            assert "namespace" in message
            assert open_descriptors("attack-operator") == 1


async def test_a_job_cancelled_mid_copy_releases_after_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown cancels what outlives its grace: the pins stay until the copy ends."""
    entered, gate = threading.Event(), threading.Event()
    real = regions_module.write_region
    copied: list[bool] = []

    def held(*args: Any) -> Any:
        entered.set()
        gate.wait(30)
        result = real(*args)
        copied.extend(result)
        return result

    monkeypatch.setattr(regions_module, "write_region", held)
    async with serve(tmp_path) as daemon:
        with memfd(8 * BLOCK, "attack-cancel") as fd:
            client, conn = await connect_watched(daemon)
            await client.store([b"k"], [pattern(b"cancel", BLOCK)])
            region = await client.register_region(fd, 8 * BLOCK)
            pending = client.send(
                "region_load", region=region, keys=[b"k"], offsets=rows(1).tobytes()
            )
            try:
                await asyncio.to_thread(entered.wait, 30)
                (task,) = conn.session.tasks
                task.cancel()
                await asyncio.sleep(0)  # one pass of the loop: the task takes the cancellation
                assert not task.done()
                tier = tenants_of(daemon)[0].chain.levels[0].tier
                assert tier.stats().pinned == 1  # the copy still reads the slot
            finally:
                gate.set()
            async with asyncio.timeout(30):
                await asyncio.wait([task])
            assert task.cancelled() and copied == [True]
            assert tier.stats().pinned == 0
            assert not pending.done()  # a cancelled request gets no reply
            assert read(fd, BLOCK) == pattern(b"cancel", BLOCK)
            await client.close()
            with pytest.raises(Unreachable):
                await pending


async def test_a_load_in_pieces_cancelled_ends_after_every_piece_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load from the disk tier goes in pieces at once; cancelled while one piece copies
    into the region and another is still being read, it ends only after both have, and
    then holds no pin."""
    MiB = 1 << 20
    entered, gate = threading.Event(), threading.Event()
    real_write = regions_module.write_region

    def held_write(*args: Any) -> Any:
        entered.set()
        gate.wait(30)
        return real_write(*args)

    monkeypatch.setattr(regions_module, "write_region", held_write)
    reading, read_gate = held_disk_reads(monkeypatch, b"p7")
    async with serve(tmp_path, block_bytes=MiB, cpu_blocks=16, disk_blocks=64) as daemon:
        client, conn = await connect_watched(daemon)
        keys = [b"p%d" % i for i in range(24)]  # the first 8 go down to the disk tier
        await client.store(keys, [pattern(b"%s-" % key, MiB) for key in keys])
        with memfd(8 * MiB, "attack-pieces") as fd:
            region = await client.register_region(fd, 8 * MiB)
            offsets = rows(*range(8), size=MiB).tobytes()
            pending = client.send("region_load", region=region, keys=keys[:8], offsets=offsets)
            tier = tenants_of(daemon)[0].chain.levels[0].tier
            try:
                await asyncio.wait_for(reading.wait(), 30)
                assert await asyncio.to_thread(entered.wait, 30)
                (task,) = conn.session.tasks
                task.cancel()
                for _ in range(3):  # passes of the loop: the pieces take the cancellation
                    await asyncio.sleep(0)
                assert not task.done()
                assert tier.stats().pinned > 0  # a copy still reads its slots
            finally:
                gate.set()
                read_gate.set()
            async with asyncio.timeout(30):
                await asyncio.wait([task])
            assert task.cancelled()
            assert tier.stats().pinned == 0
            await client.close()
            with pytest.raises(Unreachable):
                await pending
