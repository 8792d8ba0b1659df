"""The remote level on a Redis-protocol server: batched existence checks, verified reads,
writes that skip what the server holds, a deadline on every call and a circuit breaker.

Every call is one pipelined round trip for a whole batch of keys (two for a write: which
keys are missing, then ``SET NX`` of those, so N nodes storing the same prefix send its
bytes once). Faults are misses, never stalls and never errors to the caller:

- each call runs under ``deadline`` (``asyncio.timeout``; the client's own socket timeouts
  are set to it too, and its retries are off, so nothing waits behind a dead node);
- a call that times out or cannot connect counts towards the :class:`CircuitBreaker`;
  while it is open calls return at once as misses, and a probe after the back-off
  closes it again;
- a server error reply (``OOM`` with ``noeviction``, say) fails that write only: the
  server is up, so the breaker does not open.

A value is read into a private buffer and checked (:func:`decode_block`) before a byte
of it is handed on; a value that fails a check is deleted from the server and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout
from redis.retry import Retry

from tierd.events import EventKind, TierEvent
from tierd.keys import BlockKey, Medium
from tierd.logs import get_logger
from tierd.remote.breaker import CircuitBreaker
from tierd.remote.values import HEADER_BYTES, decode_block, encode_block

__all__ = ["RedisLevel", "RemoteSettings"]

Payload = bytes | bytearray | memoryview

log = get_logger("tierd.remote")

_UNREACHABLE = (RedisError, OSError)


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """What the level needs from :class:`~tierd.config.RemoteConfig` (kept apart so that
    this layer does not import the config layer)."""

    name: str
    block_bytes: int
    url: str | None = None
    cluster_nodes: tuple[str, ...] = ()
    key_prefix: str = "tierd:"
    pool_size: int = 16
    deadline_s: float = 0.1
    ttl_s: float = 0.0
    max_pending_bytes: int = 64 << 20
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_max_backoff_s: float = 30.0

    @property
    def endpoint(self) -> str:
        """Where the level is, without any password the URL carries (it is shown in
        stats, metrics labels and logs)."""
        if self.url is None:
            return "cluster " + ",".join(self.cluster_nodes)
        parts = urlsplit(self.url)
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, host, parts.path, "", ""))


@dataclass(slots=True)
class RemoteCounters:
    lookups: int = 0  # existence checks
    hits: int = 0  # blocks read and verified
    misses: int = 0  # blocks asked for and not served
    stores: int = 0  # blocks written
    skipped: int = 0  # blocks the server already held
    corrupt: int = 0  # values that failed a check (deleted)
    errors: int = 0  # calls that failed (connection, error reply)
    timeouts: int = 0  # calls past the deadline
    write_errors: int = 0  # blocks the server refused (OOM, ...)
    dropped: int = 0  # blocks not queued: max_pending_bytes reached, or breaker open
    bytes_written: int = 0
    bytes_read: int = 0


class RedisLevel:
    """A shared level on one Redis/Valkey server or cluster. Open with ``open()``."""

    medium = Medium.REMOTE

    def __init__(self, settings: RemoteSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.block_bytes = settings.block_bytes
        self.breaker = CircuitBreaker(
            failures=settings.breaker_failures,
            backoff_s=settings.breaker_backoff_s,
            max_backoff_s=settings.breaker_max_backoff_s,
        )
        self.counters = RemoteCounters()
        self._prefix = settings.key_prefix.encode()
        self._client: Any = None
        self._cluster_ready = False
        self._writes: set[asyncio.Task[None]] = set()
        self._pending_bytes = 0
        self._events: list[TierEvent] = []
        self._last_error = ""
        self._last_logged = 0.0

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> RedisLevel:
        """Create the client. Connects lazily: a server that is absent at start is a miss
        on every call until it appears, not a failure to start."""
        s = self.settings
        common: dict[str, Any] = {
            "max_connections": s.pool_size,
            "socket_timeout": s.deadline_s,
            "socket_connect_timeout": s.deadline_s,
            "retry": Retry(NoBackoff(), 0),
        }
        if s.url is not None:
            self._client = Redis.from_url(s.url, **common)
        else:
            nodes = [ClusterNode(*_host_port(node)) for node in s.cluster_nodes]
            self._client = RedisCluster(startup_nodes=nodes, require_full_coverage=False, **common)
        log.info("remote level opened", remote=self.name, endpoint=s.endpoint)
        return self

    async def close(self) -> None:
        """Give queued writes one deadline to finish, cancel the rest, close the client."""
        if self._writes:
            _, late = await asyncio.wait(set(self._writes), timeout=self.settings.deadline_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_UNREACHABLE):
                await client.aclose()

    # -- calls -------------------------------------------------------------------------

    def _key(self, key: BlockKey) -> bytes:
        return self._prefix + key

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any] | None:
        """Run commands in one non-transactional pipeline under the deadline and the
        breaker; ``None`` when the call was refused, timed out or failed to connect.
        Error replies come back in the list as exceptions."""
        if self._client is None or not commands or not self.breaker.allow():
            return None
        failed = True  # until the replies are in: a cancelled call counts as a failure
        try:
            async with asyncio.timeout(self.settings.deadline_s):
                if isinstance(self._client, RedisCluster) and not self._cluster_ready:
                    await self._client.initialize()
                    self._cluster_ready = True
                pipe = self._client.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
            failed = False
        except (TimeoutError, RedisTimeout) as exc:
            self.counters.timeouts += 1
            self._note(exc, "timed out")
            return None
        except _UNREACHABLE as exc:
            self.counters.errors += 1
            self._note(exc, "unreachable")
            return None
        finally:
            if failed:
                self.breaker.failure()
            else:
                self.breaker.success()
        return list(replies)

    def _note(self, exc: BaseException, what: str) -> None:
        self._last_error = f"{what}: {exc}" if str(exc) else what
        now = time.monotonic()
        if now - self._last_logged >= 10.0:  # a dead server must not flood the log
            self._last_logged = now
            log.warning(
                "remote level call failed",
                remote=self.name,
                error=self._last_error,
                breaker=str(self.breaker.state),
            )

    async def exists(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the server holds (one round trip; 0 on any fault)."""
        if not keys:
            return 0
        self.counters.lookups += 1
        replies = await self._pipeline([("EXISTS", self._key(k)) for k in keys])
        if replies is None:
            return 0
        run = 0
        for reply in replies:
            if isinstance(reply, BaseException) or not reply:
                break
            run += 1
        return run

    async def get(self, keys: Sequence[BlockKey]) -> list[memoryview]:
        """The verified payloads of the leading ``keys`` the server holds intact (one round
        trip). Stops at the first key missing, unreadable or failing a check; a value that
        fails a check is deleted and counted."""
        replies = await self._pipeline([("GET", self._key(k)) for k in keys])
        if replies is None:
            self.counters.misses += len(keys)
            return []
        out: list[memoryview] = []
        bad: list[BlockKey] = []
        for key, value in zip(keys, replies, strict=True):
            if isinstance(value, BaseException) or value is None:
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
            await self._pipeline([("DEL", self._key(k)) for k in bad])
            self._events.append(TierEvent(EventKind.REMOVED, tuple(bad), self.medium, self.name))
        return out

    async def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> int:
        """Write blocks the server does not hold yet; returns how many were written."""
        present = await self._pipeline([("EXISTS", self._key(k)) for k in keys])
        if present is None:
            self.counters.dropped += len(keys)
            return 0
        todo = [
            (key, payload)
            for key, payload, there in zip(keys, payloads, present, strict=True)
            if isinstance(there, BaseException) or not there
        ]
        self.counters.skipped += len(keys) - len(todo)
        if not todo:
            return 0
        ttl_ms = int(self.settings.ttl_s * 1000)
        commands = []
        for key, payload in todo:
            value = encode_block(key, payload)
            expiry = ("PX", ttl_ms) if ttl_ms > 0 else ()
            commands.append(("SET", self._key(key), value, "NX", *expiry))
        replies = await self._pipeline(commands)
        if replies is None:
            self.counters.dropped += len(todo)
            return 0
        written: list[BlockKey] = []
        for (key, payload), reply in zip(todo, replies, strict=True):
            if isinstance(reply, BaseException):
                self.counters.write_errors += 1
                self._last_error = f"write refused: {type(reply).__name__}: {reply}"
            elif reply:
                written.append(key)
                self.counters.bytes_written += HEADER_BYTES + len(key) + len(payload)
            else:
                self.counters.skipped += 1  # another node wrote it meanwhile
        self.counters.stores += len(written)
        if written:
            self._events.append(TierEvent(EventKind.STORED, tuple(written), self.medium, self.name))
        return len(written)

    def put_later(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> bool:
        """Queue a write of private copies of blocks; False (and counted as dropped) when
        ``max_pending_bytes`` is reached or the breaker is open."""
        size = sum(map(len, payloads))
        if self._client is None or self.breaker.retry_in_s > 0:
            self.counters.dropped += len(keys)
            return False
        if self._pending_bytes + size > self.settings.max_pending_bytes:
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

    # -- reporting ---------------------------------------------------------------------

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "name": self.name,
            "medium": str(self.medium),
            "endpoint": self.settings.endpoint,
            "state": str(self.breaker.state),
            "breaker_opened": self.breaker.opened,
            "refused": self.breaker.refused,
            "lookups": c.lookups,
            "hits": c.hits,
            "misses": c.misses,
            "stores": c.stores,
            "skipped": c.skipped,
            "corrupt": c.corrupt,
            "errors": c.errors,
            "timeouts": c.timeouts,
            "write_errors": c.write_errors,
            "dropped": c.dropped,
            "pending_bytes": self._pending_bytes,
            "bytes_written": c.bytes_written,
            "bytes_read": c.bytes_read,
            "last_error": self._last_error,
        }


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host, int(port)
