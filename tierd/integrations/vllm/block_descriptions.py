"""What the vLLM tier's blocks are, in the engine's terms, told to the daemon before
they are stored (``describe``, docs/events.md; issue 36).

vLLM hands a secondary tier only ``OffloadKey``s (block hash + group). With its KV events
on and a ``zmq`` publisher, the engine itself publishes a ``BlockStored`` (hashes, parent,
token ids, block size, LoRA, extra keys, group) for every block its GPU cache keeps. This
module owns the subscription to that stream (:class:`BlockBook`: a thread that decodes
each batch into a bounded LRU map, block hash -> what the block is) and the description
of a store job's chunks from it (:class:`Describer`): a chunk's last hash is its key's,
the others are found by walking parents back. A chunk not fully known is not described
(counted), never described wrongly. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import array
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import msgpack
import zmq

from tierd.errors import TierdError
from tierd.logs import get_logger

__all__ = [
    "BlockBook",
    "Describer",
    "describer_for",
    "engine_kv_events",
    "loopback_endpoint",
    "rank_endpoint",
]

log = get_logger("tierd.integrations.vllm.block_descriptions")

# Remembered engine blocks: about 316 bytes + 4 per token each (measured: 380 B at 16
# tokens, 444 at 32), so about 100 MB at 16 tokens a block.
DEFAULT_CAPACITY = 1 << 18
_WAIT_S = 0.2  # how long one store job waits, in all, for events still on their way
_POLL_MS = 100
_FRAMES = 16  # how far up the callers engine_kv_events looks
# BlockStored's fields in vLLM's order, for an array-encoded (array_like) event.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
Hash = int | bytes


@dataclass(frozen=True, slots=True)
class Known:
    """One engine block as vLLM published it (tokens packed as uint32)."""

    parent: Hash | None
    tokens: bytes
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: Any


def loopback_endpoint(endpoint: str) -> str | None:
    """Where to connect for vLLM's publisher bound at ``endpoint`` (None: not knowable,
    as ``tcp://*:0``, whose port only the publisher learns)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if endpoint.startswith("ipc://") else None
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    if host in ("*", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("[::]", "::", "[*]"):
        host = "[::1]"
    return f"tcp://{host}:{port}"


def _stored_events(payload: bytes) -> list[dict[str, Any]]:
    """The ``BlockStored`` events of one batch (``[ts, [events], dp_rank]``), as maps
    whether vLLM tagged them as maps (``type``) or arrays (tag first)."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    found = []
    for event in batch[1] if isinstance(batch, list) and len(batch) > 1 else ():
        if isinstance(event, dict) and event.get("type") == "BlockStored":
            found.append(event)
        elif isinstance(event, list) and event and event[0] == "BlockStored":
            found.append(dict(zip(_STORED_FIELDS, event[1:], strict=False)))
    return found


class BlockBook:
    """A bounded LRU map (hash, group) -> :class:`Known`, fed by a SUB thread on vLLM's
    KV events publisher."""

    def __init__(self, endpoint: str, topic: str = "", capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[Hash, int], Known] = OrderedDict()
        self._changed = threading.Condition()
        self.batches = self.undecodable = 0
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if endpoint.startswith("tcp://["):  # an IPv6 address: zmq refuses it unless told
            self._sub.setsockopt(zmq.IPV6, 1)
        self._sub.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="tierd-vllm-kv-sub", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._blocks)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sub.poll(_POLL_MS):
                    self.feed(self._sub.recv_multipart()[-1])
        finally:
            self._sub.close(0)
            self._ctx.term()

    def feed(self, payload: bytes) -> None:
        """Remember the blocks of one published batch (a batch that cannot be decoded is
        counted and skipped)."""
        try:
            events = _stored_events(payload)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
            self.undecodable += 1
            return
        with self._changed:
            self.batches += 1
            for event in events:
                self._remember(event)
            self._changed.notify_all()

    def _remember(self, event: dict[str, Any]) -> None:
        hashes, tokens = event.get("block_hashes") or [], event.get("token_ids") or []
        size = int(event.get("block_size") or 0)
        if not hashes or size <= 0 or len(tokens) != size * len(hashes):
            return
        parent, group = event.get("parent_block_hash"), int(event.get("group_idx") or 0)
        extra = event.get("extra_keys") or [None] * len(hashes)
        for i, block_hash in enumerate(hashes):
            chunk = array.array("I", tokens[i * size : (i + 1) * size]).tobytes()
            known = Known(
                parent, chunk, size, event.get("lora_id"), event.get("lora_name"), extra[i]
            )
            self._blocks[(block_hash, group)] = known
            self._blocks.move_to_end((block_hash, group))
            parent = block_hash
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def chain(self, last: Hash, group: int, count: int) -> list[tuple[Hash, Known]] | None:
        """The ``count`` blocks ending at ``last``, first to last (None: one unknown)."""
        found: list[tuple[Hash, Known]] = []
        current: Hash | None = last
        with self._changed:
            while len(found) < count and current is not None:
                known = self._blocks.get((current, group))
                if known is None:
                    return None
                found.append((current, known))
                current = known.parent
        return found[::-1] if len(found) == count else None

    def wait_for(self, last: Hash, group: int, count: int, timeout: float) -> bool:
        """Whether the chain is known, waiting up to ``timeout`` for batches on their way."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self.chain(last, group, count) is not None, timeout
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def description(chain: Sequence[tuple[Hash, Known]], group: int) -> dict[str, Any]:
    """The ``describe`` map of one chunk (docs/protocol.md)."""
    first = chain[0][1]
    tokens = array.array("I")
    for _, known in chain:
        tokens.frombytes(known.tokens)
    extra = [known.extra_keys for _, known in chain]
    return {
        "hashes": [h for h, _ in chain],
        "parent": first.parent,
        "tokens": tokens.tolist(),
        "block_size": first.block_size,
        "lora_id": first.lora_id,
        "lora_name": first.lora_name,
        "extra_keys": None if all(e is None for e in extra) else extra,
        "group": group,
    }


class Describer:
    """Describes a store job's keys to the daemon, on the store's own connection."""

    def __init__(self, book: BlockBook | None, blocks_per_chunk: int, int_hashes: bool) -> None:
        self.book = book
        self.blocks_per_chunk = blocks_per_chunk
        self.int_hashes = int_hashes
        self.described = self.unknown = self.refused = 0

    def _hash(self, key: bytes) -> tuple[Hash, int]:
        raw, group = key[:-4], int.from_bytes(key[-4:], "big")
        if self.int_hashes:  # vLLM's maybe_convert_block_hash
            return int.from_bytes(raw, "big") & ((1 << 64) - 1), group
        return raw, group

    def describe(
        self, send: Callable[[list[bytes], list[bytes]], Any], keys: Sequence[bytes]
    ) -> None:
        """Send ``describe`` for every key whose chunk is fully known (others counted),
        through ``send(keys, packed descriptions)``: the store's own connection, so the
        daemon has the descriptions before the blocks. Waits a little (on this thread)
        for events still on their way."""
        book = self.book
        if book is None or not keys:
            return
        described, blocks = [], []
        deadline = time.monotonic() + _WAIT_S
        for key in keys:
            last, group = self._hash(key)
            chain = book.chain(last, group, self.blocks_per_chunk)
            left = deadline - time.monotonic()
            if chain is None and left > 0:
                book.wait_for(last, group, self.blocks_per_chunk, left)
                chain = book.chain(last, group, self.blocks_per_chunk)
            if chain is None:
                self.unknown += 1
                continue
            described.append(key)
            blocks.append(msgpack.packb(description(chain, group), use_bin_type=True))
        if described:
            try:
                send(described, blocks)
                self.described += len(described)
            except TierdError as exc:  # the store goes on undescribed; said once per kind
                self.refused += len(described)
                log.warning("the daemon refused a description", error=str(exc))

    def close(self) -> None:
        if self.book is not None:
            self.book.close()


def engine_kv_events() -> tuple[Any, int]:
    """vLLM's ``KVEventsConfig`` for this engine (or None) and the engine's data-parallel
    index (its publisher's port is the configured one plus this index). The offloading
    spec a tier is given keeps only whether events are on, not where they go: the config
    is vLLM's current one if set, else the ``vllm_config`` that vLLM's offloading
    connector was built with, found among the callers' frames (the tier is built inside
    it)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES):
        if config is not None or frame is None:
            break
        found = frame.f_locals.get("vllm_config")
        config = found if hasattr(found, "kv_events_config") else None
        frame = frame.f_back
    parallel = getattr(config, "parallel_config", None)
    rank = getattr(parallel, "data_parallel_index", 0)
    return getattr(config, "kv_events_config", None), rank if isinstance(rank, int) else 0


def rank_endpoint(endpoint: str, rank: int) -> str | None:
    """Where vLLM's publisher of data-parallel rank ``rank`` binds when configured with
    ``endpoint``: vLLM's own rule (its ``offset_endpoint_port``), None where it has none
    (an ``ipc://`` path shared by several ranks)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    try:
        bound = ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    except ValueError:
        return None
    return str(bound) if bound is not None else None


def describer_for(spec: Any, asked: bool | None, endpoint: str | None = None) -> Describer:
    """The tier's describer. ``asked`` is the tier's ``describe_blocks`` (None: on when
    vLLM's KV events are on and published through ``zmq``); ``endpoint`` its
    ``kv_events_endpoint`` (None: vLLM's own publisher endpoint)."""
    from vllm import envs

    blocks_per_chunk = int(getattr(spec, "blocks_per_chunk", 1) or 1)
    int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    off = Describer(None, blocks_per_chunk, int_hashes)
    events, rank = engine_kv_events() if asked is not False else (None, 0)
    zmq_on = getattr(events, "enable_kv_cache_events", False) is True
    zmq_on = zmq_on and getattr(events, "publisher", None) == "zmq"
    if asked is False or (asked is None and not zmq_on and endpoint is None):
        return off
    if endpoint is None and zmq_on:
        bound = rank_endpoint(str(getattr(events, "endpoint", "")), rank)
        endpoint = loopback_endpoint(bound) if bound is not None else None
    if endpoint is None:
        log.warning("describe_blocks: no vLLM KV events publisher tierd can reach; off")
        return off
    book = BlockBook(endpoint, str(getattr(events, "topic", "") or ""))
    log.info("describing blocks from vLLM's KV events", endpoint=endpoint)
    return Describer(book, blocks_per_chunk, int_hashes)
