"""What every remote level shares, whatever its server: the counts of its block
operations, its events, the reuse of value buffers and the queue of background writes.

:class:`~tierd.remote.redis_level.RedisLevel` and :class:`~tierd.remote.s3_level.S3Level`
subclass :class:`LevelBase` and add their block operations (``exists``, ``present``,
``get``, ``write``) over their own calls (a :class:`~tierd.remote.notes.CallNotes`).

A write says what became of each block it was given (:class:`Landing`): written, found
on the server already (both *landed*), or not, and why (timed out, refused, ...), so that
an operation that caused writes (a flush) can say which did not land.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tierd.events import EventKind, TierEvent
from tierd.keys import MAX_KEY_BYTES, BlockKey, Medium
from tierd.logs import get_logger
from tierd.remote.notes import CallNotes
from tierd.remote.values import HEADER_BYTES

__all__ = ["MISSED_CAUSES", "Landing", "LevelBase", "Payload", "RemoteCounters"]

Payload = bytes | bytearray | memoryview

log = get_logger("tierd.remote")

_SPARE_BYTES = 32 << 20  # value buffers kept for reuse between writes, at most


# Why a block sent to a level did not land there (the keys of ``Landing.missed``).
MISSED_CAUSES = {
    "timeouts": "timed out",  # on the wire when the deadline passed
    "busy": "waited past the deadline for a connection",  # the level's own pool was full
    "errors": "failed",  # unreachable, reset, or an error status (5xx, 403, 501, ...)
    "write_errors": "refused by the server",  # an error answer for the block (OOM, no bucket)
    "refused": "refused by an open breaker",  # the level did not try (breaker, closed)
    "unchecked": "held back: write-once not guaranteed",  # S3, write_once: require
}


@dataclass(slots=True)
class Landing:
    """What became of the blocks one or more writes were given: per level, the blocks that
    did not land there, by cause (:data:`MISSED_CAUSES`). A block landed on a level when the
    level wrote it or found it on the server already; ``unread`` blocks could not be read
    out of the local tier, so were sent to none."""

    sent: int = 0  # blocks handed to the level(s)
    written: int = 0  # blocks written (a stack: by the level that wrote most)
    missed: dict[str, Counter[str]] = field(default_factory=dict)  # level -> cause -> blocks
    unread: int = 0

    @classmethod
    def of(cls, level: str, sent: int, written: int, missed: Mapping[str, int]) -> Landing:
        """One level's write of ``sent`` blocks."""
        return cls(sent, written, {level: Counter({c: n for c, n in missed.items() if n})})

    def missed_at(self, level: str) -> int:
        """Blocks that did not land on ``level``."""
        return sum(self.missed.get(level, Counter()).values())

    @property
    def not_landed(self) -> int:
        """Blocks that did not land on every level: the worst level's, and the unread."""
        return max((sum(c.values()) for c in self.missed.values()), default=0) + self.unread

    def add(self, other: Landing) -> None:
        """Count ``other`` (a write of other blocks) in too."""
        self.sent += other.sent
        self.written += other.written
        self.unread += other.unread
        for level, causes in other.missed.items():
            self.missed.setdefault(level, Counter()).update(causes)


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

    async def write(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> Landing:
        """Write blocks the server does not hold yet; what became of each."""
        raise NotImplementedError

    async def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> int:
        """:meth:`write`; how many blocks were written."""
        return (await self.write(keys, payloads)).written

    async def close(self) -> None:
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the level has a client (it is open)."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def problems(self) -> list[str]:
        """What keeps the level from working, in words (``tierd health``); empty: none."""
        return self.calls.problems()

    def health(self) -> list[dict[str, Any]]:
        """The level's line of ``tierd health``: its name, whether it works, and why not
        (or in which weaker mode it runs)."""
        problems = self.problems()
        return [{"name": self.name, "ok": not problems, "problems": problems, "notes": []}]

    def write_allowed(self, count: int) -> bool:
        """Whether the write breaker lets a write of ``count`` blocks through now; one it
        refuses is counted (``dropped``), and must not be sent."""
        if self.calls.write_breaker.allow():
            return True
        self.counters.dropped += count
        return False

    def write_done(self, landing: Landing) -> Landing:
        """Tell the write breaker how a write it let through went; ``landing`` back."""
        missed = landing.missed_at(self.name)
        self.calls.write_ended(landing.sent - missed, missed)
        return landing

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
        ``max_pending_bytes`` is reached or a breaker (calls', writes') is open."""
        size = sum(map(len, payloads))
        calls = self.calls
        if not self.ready() or calls.breaker.retry_in_s > 0 or calls.write_breaker.retry_in_s > 0:
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
        await self.write(keys, payloads)

    def _write_done(self, task: asyncio.Task[None], size: int) -> None:
        self._writes.discard(task)
        self._pending_bytes -= size
        if not task.cancelled() and task.exception() is not None:
            log.error("remote write failed", remote=self.name, error=repr(task.exception()))

    async def drain(self) -> None:
        """Wait for every queued write, those queued meanwhile too (tests)."""
        while self._writes:
            await asyncio.gather(*set(self._writes), return_exceptions=True)

    async def settle(self) -> None:
        """Wait for the writes queued now (a flush, once its own writes are done): each
        runs under the level's deadline, so this is bounded; writes queued meanwhile are
        not waited for."""
        if self._writes:
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
