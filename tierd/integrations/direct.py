"""The scheduler thread's own connection: lookups and loads in one round trip each.

A request waits for its lookup (RETRY until answered) and for its loads, so these are
the calls whose latency a user sees. Handed to the link's event loop, each would wait for
the interpreter lock several times (the loop's wake-up, the send, the reply, the copy),
and a busy engine hands it over only every switch interval (5 ms). A
:class:`DirectChannel` makes the call from the scheduler's thread on a blocking
connection of its own (:class:`~tierd.control.blocking_client.BlockingClient`): the
thread sends, waits in ``recv`` (the lock released), and goes on. A lookup costs one
round trip; a load one region request per round (a staging's worth of rows, at most the
blocks the connection may hold in leases: a longer prefix moves in rounds, one after the
other), the daemon copying the blocks into a memfd of this channel's, then one numpy
copy into vLLM's rows.

Each call is bounded: a lookup by ``lookup_deadline_s``, a load by ``load_deadline_s``
(the daemon is told, and starts no copy past it). A call that gets no answer in time
closes the connection (a late answer, or a late copy into the old staging memfd, is
never read: the next connection brings a fresh one) and counts for the link's
:class:`~tierd.integrations.breaker.Breaker`; while the breaker is open every call
answers at once, unsent, and the link probes the daemon until it is back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from tierd.control.blocking_client import BlockingClient
from tierd.control.client_regions import job_keys
from tierd.control.handshake import DaemonError, DaemonSilent, Unreachable
from tierd.errors import TierdError
from tierd.integrations.copies import LoadOutcome
from tierd.integrations.link import DaemonLink
from tierd.integrations.staging import NO_REGIONS, row_offsets, staging_memory

__all__ = ["DirectChannel"]

Rows = npt.NDArray[np.uint8]
T = TypeVar("T")
_FIRST_BACKOFF_S = 0.05


@dataclass(frozen=True, slots=True)
class _Staging:
    """A connection's staging region: its id, its rows here, their byte offsets."""

    region: int
    array: Rows
    offsets: npt.NDArray[np.uint64]


@dataclass(slots=True)
class _Connection:
    client: BlockingClient
    used: bool = False  # a call has gone through it (a new one was not lost between calls)
    staging: _Staging | None = None  # registered on the first load


class DirectChannel:
    """Blocking lookups and loads for the thread that schedules (one at a time)."""

    def __init__(
        self, link: DaemonLink, rows: Rows, staging_bytes: int, *, regions: bool = True
    ) -> None:
        self._link = link
        self.settings = link.settings
        self._rows = rows
        self._per_round = max(1, min(len(rows), staging_bytes // rows.shape[1]))
        self._conn: _Connection | None = None
        self._lock = threading.Lock()
        self._next_attempt = 0.0
        self._backoff = _FIRST_BACKOFF_S
        self.regions = regions  # False (or once the daemon refused a region): use the link

    # -- calls ------------------------------------------------------------------------

    def present(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether the daemon holds it; None when it did not answer in time (or
        the breaker is open): every key a miss."""
        breaker = self._link.breaker
        if breaker.is_open:
            breaker.refused()
            return None
        sent = time.monotonic()
        deadline = sent + self.settings.lookup_deadline_s
        with self._lock:
            try:
                found = self._call(deadline, lambda conn: conn.client.lookup_each(keys, deadline))
            except DaemonError as exc:
                self._answered(exc, sent)
                return None
            except (TierdError, OSError) as exc:
                self._failed(exc, sent)
                return None
        breaker.answered()
        return found

    def load(self, keys: Sequence[bytes], row_ids: Sequence[int]) -> LoadOutcome | None:
        """Copy the daemon's blocks of ``keys`` into ``rows[row_ids[i]]``; None when the
        daemon has no regions (the caller loads through the link). A failure partway
        keeps what was copied before it."""
        breaker = self._link.breaker
        if breaker.is_open:
            breaker.refused()
            return LoadOutcome((), "the tierd breaker is open")
        sent = time.monotonic()
        deadline = sent + self.settings.load_deadline_s
        loaded: list[int] = []
        ids = np.asarray(row_ids, dtype=np.intp)

        def copy(conn: _Connection) -> bool:
            staging = self._staging(conn, deadline)
            if staging is not None:
                self._copy_in(conn.client, staging, keys, ids, deadline, loaded)
            return staging is not None

        with self._lock:
            try:
                if not self._call(deadline, copy):
                    return None
            except DaemonError as exc:
                self._answered(exc, sent)
                return LoadOutcome(tuple(loaded), str(exc))
            except (TierdError, OSError) as exc:
                self._failed(exc, sent)
                return LoadOutcome(tuple(loaded), str(exc))
        breaker.answered()
        return LoadOutcome(tuple(loaded))

    @property
    def connected(self) -> bool:
        conn = self._conn
        return conn is not None and not conn.client.closed

    def close(self) -> None:
        """Close the connection and let go of vLLM's rows (an array over them keeps
        vLLM's mapping exported, and vLLM could not close it); no call after this."""
        with self._lock:
            self._drop()
            self._rows = np.empty((0, self._rows.shape[1]), dtype=self._rows.dtype)

    # -- inside the lock --------------------------------------------------------------

    def _copy_in(
        self,
        client: BlockingClient,
        staging: _Staging,
        keys: Sequence[bytes],
        ids: npt.NDArray[np.intp],
        deadline: float,
        loaded: list[int],
    ) -> None:
        # A round is one request: within the lease bound, so that the rows of a request
        # that copied are kept even when a later one fails.
        step = job_keys(client.info, len(staging.array))
        for first in range(0, len(keys), step):
            count = min(step, len(keys) - first)
            done = client.region_load(
                staging.region, keys[first : first + count], staging.offsets[:count], deadline
            )
            got = np.flatnonzero(np.asarray(done, dtype=bool))
            self._rows[ids[first + got]] = staging.array[got]
            loaded.extend((first + got).tolist())

    def _call(self, deadline: float, call: Callable[[_Connection], T]) -> T:
        """``call(connection)``; once more on a fresh connection if the one it used was
        found lost (the daemon restarted since the last call), the link told to look."""
        for attempt in range(2):
            conn = self._connected(deadline)
            reused, conn.used = conn.used, True
            try:
                return call(conn)
            except DaemonSilent:
                raise
            except (Unreachable, OSError):
                if attempt or not reused:
                    raise
                self._drop()
                self._link.check_soon()  # its own connection is likely gone too: say so
        raise AssertionError("unreachable: the loop returns or raises")

    def _connected(self, deadline: float) -> _Connection:
        if self._conn is not None and not self._conn.client.closed:
            return self._conn
        self._drop()
        if time.monotonic() < self._next_attempt:
            raise Unreachable("the daemon is unreachable; reconnecting with backoff")
        s = self.settings
        try:
            client = BlockingClient.connect(
                s.socket_path,
                namespace=s.namespace,
                block_bytes=s.block_bytes,
                deadline=deadline,
                server_uids=s.server_uids,
            )
        except (TierdError, OSError):
            self._next_attempt = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, s.reconnect_max_s)
            raise
        self._backoff = _FIRST_BACKOFF_S
        self._conn = _Connection(client)
        return self._conn

    def _staging(self, conn: _Connection, deadline: float) -> _Staging | None:
        """``conn``'s staging region (registered now on first use), or None when the
        daemon has no regions."""
        if conn.staging is not None or not self.regions:
            return conn.staging
        row_bytes = self._rows.shape[1]
        fd, array = staging_memory(self._per_round, row_bytes)
        try:
            region = conn.client.register_region(fd, array.nbytes, deadline)
        except DaemonError as exc:
            if exc.code not in NO_REGIONS:
                raise
            self.regions = False
            return None
        finally:
            os.close(fd)  # the mapping and the daemon's copy keep the memory
        conn.staging = _Staging(region, array, row_offsets(self._per_round, row_bytes))
        return conn.staging

    def _answered(self, exc: DaemonError, sent: float) -> None:
        """An error answer: the daemon is there (unless it is shutting down)."""
        if exc.code == "shutting_down" or (self._conn is not None and self._conn.client.closed):
            self._failed(exc, sent)
        else:
            self._link.breaker.answered()

    def _failed(self, exc: BaseException, sent: float) -> None:
        self._drop()
        silent = isinstance(exc, DaemonSilent)
        self._link.report_failure(silent_since=sent if silent else None)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.client.close()
