"""The transfer jobs of tierd's vLLM secondary tier: where each one runs and how it ends.

A load that a request waits for runs right on the scheduler's thread, one region request
through the :class:`~tierd.integrations.direct.DirectChannel`; a load without regions and
every store run as coroutines on the :class:`~tierd.integrations.link.DaemonLink`'s own
loop, each bounded by the job deadline (a store describes its blocks first, then goes
through staged region copies, else leases). While the link's breaker is open a job fails
at once, with no hop to the link's thread. Any failure is a failed job, never an
exception in vLLM; a job that crashed or was cancelled failed too.

This module owns the jobs in flight (:class:`Jobs`), their outcomes (:class:`Done`) and
draining them at shutdown, never waiting on a daemon that does not answer. Turning an
outcome into vLLM's ``JobResult`` and its figures is the tier's
(:mod:`tierd.integrations.vllm`); this module imports vLLM only for type checking.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tierd.client import Client, DaemonError
from tierd.errors import TierdError
from tierd.integrations.copies import LoadOutcome, load_rows, store_rows
from tierd.integrations.direct import DirectChannel
from tierd.integrations.link import DaemonLink
from tierd.integrations.staging import StagedCopies
from tierd.integrations.vllm_describe import Describer
from tierd.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey

__all__ = ["Done", "Jobs"]

log = get_logger("tierd.integrations.vllm")
_STOP_WAIT_S = 5.0  # a cancelled job stops at its next await on the link's (own) loop


@dataclass(frozen=True, slots=True)
class Done:
    """A finished job as the link's loop reports it to the scheduler thread."""

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
    finished: threading.Event  # set once the job's coroutine no longer runs


class Jobs:
    """The tier's jobs in flight, keyed by vLLM's job id; ``rows`` are vLLM's CPU rows
    (one uint8 row per chunk), which the jobs copy from and into."""

    def __init__(
        self,
        link: DaemonLink,
        direct: DirectChannel,
        staged: StagedCopies | None,
        describer: Describer,
        rows: np.ndarray[Any, Any],
    ) -> None:
        self._link = link
        self._direct = direct
        self._staged = staged
        self._describer = describer
        self._rows = rows
        self._jobs: dict[int, _Pending] = {}

    def submit(
        self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int], *, is_load: bool
    ) -> None:
        """Start a job: failed at once while the breaker is open, a load with regions on
        this thread, anything else on the link's loop."""
        finished = threading.Event()
        done: Done | None = None
        if self._link.breaker.is_open:  # fail at once: no hop to the link's thread
            self._link.breaker.refused()
            done = Done(job_id, is_load, keys, 0.0, (), "breaker open")
        elif is_load and self._direct.regions:  # a request waits for it: right here
            done = self._load_here(job_id, keys, row_ids)
        if done is not None:
            future: concurrent.futures.Future[Done] = concurrent.futures.Future()
            future.set_result(done)
            finished.set()
        else:
            coro = self._run(job_id, keys, row_ids, is_load, finished)
            future = self._link.submit(coro)
        self._jobs[job_id] = _Pending(future, keys, is_load, finished)

    def _load_here(
        self, job_id: int, keys: tuple[OffloadKey, ...], row_ids: list[int]
    ) -> Done | None:
        """A load on the scheduler's thread (None: the daemon has no regions)."""
        started = time.monotonic()
        outcome = self._direct.load([bytes(k) for k in keys], row_ids)
        if outcome is None:
            return None
        ok = tuple(keys[i] for i in outcome.loaded)
        return Done(job_id, True, keys, time.monotonic() - started, ok, outcome.error)

    async def _run(
        self,
        job_id: int,
        keys: tuple[OffloadKey, ...],
        row_ids: list[int],
        is_load: bool,
        finished: threading.Event,
    ) -> Done:
        started = time.monotonic()
        raw = [bytes(k) for k in keys]
        outcome = LoadOutcome(())
        error: str | None = None
        deadline = self._link.settings.job_deadline_s
        try:
            if is_load:
                outcome = await self._link.bounded(lambda c: self._load(c, raw, row_ids), deadline)
                error = outcome.error
            elif await self._link.bounded(lambda c: self._store(c, raw, row_ids), deadline):
                outcome = LoadOutcome(tuple(range(len(keys))))
            else:
                error = "the daemon did not take every block (capacity)"
        except (TierdError, OSError) as exc:
            error = str(exc)
        finally:
            finished.set()  # no copy of this job touches vLLM's rows after this
        ok = tuple(keys[i] for i in outcome.loaded)
        return Done(job_id, is_load, keys, time.monotonic() - started, ok, error)

    async def _load(self, client: Client, keys: list[bytes], row_ids: list[int]) -> LoadOutcome:
        """Through leases (the daemon has no regions, or the tier was told to use none)."""
        return await load_rows(client, keys, self._rows, row_ids)

    async def _store(self, client: Client, keys: list[bytes], row_ids: list[int]) -> bool:
        """Whether the daemon holds every key now (described first, if the tier can)."""
        await self._describer.describe(client, keys)
        if self._staged is not None:
            held = await self._staged.store(client, keys, row_ids)
            if held is not None:
                return held
        await store_rows(client, keys, self._rows, row_ids)
        return True

    def finished(self) -> list[Done]:
        """The jobs done since the last call, each once."""
        ids = [job_id for job_id, p in self._jobs.items() if p.future.done()]
        return [_outcome(job_id, self._jobs.pop(job_id)) for job_id in ids]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def drain(self) -> None:
        """Wait for every submitted job; never on a daemon that does not answer.

        Jobs still running after one lookup deadline are waited for only if the daemon
        answers a ``health`` within a lookup deadline (else the breaker opens), and at
        most one job deadline. The rest are cancelled; each stops at its next await (a
        row copy is never cut), and this returns only once none of them runs.
        """
        pending = [p.future for p in self._jobs.values() if not p.future.done()]
        if not pending:
            return
        settings = self._link.settings
        _, pending_set = concurrent.futures.wait(pending, timeout=settings.lookup_deadline_s)
        if pending_set and self._daemon_answers():
            _, pending_set = concurrent.futures.wait(pending_set, timeout=settings.job_deadline_s)
        for future in pending_set:
            future.cancel()
        for p in self._jobs.values():
            if not p.finished.wait(_STOP_WAIT_S):
                log.error("a tierd job did not stop", keys=len(p.keys))

    def _daemon_answers(self) -> bool:
        """Whether the daemon answers a ``health`` within a quarter of a job deadline
        (longer than a lookup's: a busy link's loop may owe the answer a few ms)."""
        try:
            self._link.ask(lambda c: c.health(), self._link.settings.job_deadline_s / 4)
        except DaemonError:
            return True
        except (TierdError, OSError):
            return False
        return True

    def release(self) -> None:
        """Let go of vLLM's rows (after :meth:`drain`: no job copies them any more)."""
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
