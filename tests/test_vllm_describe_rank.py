"""A data-parallel engine's tier listens to its own rank's KV events.

vLLM binds each data-parallel rank's publisher at the configured port plus the rank
(``ZmqEventPublisher.offset_endpoint_port``). tierd's vLLM tier runs inside each rank's
scheduler, so it must subscribe where its own rank publishes: at rank 2 of an engine
configured with ``tcp://[::1]:P``, that is ``P + 2``. A real vLLM publisher, built as
vLLM's scheduler builds it (``data_parallel_index``), publishes a block; the describer
tierd builds from the same config learns it, and learns nothing from rank 0's port.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import zmq

pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.distributed.kv_events import (
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
)

from tierd.integrations.vllm.block_descriptions import Describer, describer_for, rank_endpoint

RANK = 2


def _free_base_port() -> int:
    """A port P such that P + RANK was free a moment ago (the publisher binds P + RANK)."""
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = int(probe.getsockname()[1])
    return port - RANK


def _describer(endpoint: str, rank: int) -> Describer:
    # describer_for finds vLLM's config among its callers' frames, as the offloading
    # connector's frame holds it when vLLM builds the tier.
    vllm_config = SimpleNamespace(  # noqa: F841 (read through the frame)
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
        ),
        parallel_config=SimpleNamespace(data_parallel_index=rank),
    )
    return describer_for(SimpleNamespace(blocks_per_chunk=1), None)


def test_rank_endpoint_is_vllms_rule() -> None:
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("tcp://*:0", 3) == "tcp://*:0"  # the OS picks: unknowable
    assert rank_endpoint("ipc:///tmp/x", 1) is None  # vLLM refuses it for a rank > 0


def test_a_rank_describer_hears_its_own_ranks_publisher() -> None:
    base = _free_base_port()
    # vLLM binds a wildcard, an IPv6 or an ipc endpoint and connects to any other; ipc
    # has no rank rule, and a wildcard would listen beyond this machine: IPv6 loopback,
    # which vLLM's publisher (zmq's shared context) binds once IPv6 is on.
    endpoint = f"tcp://[::1]:{base}"
    zmq.Context.instance().setsockopt(zmq.IPV6, 1)
    publisher = ZmqEventPublisher(RANK, endpoint=endpoint)
    ours = _describer(endpoint, RANK)
    other = _describer(endpoint, 0)
    try:
        assert ours.book is not None and other.book is not None
        stored = BlockStored(
            block_hashes=[7],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        deadline = time.monotonic() + 10.0
        heard = False
        while not heard and time.monotonic() < deadline:  # bounded: zmq's slow join
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
            heard = ours.book.wait_for(7, 0, 1, 0.05)
        assert heard, f"rank {RANK}'s describer never heard its publisher"
        chain = ours.book.chain(7, 0, 1)
        assert chain is not None and chain[0][0] == 7
        assert other.book.batches == 0 and other.book.chain(7, 0, 1) is None
    finally:
        ours.close()
        other.close()
        publisher.shutdown()
        zmq.Context.instance().setsockopt(zmq.IPV6, 0)  # the shared context as it was
