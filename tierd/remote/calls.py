"""How the remote level calls its server: the client, one pipelined round trip per call
under a deadline and the circuit breaker, and the note of the last failure.

:class:`RemoteCalls` owns the redis-py client of one server (``url``) or cluster
(``cluster_nodes``), created lazily-connecting, so that a server absent at start is a miss
on every call until it appears. Each call (:meth:`RemoteCalls.pipeline`) runs under
``deadline_s`` (``asyncio.timeout``; the client's connect timeout is set to it too, and
its retries are off, so nothing waits behind a dead node; there is no per-reply socket
timeout, which would cost a timer per key). A call that times out or cannot connect
counts towards the :class:`~tierd.breaker.CircuitBreaker` and comes back ``None``;
while the breaker is open calls are refused at once. Error replies (``OOM``, say) come
back in the list: the server is up, so they do not count against it.

At most ``pool_size`` calls are on the wire at once; the others wait for one of them to
finish, within their own deadline. A call whose deadline passes while it waits, or that
gets a connection with less than half its deadline left, is a miss counted as ``busy``:
a full pool says the daemon is busy, not that the server failed, so it never feeds the
breaker. Every reply is read through a
:class:`~tierd.remote.guard.ReplyGuard` (``max_elements``, ``max_bulk``), so a server
cannot make the daemon allocate, parse or free more than those bounds on its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeout
from redis.retry import Retry

from tierd.remote.guard import guarded_parser
from tierd.remote.notes import CallNotes

__all__ = ["RemoteCalls", "RemoteSettings", "unanswered"]

_UNREACHABLE = (RedisError, OSError)
_MIN_LEFT = 0.5  # the share of its deadline a call that waited for a connection must have left


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
    max_elements: int = 1 << 16  # the longest array reply read (keys of one call)

    @property
    def max_bulk(self) -> int:
        """The longest string reply read: a value (header, tag, key, payload) with room
        to spare, and at least 1 MiB (a cluster's CLUSTER NODES text)."""
        return max(1 << 20, 2 * self.block_bytes + (64 << 10))

    @property
    def endpoint(self) -> str:
        """Where the level is, without any password the URL carries (it is shown in
        stats, metrics labels and logs)."""
        if self.url is None:
            return "cluster " + ",".join(self.cluster_nodes)
        parts = urlsplit(self.url)
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, host, parts.path, "", ""))


class RemoteCalls(CallNotes):
    """The client of one Redis/Valkey server or cluster. A fault is a ``None`` reply,
    counted (``timeouts``, ``errors``), noted in ``last_error`` and logged at a bounded
    rate; never an exception."""

    def __init__(self, settings: RemoteSettings) -> None:
        super().__init__(settings)
        self.settings = settings
        self.client: Any = None
        self._cluster_ready = False
        self._slots = asyncio.Semaphore(settings.pool_size)  # one per pooled connection

    @property
    def cluster(self) -> bool:
        """Whether the server is a cluster (its keys lie in different slots)."""
        return isinstance(self.client, RedisCluster)

    def open(self) -> None:
        """Create the client; it connects on its first call."""
        s = self.settings
        common: dict[str, Any] = {
            "max_connections": s.pool_size,
            # No per-reply timeout (redis-py's default is 5 s): the deadline of each call
            # bounds every read of it, and a timer per reply would cost more than the read.
            "socket_timeout": None,
            "socket_connect_timeout": s.deadline_s,
            "retry": Retry(NoBackoff(), 0),
        }
        parser = guarded_parser(s.max_elements, s.max_bulk)
        if s.url is not None:
            self.client = Redis.from_url(s.url, parser_class=parser, **common)
        else:
            nodes = [ClusterNode(*_host_port(node)) for node in s.cluster_nodes]
            cluster = RedisCluster(startup_nodes=nodes, require_full_coverage=False, **common)
            # The cluster client takes no parser argument: its nodes' connections are
            # made (lazily) from these keyword arguments, the startup nodes' from copies.
            cluster.connection_kwargs["parser_class"] = parser
            for node in cluster.nodes_manager.startup_nodes.values():
                node.connection_kwargs["parser_class"] = parser
            self.client = cluster

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(*_UNREACHABLE):
                await client.aclose()

    async def pipeline(
        self, commands: list[tuple[Any, ...]], why: list[str] | None = None
    ) -> list[Any] | None:
        """Run commands in one non-transactional pipeline under the deadline and the
        breaker; ``None`` when the call was refused, timed out, failed to connect or found
        no free connection in time (``why``, when given, then gets which: ``refused``,
        ``timeouts``, ``errors`` or ``busy``). Error replies come back in the list as
        exceptions."""
        if why is None:
            why = []
        if self.client is None or not commands:
            why.append("refused")
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.deadline_s
        queued = self._slots.locked()
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            self.busy += 1  # the daemon's own queue: the server is not to blame
            why.append("busy")
            return None
        if queued and deadline - loop.time() < self.settings.deadline_s * _MIN_LEFT:
            # Too little time left to judge the server by: a timeout now would be the
            # queue's doing, charged to the server.
            self._slots.release()
            self.busy += 1
            why.append("busy")
            return None
        try:
            return await self._call(commands, deadline, why)
        finally:
            self._slots.release()

    async def _call(
        self, commands: list[tuple[Any, ...]], deadline: float, why: list[str]
    ) -> list[Any] | None:
        # The breaker is asked once a connection is ours: a probe it lets through is
        # answered, never left waiting in the queue with the breaker half open.
        if self.client is None or not self.breaker.allow():
            why.append("refused")
            return None
        failed = True  # until the replies are in: a cancelled call counts as a failure
        try:
            async with asyncio.timeout_at(deadline):
                if isinstance(self.client, RedisCluster) and not self._cluster_ready:
                    await self.client.initialize()
                    self._cluster_ready = True
                pipe = self.client.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
            failed = False
        except (TimeoutError, RedisTimeout) as exc:
            self.timeouts += 1
            self.note(exc, "timed out")
            why.append("timeouts")
            return None
        except _UNREACHABLE as exc:
            self.errors += 1
            self.note(exc, "unreachable")
            why.append("errors")
            return None
        finally:
            if failed:
                self.breaker.failed()
            else:
                self.answered()
        return list(replies)


def unanswered(reply: Any) -> bool:
    """Whether a pipelined reply is a failure to get the command answered (a connection
    error or a timeout), not an answer (an error reply such as OOM is one)."""
    return isinstance(reply, BaseException) and not isinstance(reply, ResponseError)


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host, int(port)
