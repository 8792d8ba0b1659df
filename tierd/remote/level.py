"""What every remote level shares, whatever its server: the counts of its block
operations, its events, the reuse of value buffers and the queue of background writes.

:class:`~tierd.remote.redis_level.RedisLevel` and :class:`~tierd.remote.s3_level.S3Level`
subclass :class:`LevelBase` and add their block operations (``exists``, ``present``,
``get``, ``put``) over their own calls (a :class:`~tierd.remote.notes.CallNotes`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tierd.events import EventKind, TierEvent
from tierd.keys import MAX_KEY_BYTES, BlockKey, Medium
from tierd.logs import get_logger
from tierd.remote.notes import CallNotes
from tierd.remote.values import HEADER_BYTES

__all__ = ["LevelBase", "Payload", "RemoteCounters"]

Payload = bytes | bytearray | memoryview

log = get_logger("tierd.remote")

_SPARE_BYTES = 32 << 20  # value buffers kept for reuse between writes, at most


@dataclass(slots=True)
class RemoteCounters:
    """What the level's block operations did (the calls count their own faults)."""

    lookups: int = 0  # existence checks
    hits: int = 0  # blocks read and verified
    misses: int = 0  # blocks asked for and not served
    stores: int = 0  # blocks written
    skipped: int = 0  # blocks the server already held
    corrupt: int = 0  # values that failed a check (deleted)
    malformed: int = 0  # replies of the wrong shape (a short array, an integer): misses
    write_errors: int = 0  # blocks the server refused (OOM, ...)
    dropped: int = 0  # blocks not queued: max_pending_bytes reached, or breaker open
    bytes_written: int = 0
    bytes_read: int = 0


class LevelBase:
    """Counters, events, value buffers and queued writes of one remote level."""

    medium: Medium
    calls: CallNotes

    def __init__(self, name: str, block_bytes: int, max_pending_bytes: int) -> None:
        self.name = name
        self.block_bytes = block_bytes
        self.max_pending_bytes = max_pending_bytes
        self.counters = RemoteCounters()
        self._writes: set[asyncio.Task[None]] = set()
        self._pending_bytes = 0
        self._events: list[TierEvent] = []
        # Value buffers of finished writes, reused: a fresh buffer per value costs more
        # (its pages are faulted in) than the copy of the payload into it.
        self._value_room = HEADER_BYTES + MAX_KEY_BYTES + block_bytes
        self._spare: list[bytearray] = []
        self._spare_max = _SPARE_BYTES // self._value_room

    # -- what each kind of level adds (see tierd.chain.remote.RemoteLevel) --------------

    async def exists(self, keys: Sequence[BlockKey]) -> int:
        raise NotImplementedError

    async def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        raise NotImplementedError

    async def get(self, keys: Sequence[BlockKey]) -> list[memoryview]:
        raise NotImplementedError

    async def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the level has a client (it is open)."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- events and buffers --------------------------------------------------------------

    def event(self, kind: EventKind, keys: Sequence[BlockKey]) -> None:
        self._events.append(TierEvent(kind, tuple(keys), self.medium, self.name))

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def value_buffer(self, key_bytes: int, payload_bytes: int) -> bytearray:
        """A buffer for one value: a spare one when the value fits it, else a new one."""
        size = HEADER_BYTES + key_bytes + payload_bytes
        if size > self._value_room:
            return bytearray(size)
        return self._spare.pop() if self._spare else bytearray(self._value_room)

    def recycle(self, buffers: list[bytearray]) -> None:
        """Keep ``buffers`` (no longer read by anyone) for later values."""
        room = self._spare_max - len(self._spare)
        self._spare += [b for b in buffers[:room] if len(b) == self._value_room]

    # -- queued writes -----------------------------------------------------------------

    def put_later(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> bool:
        """Queue a write of private copies of blocks; False (and counted as dropped) when
        ``max_pending_bytes`` is reached or the breaker is open."""
        size = sum(map(len, payloads))
        if not self.ready() or self.calls.breaker.retry_in_s > 0:
            self.counters.dropped += len(keys)
            return False
        if self._pending_bytes + size > self.max_pending_bytes:
            self.counters.dropped += len(keys)
            return False
        self._pending_bytes += size
        task = asyncio.get_running_loop().create_task(self._write(list(keys), list(payloads)))
        self._writes.add(task)
        task.add_done_callback(lambda t: self._write_done(t, size))
        return True

    async def _write(self, keys: list[BlockKey], payloads: list[Payload]) -> None:
        await self.put(keys, payloads)

    def _write_done(self, task: asyncio.Task[None], size: int) -> None:
        self._writes.discard(task)
        self._pending_bytes -= size
        if not task.cancelled() and task.exception() is not None:
            log.error("remote write failed", remote=self.name, error=repr(task.exception()))

    async def drain(self) -> None:
        """Wait for every queued write (tests and flush)."""
        while self._writes:
            await asyncio.gather(*set(self._writes), return_exceptions=True)

    async def finish_writes(self, timeout_s: float) -> None:
        """Give queued writes ``timeout_s`` to finish and cancel the rest (closing)."""
        if self._writes:
            _, late = await asyncio.wait(set(self._writes), timeout=timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    # -- reporting ---------------------------------------------------------------------

    def base_stats(self, endpoint: str) -> dict[str, Any]:
        """The fields of ``stats()`` every level has, in one order."""
        return {
            "name": self.name,
            "medium": str(self.medium),
            "endpoint": endpoint,
            **self.calls.fault_stats(),
            **asdict(self.counters),
            "pending_bytes": self._pending_bytes,
        }
