"""The vLLM tier's block book and describer without vLLM
(``tierd.integrations.vllm.block_descriptions``):
a real zmq publisher on an ipc socket in tmp sends batches in vLLM's wire form (events as
tagged maps or as tagged arrays), a real in-loop daemon with ``kv_events:`` on takes the
descriptions. A chunk is described only when every block of it is known."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from vllm_e2e_kit import replay, stored

from tierd.client import Client
from tierd.control.clients.blocking_client import BlockingClient
from tierd.integrations.vllm.block_descriptions import BlockBook, Describer, loopback_endpoint
from tierd.testing import daemon_config, running_daemon

BS = 4


def _stored(hashes: list[int], parent: int | None, first_token: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(first_token, first_token + BS * len(hashes))),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def _batch(*events: Any) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


@contextmanager
def _book(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], BlockBook]]:
    """A PUB bound in tmp and a book subscribed to it, past zmq's slow join."""
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/events"
    pub.bind(endpoint)
    book = BlockBook(endpoint)
    try:
        for _ in range(500):  # bounded: until the subscription has joined
            pub.send_multipart([b"", b"\0" * 8, _batch()])
            if book.wait_for(-1, 0, 1, 0.02) or book.batches:
                break
        assert book.batches, "the book never heard the publisher"
        yield pub, book
    finally:
        book.close()
        pub.close()


def _key(block_hash: int, group: int = 0) -> bytes:
    return block_hash.to_bytes(32, "big") + group.to_bytes(4, "big")


@pytest.mark.parametrize(
    ("bound", "connect"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
        ("ipc:///tmp/x", "ipc:///tmp/x"),
        ("tcp://*:0", None),
        ("inproc://cache", None),
    ],
)
def test_loopback_endpoint(bound: str, connect: str | None) -> None:
    assert loopback_endpoint(bound) == connect


def test_book_learns_tagged_maps_and_arrays_and_walks_parents(tmp_path: Path) -> None:
    with _book(tmp_path) as (pub, book):
        array_form = ["BlockStored", [3], 2, list(range(8, 12)), BS, None, "GPU", None, None, 0]
        pub.send_multipart([b"", b"\0" * 8, b"not msgpack \xc1"])
        pub.send_multipart([b"", b"\0" * 8, _batch(_stored([1, 2], None, 0), array_form)])
        assert book.wait_for(3, 0, 3, 10.0)
        chain = book.chain(3, 0, 3)
        assert chain is not None and [h for h, _ in chain] == [1, 2, 3]
        assert book.chain(3, 0, 4) is None  # block 1 has no parent: no 4-block chunk
        assert book.chain(3, 1, 1) is None  # another group
        assert book.undecodable == 1


def test_book_keeps_at_most_its_capacity(tmp_path: Path) -> None:
    with _book(tmp_path) as (_, book):
        book.capacity = 2
        book.feed(_batch(_stored([1, 2, 3], None, 0)))
        assert len(book) == 2
        assert book.chain(1, 0, 1) is None and book.chain(3, 0, 2) is not None


async def test_describer_describes_known_chunks_only_and_the_daemon_publishes_them(
    tmp_path: Path,
) -> None:
    kv = {"enabled": True, "batch_s": 0.001}
    config = daemon_config(tmp_path, cpu_blocks=4, disk_blocks=None, kv_events=kv)
    with _book(tmp_path) as (pub, book):
        pub.send_multipart([b"", b"\0" * 8, _batch(_stored([11, 12], None, 0))])
        assert await asyncio.to_thread(book.wait_for, 12, 0, 2, 10.0)
        describer = Describer(book, blocks_per_chunk=2, int_hashes=True)
        async with running_daemon(config) as daemon:
            path = str(daemon.config.socket.path)
            async with await Client.connect(path, namespace="m") as client:
                send = await asyncio.to_thread(_sender, path)  # the daemon is this loop's
                await asyncio.to_thread(describer.describe, send, [_key(12), _key(99)])
                assert (describer.described, describer.unknown) == (1, 1)
                await client.put([_key(12), _key(99)], [b"x" * 4096] * 2)
                stats = (await client.stats())["kv_events"]
                ours = await _published(stats["replay_endpoint"])
    assert stats["undescribed"] == 1
    assert [e["block_hashes"] for e in ours] == [[11, 12]]
    assert ours[0]["token_ids"] == list(range(2 * BS)) and ours[0]["parent_block_hash"] is None


def _sender(path: str) -> Callable[[list[bytes], list[bytes]], Any]:
    """``describe`` requests on a blocking connection of namespace ``m`` (as a store's)."""
    client = BlockingClient.connect(
        path, namespace="m", block_bytes=None, deadline=time.monotonic() + 10.0
    )
    return lambda keys, blocks: client.request(
        "describe", time.monotonic() + 10.0, keys=keys, blocks=blocks
    )


async def _published(endpoint: str) -> list[dict[str, Any]]:
    """The daemon's BlockStored events, replayed until there is one (bounded)."""
    for _ in range(200):
        ours = stored(await asyncio.to_thread(replay, endpoint))
        if ours:
            return ours
    raise AssertionError("the daemon published no BlockStored")
