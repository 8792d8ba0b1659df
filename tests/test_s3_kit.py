"""The S3 test kit itself: a real SeaweedFS on loopback that obstore talks to, which
restarts with its data and deletes buckets, and the fault proxy, each of whose faults shows
itself to obstore (or to a raw socket) the way the tests that use it expect."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, GenericError
from s3_kit import S3FaultProxy, SeaweedServer

# One try, short timeouts: a fault shows itself at once instead of after obstore's retries.
NO_RETRY: dict[str, Any] = {
    "retry_config": {"max_retries": 0, "retry_timeout": timedelta(seconds=5)},
    "client_options": {"timeout": "10s", "connect_timeout": "5s"},
}


def _payload(size: int, seed: int = 7) -> bytes:
    return bytes((seed + i * 31) % 251 for i in range(size))


def _listening(pid: int) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every inet socket the process has bound."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for row in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            fields = row.split()
            listens = proto.startswith("udp") or fields[3] == "0A"
            if fields[9] in inodes and listens:
                address, port = fields[1].split(":")
                found.append((proto, address, int(port, 16)))
    return found


def test_server_binds_only_the_loopback_ports_it_was_given(seaweed: SeaweedServer) -> None:
    assert seaweed.proc is not None
    bound = _listening(seaweed.proc.pid)
    assert bound, "weed mini listens on nothing?"
    loopback = "0100007F"  # 127.0.0.1, as /proc/net/tcp writes it
    assert {(proto, address) for proto, address, _ in bound} == {("tcp", loopback)}
    assert {port for *_, port in bound} <= set(seaweed.ports.all())
    assert seaweed.ports.s3 in {port for *_, port in bound}
    assert seaweed.bucket in seaweed.buckets()


async def test_put_get_head_round_trip(seaweed: SeaweedServer) -> None:
    store = seaweed.store(prefix="round-trip")
    data = _payload(100_000)
    await obstore.put_async(store, "a/1", data, mode="create")
    got = await obstore.get_async(store, "a/1")
    assert bytes(await got.bytes_async()) == data
    meta = await obstore.head_async(store, "a/1")
    assert meta["size"] == len(data)
    with pytest.raises(FileNotFoundError):
        await obstore.head_async(store, "a/missing")


async def test_create_mode_refuses_an_existing_object(seaweed: SeaweedServer) -> None:
    store = seaweed.store(prefix="create-mode", **NO_RETRY)
    await obstore.put_async(store, "k", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        await obstore.put_async(store, "k", b"second", mode="create")
    got = await obstore.get_async(store, "k")
    assert bytes(await got.bytes_async()) == b"first"


def test_restart_and_kill_keep_the_objects(seaweed: SeaweedServer) -> None:
    store = seaweed.store(prefix="restart")
    obstore.put(store, "before-stop", b"stopped", mode="create")
    seaweed.restart()
    assert bytes(obstore.get(store, "before-stop").bytes()) == b"stopped"
    obstore.put(store, "before-kill", b"killed", mode="create")
    seaweed.kill()
    assert not any(path.exists() for path in seaweed.ports.local_sockets())
    seaweed.start()
    fresh = seaweed.store(prefix="restart")
    assert bytes(obstore.get(fresh, "before-kill").bytes()) == b"killed"
    assert bytes(obstore.get(fresh, "before-stop").bytes()) == b"stopped"


def test_delete_bucket_removes_it_with_its_objects(seaweed: SeaweedServer) -> None:
    store = seaweed.store("scratch", **NO_RETRY)
    obstore.put(store, "doomed", b"bytes")  # an admin's PUT creates the bucket
    assert "scratch" in seaweed.buckets()
    seaweed.delete_bucket("scratch")
    assert "scratch" not in seaweed.buckets()
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "doomed")


async def test_proxy_passes_requests_through(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy
) -> None:
    store = seaweed.store(prefix="pass", endpoint=s3_proxy.endpoint, **NO_RETRY)
    data = _payload(300_000)
    await obstore.put_async(store, "x", data, mode="create")
    got = await obstore.get_async(store, "x")
    assert bytes(await got.bytes_async()) == data
    assert (await obstore.head_async(store, "x"))["size"] == len(data)
    with pytest.raises(AlreadyExistsError):
        await obstore.put_async(store, "x", b"again", mode="create")
    assert s3_proxy.requests == {"PUT": 2, "GET": 1, "HEAD": 1}
    assert s3_proxy.forwarded == s3_proxy.requests
    assert not s3_proxy.faulted


async def test_injected_status_never_reaches_the_server(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy
) -> None:
    store = seaweed.store(prefix="status", endpoint=s3_proxy.endpoint, **NO_RETRY)
    s3_proxy.fault = "status:500"
    with pytest.raises(GenericError, match="500 Internal Server Error"):
        await obstore.put_async(store, "x", b"data", mode="create")
    assert s3_proxy.faulted == {"status:500": 1}
    assert not s3_proxy.forwarded
    with pytest.raises(FileNotFoundError):
        await obstore.head_async(seaweed.store(prefix="status"), "x")


async def test_fault_applies_only_to_its_methods(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy
) -> None:
    store = seaweed.store(prefix="methods", endpoint=s3_proxy.endpoint, **NO_RETRY)
    await obstore.put_async(store, "x", b"data")
    s3_proxy.set_fault("status:503", methods=["put"])
    assert bytes(await (await obstore.get_async(store, "x")).bytes_async()) == b"data"
    with pytest.raises(GenericError, match="503 Service Unavailable"):
        await obstore.put_async(store, "y", b"data")
    assert s3_proxy.forwarded == {"PUT": 1, "GET": 1}
    with pytest.raises(ValueError, match="unknown fault"):
        s3_proxy.fault = "status:42"


async def test_flip_changes_one_byte_of_the_body(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy
) -> None:
    store = seaweed.store(prefix="flip", endpoint=s3_proxy.endpoint, **NO_RETRY)
    data = _payload(4096)
    await obstore.put_async(store, "x", data)
    s3_proxy.fault = "flip"
    got = bytes(await (await obstore.get_async(store, "x")).bytes_async())
    assert len(got) == len(data)
    assert sum(a != b for a, b in zip(got, data, strict=True)) == 1
    assert s3_proxy.faulted == {"flip": 1}


async def test_truncate_fails_the_read(seaweed: SeaweedServer, s3_proxy: S3FaultProxy) -> None:
    store = seaweed.store(prefix="truncate", endpoint=s3_proxy.endpoint, **NO_RETRY)
    data = _payload(200_000)
    await obstore.put_async(store, "x", data)
    s3_proxy.fault = "truncate"
    got = await obstore.get_async(store, "x")  # the head arrives whole
    with pytest.raises(GenericError, match="body error"):
        await got.bytes_async()
    assert s3_proxy.faulted["truncate"] >= 1


async def test_hang_times_out_and_never_reaches_the_server(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy
) -> None:
    store = seaweed.store(prefix="hang", endpoint=s3_proxy.endpoint, **NO_RETRY)
    s3_proxy.fault = "hang"
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1):
            await obstore.put_async(store, "x", b"data", mode="create")
    assert s3_proxy.faulted == {"hang": 1}
    assert not s3_proxy.forwarded
    s3_proxy.fault = None
    await obstore.put_async(store, "x", b"data", mode="create")
    assert s3_proxy.forwarded == {"PUT": 1}


async def test_slow_body_still_arrives_intact(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy
) -> None:
    store = seaweed.store(prefix="slow", endpoint=s3_proxy.endpoint, **NO_RETRY)
    data = _payload(32 * 1024)
    await obstore.put_async(store, "x", data)
    s3_proxy.fault = "slow"
    got = await obstore.get_async(store, "x")
    assert bytes(await got.bytes_async()) == data
    assert s3_proxy.faulted == {"slow": 1}


async def test_refuse_closes_before_reading(seaweed: SeaweedServer, s3_proxy: S3FaultProxy) -> None:
    store = seaweed.store(prefix="refuse", endpoint=s3_proxy.endpoint, **NO_RETRY)
    s3_proxy.fault = "refuse"
    with pytest.raises(GenericError):  # a dropped connection, however hyper words it
        await obstore.put_async(store, "x", b"data")
    assert s3_proxy.faulted["refuse"] >= 1
    assert not s3_proxy.requests


@pytest.fixture
def raw(s3_proxy: S3FaultProxy) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", s3_proxy.port), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


PUT_X = b"PUT /blocks/raw/x HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\ndata"


def test_a_held_request_closes_unanswered_when_the_fault_clears(
    s3_proxy: S3FaultProxy, raw: socket.socket
) -> None:
    s3_proxy.fault = "hang"
    raw.sendall(PUT_X)
    s3_proxy.wait_until(lambda p: p.faulted["hang"] == 1)
    s3_proxy.fault = None
    assert raw.recv(1024) == b""
    assert not s3_proxy.forwarded


def test_stop_closes_held_connections(s3_proxy: S3FaultProxy, raw: socket.socket) -> None:
    s3_proxy.fault = "hang"
    raw.sendall(PUT_X)
    s3_proxy.wait_until(lambda p: p.faulted["hang"] == 1)
    s3_proxy.stop()
    assert raw.recv(1024) == b""


def test_chunked_requests_are_forwarded_on_a_kept_connection(s3_proxy: S3FaultProxy) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", s3_proxy.port, timeout=10)
    try:
        statuses, sockets = [], []
        for _ in range(2):
            conn.request("PUT", "/blocks/raw/chunked", body=iter([b"ab", b"cd"]))
            response = conn.getresponse()
            body = response.read()
            statuses.append(response.status)
            sockets.append(conn.sock)
        # Unsigned, so SeaweedFS itself refuses it: the answer came from the server.
        assert statuses == [403, 403], body
        assert b"AccessDenied" in body
        assert sockets[0] is sockets[1]
        assert s3_proxy.forwarded == {"PUT": 2}
    finally:
        conn.close()
