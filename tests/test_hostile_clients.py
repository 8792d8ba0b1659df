"""Clients that attack the daemon's memory and its connection slots, against a real
daemon process over its real socket.

Each test reproduces an attack that worked on an earlier daemon: a frame that decodes
into millions of objects, a client that pipelines ``get`` requests and never reads the
replies, connections that hold half a frame forever, connections that never say hello,
and a flood of refused connections filling the log. Memory is read from
``/proc/PID/status`` (VmRSS): the bounds below are generous, and the attacks without the
guards grow the daemon by gigabytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.daemon_kit import BLOCK, DaemonProcess, Spawn, block, keys
from tests.wire_kit import replies_from
from tierd.client import Client, DaemonError
from tierd.control.protocol import HEADER, PROTOCOL_VERSION, FrameDecoder, encode
from tierd.testing import daemon_config

NS = "hostile"
WAIT_S = 30.0  # safety net for anything a test waits on; never a timed assertion


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def raw_connect(daemon: DaemonProcess, *, hello: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT_S)
    sock.connect(daemon.socket_path)
    if hello:
        sock.sendall(encode({"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NS}))
        reply = read_replies(sock, 1)[0]
        assert reply["ok"], reply
    return sock


def read_replies(sock: socket.socket, count: int) -> list[dict[str, Any]]:
    """The next ``count`` messages (fewer if the daemon closes the connection)."""
    return replies_from(sock, FrameDecoder(1 << 30), count)


def closed_by_daemon(sock: socket.socket) -> bool:
    """Read until the daemon closes the connection (True) or WAIT_S passes (False)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if not sock.recv(1 << 16):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


@contextlib.contextmanager
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


async def stats(daemon: DaemonProcess) -> dict[str, Any]:
    client = await Client.connect(daemon.socket_path)
    try:
        return await client.stats()
    finally:
        await client.close()


async def settle(daemon: DaemonProcess) -> None:
    """Wait until the daemon has stopped answering requests of other connections: its
    request count (one stats request of ours each poll) holds still for half a second."""
    last = -1
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        count = (await stats(daemon))["server"]["requests"]
        if count == last + 2:  # our own hello and stats only
            return
        last = count
        await asyncio.sleep(0.5)
    raise AssertionError("the daemon kept working for the whole safety net")


# -- decoding --------------------------------------------------------------------------------


async def test_a_frame_of_empty_arrays_is_refused_without_decoding_it(
    tmp_path: Path, spawn: Spawn
) -> None:
    """16 MiB of empty arrays: 16 M Python lists (more than a gigabyte) on the old
    decoder. Now the frame is refused after a handful of objects."""
    cfg = daemon_config(tmp_path, limits={"max_frame_bytes": 32 << 20})
    daemon = await spawn(cfg)
    before = rss_bytes(daemon.pid)
    count = 16 << 20
    head = msgpack.packb({"id": 5, "op": "health", "x": []})  # then swap the empty array
    body = head[:-1] + b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    with sockets() as opened:
        sock = raw_connect(daemon)
        opened.append(sock)
        sock.sendall(HEADER.pack(len(body)) + body)
        reply = read_replies(sock, 1)[0]
        assert reply["ok"] is False and reply["error"] == "bad_frame", reply
        # The connection goes on: framing was intact.
        sock.sendall(encode({"id": 7, "op": "health"}))
        assert read_replies(sock, 1)[0]["id"] == 7
    assert rss_bytes(daemon.pid) - before < 128 << 20


async def test_deep_nesting_is_a_bad_frame_not_an_internal_error(
    tmp_path: Path, spawn: Spawn
) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    nested: Any = []
    for _ in range(1000):
        nested = [nested]
    with sockets() as opened:
        sock = raw_connect(daemon)
        opened.append(sock)
        sock.sendall(encode({"id": 2, "op": "lookup", "keys": [b"k"], "x": nested}))
        reply = read_replies(sock, 1)[0]
        assert reply["ok"] is False
        assert reply["error"] in {"bad_frame", "bad_request"}, reply
    assert (await stats(daemon))["server"]["errors"].get("internal", 0) == 0


async def test_many_small_maps_are_refused(tmp_path: Path, spawn: Spawn) -> None:
    """A request is a map of a few fields: a frame of thousands of maps is no request."""
    daemon = await spawn(daemon_config(tmp_path))
    body = msgpack.packb({"id": 3, "op": "health", "pad": [{"a": 1}] * 5000})
    with sockets() as opened:
        sock = raw_connect(daemon)
        opened.append(sock)
        sock.sendall(HEADER.pack(len(body)) + body)
        assert read_replies(sock, 1)[0]["error"] == "bad_frame"


async def big_blocks(
    tmp_path: Path, spawn: Spawn, limits: dict[str, Any]
) -> tuple[DaemonProcess, list[bytes], list[bytes]]:
    """A daemon of 256 KiB blocks (CPU tier only) under ``limits``, holding 16 blocks:
    a ``get`` of them is a 4 MiB reply. Returns the daemon, the keys and the blocks."""
    block_bytes = 256 << 10
    cfg = daemon_config(
        tmp_path, cpu_blocks=32, disk_blocks=None, block_bytes=block_bytes, limits=limits
    )
    daemon = await spawn(cfg)
    names = keys("big", 16)
    values = [bytes([i]) * block_bytes for i in range(len(names))]
    client = await Client.connect(daemon.socket_path, namespace=NS, block_bytes=block_bytes)
    try:
        assert await client.store(names, values) == len(names)
    finally:
        await client.close()
    return daemon, names, values


# -- a client that never reads -----------------------------------------------------------------


async def test_a_client_that_never_reads_cannot_grow_the_daemon(
    tmp_path: Path, spawn: Spawn
) -> None:
    """200 pipelined gets of 16 blocks of 256 KiB = 800 MiB of replies. The daemon stops
    reading the connection once its unsent replies pass the output limit, so it holds
    a few of them, and the client gets every reply, in order, once it reads."""
    daemon, names, values = await big_blocks(tmp_path, spawn, {"output_buffer_bytes": 8 << 20})
    before = rss_bytes(daemon.pid)
    requests = 200
    frames = b"".join(encode({"id": 100 + i, "op": "get", "keys": names}) for i in range(requests))
    with sockets() as opened:
        sock = raw_connect(daemon)
        opened.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(frames)  # about 200 KiB: fits the socket buffers without a reader
        await settle(daemon)
        grown = rss_bytes(daemon.pid) - before
        assert grown < 96 << 20, f"the daemon grew by {grown >> 20} MiB"
        replies = await asyncio.to_thread(read_replies, sock, requests)
    assert [r["id"] for r in replies] == [100 + i for i in range(requests)]
    assert all(r["ok"] and r["data"] == values for r in replies)


# -- half a frame ------------------------------------------------------------------------------


async def test_a_frame_must_complete_within_its_deadline(tmp_path: Path, spawn: Spawn) -> None:
    cfg = daemon_config(tmp_path, limits={"frame_deadline_s": 1})
    daemon = await spawn(cfg)
    with sockets() as opened:
        sock = raw_connect(daemon)
        opened.append(sock)
        sock.sendall(HEADER.pack(1 << 20) + b"\x00" * (100 << 10))
        assert closed_by_daemon(sock)
        # A client that keeps sending whole frames is never cut off.
        steady = raw_connect(daemon)
        opened.append(steady)
        for i in range(6):
            steady.sendall(encode({"id": i, "op": "health"}))
            assert read_replies(steady, 1)[0]["id"] == i
            await asyncio.sleep(0.3)


async def test_unfinished_frames_share_one_budget(tmp_path: Path, spawn: Spawn) -> None:
    """Three connections each holding 700 KiB of a 1 MiB frame, under a 2 MiB budget for
    all unfinished frames: the third is closed, the first two carry on."""
    cfg = daemon_config(
        tmp_path,
        limits={"partial_frame_bytes": 2 << 20, "frame_deadline_s": 60},
    )
    daemon = await spawn(cfg)
    with sockets() as opened:
        holders = [raw_connect(daemon) for _ in range(3)]
        opened += holders
        for sock in holders[:2]:
            sock.sendall(HEADER.pack(1 << 20) + b"\x00" * (700 << 10))
        await settle(daemon)
        third = holders[2]
        # The daemon may answer and hang up before the last of these bytes is sent.
        with contextlib.suppress(BrokenPipeError):
            third.sendall(HEADER.pack(1 << 20) + b"\x00" * (700 << 10))
        replies = read_replies(third, 1)
        assert replies and replies[0]["error"] == "busy", replies
        assert closed_by_daemon(third)
        # The first two finish their frames and are answered.
        for sock in holders[:2]:
            rest = (1 << 20) - (700 << 10)
            sock.sendall(b"\x00" * rest)
            assert read_replies(sock, 1)[0]["error"] == "bad_frame"


async def test_unfinished_frames_of_closed_connections_are_freed(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Eight rounds of four connections, each sending 15 MiB of a 16 MiB frame and then
    closing, under a 64 MiB budget: whatever they sent is freed when they close, so the
    daemon holds about one round at most, not every round's bytes (480 MiB)."""
    cfg = daemon_config(tmp_path, limits={"partial_frame_bytes": 64 << 20, "frame_deadline_s": 60})
    daemon = await spawn(cfg)
    before = rss_bytes(daemon.pid)
    part = b"\x00" * (15 << 20)
    for _ in range(8):
        with sockets() as opened:
            for _ in range(4):
                sock = raw_connect(daemon, hello=False)
                opened.append(sock)
                sock.sendall(HEADER.pack(16 << 20) + part)
            await settle(daemon)  # every byte sent was read before the close
        await settle(daemon)
    client = await Client.connect(daemon.socket_path, namespace=NS, block_bytes=BLOCK)
    try:
        for i in range(200):
            await client.lookup([b"after-%d" % i])
    finally:
        await client.close()
    grown = rss_bytes(daemon.pid) - before
    assert grown < 128 << 20, f"the daemon still holds {grown >> 20} MiB"
    assert (await stats(daemon))["server"]["connections"] == 1  # only this stats call's


# -- connections that never say hello ----------------------------------------------------------


async def test_connections_that_never_say_hello_cannot_lock_clients_out(
    tmp_path: Path, spawn: Spawn
) -> None:
    cfg = daemon_config(tmp_path, limits={"max_connections": 8, "hello_timeout_s": 2})
    daemon = await spawn(cfg)
    with sockets() as opened:
        idle = [raw_connect(daemon, hello=False) for _ in range(8)]
        opened += idle
        # A real client still gets in, at once: the oldest silent connection makes room.
        client = await Client.connect(daemon.socket_path, namespace=NS, block_bytes=BLOCK)
        try:
            assert await client.store([b"in"], [block(b"in")]) == 1
        finally:
            await client.close()
        # And every silent one is closed when its hello deadline passes.
        assert all(closed_by_daemon(sock) for sock in idle)


async def test_greeted_clients_keep_their_connections(tmp_path: Path, spawn: Spawn) -> None:
    """Making room takes only silent connections: a full house of greeted clients still
    turns a newcomer away with ``busy``."""
    cfg = daemon_config(tmp_path, limits={"max_connections": 3, "hello_timeout_s": 1})
    daemon = await spawn(cfg)
    with sockets() as opened:
        opened += [raw_connect(daemon) for _ in range(3)]
        await asyncio.sleep(1.5)  # past the hello deadline: greeted clients stay
        with pytest.raises(DaemonError) as refused:
            await Client.connect(daemon.socket_path, namespace=NS)
        assert refused.value.code == "busy"
        for sock in opened:
            sock.sendall(encode({"id": 9, "op": "health"}))
            assert read_replies(sock, 1)[0]["id"] == 9


# -- refusals ------------------------------------------------------------------------------------


async def test_refused_connections_are_counted_not_logged_one_by_one(
    tmp_path: Path, spawn: Spawn
) -> None:
    cfg = daemon_config(tmp_path, limits={"max_connections": 2})
    daemon = await spawn(cfg)
    attempts = 500
    with sockets() as opened:
        opened += [raw_connect(daemon) for _ in range(2)]
        for _ in range(attempts):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(WAIT_S)
            sock.connect(daemon.socket_path)
            assert read_replies(sock, 1)[0]["error"] == "busy"
            sock.close()
        held = opened[0]  # ask on a connection already in: a new one would be refused
        held.sendall(encode({"id": 3, "op": "metrics"}))
        text = read_replies(held, 1)[0]["text"]
    lines = [line for line in daemon.stderr().splitlines() if "connection refused" in line]
    assert 1 <= len(lines) <= 10, len(lines)
    match = re.search(r'^tierd_connections_refused_total\{reason="busy"\} (\S+)$', text, re.M)
    assert match is not None and float(match.group(1)) == attempts


async def test_replies_left_unread_too_long_close_the_connection(
    tmp_path: Path, spawn: Spawn
) -> None:
    limits = {"output_buffer_bytes": 1 << 20, "output_stall_s": 1}
    daemon, names, _ = await big_blocks(tmp_path, spawn, limits)
    with sockets() as opened:
        sock = raw_connect(daemon)
        opened.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(b"".join(encode({"id": i, "op": "get", "keys": names}) for i in range(50)))
        await settle(daemon)
        await asyncio.sleep(1.5)  # past the stall limit, still not reading
        dropped = (await stats(daemon))["server"]["dropped"]
        assert dropped.get("output_stall") == 1, dropped
