"""Leases on the daemon's pool for an engine whose own workers copy into its rows.

When tierd's pool is an engine's CPU tier (vLLM's, :mod:`tierd.integrations.vllm.pool_spec`),
the engine's scheduler asks the daemon for rows and the engine's workers copy between
their KV cache and those rows of the mapped pool, later, on other threads or in other
processes. The daemon must not give a row to another block while such a copy may still
run (``docs/protocol.md`` section 6): a load's rows stay pinned and a store's reserved
until the engine reports the copy done, and that holds however the connection fares.
:class:`PoolLeases` keeps that promise on the engine's side:

- **Pins without a wait.** :meth:`PoolLeases.ask` sends ``prepare_load`` requests (one
  per batch of keys, ``wait_s: 0``, counted by the daemon as lookups: ``lookup: true``)
  and returns at once; :meth:`PoolLeases.answers`
  hands out what has come since (never waiting), and gives up on an ask older than the
  lookup deadline (a miss; its grant, should it come later, is ended at once). A
  scheduler step never waits on the daemon for a lookup.
- **Reservations** (:meth:`PoolLeases.reserve`): one ``prepare_store`` round trip,
  bounded by the store deadline; a grant that comes later is aborted when it comes.
- **Ends** (:meth:`PoolLeases.release`, :meth:`PoolLeases.commit`): posted, never waited
  for, once the engine's copy is done.
- **A connection is closed only when no copy can use its leases.** The daemon ends a
  connection's leases when its socket closes. A connection that breaks (a deadline
  missed on a send, a lost frame) is *retired*: no request goes on it any more, but its
  socket stays open until every lease the engine still uses on it is ended, then it is
  closed. A deadline missed while waiting for a reply breaks nothing: the reply is
  matched by its id when it comes. A daemon that died took its leases with it, and its
  pool (still mapped by the engine's workers) is never written again by anyone: a copy
  in flight reads the right bytes or writes bytes nobody reads.

The breaker is the link's (:class:`~tierd.integrations.core.link.DaemonLink`): while it is
open nothing is sent, asks are misses and reservations fail at once. Every row handed out
names the pool it lies in (the daemon's pool name): a restarted daemon has another pool,
which the workers map when they first meet it (:func:`mapped_pool`, for workers in this
process: the scheduler's connections map each pool and keep it here, a pool until no
connection with leases on it is open, the newest two at least). Needs no engine.

Threads. A :class:`PoolLeases` is called from one thread, the scheduler's, which owns
its connections (current and retired), their leases, the commits in flight and the
connect backoff, all unlocked. Shared: the replies that came after their asks were given
up on (filled by a handler wherever the connection's replies are read, taken by the
scheduler's next call), under the instance's lock; the process's pool mappings
(``_HERE``, read by workers of this process through :func:`mapped_pool`), under
:class:`~tierd.integrations.core.channel.PoolUsers`' own lock; and the link's breaker, under
its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierd.breaker import Backoff
from tierd.control.clients.blocking_client import BlockingClient
from tierd.control.clients.handshake import DaemonError, Unreachable
from tierd.control.clients.pool import PoolMap
from tierd.errors import TierdError
from tierd.integrations.core.channel import PoolUsers
from tierd.integrations.core.link import DaemonLink
from tierd.logs import get_logger

__all__ = ["NoPool", "PoolLeases", "Rows", "mapped_pool"]

log = get_logger("tierd.integrations.pool")


class NoPool(TierdError):
    """The daemon serves this engine without a shared-memory pool (its entry tier is not
    a CPU tier): its pool cannot be the engine's CPU tier."""


@dataclass(slots=True, eq=False)
class _Line:
    """One connection, and the leases the engine may still copy through."""

    client: BlockingClient
    pool: str
    leases: set[int] = field(default_factory=set)
    released: bool = False  # closed, its use of the pool mapping given back


@dataclass(slots=True, eq=False)
class Rows:
    """Rows of the pool ``pool`` under one lease: ``keys[i]`` lies in ``slots[i]``. A
    reservation's ``keys`` are those it got a slot for (the others were held already or
    in flight), in the order asked; ``lease`` is None when it got none."""

    keys: list[bytes]
    slots: list[int]
    pool: str
    lease: int | None
    line: _Line | None = None


@dataclass(slots=True, eq=False)
class Asked:
    """A batch of keys asked to be pinned (:meth:`PoolLeases.ask`)."""

    keys: list[bytes]
    line: _Line
    request: int
    sent: float


# Pools mapped by this process's connections, by name, for the workers of an engine
# whose scheduler runs here (vLLM's single-process executor): the newest two, and any
# an open connection uses (its leases' rows may still be copied).
_HERE = PoolUsers(keep=2)


def mapped_pool(name: str) -> PoolMap | None:
    """The pool ``name`` if a connection of this process mapped it (None: not here)."""
    return _HERE.find(name)


class PoolLeases:
    """Pins and reservations of one engine's scheduler on the daemon's pool; called from
    one thread (the scheduler's)."""

    def __init__(self, link: DaemonLink) -> None:
        self._link = link
        self.settings = link.settings
        self._line: _Line | None = None
        self._retired: list[_Line] = []
        self._late: list[tuple[_Line, str, Any]] = []  # replies given up on: (line, op, reply)
        self._backoff = Backoff(link.settings.reconnect_max_s)
        self._lock = threading.Lock()  # _late is filled while replies are read
        self._commits: list[tuple[_Line, int, Rows, float]] = []  # sent, not answered
        self._failed: list[Rows] = []  # commits that could not be sent
        self.closed = False

    # -- the connection ---------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._line is not None and not self._line.client.closed

    def line(self, deadline: float) -> _Line | None:
        """The usable connection, connecting when due (None: none now). Refuses with
        :class:`NoPool` a daemon that has no pool for this engine."""
        line = self._line
        if line is not None and not line.client.closed:
            # Read what has come: a late grant is ended before anything new is asked (a
            # broken connection is retired below).
            with contextlib.suppress(TierdError, OSError):
                line.client.collect(())
        self._settle()
        if line is not None and not line.client.closed:
            return line
        if line is not None:
            self._retire(line)
        breaker = self._link.breaker
        if self.closed or breaker.is_open or not self._backoff.due(breaker.last_answer):
            return None
        s = self.settings
        try:
            client = s.blocking(deadline, map_pool=True, pools=_HERE, retain=True)
        except (TierdError, OSError) as exc:
            self._backoff.failed()
            if not isinstance(exc, DaemonError):
                self._link.report_failure()
            raise
        self._backoff.succeeded()
        pool = client.info.get("pool")
        if client.pool is None or not isinstance(pool, dict):
            _close(_Line(client, ""))
            self._backoff.hold_off()
            raise NoPool(
                "the daemon has no shared-memory pool for this engine (its entry tier is"
                " not a CPU tier): it cannot be the engine's CPU tier"
            )
        self._line = _Line(client, str(pool.get("name", "")))
        return self._line

    def _retire(self, line: _Line) -> None:
        """``line`` broke: nothing more goes on it; closed once no lease of it is used."""
        if self._line is line:
            self._line = None
        if line.leases:
            self._retired.append(line)
        else:
            _close(line)

    def _ended(self, line: _Line, lease: int) -> None:
        """The engine is done with ``lease`` of ``line`` (its end posted, if the line is
        usable): a retired line with nothing left on it is closed now."""
        line.leases.discard(lease)
        client = line.client
        if client.closed and not line.leases and line in self._retired:
            self._retired.remove(line)
            _close(line)

    def _post(self, line: _Line, op: str, **fields: Any) -> None:
        """Post ``op`` on ``line`` if it is usable (a broken one ends its leases when it
        is closed); a failure to send breaks it."""
        client = line.client
        if client.closed:
            return
        try:
            client.post(op, time.monotonic() + self.settings.lookup_deadline_s, **fields)
        except Unreachable:  # lost (the daemon gone, or restarted): its leases went with it
            self._link.check_soon()
            self._retire(line)
        except (TierdError, OSError):
            self._link.report_failure()
            if client.closed:
                self._retire(line)

    # -- pins (loads) -----------------------------------------------------------------

    def ask(self, batches: Sequence[list[bytes]]) -> list[Asked]:
        """Send a pin request (``prepare_load``, no wait on blocks being written) for each
        batch of keys (none empty); answered by :meth:`answers`. Nothing is sent while the
        daemon is unreachable or the breaker open: then no ask is returned."""
        if not batches:
            return []
        now = time.monotonic()
        fields = [{"keys": list(keys), "wait_s": 0, "lookup": True} for keys in batches]
        deadline = now + self.settings.lookup_deadline_s
        started = self._started("prepare_load", fields, deadline)
        if started is None:
            return []
        line, ids = started
        return [Asked(list(keys), line, i, now) for keys, i in zip(batches, ids, strict=True)]

    def _started(
        self, op: str, fields: list[dict[str, Any]], deadline: float
    ) -> tuple[_Line, list[int]] | None:
        """``op`` requests started on the usable connection (None: not sent); once more
        on a fresh one when the one used is found lost (a restarted daemon costs no
        miss), as every engine call does."""
        for attempt in range(2):
            line: _Line | None = None
            try:
                line = self.line(deadline)
                if line is None:
                    return None
                return line, line.client.start(op, fields, deadline)
            except Unreachable:
                if attempt or line is None:
                    self._link.report_failure()
                    return None
                self._retire(line)
                self._link.check_soon()
            except (TierdError, OSError):
                self._link.report_failure()
                return None
        return None

    def answers(self, asked: Sequence[Asked]) -> dict[Asked, Rows | None]:
        """The asks among ``asked`` answered since (never waiting): the rows pinned (None:
        not even the first key), or None for an ask given up (older than the load
        deadline, or its connection broken). The others are still under way."""
        out: dict[Asked, Rows | None] = {}
        by_line: dict[_Line, list[Asked]] = {}
        for one in asked:
            by_line.setdefault(one.line, []).append(one)
        now = time.monotonic()
        for line, some in by_line.items():
            try:
                got = line.client.collect([a.request for a in some])
            except Unreachable:  # lost: the daemon gone or restarted, its pins with it
                self._link.check_soon()
                got = {}
            except (TierdError, OSError):
                self._link.report_failure()
                got = {}
            if got:
                self._link.breaker.answered()
            late: list[Asked] = []
            for one in some:
                reply = got.get(one.request)
                if reply is not None:
                    out[one] = self._pinned(line, one.keys, reply)
                elif line.client.closed or now - one.sent > self.settings.load_deadline_s:
                    out[one] = None
                    late.append(one)
            if late and not line.client.closed:
                line.client.forget([a.request for a in late], self._late_reply(line, "load"))
                self._link.report_failure(silent_since=min(a.sent for a in late))
            if line.client.closed:
                self._retire(line)
        return out

    def _pinned(self, line: _Line, keys: list[bytes], reply: Any) -> Rows | None:
        lease = reply.get("lease") if reply.get("ok") else None
        if lease is None:
            return None
        count = int(reply["count"])
        if list(dict.fromkeys(keys))[:count] != keys[:count]:  # a repeated key: give up
            self._post(line, "complete_load", lease=lease)
            return None
        line.leases.add(int(lease))
        return Rows(keys[:count], [int(s) for s in reply["slots"]], line.pool, int(lease), line)

    def release(self, rows: Rows) -> None:
        """The engine's copies out of ``rows`` are done: unpin them."""
        line, lease = rows.line, rows.lease
        if line is None or lease is None or lease not in line.leases:
            return
        self._settle()
        self._post(line, "complete_load", lease=lease)
        self._ended(line, lease)

    # -- reservations (stores) --------------------------------------------------------

    def reserve(self, keys: Sequence[bytes]) -> Rows | None:
        """Rows for the ``keys`` the daemon does not hold, reserved until :meth:`commit`
        (one round trip, at most the store deadline). None: no room now (``capacity``;
        ask again later). Rows of no key: nothing to store now (the daemon holds them
        all, or did not answer in time, or cannot be reached)."""
        sent = time.monotonic()
        deadline = sent + self.settings.job_deadline_s
        none = Rows([], [], "", None)
        started = self._started("prepare_store", [{"keys": list(keys)}], deadline)
        if started is None:
            return none
        line, (request,) = started
        try:
            got = line.client.collect([request], deadline)
        except (TierdError, OSError):
            self._link.report_failure()
            return none
        reply = got.get(request)
        if reply is None:
            if not line.client.closed:
                line.client.forget([request], self._late_reply(line, "store"))
            self._link.report_failure(silent_since=sent)
            return none
        self._link.breaker.answered()
        if not reply.get("ok"):
            log.debug("tierd refused a reservation", error=reply.get("error"))
            return None if reply.get("error") == "capacity" else none
        lease = reply.get("lease")
        if lease is None:
            return Rows([], [], line.pool, None, line)
        taken = [(k, int(s)) for k, s in zip(keys, reply["slots"], strict=True) if s is not None]
        line.leases.add(int(lease))
        return Rows([k for k, _ in taken], [s for _, s in taken], line.pool, int(lease), line)

    def commit(self, rows: Rows, ok: bool) -> None:
        """The engine's copies into ``rows`` are done (``ok``: all of them written):
        make the blocks ready (its result comes with :meth:`committed`), or give the rows
        back."""
        line, lease = rows.line, rows.lease
        if line is None or lease is None or lease not in line.leases:
            return
        self._settle()
        if ok and not line.client.closed:
            try:
                deadline = time.monotonic() + self.settings.lookup_deadline_s
                (request,) = line.client.start(
                    "complete_store", [{"lease": lease, "ok": True}], deadline
                )
                self._commits.append((line, request, rows, time.monotonic()))
            except (TierdError, OSError):
                self._link.report_failure()
                self._failed.append(rows)
                if line.client.closed:
                    self._retire(line)
        elif ok:
            self._failed.append(rows)
        else:
            self._post(line, "abort_store", lease=lease)
        self._ended(line, lease)

    def committed(self) -> list[tuple[Rows, bool]]:
        """The commits answered since (never waiting), each with whether the daemon
        stored every block; a commit not answered within the store deadline, or on a
        connection that broke, counts as not stored."""
        out: list[tuple[Rows, bool]] = [(rows, False) for rows in self._failed]
        self._failed = []
        if not self._commits:
            return out
        now, left = time.monotonic(), []
        for line, request, rows, sent in self._commits:
            try:
                got = line.client.collect([request]) if not line.client.closed else {}
            except (TierdError, OSError):
                got = {}
            reply = got.get(request)
            if reply is not None:
                stored = bool(reply.get("ok")) and int(reply.get("stored", 0)) == len(rows.keys)
                out.append((rows, stored))
            elif line.client.closed or now - sent > self.settings.job_deadline_s + 1.0:
                if not line.client.closed:
                    line.client.forget([request], _ignore)
                out.append((rows, False))
            else:
                left.append((line, request, rows, sent))
        self._commits = left
        return out

    # -- replies given up on ----------------------------------------------------------

    def _late_reply(self, line: _Line, kind: str) -> Any:
        def late(reply: Any) -> None:
            with self._lock:
                self._late.append((line, kind, reply))

        return late

    def _settle(self) -> None:
        """End the leases that came after their asks were given up on."""
        with self._lock:
            late, self._late = self._late, []
        for line, kind, reply in late:
            lease = reply.get("lease") if isinstance(reply, dict) and reply.get("ok") else None
            if lease is not None:
                self._post(line, "complete_load" if kind == "load" else "abort_store", lease=lease)

    # -- the end ----------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Leases the engine may still copy through, on every connection."""
        lines = self._retired + ([self._line] if self._line is not None else [])
        return sum(len(line.leases) for line in lines)

    def close(self) -> None:
        """No more leases. A connection with leases still in use keeps its socket (the
        process's exit closes it, after every copy of its threads): never closed under a
        copy that may still run."""
        self.closed = True
        lines = self._retired + ([self._line] if self._line is not None else [])
        self._line, self._retired = None, []
        for line in lines:
            if line.leases:
                log.info("tierd leases left to the process's exit", leases=len(line.leases))
                continue
            _close(line)


def _close(line: _Line) -> None:
    """Close ``line``'s socket (the daemon ends its leases) and give back its use of the
    pool mapping (closed once no open connection uses it, unless among the newest)."""
    line.client.close()
    pool = line.client.pool
    if pool is not None and not line.released:
        line.released = True
        _HERE.release(pool)


def _ignore(reply: Any) -> None:
    """A reply nobody needs (a commit's result given up on)."""
