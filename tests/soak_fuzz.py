"""The soak's hostile protocol traffic: the :class:`Fuzzer` (bad frames on a connection
of its own, every reply checked) and the :class:`StuckSubscriber` (subscribes to events
and never reads). The misbehaving clients that test the daemon's guards are
``tests/soak_hostile.py``."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections import Counter
from typing import Any

import msgpack
from soak_load import Gate
from soak_settings import DEADLINE_S, FUZZ_NAMESPACE, NAMESPACE

from tierd.control.protocol import (
    HEADER,
    OPERATIONS,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameDecoder,
    encode,
)
from tierd.errors import ProtocolError

CODES = frozenset(str(code) for code in ErrorCode)
OPS = list(OPERATIONS)
FIELDS = ("keys", "lease", "ok", "data", "tier", "namespace", "version", "block_bytes", "id")


class Fuzzer:
    """Bad frames on a connection of its own, at about ``rate`` frames per second; reads
    every reply and checks it (a map with ``ok``, an error code of the closed set, never
    ``internal``). ``counts``: frames, bad_frames, replies, internal, malformed, ..."""

    def __init__(
        self, path: str, rng: random.Random, gate: Gate, block_bytes: int, rate: float = 100.0
    ) -> None:
        self.path, self.rng, self.gate, self.rate = path, rng, gate, rate
        self.block_bytes = block_bytes
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._named = False  # whether this connection's hello named a namespace

    async def run(self, stop: asyncio.Event, frames: int | None = None) -> None:
        try:
            while not stop.is_set() and (frames is None or self.counts["frames"] < frames):
                pause = 0.0
                async with self.gate.turn():
                    if stop.is_set():
                        break
                    if self._writer is None or self._writer.is_closing():
                        await self.disconnect()
                        pause = 0.0 if await self._connect() else 0.2
                    else:
                        burst = self.rng.randint(1, 10)
                        await self._send_burst(burst)
                        pause = burst / self.rate
                await asyncio.sleep(pause)  # the pace of the fuzzing, not a synchronisation
        finally:
            await self.disconnect()

    async def _connect(self) -> bool:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError:
            self.counts["refused"] += 1
            return False
        self.counts["connections"] += 1
        self._writer = writer
        self._reading = asyncio.create_task(self._read(reader))
        roll = self.rng.random()
        self._named = roll < 0.8
        if roll < 0.9:
            hello: dict[str, Any] = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION}
            if self._named:
                hello["namespace"] = FUZZ_NAMESPACE
            writer.write(encode(hello))
        return True

    async def disconnect(self) -> None:
        writer, self._writer = self._writer, None
        reading, self._reading = self._reading, None
        if writer is not None:
            # Abort, not close: a close waits to flush what the daemon will not read while
            # its own replies to us are unread (both sides full), and hangs for good.
            writer.transport.abort()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(DEADLINE_S):
                    await writer.wait_closed()
        if reading is not None:
            await asyncio.wait([reading], timeout=DEADLINE_S)

    async def _send_burst(self, count: int) -> None:
        writer = self._writer
        if writer is None:
            return
        broken = False
        for _ in range(count):
            frame, bad, breaks = self._frame()
            writer.write(frame)
            self.counts["frames"] += 1
            self.counts["bad_frames"] += bad
            broken = broken or breaks
        try:
            async with asyncio.timeout(DEADLINE_S):
                await writer.drain()
        except (OSError, TimeoutError):
            broken = True
        # Framing lost (or just time for a fresh connection): start over, as a client would.
        if (broken and self.rng.random() < 0.5) or self.rng.random() < 0.02:
            await self.disconnect()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = FrameDecoder(1 << 30)
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                try:
                    messages = decoder.feed(data)
                except ProtocolError:
                    self._bad_reply("an undecodable frame length")
                    return
                for message in messages:
                    self._check(message)
        self.counts["hangups"] += 1

    def _check(self, message: Any) -> None:
        self.counts["replies"] += 1
        if isinstance(message, ProtocolError) or not isinstance(message, dict):
            self._bad_reply(f"not a map: {message!r:.80}")
        elif "push" in message:
            self.counts["pushes"] += 1
        elif not isinstance(message.get("ok"), bool):
            self._bad_reply(f"no ok: {message!r:.80}")
        elif not message["ok"]:
            code = message.get("error")
            self.counts[f"error:{code}"] += 1
            if code == ErrorCode.INTERNAL:
                self.counts["internal"] += 1
                self._example(f"internal: {message.get('message')!r:.200}")
            elif code not in CODES:
                self._bad_reply(f"unknown error code {code!r:.40}")

    def _bad_reply(self, what: str) -> None:
        self.counts["malformed"] += 1
        self._example(what)

    def _example(self, what: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(what)

    # -- frames ---------------------------------------------------------------------------

    def _frame(self) -> tuple[bytes, bool, bool]:
        """(frame, whether it is bad, whether it breaks the framing)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return encode(self._valid()), False, False
        if roll < 0.45:
            return self._mutated(encode(self._valid()))
        if roll < 0.8:
            return encode(self._random_map()), True, False
        if roll < 0.95:
            body = rng.randbytes(rng.randint(0, 200))
            return HEADER.pack(len(body)) + body, True, False
        return rng.randbytes(rng.randint(1, 64)), True, True

    def _key(self) -> bytes:
        return f"f{self.rng.randint(0, 63)}".encode()

    def _valid(self) -> dict[str, Any]:
        rng = self.rng
        keys = [self._key() for _ in range(rng.randint(1, 4))]
        keys = list(dict.fromkeys(keys))
        request: dict[str, Any] = rng.choice(
            [
                {"op": "lookup", "keys": keys},
                {"op": "touch", "keys": keys},
                {"op": "prepare_load", "keys": keys},
                {"op": "prepare_store", "keys": keys},
                {"op": "complete_store", "lease": rng.randint(0, 50), "ok": True},
                {"op": "complete_load", "lease": rng.randint(0, 50)},
                {"op": "abort_store", "lease": rng.randint(0, 50)},
                {"op": "get", "keys": keys},
                {"op": "put", "keys": keys[:1], "data": [bytes(self.block_bytes)]},
                {"op": "stats"},
                {"op": "health"},
                {"op": "subscribe"},
                {"op": "unsubscribe"},
            ]
        )
        return {"id": rng.randint(1, 1 << 20), **request}

    def _mutated(self, frame: bytes) -> tuple[bytes, bool, bool]:
        rng, data = self.rng, bytearray(frame)
        how = rng.random()
        if how < 0.6:  # flip bytes of the body (the length stays right)
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(HEADER.size, len(data)) if len(data) > HEADER.size else 0
                data[pos] ^= 1 << rng.randrange(8)
            return bytes(data), True, False
        if how < 0.8:  # truncated: the daemon reads the next frame's bytes as its rest
            return bytes(data[: rng.randrange(1, len(data))]), True, True
        if how < 0.9:  # a length header that lies
            data[: HEADER.size] = HEADER.pack(rng.randrange(0, 1 << 20))
            return bytes(data), True, True
        return bytes(data) + rng.randbytes(rng.randint(1, 16)), True, True

    def _random_map(self) -> dict[str, Any]:
        rng = self.rng
        ops = OPS if self._named else [op for op in OPS if op not in ("clear", "stop")]
        message: dict[str, Any] = {"id": self._value(0), "op": rng.choice(ops)}
        if rng.random() < 0.1:
            message["op"] = self._value(0)
        if rng.random() < 0.05:
            del message["id"]
        for name in rng.sample(FIELDS, rng.randint(0, 3)):
            message[name] = self._value(0)
        return message

    def _value(self, depth: int) -> Any:
        rng = self.rng
        kind = rng.randrange(10 if depth < 2 else 7)
        if kind == 0:
            return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randint(0, 99)])
        if kind == 1:
            return rng.choice([0.5, -1e300, float("inf"), float("nan")])
        if kind == 2:
            return rng.choice(["", "x" * rng.randint(1, 300), FUZZ_NAMESPACE, "a/b", "\u00e9"])
        if kind == 3:
            return rng.randbytes(rng.choice([0, 1, 8, 56, 57, 64, 65, self.block_bytes]))
        if kind == 4:
            return rng.choice([True, False])
        if kind == 5:
            return None
        if kind == 6:
            return [self._key() for _ in range(rng.randint(0, 5))]
        if kind == 7:
            return [self._value(depth + 1) for _ in range(rng.randint(0, 4))]
        if kind == 8:
            return {str(self._value(2)): self._value(depth + 1) for _ in range(rng.randint(0, 3))}
        return msgpack.ExtType(rng.randint(0, 127), rng.randbytes(4))


class StuckSubscriber:
    """A client that subscribes to events and never reads its socket (small receive
    buffer, so the daemon's side fills quickly)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.sock.settimeout(DEADLINE_S)
            self.sock.connect(path)
            hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NAMESPACE}
            self.sock.sendall(encode(hello) + encode({"id": 2, "op": "subscribe"}))
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()
