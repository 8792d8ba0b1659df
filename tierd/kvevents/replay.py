"""The batches kept for replay, and the replays under way, each bounded.

:class:`Kept` holds the last batches published: at most ``batches`` of them and
``max_bytes`` of their payloads, the oldest going first.

:class:`Replays` answers the ROUTER's requests (``[peer, b"", start]``: every kept batch
from ``start`` on, then the end marker) a little at a time: what a peer's pipe takes now
(its high-water mark is :data:`PEER_HWM` messages, ``ROUTER_MANDATORY`` says when it is
full), the rest when it has read. A peer has one replay at a time (a new request replaces
its last), at most :data:`MAX_REPLAYS` peers have one, and a replay not read to its end in
:data:`REPLAY_TIMEOUT_S` is given up. So what replays cost the daemon is bounded by the
peers it answers, never by the requests it is sent: 4,000 requests from 100 peers that
never read once took it from 120 to 892 MiB, each queueing the whole kept history.

Everything here runs on the publisher's thread; the kept batches are the loop's too (it
adds them), so they are read under the publisher's lock, a pipe's worth at a time.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice

import zmq

from tierd.kvevents import wire
from tierd.logs import get_logger

__all__ = ["MAX_REPLAYS", "PEER_HWM", "REPLAY_TIMEOUT_S", "Kept", "Replays"]

PEER_HWM = 64  # replayed batches queued for one peer, at most
MAX_REPLAYS = 16  # peers being answered at once; a request beyond waits for a retry
REPLAY_TIMEOUT_S = 30.0  # a replay its peer has not read by then is given up
REQUEST_BYTES = 64  # the longest frame a ROUTER takes (a request's is 8 bytes)

log = get_logger("tierd.kvevents")


class Kept:
    """The last published batches: ``(seq, payload)``, oldest first, bounded twice."""

    def __init__(self, batches: int, max_bytes: int) -> None:
        self.batches, self.max_bytes = batches, max_bytes
        self.items: deque[tuple[int, bytes]] = deque()
        self.bytes = 0

    def add(self, seq: int, payload: bytes) -> None:
        self.items.append((seq, payload))
        self.bytes += len(payload)
        while len(self.items) > self.batches or (
            self.bytes > self.max_bytes and len(self.items) > 1
        ):
            self.bytes -= len(self.items.popleft()[1])

    def index_of(self, seq: int) -> int:
        """The position of the first kept batch numbered ``seq`` or later."""
        items, lo, hi = self.items, 0, len(self.items)
        while lo < hi:
            mid = (lo + hi) // 2
            if items[mid][0] < seq:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def __len__(self) -> int:
        return len(self.items)


@dataclass(slots=True)
class _Replay:
    next_seq: int  # the first batch not yet queued for the peer
    deadline: float
    done: bool = False  # every batch queued: the end marker is what is left


class Replays:
    """The replays under way on one ROUTER socket."""

    def __init__(
        self,
        router: zmq.Socket[bytes],
        topic: bytes,
        kept: Kept,
        lock: threading.Lock | None = None,
    ) -> None:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, PEER_HWM)
        router.setsockopt(zmq.RCVHWM, 64)
        router.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)
        self.router, self.topic, self.kept = router, topic, kept
        self.lock = lock or threading.Lock()  # the kept batches'
        self.pending: OrderedDict[bytes, _Replay] = OrderedDict()
        self.counts = {"replays": 0, "replays_refused": 0, "replays_given_up": 0}
        self._warned = False

    def requests(self) -> None:
        """Take every request waiting on the socket."""
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            start = wire.replay_start(frames)
            peer = frames[0]
            if start is None:
                if not self._warned:  # once: a client could flood the log
                    self._warned = True
                    log.warning("malformed KV-event replay request", frames=len(frames))
                self._send(peer, [peer, b"", b"", wire.END_SEQ, b""])
                continue
            if peer not in self.pending and len(self.pending) >= MAX_REPLAYS:
                self.counts["replays_refused"] += 1
                continue
            self.counts["replays"] += 1
            self.pending[peer] = _Replay(start, time.monotonic() + REPLAY_TIMEOUT_S)
            self.pending.move_to_end(peer)

    def advance(self) -> None:
        """Queue for each peer what its pipe takes now; end the replays read to the end."""
        now = time.monotonic()
        for peer, replay in list(self.pending.items()):
            if now > replay.deadline:
                self.counts["replays_given_up"] += 1
                del self.pending[peer]
            elif self._advance(peer, replay):
                del self.pending[peer]

    def _advance(self, peer: bytes, replay: _Replay) -> bool:
        """True: the replay is over (answered to its end, or its peer is gone)."""
        while not replay.done:
            with self.lock:  # (a pipe holds PEER_HWM at most: no more is taken at once)
                at = self.kept.index_of(replay.next_seq)
                batches = list(islice(self.kept.items, at, at + PEER_HWM))
            if not batches:
                replay.done = True
                break
            for seq, payload in batches:
                frames = [peer, b"", self.topic, seq.to_bytes(8, "big"), payload]
                sent = self._send(peer, frames)
                if sent is not True:
                    return sent is None
                replay.next_seq = seq + 1
        return self._send(peer, [peer, b"", b"", wire.END_SEQ, b""]) is not False

    def _send(self, peer: bytes, frames: list[bytes]) -> bool | None:
        """True: queued; False: the peer's pipe is full; None: the peer is gone."""
        try:
            self.router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return None
            raise
        return True
