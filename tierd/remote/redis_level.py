"""The remote level on a Redis-protocol server: batched existence checks, verified reads,
writes that skip what the server holds, a deadline on every call and a circuit breaker.

Every call is one pipelined round trip for a whole batch of keys. A write is ``SET NX``,
so a block is stored once however many nodes send it. Asking first which keys the server
holds (``EXISTS``, one more round trip and one more command per block) saves sending the
bytes of those it holds: worth it only where that saves more than it costs, so a write
asks first while the share of blocks that recent writes found on the server, times the
block size, is above what a check costs (:data:`CHECK_COST_BYTES`). With big blocks and
nodes that share prefixes, N nodes storing the same prefix then send its bytes once;
with small blocks, or writes that are new, every write is one round trip, and the
``SET NX`` replies keep the estimate current. Faults are misses, never stalls and never
errors to the caller:

- each call runs under ``deadline``, with no retry and no per-reply timer;
- a call that times out or cannot connect counts towards the :class:`CircuitBreaker`;
  while it is open calls return at once as misses, and a probe after the back-off
  closes it again;
- a server error reply (``OOM`` with ``noeviction``, say) fails that write only: the
  server is up, so the breaker does not open.

This module owns the block operations (``exists``, ``get``, ``write``, ``put_later``), the
queue of writes, the reuse of value buffers and the level's counters and events; the
call machinery (client, deadline, breaker, failure notes) is
:class:`~tierd.remote.calls.RemoteCalls`.

A value is read into a private buffer and checked (:func:`decode_block`) before a byte
of it is handed on; a value that fails a check is deleted from the server and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierd.events import EventKind
from tierd.keys import BlockKey, Medium
from tierd.logs import get_logger
from tierd.remote.calls import RemoteCalls, RemoteSettings, unanswered
from tierd.remote.level import Landing, LevelBase, Payload
from tierd.remote.values import HEADER_BYTES, decode_block, encode_into, key_space

__all__ = ["RedisLevel"]

log = get_logger("tierd.remote")

# What asking EXISTS for one block costs, in bytes of payload that are as costly to send:
# redis-py's work for one more command and reply and its share of a round trip (measured
# with scripts/bench remote: docs/BENCHMARKS.md). A write asks first while the expected bytes saved
# per block, the share of blocks recent writes found there times the block size, exceed it.
CHECK_COST_BYTES = 32 << 10
_HELD_WEIGHT = 0.25  # each write's weight in the moving average of that share


class RedisLevel(LevelBase):
    """A shared level on one Redis/Valkey server or cluster. Open with ``open()``."""

    medium = Medium.REMOTE
    calls: RemoteCalls

    def __init__(self, settings: RemoteSettings) -> None:
        super().__init__(settings.name, settings.block_bytes, settings.max_pending_bytes)
        self.settings = settings
        self.calls = RemoteCalls(settings)
        # The block size and the value format are part of every key: deployments that
        # differ in either never see, or delete, each other's values.
        self._prefix = settings.key_prefix.encode() + key_space(settings.block_bytes)
        # Check first while held_share > check_above; it starts above it (when checking
        # can pay at all), so that the first writes check until they show otherwise.
        self.check_above = min(1.0, CHECK_COST_BYTES / settings.block_bytes)
        self.held_share = min(1.0, 2 * self.check_above)

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> RedisLevel:
        """Create the client. Connects lazily: a server that is absent at start is a miss
        on every call until it appears, not a failure to start."""
        self.calls.open()
        log.info("remote level opened", remote=self.name, endpoint=self.settings.endpoint)
        return self

    def ready(self) -> bool:
        return self.calls.client is not None

    async def close(self) -> None:
        """Give queued writes one deadline to finish, cancel the rest, close the client."""
        await self.finish_writes(self.settings.deadline_s)
        await self.calls.close()

    # -- block operations ----------------------------------------------------------------

    def _key(self, key: BlockKey) -> bytes:
        return self._prefix + key

    async def exists(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the server holds (one round trip; 0 on any fault)."""
        if not keys:
            return 0
        self.counters.lookups += 1
        replies = await self.calls.pipeline([("EXISTS", self._key(k)) for k in keys])
        if replies is None:
            return 0
        run = 0
        for reply in replies:
            if isinstance(reply, BaseException) or not reply:
                break
            run += 1
        return run

    async def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether the server holds it (one round trip; all False on a fault)."""
        if not keys:
            return []
        self.counters.lookups += 1
        replies = await self.calls.pipeline([("EXISTS", self._key(k)) for k in keys])
        if replies is None:
            return [False] * len(keys)
        return [not isinstance(reply, BaseException) and bool(reply) for reply in replies]

    async def get(self, keys: Sequence[BlockKey]) -> list[memoryview]:
        """The verified payloads of the leading ``keys`` the server holds intact (one round
        trip: one ``MGET`` on a single server, a ``GET`` per key on a cluster, whose keys
        lie in different slots). Stops at the first key missing, unreadable or failing a
        check; a value that fails a check is deleted and counted."""
        if not keys:
            return []
        replies = await self._values(keys)
        if replies is None:
            self.counters.misses += len(keys)
            return []
        out: list[memoryview] = []
        bad: list[BlockKey] = []
        for key, value in zip(keys, replies, strict=True):
            if isinstance(value, BaseException) or value is None:
                break
            if not isinstance(value, bytes):
                self._malformed(f"a value of type {type(value).__name__}")
                break
            self.counters.bytes_read += len(value)
            payload = decode_block(key, value, self.block_bytes)
            if isinstance(payload, str):
                bad.append(key)
                log.warning("remote block failed a check", remote=self.name, reason=payload)
                break
            out.append(payload)
        self.counters.hits += len(out)
        self.counters.misses += len(keys) - len(out)
        if bad:
            self.counters.corrupt += len(bad)
            await self.calls.pipeline([("DEL", self._key(k)) for k in bad])
            self.event(EventKind.REMOVED, bad)
        return out

    async def _values(self, keys: Sequence[BlockKey]) -> list[Any] | None:
        """The server's replies for ``keys``' values, one per key, or ``None`` when the call
        failed or its reply has the wrong shape (counted as malformed)."""
        if self.calls.cluster:
            return await self.calls.pipeline([("GET", self._key(k)) for k in keys])
        reply = await self.calls.pipeline([("MGET", *map(self._key, keys))])
        if reply is None or isinstance(reply[0], BaseException):
            return None
        values = reply[0]
        if not isinstance(values, list) or len(values) != len(keys):
            shape = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
            self._malformed(f"MGET of {len(keys)} keys answered with {shape}")
            return None
        return values

    def _malformed(self, what: str) -> None:
        self.counters.malformed += 1
        self.calls.last_error = f"malformed reply: {what}"
        log.warning("remote reply of the wrong shape", remote=self.name, reply=what)

    async def write(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> Landing:
        """Write blocks the server does not hold yet (``SET NX``, after an ``EXISTS`` check
        while writes often find their blocks there); what became of each."""
        count = len(keys)
        if not keys:
            return Landing()
        if not self.write_allowed(count):
            return Landing.of(self.name, count, 0, {"refused": count})
        return self.write_done(await self._set(keys, payloads))

    async def _set(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> Landing:
        todo = list(zip(keys, payloads, strict=True))
        why: list[str] = []
        if self.held_share > self.check_above:
            present = await self.calls.pipeline([("EXISTS", self._key(k)) for k in keys], why)
            if present is None:
                self.counters.dropped += len(keys)
                return Landing.of(self.name, len(keys), 0, {why[0]: len(keys)})
            todo = [
                item
                for item, there in zip(todo, present, strict=True)
                if isinstance(there, BaseException) or not there
            ]
            self.counters.skipped += len(keys) - len(todo)
            if not todo:
                self._held(len(keys), len(keys))
                return Landing.of(self.name, len(keys), 0, {})
        ttl_ms = int(self.settings.ttl_s * 1000)
        expiry = ("PX", ttl_ms) if ttl_ms > 0 else ()
        buffers = [self.value_buffer(len(key), len(payload)) for key, payload in todo]
        commands = []
        for (key, payload), buffer in zip(todo, buffers, strict=True):
            size = encode_into(buffer, key, payload)
            commands.append(("SET", self._key(key), memoryview(buffer)[:size], "NX", *expiry))
        replies = await self.calls.pipeline(commands, why)
        if replies is None:
            # Not reused: a write cut short may still hold them in the connection.
            self.counters.dropped += len(todo)
            return Landing.of(self.name, len(keys), 0, {why[0]: len(todo)})
        # A buffer whose command was answered was read whole by the server: reuse it. One
        # whose reply is a failure (a cluster node lost under it) may still sit in a
        # closing connection's queue, so it is left alone.
        self.recycle([b for b, r in zip(buffers, replies, strict=True) if not unanswered(r)])
        written: list[BlockKey] = []
        there = 0
        missed: dict[str, int] = {}
        for (key, payload), reply in zip(todo, replies, strict=True):
            if isinstance(reply, BaseException):
                self.counters.write_errors += 1
                cause = "errors" if unanswered(reply) else "write_errors"
                missed[cause] = missed.get(cause, 0) + 1
                self.calls.record_error(f"write refused: {type(reply).__name__}: {reply}")
            elif reply:
                written.append(key)
                self.counters.bytes_written += HEADER_BYTES + len(key) + len(payload)
            else:
                there += 1  # held already: by another node, or written meanwhile
        self.counters.skipped += there
        self._held(len(keys) - len(todo) + there, len(keys))
        self.counters.stores += len(written)
        if written:
            self.event(EventKind.STORED, written)
        return Landing.of(self.name, len(keys), len(written), missed)

    def _held(self, there: int, asked: int) -> None:
        """Fold one write's share of blocks found on the server into the average."""
        self.held_share += _HELD_WEIGHT * (there / asked - self.held_share)

    # -- reporting ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.base_stats(self.settings.endpoint)
