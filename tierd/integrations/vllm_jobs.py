"""The transfer jobs of tierd's vLLM secondary tier: where each one runs and how it ends.

Every job is a call of the tier's :class:`~tierd.integrations.engine_calls.EngineCalls`
(one blocking connection per thread, the way :mod:`tierd.integrations.route` picks):

- a **load**, which a request waits for, runs right on the scheduler's thread: one
  region request per round into the connection's staging memfd, then one numpy copy into
  vLLM's rows;
- a **store**, which nobody waits for, runs on the tier's store thread (one job at a
  time, in order): its blocks are described first (on the same connection, so the daemon
  has the descriptions before the blocks), then copied into the store connection's
  staging memfd and stored with region requests.

While the link's breaker is open a job fails at once. Any failure is a failed job, never
an exception in vLLM; a job that crashed or was cancelled failed too.

This module owns the jobs in flight (:class:`Jobs`), their outcomes (:class:`Done`) and
draining them (``reset_prefix_cache``, shutdown), never waiting on a daemon that does not
answer. A store reads vLLM's rows only through its :class:`_StoreRows`, which draining
can stop: a store still waiting for the daemon is then cut off from vLLM's rows (a row
copy under way ends first) and reported failed at once, while its request ends on the
store thread at its own deadline. Nothing partial comes of it: the daemon only ever reads
a store's staging copy, whole rounds of it, never vLLM's rows. Turning an outcome into
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
from tierd.integrations.engine_calls import EngineCalls
from tierd.integrations.moves import Positions, RowBlocks, Rows
from tierd.integrations.vllm_describe import Describer
from tierd.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey

__all__ = ["Done", "JobStopped", "Jobs"]

log = get_logger("tierd.integrations.vllm")
_STOP_WAIT_S = 5.0  # the longest one row copy of a store may take to end (a few ms)
_STOPPED = "stopped by drain_jobs: the daemon did not answer in time"


class JobStopped(TierdError):
    """A store read vLLM's rows after :meth:`Jobs.drain` stopped it."""


@dataclass(frozen=True, slots=True)
class Done:
    """A finished job as it is reported to the scheduler thread."""

    job_id: int
    is_load: bool
    keys: tuple[OffloadKey, ...]
    elapsed_s: float
    ok_keys: tuple[OffloadKey, ...]
    error: str | None


class _StoreRows:
    """A store's blocks: vLLM's rows ``rows[row_ids[i]]``, read (``gather``) until
    :meth:`stop`; a read after it raises :class:`JobStopped`. A store never writes them."""

    def __init__(self, rows: Rows, row_ids: Positions) -> None:
        self._blocks: RowBlocks | None = RowBlocks(rows, row_ids)
        self._lock = threading.Lock()  # held for one copy out of vLLM's rows

    def stop(self, timeout_s: float) -> bool:
        """No read of vLLM's rows after this returns True (a copy under way ends first),
        and no reference to them; False if a copy did not end within ``timeout_s``."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        self._blocks = None
        self._lock.release()
        return True

    def gather(self, positions: Positions, out: Rows) -> None:
        with self._lock:
            self._live().gather(positions, out)

    def gather_one(self, position: int, out: memoryview) -> None:
        with self._lock:
            self._live().gather_one(position, out)

    def fill(self, positions: Positions, source: Rows) -> None:
        raise TypeError("a store does not write vLLM's rows")

    def fill_one(self, position: int, block: memoryview) -> None:
        raise TypeError("a store does not write vLLM's rows")

    def _live(self) -> RowBlocks:
        if self._blocks is None:
            raise JobStopped(_STOPPED)
        return self._blocks


@dataclass(slots=True, eq=False)
class _Pending:
    future: concurrent.futures.Future[Done]
    keys: tuple[OffloadKey, ...]
    is_load: bool
    submitted: float  # time.monotonic()
    rows: _StoreRows | None = None  # a store's way to vLLM's rows (a load is done at once)
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
        # Stores drain stopped under way, whose requests still run on the store thread.
        self._stopped: list[concurrent.futures.Future[Done]] = []

    def submit(
        self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int], *, is_load: bool
    ) -> None:
        """Start a job: failed at once while the breaker is open, a load on this thread,
        a store on the store thread."""
        submitted = time.monotonic()
        future: concurrent.futures.Future[Done]
        rows: _StoreRows | None = None
        if self._calls.channel.breaker_open or is_load:
            future = concurrent.futures.Future()
            if not self._calls.link.breaker.allow():  # fail at once: nothing is sent
                future.set_result(Done(job_id, is_load, keys, 0.0, (), "breaker open"))
            else:  # a request waits for it: right here
                future.set_result(self._load(job_id, keys, row_ids))
        else:
            rows = _StoreRows(self._rows, np.asarray(row_ids, dtype=np.intp))
            future = self._stores.submit(self._store, job_id, keys, rows)
        self._jobs[job_id] = _Pending(future, keys, is_load, submitted, rows)

    def _load(self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int]) -> Done:
        started = time.monotonic()
        blocks = RowBlocks(self._rows, np.asarray(row_ids, dtype=np.intp))
        deadline_s = self._calls.link.settings.load_deadline_s
        outcome = self._calls.load([bytes(k) for k in keys], blocks, deadline_s)
        ok = tuple(keys[i] for i in outcome.loaded)
        return Done(job_id, True, keys, time.monotonic() - started, ok, outcome.error)

    def _store(self, job_id: int, keys: tuple[OffloadKey, ...], rows: _StoreRows) -> Done:
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
        """The jobs done (or stopped by :meth:`drain`) since the last call, each once."""
        ids = [job_id for job_id, p in self._jobs.items() if _reportable(p)]
        return [_outcome(job_id, self._jobs.pop(job_id)) for job_id in ids]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def drain(self) -> None:
        """Wait for every submitted job; never on a daemon that does not answer. Once
        this returns no job reads vLLM's rows and every job's outcome is ready for
        :meth:`finished` (vLLM's ``drain_jobs`` contract).

        Stores still running after one lookup deadline are waited for only if the
        daemon answers a ``health`` within a quarter of a job deadline (else the breaker
        opens), and at most one job deadline. The rest are stopped: one not started
        never runs; one under way reads no more of vLLM's rows (a row copy under way
        ends first) and is reported failed now, its request to the daemon ending on the
        store thread at its own deadline.
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
                log.error("a tierd store did not end its copy of vLLM's rows", keys=len(p.keys))
            if started and not p.future.done():
                elapsed = time.monotonic() - p.submitted
                p.stopped = Done(job_id, p.is_load, p.keys, elapsed, (), _STOPPED)
                self._stopped = [f for f in self._stopped if not f.done()] + [p.future]

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
        """Let go of vLLM's rows (after :meth:`drain`: no job reads them any more) and of
        the store thread: at once, and without waiting for it while a store that drain
        stopped still waits for the daemon (the thread ends with it, at its deadline)."""
        waiting = any(not future.done() for future in self._stopped)
        self._stores.shutdown(wait=not waiting, cancel_futures=True)
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
