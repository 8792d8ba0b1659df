"""The control-path half of ``scripts/bench daemon``: the framing (a 4-byte big-endian
length, then a msgpack map, as ``tierd.control.protocol``), the baseline echo server, the
raw asyncio.Protocol client that drives both servers alike, and the spawned client
processes that run a :class:`ClientPlan`'s phases together and pool their figures.

Only light imports: the client processes are spawned and import this module.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
import struct
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import uvloop

from bench.figures import median_of
from tierd.control.protocol import PROTOCOL_VERSION  # light: msgpack and the stdlib only

HEADER = struct.Struct(">I")
NAMESPACE = "bench"
KEY_BYTES = 32
START_TIMEOUT_S = 60.0


# -- framing (the echo server and the raw client) ----------------------------------------


def frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class Frames:
    """Length-prefixed msgpack frames out of a byte stream (as tierd's FrameDecoder)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self.buf
        buf += data
        out = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if end - pos - 4 < size:
                break
            out.append(msgpack.unpackb(buf[pos + 4 : pos + 4 + size], raw=False))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out


def lookup_keys(count: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * (KEY_BYTES // 4) for i in range(1, count + 1)]


# -- the baseline: a bare echo server (child process) ------------------------------------


class EchoProtocol(asyncio.Protocol):
    """Decodes each request and answers with a lookup-shaped reply of the same size."""

    def __init__(self) -> None:
        self.frames = Frames()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        out = []
        for msg in self.frames.feed(data):
            keys = msg.get("keys") or ()
            reply = {"id": msg.get("id", 0), "ok": True}
            if msg.get("op") == "lookup":
                reply.update(count=len(keys), media=["CPU"] * len(keys), in_flight=False)
            out.append(frame(reply))
        if out:
            self.transport.writelines(out)


async def echo_main(path: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = await loop.create_unix_server(EchoProtocol, path)
    print("ready", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()


# -- the raw client ----------------------------------------------------------------------


class RawClient(asyncio.Protocol):
    """One connection; :meth:`run` sends ``count`` requests keeping ``window`` in flight,
    each next request written from ``data_received`` (replies come back in order)."""

    def __init__(self) -> None:
        self.frames = Frames()
        self.transport: Any = None
        self.next_id = 0
        self.last_reply: dict[str, Any] = {}
        self._done: asyncio.Future[float] | None = None
        self._make: Callable[[int], bytes] = lambda i: b""
        self._left = 0
        self._pending = 0
        self._sent_at: deque[float] | None = None
        self.latencies: list[float] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"the server closed the connection: {exc}"))

    def _request(self) -> bytes:
        self.next_id += 1
        self._left -= 1
        self._pending += 1
        if self._sent_at is not None:
            self._sent_at.append(time.perf_counter())
        return self._make(self.next_id)

    async def run(
        self, make: Callable[[int], bytes], count: int, window: int, timed: bool = False
    ) -> list[float]:
        """Latencies in seconds when ``timed``, else an empty list."""
        self._done = asyncio.get_running_loop().create_future()
        self._make, self._left, self._pending = make, count, 0
        self._sent_at = deque() if timed else None
        self.latencies = []
        self.transport.writelines([self._request() for _ in range(min(window, count))])
        await self._done
        return self.latencies

    def data_received(self, data: bytes) -> None:
        out = []
        now = time.perf_counter()
        for msg in self.frames.feed(data):
            self._pending -= 1
            if self._sent_at is not None:
                self.latencies.append(now - self._sent_at.popleft())
            if msg.get("ok") is not True:
                if self._done is not None and not self._done.done():
                    self._done.set_exception(RuntimeError(f"error reply: {msg}"))
                return
            self.last_reply = msg
            if self._left > 0:
                out.append(self._request())
        if out:
            self.transport.writelines(out)
        done = self._done
        if self._left == 0 and self._pending == 0 and done is not None and not done.done():
            done.set_result(now)


async def raw_connect(path: str) -> RawClient:
    loop = asyncio.get_running_loop()
    _, client = await loop.create_unix_connection(RawClient, path)
    hello = frame({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NAMESPACE})
    await client.run(lambda i: hello, 1, 1)
    return client


def lookup_request(keys: list[bytes]) -> Callable[[int], bytes]:
    def make(request_id: int) -> bytes:
        return frame({"id": request_id, "op": "lookup", "keys": keys})

    return make


# -- client processes --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    count: int  # per connection
    window: int
    timed: bool


@dataclass(frozen=True, slots=True)
class ClientPlan:
    path: str
    conns: int  # per process
    keys: int
    warmup: int  # requests per connection, pipelined, before the first phase
    phases: tuple[Phase, ...]


async def _client_body(plan: ClientPlan, barrier: Any) -> dict[str, Any]:
    clients = [await raw_connect(plan.path) for _ in range(plan.conns)]
    make = lookup_request(lookup_keys(plan.keys))
    await asyncio.gather(*(c.run(make, plan.warmup, 16) for c in clients))
    count = clients[0].last_reply.get("count")
    if count != plan.keys:
        raise RuntimeError(f"a lookup of {plan.keys} keys found {count}: not all hits")
    out: dict[str, Any] = {}
    for phase in plan.phases:
        barrier.wait(START_TIMEOUT_S)  # every process starts the phase together
        started = time.perf_counter()
        lats = await asyncio.gather(
            *(c.run(make, phase.count, phase.window, phase.timed) for c in clients)
        )
        out[phase.name] = {
            "start": started,
            "end": time.perf_counter(),
            "requests": phase.count * plan.conns,
            "latencies": [x for lat in lats for x in lat],
        }
    for c in clients:
        c.transport.close()
    return out


def client_process(plan: ClientPlan, barrier: Any, results: Any) -> None:
    try:
        results.put(("ok", uvloop.run(_client_body(plan, barrier))))
    except BaseException:
        barrier.abort()
        results.put(("error", traceback.format_exc()))


def run_clients(plan: ClientPlan, procs: int) -> dict[str, dict[str, float]]:
    """Run ``plan`` in ``procs`` spawned processes; per phase: the median latency (s), the
    aggregate requests/s, from the first start to the last end."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=client_process, args=(plan, barrier, results)) for _ in range(procs)
    ]
    try:
        for w in workers:
            w.start()
        outs = []
        while len(outs) < procs:
            try:
                status, value = results.get(timeout=5)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process died (exit status {dead[0]})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"a client process failed:\n{value}")
            outs.append(value)
        for w in workers:
            w.join(30)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
    figures = {}
    for phase in plan.phases:
        parts = [o[phase.name] for o in outs]
        elapsed = max(p["end"] for p in parts) - min(p["start"] for p in parts)
        lats = [x for p in parts for x in p["latencies"]]
        figures[phase.name] = {
            "latency": median_of(lats) if lats else 0.0,
            "rate": sum(p["requests"] for p in parts) / elapsed,
        }
    return figures
