"""The one transport of an engine's calls: a blocking connection per calling thread.

An engine calls its integration synchronously, from threads of its own (vLLM's
scheduler, SGLang's prefetch and backup threads), and a call that waits on the daemon
gains nothing from hopping to an event loop on another thread: every hand-over waits for
the interpreter lock, which a busy engine holds for its whole switch interval (5 ms).
:class:`EngineChannel` makes each call on the calling thread, over a
:class:`~tierd.control.clients.blocking_client.BlockingClient` of that thread's own: the thread
sends, waits in ``recv`` (the lock released) and goes on. Threads never share a
connection, so no call waits behind another's, and what a connection holds (its leases,
its regions, a staging memfd) is one thread's.

Every call is bounded by its deadline (:meth:`EngineChannel.call`). One that gets no
answer in time closes its connection (a late answer, or a late copy into the old
connection's staging memfd, is never read: the next connection brings fresh ones) and
counts for the link's :class:`~tierd.breaker.CircuitBreaker`; so does a call that
failed in any other way but an error answer (whatever it raised: the connection's state
is then unknown, so it is closed too). While the breaker is open every call fails at
once, unsent (:class:`~tierd.integrations.core.link.BreakerOpen`), and the link probes the
daemon until it is back. A lost connection (the daemon restarted since the last call) is
tried once more on a fresh one. Connecting backs off exponentially after a failure, for
every thread at once.

The threads' connections share one mapping of the daemon's pool (:class:`PoolUsers`): a
mapping is closed only once no connection uses it (a restarted daemon's new pool does
not unmap the old one under a thread still copying into it).

Threads. Each calling thread owns its :class:`ThreadConnection` (found through a
``threading.local``): its client, what it holds and whether it was used; no other thread
calls on it. Shared, under the channel's one lock: the list of open connections, the
connect backoff, whether the channel is closed, and each connection's ``busy``,
``dropped`` and ``released`` (:meth:`EngineChannel.close`, on any thread, may drop a
connection under its thread's call; whichever of the two comes last gives back its use of
the pool mapping, once). The mappings and their users are :class:`PoolUsers`', under its
own lock; a mapping is closed outside it. The breaker is the link's, under its own lock,
counted from every thread.

Which data path a call takes is :mod:`tierd.integrations.core.route`'s to say.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tierd.breaker import Backoff
from tierd.control.clients.blocking_client import BlockingClient
from tierd.control.clients.handshake import DaemonSilent, Unreachable
from tierd.control.clients.pool import PoolMap, PoolShare
from tierd.errors import TierdError
from tierd.integrations.core.link import BreakerOpen, DaemonLink

__all__ = ["ThreadConnection", "EngineChannel", "PoolUsers"]

T = TypeVar("T")


@dataclass(slots=True)
class ThreadConnection:
    """One thread's connection and what it holds in the daemon (``held``: an engine's
    regions, a staging memfd, by the name the caller gives them; they die with it)."""

    client: BlockingClient
    used: bool = False  # a call has gone through it (a new one was not lost between calls)
    held: dict[str, Any] = field(default_factory=dict)
    busy: bool = False  # a call runs on it now
    dropped: bool = False  # out of the channel: no call goes on it any more
    released: bool = False  # its use of the pool mapping given back


class PoolUsers(PoolShare):
    """One mapping of a tenant's pool for every connection that passes it (as
    :class:`~tierd.control.clients.pool.PoolShare`), closed only when no connection uses
    it: each connection that took a mapping (:meth:`mapping`) uses it until it gives it
    back (:meth:`release`). Past the newest ``keep`` pools (a restarted daemon's), a
    pool is closed with its last user; :meth:`close` closes the pools nobody uses at
    once, the others with their last user."""

    def __init__(self, keep: int = 1) -> None:
        super().__init__(keep)
        self._pools: list[_Used] = []  # oldest first
        self._shut = False

    def mapping(self, fd: int, block_bytes: int, named: dict[str, Any]) -> PoolMap:
        """The mapping of the pool ``fd`` is, one user more."""
        found = os.fstat(fd)
        key = (found.st_dev, found.st_ino, block_bytes, *sorted(named.items()))
        with self._lock:
            for used in self._pools:
                if used.key == key:
                    used.users += 1
                    return used.pool
            pool = PoolMap(fd, block_bytes=block_bytes, **named)
            self._pools.append(_Used(key, pool, 1))
            unused = self._unused()
        for gone in unused:
            gone.close()
        return pool

    def release(self, pool: PoolMap) -> None:
        """One user of ``pool`` is done with it."""
        with self._lock:
            for used in self._pools:
                if used.pool is pool:
                    used.users -= 1
            unused = self._unused()
        for gone in unused:
            gone.close()

    def find(self, name: str) -> PoolMap | None:
        with self._lock:
            return next((u.pool for u in self._pools if u.pool.name == name), None)

    def close(self) -> None:
        with self._lock:
            self._shut = True
            unused = self._unused()
        for gone in unused:
            gone.close()

    def _unused(self) -> list[PoolMap]:
        """Take out the pools to close now: nobody uses them, and they are not among the
        newest ``keep`` (any, once shut). Called with the lock held."""
        kept = 0 if self._shut else self._keep
        old = self._pools[: max(0, len(self._pools) - kept)]
        unused = [u for u in old if u.users <= 0]
        self._pools = [u for u in self._pools if u not in unused]
        return [u.pool for u in unused]


@dataclass(slots=True, eq=False)
class _Used:
    """A pool mapping and how many connections use it."""

    key: tuple[Any, ...]
    pool: PoolMap
    users: int


class EngineChannel:
    """Blocking calls to the daemon, each thread on a connection of its own."""

    def __init__(self, link: DaemonLink, *, map_pool: bool = False) -> None:
        self._link = link
        self.settings = link.settings
        self.map_pool = map_pool  # for connections made from now on
        self._pools = PoolUsers()  # one mapping of the pool for every thread's connection
        self._local = threading.local()
        self._lock = threading.Lock()  # the connections, the backoff
        self._connections: list[ThreadConnection] = []
        self._backoff = Backoff(link.settings.reconnect_max_s)
        self._closed = False

    @property
    def breaker_open(self) -> bool:
        return self._link.breaker.is_open

    @property
    def connected(self) -> bool:
        return bool(self.snapshot())

    def here(self) -> ThreadConnection | None:
        """The calling thread's connection, if it has one open."""
        conn: ThreadConnection | None = getattr(self._local, "conn", None)
        return conn if conn is not None and not conn.client.closed else None

    def snapshot(self) -> list[ThreadConnection]:
        """Every thread's open connection."""
        with self._lock:
            return [c for c in self._connections if not c.client.closed]

    def call(
        self,
        deadline_s: float,
        body: Callable[[ThreadConnection, float], T],
        *,
        answered: bool = True,
    ) -> T:
        """``body(connection, deadline)`` on this thread's connection, ``deadline`` a
        ``time.monotonic()`` second ``deadline_s`` from now; raises what the daemon or
        the connection raised (:class:`BreakerOpen` at once while the breaker is open),
        each counted for the breaker, and anything else it raised too (its connection,
        in an unknown state, is closed). ``answered=False``: the body only sends (a
        post), so its return is no sign of a daemon that answers."""
        breaker = self._link.breaker
        if not breaker.allow():
            raise BreakerOpen("the tierd breaker is open")
        sent = time.monotonic()
        deadline = sent + deadline_s
        try:
            result = self._attempts(deadline, body)
        except BaseException as exc:  # a bug or an interrupt too: the connection is unknown
            conn: ThreadConnection | None = getattr(self._local, "conn", None)
            lost = conn is not None and conn.client.closed
            if self._link.count_call(exc, sent, lost=lost):
                self._drop()
            raise
        self._link.count_call(None, sent, answered=answered)
        return result

    def close(self) -> None:
        """Close every thread's connection; a call after this fails at once. A pool
        mapping a call still copies through stays until that call ends."""
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
            for conn in connections:
                conn.dropped = True
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.client.close()
            self._release(conn)
        self._pools.close()

    # -- inside a call ----------------------------------------------------------------

    def _attempts(self, deadline: float, body: Callable[[ThreadConnection, float], T]) -> T:
        """``body`` once more on a fresh connection if the one it used was found lost
        (the daemon restarted since the last call), the link told to look."""
        for attempt in range(2):
            conn = self._connected(deadline)
            reused, conn.used = conn.used, True
            try:
                return self._on(conn, deadline, body)
            except DaemonSilent:
                raise
            except (Unreachable, OSError):
                if attempt or not reused:
                    raise
                self._drop()
                self._link.check_soon()  # its own connection is likely gone too: say so
        raise AssertionError("unreachable: the loop returns or raises")

    def _on(
        self, conn: ThreadConnection, deadline: float, body: Callable[[ThreadConnection, float], T]
    ) -> T:
        """``body`` on ``conn``, which is busy meanwhile: its pool mapping stays, even if
        :meth:`close` closes it under the call."""
        conn.busy = True
        try:
            return body(conn, deadline)
        finally:
            with self._lock:
                conn.busy = False
            if conn.dropped:
                self._release(conn)

    def _connected(self, deadline: float) -> ThreadConnection:
        conn: ThreadConnection | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.client.closed:
            return conn
        self._drop()
        with self._lock:
            if self._closed:
                raise Unreachable("the tierd channel is closed")
            if not self._backoff.due(self._link.breaker.last_answer):
                raise Unreachable("the daemon is unreachable; reconnecting with backoff")
        s = self.settings
        try:
            client = s.blocking(deadline, map_pool=self.map_pool, pools=self._pools)
        except (TierdError, OSError):
            with self._lock:
                self._backoff.failed()
            raise
        conn = ThreadConnection(client)
        with self._lock:
            closed = conn.dropped = self._closed
            if not closed:
                self._backoff.succeeded()
                self._connections.append(conn)
        if closed:
            client.close()
            self._release(conn)
            raise Unreachable("the tierd channel is closed")
        self._local.conn = conn
        return conn

    def _drop(self) -> None:
        """Close this thread's connection (whatever it held in the daemon goes with it)."""
        conn: ThreadConnection | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is None:
            return
        with self._lock:
            conn.dropped = True
            with contextlib.suppress(ValueError):
                self._connections.remove(conn)
        with contextlib.suppress(OSError):
            conn.client.close()
        self._release(conn)

    def _release(self, conn: ThreadConnection) -> None:
        """Give back a dropped connection's use of the pool mapping, once, when no call
        runs on it."""
        with self._lock:
            if conn.busy or conn.released or not conn.dropped:
                return
            conn.released = True
        pool = conn.client.pool
        if pool is not None:
            self._pools.release(pool)
