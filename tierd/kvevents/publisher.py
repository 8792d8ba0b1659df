"""The ZMQ publisher of KV-event batches: vLLM's PUB stream and ROUTER replay.

This module owns the two sockets and their one thread. ``offer`` (on the asyncio loop)
numbers and stamps a batch and sends it on PUB itself, never blocking (a PUB drops what a
subscriber has not read past its high-water mark), and keeps it for replay; a dropped
batch still uses its number, so a subscriber sees the gap and asks ROUTER (frames:
:mod:`tierd.kvevents.wire`). The thread takes what peers send (subscriptions, replay
requests) and answers replays. The PUB socket is shared by the two under one lock (ZMQ
lets a socket change threads across a full barrier, which a lock is), so a batch costs the
loop a send and no wake-up of the thread: handed to the thread, each batch would be a
write to its pipe, a wake-up, a round of its poll and two hand-overs of the GIL, which
cost more than the batches' own encoding and sending. When the lock is taken (the thread
is reading a subscription or a replay's batches) or batches wait already, ``offer`` queues
the batch (at most ``queue_batches``; past it the batch is dropped, counted) and the thread
sends it, in order. The thread polls the PUB socket's own descriptor (ZMQ's ``FD``), not the socket,
and as ZMQ's notice that something came may be taken by a send, the loop looks after a
send whether a subscription waits, and wakes the thread if one does: at most every
:data:`LOOK_S` (the look costs the loop some 35 us after an idle moment, as much as a
third of the send itself), and the thread looks every :data:`IDLE_LOOK_S` when nothing
woke it (for a notice taken by the last send of a burst). A subscription waits that long
at most to be applied.

What a peer of either socket can cost the daemon is bounded: connections
(:mod:`tierd.kvevents.peers`), replays (:mod:`tierd.kvevents.replay`), the size of any
message it sends (a subscription, a request), and subscriptions: the PUB side is an XPUB
that applies a subscription only when it is a prefix of the stream's topic (the only
ones that select anything), so a peer holds at most ``len(topic) + 1`` of them, however
many it sends, and none bigger than the topic.

Threads. The loop (``offer``'s one caller) owns the batch numbers, the drops it counts
and the appends to the queue of waiting batches. The publisher's thread owns the ROUTER
socket, the replays under way, the peers' monitors and counts, and the queue's other end
(it pops, under the lock). Shared under the one lock: the PUB socket, the batches kept
for replay (replays read them under it too), the send counters and whether the sockets
are gone. The wake-up flag is written by both without it (the thread clears it before it
looks at the queue, so a batch queued meanwhile is never missed), and
:meth:`Publisher.stats` reads the counters and the peers' counts without it: figures of a
moment.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import zmq

from tierd.errors import ConfigError
from tierd.kvevents import wire
from tierd.kvevents.peers import MAX_MESSAGES, PeerBound
from tierd.kvevents.replay import Kept, Replays
from tierd.logs import get_logger

__all__ = ["Publisher", "PublisherSettings"]

log = get_logger(__name__)

_DROPS = ("dropped_batches", "dropped_events")
_COUNTS = ("published_batches", "published_events", *_DROPS)
SUBSCRIPTION_BYTES = 512  # the longest subscription message taken (a topic is 256 at most)
RETRY_S = 0.01  # how soon the thread looks again at replays waiting on a full pipe
LOOK_S = 0.05  # how often, at most, a send is followed by a look for a subscription waiting
IDLE_LOOK_S = 0.5  # and the thread's look when nothing woke it


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    """Where and how the events go out (validated by the caller)."""

    endpoint: str  # PUB bind address: "tcp://127.0.0.1:5557", "ipc:///path"
    replay_endpoint: str | None  # ROUTER bind address; None: no replay
    topic: str = ""
    buffer_batches: int = 10_000  # past batches kept for replay
    buffer_bytes: int = 64 << 20  # and their bytes, at most
    queue_batches: int = 1024  # batches waiting for the thread; beyond: dropped
    hwm: int = 1000  # PUB send high-water mark (batches queued for one subscriber)
    dp_rank: int | None = None
    max_peers: int = 64  # connections to each socket at once
    first_seq: int = 0  # the number of the first batch
    socket_mode: int = 0o600  # of an ipc:// socket's file (connecting needs write access)
    socket_group: int | None = None  # the group an ipc:// socket's file is given


def _bind(sock: zmq.Socket[bytes], endpoint: str, settings: PublisherSettings) -> str:
    """Bind ``sock`` (an ipc:// file gets its mode and group); its bound address, or the
    endpoint's ConfigError."""
    try:
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://") :]
            os.chmod(path, settings.socket_mode)
            if settings.socket_group is not None:
                os.chown(path, -1, settings.socket_group)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind KV-event endpoint {endpoint!r}: {exc.strerror}") from exc
    except OSError as exc:
        raise ConfigError(f"KV-event endpoint {endpoint!r}: {exc.strerror}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _count(counts: dict[str, int], kind: str, events: list[bytes]) -> None:
    counts[f"{kind}_batches"] += 1
    counts[f"{kind}_events"] += len(events)


class Publisher:
    """One incarnation of a KV-event stream: its batches are numbered from ``first_seq``."""

    def __init__(
        self, settings: PublisherSettings, on_subscribed: Callable[[], None] | None = None
    ) -> None:
        """``on_subscribed`` is called, on the publisher's thread, for each subscription
        taken (a subscriber joined, or came back: ZMQ subscribes again on a reconnect)."""
        self._settings = settings
        self._on_subscribed = on_subscribed
        self.endpoint, self.replay_endpoint = settings.endpoint, settings.replay_endpoint
        self._topic = settings.topic.encode()
        self._queue: deque[tuple[int, float, list[bytes]]] = deque()
        self._kept = Kept(settings.buffer_batches, settings.buffer_bytes)
        self._counts = dict.fromkeys(_COUNTS, 0)  # the sends' (under the lock)
        self._offered = dict.fromkeys(_DROPS, 0)  # offer's (the loop thread)
        self._seq = settings.first_seq
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
        self._pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_BYTES)
        # ZMQ files every subscription it reads from a peer before this thread sees it:
        # reading few at a time lets a peer that sends too many be shut down early.
        self._pub.setsockopt(zmq.RCVHWM, MAX_MESSAGES)
        self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
        self._peers = [PeerBound(self._pub, settings.max_peers)]
        self._router = None if settings.replay_endpoint is None else self._ctx.socket(zmq.ROUTER)
        self._lock = threading.Lock()  # the PUB socket's, and the kept batches'
        self._pub_fd = cast(int, self._pub.getsockopt(zmq.FD))
        self._replays = None
        if self._router is not None:
            self._replays = Replays(self._router, self._topic, self._kept, self._lock)
            self._peers.append(PeerBound(self._router, settings.max_peers))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._woken = self._closed = False
        self._look_at = 0.0  # (the loop's) when a send is next followed by a look
        self._gone = False  # the sockets are closed (under the lock)
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind both sockets (a failure closes this, raising ConfigError); start the thread
        (it sends what was offered before)."""
        if self._thread is not None or self._closed:
            raise RuntimeError("a Publisher starts once")
        try:
            self.endpoint = _bind(self._pub, self._settings.endpoint, self._settings)
            self._peers[0].bound_to(self.endpoint)
            if self._router is not None and self._settings.replay_endpoint is not None:
                self.replay_endpoint = _bind(
                    self._router, self._settings.replay_endpoint, self._settings
                )
                self._peers[1].bound_to(self.replay_endpoint)
        except ConfigError:
            self.close()
            raise
        self._thread = threading.Thread(target=self._run, name="tierd-kv-events", daemon=True)
        self._thread.start()

    def offer(self, events: list[bytes]) -> bool:
        """Send one batch, or queue it for the thread; never blocks. False: dropped (queue
        full, closed), its number used. (From one thread, the loop's.)"""
        seq = self._seq
        self._seq = seq + 1
        if self._closed or len(self._queue) >= self._settings.queue_batches:
            _count(self._offered, "dropped", events)
            return False
        # Only this thread queues: an empty queue stays empty until it does, so a batch
        # sent here follows every batch offered before.
        if not self._queue and self._thread is not None and self._lock.acquire(blocking=False):
            try:
                if not self._gone:
                    self._send(seq, time.time(), events)
                    now = time.monotonic()
                    # A subscription whose notice the send took? (Looked for now and then.)
                    if now >= self._look_at:
                        self._look_at = now + LOOK_S
                        if self._readable(self._pub) and not self._woken:
                            self._woken = True
                            self._wake()
                    return True
            finally:
                self._lock.release()
        self._queue.append((seq, time.time(), events))
        if not self._woken and self._thread is not None:
            self._woken = True
            self._wake()
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued for up to ``timeout_s``, close the sockets, join the thread."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            self._finish()
        else:
            self._deadline = time.monotonic() + timeout_s
            self._wake()
            thread.join(timeout_s + 1.0)
            if thread.is_alive():
                log.error("KV-event thread still running after close", timeout_s=timeout_s)
                return
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stats(self) -> dict[str, int]:
        """Counters since this Publisher was made (``buffered``: batches kept for replay,
        ``peers``: connections to both sockets now, ``peers_refused``: shut down as one too
        many)."""
        stats = dict(
            self._counts,
            sequence=self._seq,
            queued=len(self._queue),
            buffered=len(self._kept),
            buffered_bytes=self._kept.bytes,
            peers=sum(len(p.live) for p in self._peers),
            peers_refused=sum(p.refused for p in self._peers),
            replays=0,
            replays_refused=0,
            replays_given_up=0,
        )
        if self._replays is not None:
            stats.update(self._replays.counts)
        for key, count in self._offered.items():
            stats[key] += count
        return stats

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the thread has wake-ups to read
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        for source in (self._wake_r, self._pub_fd, self._router, *(p.monitor for p in self._peers)):
            if source is not None:
                poller.register(source, zmq.POLLIN)
        try:
            while True:
                self._woken = False
                with self._lock:
                    self._publish_pending()
                if self._deadline is not None:
                    return
                replays = self._replays
                waiting = replays is not None and bool(replays.pending)
                ready = dict(poller.poll(int((RETRY_S if waiting else IDLE_LOOK_S) * 1000)))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                for bound in self._peers:
                    if bound.monitor in ready:
                        bound.take()  # (connections first: a new one's count starts here)
                # (The loop wakes this thread when one waits, now and then; the idle look
                # finds one whose notice the last send took.)
                if self._pub_fd in ready or self._wake_r in ready or not ready:
                    with self._lock:
                        self._subscriptions()
                if replays is not None:
                    if self._router in ready:
                        replays.requests()
                    with self._lock:
                        self._publish_pending()  # a replay reaches the last batch offered
                    replays.advance()
        except Exception:
            log.exception("KV-event thread stopped on an error; events are no longer sent")
        finally:
            with self._lock:
                self._finish()

    def _subscriptions(self) -> None:
        """Apply the (un)subscriptions waiting that select this stream's topic (under
        the lock)."""
        while True:
            try:
                frame = self._pub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                continue  # ZMQ's own notice of a peer gone: it dropped its subscriptions
            if not self._peers[0].sent_one(fd):
                continue
            message = frame.bytes
            prefix = message[1:]
            if message[:1] in (b"\x00", b"\x01") and self._topic.startswith(prefix):
                joined = message[:1] == b"\x01"
                self._pub.setsockopt(zmq.SUBSCRIBE if joined else zmq.UNSUBSCRIBE, prefix)
                if joined and self._on_subscribed is not None:
                    self._on_subscribed()

    @staticmethod
    def _readable(sock: zmq.Socket[bytes]) -> bool:
        """Whether ``sock`` has a message waiting (asked without reading: a read that
        finds none raises, and costs more)."""
        return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _publish_pending(self) -> None:
        """Send the queued batches in order (when closing, until the deadline), taking
        new subscriptions every so often (a subscriber is sent nothing before); under
        the lock."""
        sent = 0
        while self._queue:
            if self._deadline is not None and time.monotonic() > self._deadline:
                return
            if sent % 256 == 0 and self._readable(self._pub):
                self._subscriptions()
            sent += 1
            self._send(*self._queue.popleft())

    def _send(self, seq: int, ts: float, events: list[bytes]) -> None:
        """Send one batch on PUB and keep it for replay, if there is a replay socket
        (under the lock)."""
        try:
            payload = wire.batch(ts, events, self._settings.dp_rank)
            if self._replays is not None:  # (kept for replays: none without their socket)
                self._kept.add(seq, payload)
            frames = [self._topic, seq.to_bytes(8, "big"), payload]
            self._pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at its high-water mark; this is the same drop
            _count(self._counts, "dropped", events)
        except Exception:
            _count(self._counts, "dropped", events)
            log.exception("KV-event batch not sent", seq=seq)
        else:
            _count(self._counts, "published", events)

    def _finish(self) -> None:
        """Count what was never sent as dropped; close the sockets (linger 0) and the
        context (under the lock, or with no thread)."""
        self._gone = True
        while self._queue:
            _count(self._counts, "dropped", self._queue.popleft()[2])
        for bound in self._peers:
            bound.close()
        self._ctx.destroy(linger=0)
