"""Runs KV-event payloads through SMG's own relay normalizer; run by .venv-smg's python.

SMG (SGLang's model gateway) relays an engine's KV events into its router with
``smg_grpc_servicer.kv_relay`` (smg-grpc-servicer 0.14.1, scripts/setup_smg): each ZMQ
payload is decoded by ``decode_batch`` and each event is kept or dropped by
``Normalizer.normalize_batch``, whose rules this script never restates: it feeds SMG's
normalizer one event at a time (a one-event ``WireBatch``, the normalizer's state kept
across them, as one relay stream keeps it) and reads the drop reason from the
normalizer's own counters.

Input, one of:

- ``--payloads FILE``: the third frame of each ZMQ message (vLLM's ``KVEventBatch``
  msgpack), as records of a 4-byte big-endian length then that many bytes; a record's
  sequence number is its index in the file, from 0.
- ``--endpoint tcp://127.0.0.1:PORT --count N``: a ZMQ SUB socket connected there
  (``--topic``, default all) reads N messages ``[topic, seq u64 big-endian, payload]``,
  giving up after ``--timeout-s`` (default 10) in all; exit status 3 then.

Output, one JSON line on stdout per input event::

    {"seq": 0, "index": 0, "event_id": 1, "type": "BlockStored", "medium": "CPU",
     "verdict": "forwarded", "normalized": {"kind": "stored", "tier": "HOST", ...}}
    {"seq": 0, "index": 1, ..., "verdict": "dropped", "reason": "placeholder"}

``normalized`` is SMG's proto for the event (``kind`` stored / removed / cleared; ``tier``
and ``locality`` without their enum prefix; every optional field SMG set; for a store
``block_hashes``, ``token_count``, ``block_size`` and ``cache_level`` from its blocks);
``reason`` is SMG's drop-reason name. A payload SMG cannot decode gives one line with
``"verdict": "undecodable"`` (SMG relays it as an empty batch); a message that is not three
frames with an 8-byte sequence gives ``"verdict": "skipped"`` (SMG ignores it). At the
end the normalizer's counters go to stderr as one JSON line ``{"counts": {...}}``.

``--check`` only imports SMG's relay and prints the versions (scripts/setup_smg). Exit
status 2, with a message, when SMG is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NOT_INSTALLED = 2
TIMED_OUT = 3
BAD_INPUT = 4
LENGTH = struct.Struct(">I")
STORED_FIELDS = (
    "parent_block_hash",
    "medium",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "ownership",
    "session_id",
    "lora_name",
    "cache_salt",
)
REMOVED_FIELDS = ("cache_level", "medium", "group_idx", "ownership")


def load_smg() -> tuple[Any, Any]:
    """SMG's relay module and proto module, or exit 2 saying how to install them."""
    try:
        from smg_grpc_proto.generated import common_pb2
        from smg_grpc_servicer import kv_relay
    except ImportError as exc:
        print(
            f"smg_driver: SMG's KV-event relay is not installed in {sys.executable} "
            f"({exc}); run scripts/setup_smg and use .venv-smg/bin/python",
            file=sys.stderr,
        )
        raise SystemExit(NOT_INSTALLED) from exc
    return kv_relay, common_pb2


def check() -> None:
    import importlib.metadata as md

    load_smg()
    names = ("smg-grpc-servicer", "smg-grpc-proto", "msgspec", "pyzmq")
    print(", ".join(f"{name} {md.version(name)}" for name in names))


def file_frames(path: Path) -> Iterator[tuple[int, bytes]]:
    """(sequence, payload) records of a length-prefixed payload file."""
    data = path.read_bytes()
    offset, seq = 0, 0
    while offset < len(data):
        if offset + LENGTH.size > len(data):
            raise ValueError(f"{path}: truncated length prefix at byte {offset}")
        (size,) = LENGTH.unpack_from(data, offset)
        offset += LENGTH.size
        if offset + size > len(data):
            raise ValueError(f"{path}: record {seq} wants {size} bytes, {len(data) - offset} left")
        yield seq, data[offset : offset + size]
        offset += size
        seq += 1


def socket_frames(endpoint: str, topic: str, count: int, timeout_s: float) -> Iterator[Any]:
    """Up to ``count`` multipart messages from a SUB socket, within ``timeout_s`` in all;
    a ``TimeoutError`` when fewer came."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.subscribe(topic.encode())
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close()
        ctx.term()
        raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    try:
        for received in range(count):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                raise TimeoutError(
                    f"{received} of {count} messages from {endpoint} in {timeout_s} s"
                )
            yield sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def enum_name(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix)


def present(message: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def normalized(event: Any, pb: Any) -> dict[str, Any]:
    """SMG's proto ``KvCacheEvent`` as a plain dict."""
    kind = event.WhichOneof("data")
    body = getattr(event, kind)
    if kind == "cleared":
        return {"kind": kind, **present(body, ("ownership",))}
    out: dict[str, Any] = {
        "kind": kind,
        "tier": enum_name(pb.KvCacheTier, body.tier, "KV_CACHE_TIER_"),
        "locality": enum_name(pb.KvCacheLocality, body.locality, "KV_CACHE_LOCALITY_"),
    }
    if kind == "removed":
        return {**out, "block_hashes": list(body.block_hashes), **present(body, REMOVED_FIELDS)}
    blocks = list(body.blocks)
    levels = {b.cache_level for b in blocks if b.HasField("cache_level")}
    return {
        **out,
        "block_hashes": [b.block_hash for b in blocks],
        "token_count": sum(len(b.token_ids) for b in blocks),
        "block_size": blocks[0].block_size if blocks else 0,
        "cache_level": levels.pop() if len(levels) == 1 else sorted(levels) or None,
        "lora_ids": sorted({b.lora_id for b in blocks if b.HasField("lora_id")}),
        **present(body, STORED_FIELDS),
    }


class Driver:
    """One relay stream: SMG's normalizer, fed one event at a time."""

    def __init__(self, rank: int | None) -> None:
        self.kv_relay, self.pb = load_smg()
        self.normalizer = self.kv_relay.Normalizer()
        self.rank = rank

    def payload(self, seq: int, payload: bytes) -> None:
        try:
            batch = self.kv_relay.decode_batch(payload)
        except Exception as exc:  # SMG relays such a payload as an empty batch
            emit({"seq": seq, "index": None, "verdict": "undecodable", "error": repr(exc)})
            return
        for index, event in enumerate(batch.events):
            emit({"seq": seq, "index": index, **self.event(batch, seq, event)})

    def event(self, batch: Any, seq: int, event: Any) -> dict[str, Any]:
        before = dict(self.normalizer.counts.dropped)
        one = self.kv_relay.WireBatch(ts=batch.ts, events=[event], dp_rank=batch.dp_rank)
        proto = self.normalizer.normalize_batch(one, seq, self.rank)
        line: dict[str, Any] = {
            "event_id": self.normalizer._event_id,
            "type": event.kind,
            "medium": event.medium,
        }
        if proto.events:
            return {
                **line,
                "verdict": "forwarded",
                "normalized": normalized(proto.events[0], self.pb),
            }
        after = self.normalizer.counts.dropped
        reasons = [r for r, n in after.items() if n != before.get(r, 0)]
        return {**line, "verdict": "dropped", "reason": reasons[0] if reasons else None}

    def message(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or len(frames[1]) != 8:
            emit({"seq": None, "index": None, "verdict": "skipped", "frames": len(frames)})
            return
        self.payload(int.from_bytes(frames[1], "big"), frames[2])

    def counts(self) -> dict[str, Any]:
        return dataclasses.asdict(self.normalizer.counts)


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--payloads", type=Path, help="length-prefixed msgpack payloads")
    src.add_argument("--endpoint", help="ZMQ PUB endpoint to subscribe to")
    src.add_argument("--check", action="store_true", help="only import SMG's relay")
    p.add_argument("--count", type=int, default=1, help="messages to read from --endpoint")
    p.add_argument("--timeout-s", type=float, default=10.0, help="for --endpoint, in all")
    p.add_argument("--topic", default="", help="SUB topic filter for --endpoint")
    p.add_argument("--rank", type=int, default=None, help="the socket's DP rank")
    args = p.parse_args(argv)
    if args.count < 1 or args.timeout_s <= 0:
        p.error("--count must be at least 1 and --timeout-s positive")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.check:
        check()
        return 0
    driver = Driver(args.rank)
    try:
        if args.payloads is not None:
            for seq, payload in file_frames(args.payloads):
                driver.payload(seq, payload)
        else:
            for frames in socket_frames(args.endpoint, args.topic, args.count, args.timeout_s):
                driver.message(frames)
    except TimeoutError as exc:
        print(f"smg_driver: timed out: {exc}", file=sys.stderr)
        return TIMED_OUT
    except (OSError, ValueError) as exc:
        print(f"smg_driver: bad input: {exc}", file=sys.stderr)
        return BAD_INPUT
    finally:
        print(json.dumps({"counts": driver.counts()}), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
