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
draining them at shutdown, never waiting on a daemon that does not answer. Turning an
outcome into vLLM's ``JobResult`` and its figures is the tier's
(:mod:`tierd.integrations.vllm`); this module imports vLLM only for type checking.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tierd.control.handshake import DaemonError
from tierd.errors import TierdError
from tierd.integrations.engine_calls import EngineCalls
from tierd.integrations.moves import RowBlocks
from tierd.integrations.vllm_describe import Describer
from tierd.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey

__all__ = ["Done", "Jobs"]

log = get_logger("tierd.integrations.vllm")
_STOP_WAIT_S = 5.0  # past its deadline, a running store has stopped


@dataclass(frozen=True, slots=True)
class Done:
    """A finished job as it is reported to the scheduler thread."""

    job_id: int
    is_load: bool
    keys: tuple[OffloadKey, ...]
    elapsed_s: float
    ok_keys: tuple[OffloadKey, ...]
    error: str | None


@dataclass(frozen=True, slots=True)
class _Pending:
    future: concurrent.futures.Future[Done]
    keys: tuple[OffloadKey, ...]
    is_load: bool
    finished: threading.Event  # set once the job no longer touches vLLM's rows


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

    def submit(
        self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int], *, is_load: bool
    ) -> None:
        """Start a job: failed at once while the breaker is open, a load on this thread,
        a store on the store thread."""
        finished = threading.Event()
        future: concurrent.futures.Future[Done]
        if self._calls.channel.breaker_open or is_load:
            future = concurrent.futures.Future()
            if self._calls.channel.breaker_open:  # fail at once: nothing is sent
                self._calls.link.breaker.refused()
                future.set_result(Done(job_id, is_load, keys, 0.0, (), "breaker open"))
            else:  # a request waits for it: right here
                future.set_result(self._load(job_id, keys, row_ids))
            finished.set()
        else:
            future = self._stores.submit(self._store, job_id, keys, row_ids, finished)
        self._jobs[job_id] = _Pending(future, keys, is_load, finished)

    def _load(self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int]) -> Done:
        started = time.monotonic()
        blocks = RowBlocks(self._rows, np.asarray(row_ids, dtype=np.intp))
        deadline_s = self._calls.link.settings.load_deadline_s
        outcome = self._calls.load([bytes(k) for k in keys], blocks, deadline_s)
        ok = tuple(keys[i] for i in outcome.loaded)
        return Done(job_id, True, keys, time.monotonic() - started, ok, outcome.error)

    def _store(
        self,
        job_id: int,
        keys: tuple[OffloadKey, ...],
        row_ids: list[int],
        finished: threading.Event,
    ) -> Done:
        started = time.monotonic()
        raw = [bytes(k) for k in keys]
        error: str | None = None
        ok: tuple[OffloadKey, ...] = ()
        deadline_s = self._calls.link.settings.job_deadline_s
        try:
            self._before_store(deadline_s)
            self._describer.describe(lambda k, b: self._describe(k, b, deadline_s), raw)
            blocks = RowBlocks(self._rows, np.asarray(row_ids, dtype=np.intp))
            if all(self._calls.store(raw, blocks, deadline_s)):
                ok = keys
            else:
                error = "the daemon did not take every block (capacity)"
        except (TierdError, OSError) as exc:
            error = str(exc)
        finally:
            finished.set()  # no copy of this job touches vLLM's rows after this
        return Done(job_id, False, keys, time.monotonic() - started, ok, error)

    def _describe(self, keys: list[bytes], blocks: list[bytes], deadline_s: float) -> None:
        self._calls.request("describe", deadline_s, keys=keys, blocks=blocks)

    def finished(self) -> list[Done]:
        """The jobs done since the last call, each once."""
        ids = [job_id for job_id, p in self._jobs.items() if p.future.done()]
        return [_outcome(job_id, self._jobs.pop(job_id)) for job_id in ids]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def drain(self) -> None:
        """Wait for every submitted job; never on a daemon that does not answer.

        Stores still running after one lookup deadline are waited for only if the
        daemon answers a ``health`` within a lookup deadline (else the breaker opens),
        and at most one job deadline. The rest are cancelled: one not started never
        runs, one under way ends at its deadline; this returns only once none runs.
        """
        pending = [p.future for p in self._jobs.values() if not p.future.done()]
        if not pending:
            return
        settings = self._calls.link.settings
        _, pending_set = concurrent.futures.wait(pending, timeout=settings.lookup_deadline_s)
        if pending_set and self._daemon_answers():
            _, pending_set = concurrent.futures.wait(pending_set, timeout=settings.job_deadline_s)
        for p in self._jobs.values():
            if p.future in pending_set and p.future.cancel():
                p.finished.set()  # not started: it never will
        for p in self._jobs.values():
            if not p.finished.wait(_STOP_WAIT_S):
                log.error("a tierd job did not stop", keys=len(p.keys))

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
        """Let go of vLLM's rows (after :meth:`drain`: no job copies them any more) and
        of the store thread."""
        self._stores.shutdown(wait=True, cancel_futures=True)  # drained: at once
        self._rows = np.empty((0, self._rows.shape[1]), dtype=np.uint8)


def _outcome(job_id: int, pending: _Pending) -> Done:
    """A finished job's result; a job that crashed or was cancelled failed."""
    future = pending.future
    if future.cancelled():
        return Done(job_id, pending.is_load, pending.keys, 0.0, (), "cancelled")
    exc = future.exception()
    if exc is not None:
        log.error("tierd job crashed", job=job_id, error=repr(exc))
        return Done(job_id, pending.is_load, pending.keys, 0.0, (), repr(exc))
    return future.result()
