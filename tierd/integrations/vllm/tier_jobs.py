"""The transfer jobs of tierd's vLLM secondary tier: where each one runs and how it ends.

Every job is a call of the tier's :class:`~tierd.integrations.core.engine_calls.EngineCalls`
(one blocking connection per thread, the way :mod:`tierd.integrations.core.route` picks):

- a **load**, which a request waits for, runs on one of the tier's load threads (at
  most :data:`LOAD_THREADS`, so the loads of a step run side by side, and ``submit_load``
  returns at once, vLLM's scheduler never waiting on the daemon): one region request per
  round into that thread's connection's staging memfd, then one numpy copy into vLLM's
  rows. Its deadline counts from its submission: a load that waited that long for a
  thread fails unsent;
- a **store**, which nobody waits for, runs on the tier's store thread (one job at a
  time, in order): its blocks are described first (on the same connection, so the daemon
  has the descriptions before the blocks), then copied into the store connection's
  staging memfd and stored with region requests.

While the link's breaker is open a job fails at once. Any failure is a failed job, never
an exception in vLLM; a job that crashed or was cancelled failed too.

This module owns the jobs in flight (:class:`Jobs`), their outcomes (:class:`Done`) and
draining them (``reset_prefix_cache``, shutdown), never waiting on a daemon that does not
answer. A job reads (a store) or writes (a load) vLLM's rows only through its
:class:`_JobRows`, which draining can stop: a job still waiting for the daemon is then
cut off from vLLM's rows (a row copy under way ends first) and reported failed at once,
while its request ends on its thread at its own deadline. Nothing partial comes of a
store: the daemon only ever reads a store's staging copy, whole rounds of it, never
vLLM's rows; and no byte of a load lands in vLLM's rows after its job is reported, done
or failed (a job is reported once its thread is done with the rows, or once drain cut
it off them). Turning an outcome into
vLLM's ``JobResult`` and its figures is the tier's (:mod:`tierd.integrations.vllm`); this
module imports vLLM only for type checking.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tierd.control.clients.handshake import DaemonError
from tierd.errors import TierdError
from tierd.integrations.core.data_paths import Positions, RowBlocks, Rows
from tierd.integrations.core.engine_calls import EngineCalls
from tierd.integrations.vllm.block_descriptions import Describer
from tierd.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey

__all__ = ["LOAD_THREADS", "Done", "JobStopped", "Jobs"]

log = get_logger("tierd.integrations.vllm")
_STOP_WAIT_S = 5.0  # the longest one row copy of a job may take to end (a few ms)
LOAD_THREADS = 4  # loads run side by side, at most (each thread: a connection, a staging memfd)
# The longest a poll waits for a load in flight to end, the interpreter lock released: the
# load threads run then, not only when the engine's busy loop hands the lock over (5 ms).
POLL_WAIT_S = 0.001
_STOPPED = "stopped by drain_jobs: the daemon did not answer in time"


class JobStopped(TierdError):
    """A job read or wrote vLLM's rows after :meth:`Jobs.drain` stopped it."""


@dataclass(frozen=True, slots=True)
class Done:
    """A finished job as it is reported to the scheduler thread."""

    job_id: int
    is_load: bool
    keys: tuple[OffloadKey, ...]
    elapsed_s: float
    ok_keys: tuple[OffloadKey, ...]
    error: str | None


class _JobRows:
    """A job's blocks: vLLM's rows ``rows[row_ids[i]]``, read by a store (``gather``) or
    written by a load (``fill``) until :meth:`stop`; a copy after it raises
    :class:`JobStopped`. A store never writes them, a load never reads them."""

    def __init__(self, rows: Rows, row_ids: Positions, *, load: bool) -> None:
        self._blocks: RowBlocks | None = RowBlocks(rows, row_ids)
        self._load = load
        self._lock = threading.Lock()  # held for one copy out of, or into, vLLM's rows

    def stop(self, timeout_s: float) -> bool:
        """No copy out of or into vLLM's rows after this returns True (one under way ends first),
        and no reference to them; False if a copy did not end within ``timeout_s``."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        self._blocks = None
        self._lock.release()
        return True

    def gather(self, positions: Positions, out: Rows) -> None:
        with self._lock:
            self._live(load=False).gather(positions, out)

    def gather_one(self, position: int, out: memoryview) -> None:
        with self._lock:
            self._live(load=False).gather_one(position, out)

    def fill(self, positions: Positions, source: Rows) -> None:
        with self._lock:
            self._live(load=True).fill(positions, source)

    def fill_one(self, position: int, block: memoryview) -> None:
        with self._lock:
            self._live(load=True).fill_one(position, block)

    def _live(self, *, load: bool) -> RowBlocks:
        if load is not self._load:
            raise TypeError("a store does not write vLLM's rows, nor a load read them")
        if self._blocks is None:
            raise JobStopped(_STOPPED)
        return self._blocks


@dataclass(slots=True, eq=False)
class _Pending:
    future: concurrent.futures.Future[Done]
    keys: tuple[OffloadKey, ...]
    is_load: bool
    submitted: float  # time.monotonic()
    rows: _JobRows | None = None  # the job's way to vLLM's rows (None: failed at once)
    stopped: Done | None = None  # its outcome, once drain stopped it under way


class Jobs:
    """The tier's jobs in flight, keyed by vLLM's job id; ``rows`` are vLLM's CPU rows
    (one uint8 row per chunk), which the jobs copy from and into. ``before_store`` runs
    on the store thread ahead of each store (the tier's event subscription)."""

    def __init__(
        self,
        calls: EngineCalls,
        describer: Describer,
        rows: np.ndarray[Any, Any],
        before_store: Callable[[float], None] = lambda deadline_s: None,
    ) -> None:
        self._calls = calls
        self._describer = describer
        self._rows = rows
        self._before_store = before_store
        self._jobs: dict[int, _Pending] = {}
        self._stores = concurrent.futures.ThreadPoolExecutor(1, "tierd-vllm-store")
        self._loads = concurrent.futures.ThreadPoolExecutor(LOAD_THREADS, "tierd-vllm-load")
        # Jobs drain stopped under way, whose requests still run on their threads.
        self._stopped: list[_Pending] = []

    def submit(
        self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int], *, is_load: bool
    ) -> None:
        """Start a job and return: failed at once while the breaker is open (a load's
        breaker is asked here, so it is failed unsent), a load on a load thread, a store
        on the store thread."""
        submitted = time.monotonic()
        future: concurrent.futures.Future[Done]
        rows: _JobRows | None = None
        if (is_load or self._calls.channel.breaker_open) and not self._calls.link.breaker.allow():
            future = concurrent.futures.Future()  # fail at once: nothing is sent
            future.set_result(Done(job_id, is_load, keys, 0.0, (), "breaker open"))
        else:
            rows = _JobRows(self._rows, np.asarray(row_ids, dtype=np.intp), load=is_load)
            if is_load:
                future = self._loads.submit(self._load, job_id, keys, rows, submitted)
            else:
                future = self._stores.submit(self._store, job_id, keys, rows)
        self._jobs[job_id] = _Pending(future, keys, is_load, submitted, rows)

    def _load(
        self, job_id: int, keys: tuple[OffloadKey, ...], rows: _JobRows, submitted: float
    ) -> Done:
        """On a load thread: the daemon's blocks into vLLM's rows (through ``rows``, which
        drain may stop), within the load deadline counted from ``submitted``."""
        started = time.monotonic()
        try:
            deadline_s = self._calls.link.settings.load_deadline_s - (started - submitted)
            if deadline_s <= 0:  # waited its whole deadline for a thread: not sent
                error = "the load waited its whole deadline for a load thread"
                return Done(job_id, True, keys, 0.0, (), error)
            outcome = self._calls.load([bytes(k) for k in keys], rows, deadline_s)
        finally:
            rows.stop(_STOP_WAIT_S)  # done with vLLM's rows: no reference left to them
        ok = tuple(keys[i] for i in outcome.loaded)
        return Done(job_id, True, keys, time.monotonic() - started, ok, outcome.error)

    def _store(self, job_id: int, keys: tuple[OffloadKey, ...], rows: _JobRows) -> Done:
        started = time.monotonic()
        raw = [bytes(k) for k in keys]
        error: str | None = None
        ok: tuple[OffloadKey, ...] = ()
        deadline_s = self._calls.link.settings.job_deadline_s
        try:
            self._before_store(deadline_s)
            self._describer.describe(lambda k, b: self._describe(k, b, deadline_s), raw)
            if all(self._calls.store(raw, rows, deadline_s)):
                ok = keys
            else:
                error = "the daemon did not take every block (capacity)"
        except (TierdError, OSError) as exc:
            error = str(exc)
        finally:
            rows.stop(_STOP_WAIT_S)  # done with vLLM's rows: no reference left to them
        return Done(job_id, False, keys, time.monotonic() - started, ok, error)

    def _describe(self, keys: list[bytes], blocks: list[bytes], deadline_s: float) -> None:
        self._calls.request("describe", deadline_s, keys=keys, blocks=blocks)

    def finished(self) -> list[Done]:
        """The jobs done (or stopped by :meth:`drain`) since the last call, each once;
        with loads in flight and none done, after waiting :data:`POLL_WAIT_S` at most
        for one to end."""
        loading = [p.future for p in self._jobs.values() if p.is_load and not _reportable(p)]
        if loading and not any(_reportable(p) for p in self._jobs.values()):
            concurrent.futures.wait(loading, POLL_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        ids = [job_id for job_id, p in self._jobs.items() if _reportable(p)]
        return [_outcome(job_id, self._jobs.pop(job_id)) for job_id in ids]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def drain(self) -> None:
        """Wait for every submitted job; never on a daemon that does not answer. Once
        this returns no job reads or writes vLLM's rows and every job's outcome is ready for
        :meth:`finished` (vLLM's ``drain_jobs`` contract).

        Jobs still running after one lookup deadline are waited for only if the
        daemon answers a ``health`` within a quarter of a job deadline (else the breaker
        opens), and at most one job deadline. The rest are stopped: one not started
        never runs; one under way reads or writes no more of vLLM's rows (a row copy
        under way ends first) and is reported failed now, its request to the daemon
        ending on its thread at its own deadline.
        """
        pending = [p for p in self._jobs.values() if not _reportable(p)]
        if not pending:
            return
        settings = self._calls.link.settings
        futures = [p.future for p in pending]
        _, left = concurrent.futures.wait(futures, timeout=settings.lookup_deadline_s)
        if left and self._daemon_answers():
            _, left = concurrent.futures.wait(left, timeout=settings.job_deadline_s)
        for job_id, p in self._jobs.items():
            if p.future not in left:
                continue
            started = not p.future.cancel()  # not started: it never will (cancelled)
            if p.rows is not None and not p.rows.stop(_STOP_WAIT_S):
                log.error("a tierd job did not end its copy of vLLM's rows", keys=len(p.keys))
            if started and not p.future.done():
                elapsed = time.monotonic() - p.submitted
                p.stopped = Done(job_id, p.is_load, p.keys, elapsed, (), _STOPPED)
                self._stopped = [s for s in self._stopped if not s.future.done()] + [p]

    def _daemon_answers(self) -> bool:
        """Whether the daemon answers a ``health`` within a quarter of a job deadline
        (longer than a lookup's: a busy daemon may owe the answer a few ms)."""
        try:
            self._calls.request("health", self._calls.link.settings.job_deadline_s / 4)
        except DaemonError:
            return True
        except (TierdError, OSError):
            return False
        return True

    def release(self) -> None:
        """Let go of vLLM's rows (after :meth:`drain`: no job touches them any more) and
        of the store and load threads: joined, except a pool where a job that drain
        stopped still waits for the daemon (its thread ends with it, at its deadline)."""
        for pool, loads in ((self._stores, False), (self._loads, True)):
            waiting = any(s.is_load is loads and not s.future.done() for s in self._stopped)
            pool.shutdown(wait=not waiting, cancel_futures=True)
        for p in self._jobs.values():
            if p.rows is not None:
                p.rows.stop(_STOP_WAIT_S)
        self._rows = np.empty((0, self._rows.shape[1]), dtype=np.uint8)


def _reportable(pending: _Pending) -> bool:
    """Whether the job's outcome is known: it ended, or drain stopped it."""
    return pending.stopped is not None or pending.future.done()


def _outcome(job_id: int, pending: _Pending) -> Done:
    """A finished job's result; a job that crashed, was cancelled or stopped failed."""
    if pending.stopped is not None:
        return pending.stopped
    future = pending.future
    if future.cancelled():
        return Done(job_id, pending.is_load, pending.keys, 0.0, (), "cancelled")
    exc = future.exception()
    if exc is not None:
        log.error("tierd job crashed", job=job_id, error=repr(exc))
        return Done(job_id, pending.is_load, pending.keys, 0.0, (), repr(exc))
    return future.result()
