"""The ZMQ publisher of KV-event batches: vLLM's PUB stream and ROUTER replay, off the loop.

This module owns the two sockets and their one thread: ``offer`` (on the asyncio loop)
numbers, stamps and queues a batch without waiting; the thread sends it on PUB, never
blocking, and keeps it for replay. A dropped batch still uses its number, so a subscriber
sees the gap and asks ROUTER (frames: :mod:`tierd.kvevents.wire`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from tierd.errors import ConfigError
from tierd.kvevents import wire
from tierd.logs import get_logger

__all__ = ["Publisher", "PublisherSettings"]

log = get_logger(__name__)

_DROPS = ("dropped_batches", "dropped_events")
_COUNTS = ("published_batches", "published_events", *_DROPS, "replays")


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    """Where and how the events go out (validated by the caller)."""

    endpoint: str  # PUB bind address: "tcp://127.0.0.1:5557", "ipc:///path"
    replay_endpoint: str | None  # ROUTER bind address; None: no replay
    topic: str = ""
    buffer_batches: int = 10_000  # past batches kept for replay
    queue_batches: int = 1024  # batches waiting for the thread; beyond: dropped
    hwm: int = 100_000  # PUB send high-water mark (messages)
    dp_rank: int | None = None


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``sock``; its bound address, or the endpoint's ConfigError."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind KV-event endpoint {endpoint!r}: {exc.strerror}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _count(counts: dict[str, int], kind: str, events: list[bytes]) -> None:
    counts[f"{kind}_batches"] += 1
    counts[f"{kind}_events"] += len(events)


class Publisher:
    """One incarnation of tierd's KV-event stream: sequence numbers start at 0."""

    def __init__(self, settings: PublisherSettings) -> None:
        self._settings = settings
        self.endpoint, self.replay_endpoint = settings.endpoint, settings.replay_endpoint
        self._topic = settings.topic.encode()
        self._queue: deque[tuple[int, float, list[bytes]]] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_batches)
        self._counts = dict.fromkeys(_COUNTS, 0)  # the thread's
        self._offered = dict.fromkeys(("sequence", *_DROPS), 0)  # offer's (the loop thread)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
        self._router = None if settings.replay_endpoint is None else self._ctx.socket(zmq.ROUTER)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._woken = self._closed = self._warned = False
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind both sockets (a failure closes this, raising ConfigError); start the thread."""
        if self._thread is not None or self._closed:
            raise RuntimeError("a Publisher starts once")
        try:
            self.endpoint = _bind(self._pub, self._settings.endpoint)
            if self._router is not None and self._settings.replay_endpoint is not None:
                self.replay_endpoint = _bind(self._router, self._settings.replay_endpoint)
        except ConfigError:
            self.close()
            raise
        self._thread = threading.Thread(target=self._run, name="tierd-kv-events", daemon=True)
        self._thread.start()

    def offer(self, events: list[bytes]) -> bool:
        """Queue one batch; never blocks. False: dropped (queue full, closed), its number used."""
        seq = self._offered["sequence"]
        self._offered["sequence"] = seq + 1
        if self._closed or len(self._queue) >= self._settings.queue_batches:
            _count(self._offered, "dropped", events)
            return False
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
        """Counters since this Publisher was made (``buffered``: batches kept for replay)."""
        stats = dict(self._counts, queued=len(self._queue), buffered=len(self._buffer))
        for key, count in self._offered.items():
            stats[key] = stats.get(key, 0) + count
        return stats

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the thread has wake-ups to read
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        for source in (self._wake_r, self._router):
            if source is not None:
                poller.register(source, zmq.POLLIN)
        try:
            while True:
                self._woken = False
                self._publish_pending()
                if self._deadline is not None:
                    return
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if self._router is not None and self._router in ready:
                    self._serve_replay(self._router)
        except Exception:
            log.exception("KV-event thread stopped on an error; events are no longer sent")
        finally:
            self._finish()

    def _publish_pending(self) -> None:
        """Send the queued batches in order (when closing, until the deadline)."""
        while self._queue:
            if self._deadline is not None and time.monotonic() > self._deadline:
                return
            seq, ts, events = self._queue.popleft()
            try:
                payload = wire.batch(ts, events, self._settings.dp_rank)
                self._buffer.append((seq, payload))
                frames = [self._topic, seq.to_bytes(8, "big"), payload]
                self._pub.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # PUB drops at its high-water mark; this is the same drop
                _count(self._counts, "dropped", events)
            except Exception:
                _count(self._counts, "dropped", events)
                log.exception("KV-event batch not sent", seq=seq)
            else:
                _count(self._counts, "published", events)

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        """Answer one replay request (poll reports the next one, if any, at once)."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
            start = wire.replay_start(frames)
            if start is None and not self._warned:  # once: a client could flood the log
                self._warned = True
                log.warning("malformed KV-event replay request", frames=len(frames))
            elif start is not None:
                self._publish_pending()
                self._counts["replays"] += 1
                for seq, payload in [kept for kept in self._buffer if kept[0] >= start]:
                    answer = [frames[0], b"", self._topic, seq.to_bytes(8, "big"), payload]
                    router.send_multipart(answer, zmq.NOBLOCK)
            router.send_multipart([frames[0], b"", b"", wire.END_SEQ, b""], zmq.NOBLOCK)
        except zmq.Again:
            return  # no request after all (a stale report), or the client's pipe is full
        except Exception:
            log.exception("KV-event replay request not answered")

    def _finish(self) -> None:
        """Count what was never sent as dropped; close the sockets (linger 0) and the context."""
        while self._queue:
            _count(self._counts, "dropped", self._queue.popleft()[2])
        self._ctx.destroy(linger=0)
