"""The node's blocks in an engine's own KV events: tierd's stream, merged into the engine's.

Routers follow each engine's KV event stream and credit the engine for what it announces.
A block one engine stored in tierd is a CPU- or disk-speed hit for every engine of the
same namespace on the node, so each engine should announce it. :class:`NodeEvents`
subscribes to the tenant's own stream of the daemon (``kv_events``, docs/events.md: its
``BlockStored`` events fully described by the engines that stored the blocks, its
``BlockRemoved`` when the node lets a block go) and hands the engine, at each of its
steps, the events that change what its stream says the engine holds:

- a node ``BlockStored`` whose every (hash, medium, group) the engine's stream already
  holds (its own announcement, or an earlier one from the node) is left out; any other
  goes whole (its tokens stay aligned with its hashes);
- a node ``BlockRemoved`` goes with the hashes this merge announced, and no others (a
  block the engine announced itself, the engine's connector removes itself);
- the daemon's ``AllBlocksCleared`` (a restart, or the snapshot a new subscription gets)
  is never passed on (it would clear the engine's GPU blocks too): what the merge
  announced becomes *stale*, the snapshot's stores that follow make each block they name
  current again (nothing to announce: the router still holds it), and after
  :data:`STALE_S` a removal goes for every block still stale (one the node no longer
  holds: a wiped disk, a block evicted while the stream was down);
- the engine's own ``AllBlocksCleared`` (vLLM's prefix cache reset) clears what a router
  credits it with: the node blocks the merge announced are announced again after it.

Events are taken at the engine's steps: an idle engine announces the node's blocks at its
next step. The queue of events not yet taken is bounded (:data:`MAX_QUEUED` batches; past
it the oldest are dropped and counted, and the next merge starts over from a snapshot by
resubscribing). What the merge announced is bounded too (:data:`MAX_ANNOUNCED`). The
subscription runs on a thread of its own; the stream's endpoint is the tenant's, asked of
the daemon (``stats``), again after a failure every :data:`RETRY_S`. Events are kept as
the dicts the stream decodes to: the engine's side turns them into its own event types.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
import zmq

from tierd.logs import get_logger

__all__ = ["MAX_ANNOUNCED", "MAX_QUEUED", "NodeEvents", "RETRY_S", "STALE_S", "stream_endpoint"]

log = get_logger("tierd.integrations.core.node_events")

MAX_QUEUED = 4096  # batches of the node's events not yet taken by an engine step
MAX_ANNOUNCED = 1 << 20  # (hash, medium, group) the merge keeps as announced
RETRY_S = 2.0  # between attempts to find and follow the stream
STALE_S = 2.0  # after the daemon's AllBlocksCleared, how long its snapshot has to follow
_POLL_MS = 100
_ASK_S = 2.0

Event = dict[str, Any]
Held = tuple[Any, Any, Any]  # (block hash, medium, group index)


def stream_endpoint(socket_path: str) -> str | None:
    """The endpoint of the KV event stream of this user's tenant at the daemon at
    ``socket_path`` (None: no daemon answers, or it publishes none for the tenant)."""
    from tierd.control.clients.blocking_client import BlockingClient
    from tierd.errors import TierdError

    try:
        client = BlockingClient.connect(
            socket_path, namespace=None, block_bytes=None, deadline=time.monotonic() + _ASK_S
        )
    except (TierdError, OSError):
        return None
    try:
        stats = client.request("stats", time.monotonic() + _ASK_S).get("stats") or {}
    except (TierdError, OSError):
        return None
    finally:
        client.close()
    events = stats.get("kv_events") or {}
    tenant = client.info.get("tenant")
    own = (events.get("streams") or {}).get(tenant) or events
    endpoint = own.get("endpoint")
    return str(endpoint) if endpoint else None


class NodeEvents:
    """The daemon's stream for one engine (see the module's docstring); thread-safe."""

    def __init__(
        self, socket_path: str, find: Callable[[str], str | None] = stream_endpoint
    ) -> None:
        self.socket_path = socket_path
        self._find = find
        self._queue: deque[list[Event]] = deque()
        self._lock = threading.Lock()
        self._held: set[Held] = set()  # what the engine's stream says it holds
        self._ours: dict[Held, Event] = {}  # of those, what this merge announced
        self._stale: dict[Held, Event] = {}  # announced before the daemon's last clear
        self._stale_until = 0.0
        self.dropped = 0  # batches dropped from a full queue
        self.endpoint: str | None = None
        self._resubscribe = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierd-node-events", daemon=True)
        self._thread.start()

    # -- the engine's step ------------------------------------------------------------

    def merge(self, own: Sequence[Event]) -> list[Event]:
        """Given the events the engine publishes this step (``own``, as dicts with a
        ``type``), the node's events to publish after them."""
        with self._lock:
            batches = list(self._queue)
            self._queue.clear()
        out: list[Event] = []
        for event in own:
            kind = event.get("type")
            if kind == "BlockStored":
                self._held.update(_held(event))
            elif kind == "BlockRemoved":
                self._held.difference_update(_held(event))
            elif kind == "AllBlocksCleared":
                self._held.clear()
                out.extend(self._again())
        for batch in batches:
            for event in batch:
                out.extend(self._node(event))
        if self._stale and time.monotonic() >= self._stale_until:
            out.extend(self._removals(self._stale))
            self._stale.clear()
        return out

    def _node(self, event: Event) -> list[Event]:
        kind = event.get("type")
        if kind == "BlockStored":
            held = _held(event)
            for h in held:  # still held after the daemon's clear: current again
                if (current := self._stale.pop(h, None)) is not None:
                    self._ours[h] = current
            if not held or all(h in self._held for h in held):
                return []
            if len(self._ours) + len(held) > MAX_ANNOUNCED:
                return []  # past the bound: the block is left to the engine's own events
            self._held.update(held)
            for h in held:
                self._ours[h] = event
            return [event]
        if kind == "BlockRemoved":
            gone = [h for h in _held(event) if h in self._ours or h in self._stale]
            if not gone:
                return []
            for h in gone:
                self._ours.pop(h, None)
                self._stale.pop(h, None)
                self._held.discard(h)
            return [dict(event, block_hashes=[h[0] for h in gone])]
        if kind == "AllBlocksCleared":
            self._stale.update(self._ours)
            self._ours.clear()
            self._stale_until = time.monotonic() + STALE_S
        return []

    def _again(self) -> list[Event]:
        """The node's stores announced again (after the engine's own clear), each once."""
        seen: set[int] = set()
        out = []
        for h, event in [*self._ours.items(), *self._stale.items()]:
            self._held.add(h)
            if id(event) not in seen:
                seen.add(id(event))
                out.append(event)
        return out

    def _removals(self, announced: dict[Held, Event]) -> list[Event]:
        """Removals of the blocks of ``announced``, by medium and group."""
        by_where: dict[tuple[Any, Any], list[Any]] = {}
        for block, medium, group in announced:
            by_where.setdefault((medium, group), []).append(block)
            self._held.discard((block, medium, group))
        out = []
        for (medium, group), hashes in by_where.items():
            removed: Event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
            if group is not None:
                removed["group_idx"] = group
            out.append(removed)
        return out

    # -- the subscription (its own thread) --------------------------------------------

    def _run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._subscribe(context)
        finally:
            context.term()

    def _subscribe(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        while not self._stop.is_set():
            endpoint = self._find(self.socket_path)
            if endpoint is None:
                self._stop.wait(RETRY_S)
                continue
            if endpoint != self.endpoint:
                log.info("following the node's KV events", endpoint=endpoint)
            self.endpoint = endpoint
            sock = context.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(endpoint)
                self._follow(sock)
            except zmq.ZMQError as exc:
                log.warning("cannot follow the node's KV events", endpoint=endpoint, error=str(exc))
                self._stop.wait(RETRY_S)
            finally:
                sock.close()

    def _follow(self, sock: zmq.Socket[bytes]) -> None:
        """Read ``sock`` until told to stop or to resubscribe (a full queue)."""
        self._resubscribe.clear()
        while not self._stop.is_set() and not self._resubscribe.is_set():
            if not sock.poll(_POLL_MS):
                continue
            frames = sock.recv_multipart()
            try:
                batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                events = [e for e in batch[1] if isinstance(e, dict)]
            except (ValueError, TypeError, IndexError, msgpack.UnpackException):
                continue  # not a batch of the stream: nothing to announce
            self._put(events)

    def _put(self, events: list[Event]) -> None:
        with self._lock:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.clear()
                self.dropped += 1
                self._queue.append([{"type": "AllBlocksCleared"}])  # start over: resubscribe
                self._resubscribe.set()
                return
            self._queue.append(events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000 + _ASK_S)


def _held(event: Event) -> list[Held]:
    hashes: Iterable[Any] = event.get("block_hashes") or ()
    medium, group = event.get("medium"), event.get("group_idx")
    return [(_hashable(h), medium, group) for h in hashes]


def _hashable(value: Any) -> Any:
    return bytes(value) if isinstance(value, bytearray | memoryview) else value
