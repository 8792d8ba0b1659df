"""tierd as a secondary tier of vLLM's KV offloading (vLLM 0.33, ``TieringOffloadingSpec``).

vLLM loads the class by module path (``docs/vllm.md`` has the config to paste)::

    {"type": "TierdSecondaryTier", "module_path": "tierd.integrations.vllm",
     "socket": "/run/user/1000/tierd/tierd.sock"}

(or none of it: ``TIERD=1`` in vLLM's environment, :mod:`tierd.integrations.vllm.plugin`).

vLLM's scheduler calls every method synchronously. Every call to the daemon goes through
the tier's :class:`~tierd.integrations.core.engine_calls.EngineCalls`: on the calling thread's
own blocking connection, bounded by a short deadline. vLLM's scheduler step does not wait
on the daemon (a step waits :data:`STEP_WAIT_S` at most for its lookups' answer, a poll 1
ms at most for a load in flight, a touch is only sent, ``drain_jobs`` is bounded): the
lookups of a scheduler step go to the daemon as one request from the tier's lookup thread
when the step ends (vLLM's ``AsyncLookupManager``: RETRY until the answer, then HIT or
MISS); a load is one region request sent from one of the tier's load threads (several side
by side), the daemon copying the blocks, the thread waiting in ``recv``; stores run on the
tier's store thread. ``submit_load`` and ``submit_store`` return at once; where each job
runs and how it ends is :mod:`tierd.integrations.vllm.tier_jobs`'. The
:class:`~tierd.integrations.core.link.DaemonLink` carries no job: it watches the daemon (the
breaker's probe) and follows its events. Jobs are reported by ``get_finished_jobs``. Any
failure (daemon down, stopped, killed, restarted, ``capacity``, a block evicted or failing
its checksum) is a failed job or a miss, never an exception in vLLM; past a few failures a
breaker answers at once until the daemon is back.

This module needs vLLM (``scripts/setup_vllm``); nothing else in tierd imports it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tierd.client import Unreachable
from tierd.config import default_socket_path
from tierd.errors import TierdError
from tierd.integrations.core.engine_calls import EngineCalls
from tierd.integrations.core.link import BlockSizeMismatch, DaemonLink, LinkSettings
from tierd.integrations.core.naming import derive_namespace
from tierd.integrations.core.one_flag import missing_daemon
from tierd.integrations.core.params import start_refusal
from tierd.integrations.vllm.block_descriptions import describer_for
from tierd.integrations.vllm.tier_jobs import Done, Jobs
from tierd.integrations.vllm.tier_report import EventFollower, TierReport, event_config
from tierd.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["BlockSizeMismatch", "TierdSecondaryTier", "Unreachable", "live_tiers"]

log = get_logger("tierd.integrations.vllm")
# vLLM's own logger (a child of "vllm": its handler, format and level), for what a person
# starting vLLM must see.
engine_log = logging.getLogger("vllm.tierd")

_Results = Any  # the lookup manager's result queue: put(list of (key, generation, found))
_LIVE: weakref.WeakSet[TierdSecondaryTier] = weakref.WeakSet()


class _Lookups(AsyncLookupManager):
    """vLLM's per-step lookup batching (its lookup states, generations, request
    references and ``mark_miss``), answered by the daemon.

    The base class posts each step's batch to a queue that its own thread serves, one
    ``batch_lookup`` per request. Here each step's batch goes to the daemon as one
    ``lookup_each`` for every key of the step, sent from a lookup thread of the tier's
    (or, while the breaker is open, answered MISS on the spot); the scheduler's step
    waits for the answer at most :data:`STEP_WAIT_S` (a daemon that answers at once is
    heard in the same step, without a thread's wake-up on the GIL), never a lookup
    deadline: vLLM's step stays non-blocking, and an answer that comes later is taken at
    a later step. At most :data:`LOOKUPS_QUEUED` steps' batches wait for the lookup
    thread; past that a step's keys are misses. The base thread stays parked on the
    queue it was built with, until shutdown posts its stop there.

    The seam is vLLM's private ``_lookup_queue`` and ``_pending_results`` (vLLM 0.32 and
    0.33): a vLLM without them stops the engine at start-up, saying so
    (:func:`check_lookup_seam`).
    """

    def __init__(self, tier: TierdSecondaryTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type)
        check_lookup_seam(self)
        self._parked: Any = self.__dict__["_lookup_queue"]
        self.__dict__["_lookup_queue"] = _StepBatches(self)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._present(keys)


class _StepBatches:
    """Where vLLM's lookup manager posts each step's batch (``put``)."""

    def __init__(self, lookups: _Lookups) -> None:
        self._lookups = lookups

    def put(self, batch: list[tuple[OffloadKey, ReqContext, int]] | None) -> None:
        if batch is None:  # shutdown: release the base class's parked thread
            self._lookups._parked.put(None)
            return
        self._lookups._tier._lookup_step(batch, self._lookups._pending_results)

    def get(self) -> Any:
        """The base class's thread may come here for its next batch if it started after
        the swap: it waits on the parked queue, as it would have."""
        return self._lookups._parked.get()


STEP_WAIT_S = 0.002  # the longest a scheduler step waits for its lookups' answer
LOOKUPS_QUEUED = 4  # steps' batches waiting for the lookup thread, at most
_SEAM = ("_lookup_queue", "_pending_results")  # vLLM's AsyncLookupManager's, replaced/used


def check_lookup_seam(lookups: Any) -> None:
    """The private fields of vLLM's ``AsyncLookupManager`` the tier relies on are there;
    else a ``RuntimeError`` naming them and the versions tierd supports."""
    missing = [name for name in _SEAM if name not in vars(lookups)]
    if missing:
        import vllm

        raise RuntimeError(
            f"tierd's vLLM tier needs vLLM's AsyncLookupManager fields {missing}, which"
            f" vLLM {getattr(vllm, '__version__', '?')} does not have: tierd supports vLLM"
            " 0.33 and vLLM's CPU build 0.32 (docs/vllm.md)"
        )


def live_tiers() -> list[TierdSecondaryTier]:
    """The tiers of this process not yet shut down (for tools and tests: vLLM keeps its
    tiers deep inside its scheduler)."""
    return list(_LIVE)


class TierdSecondaryTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a running ``tierd serve``."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        socket: str | None = None,
        namespace: str | None = None,
        lookup_deadline_s: float = 0.05,
        job_deadline_s: float = 2.0,
        load_deadline_s: float = 0.5,
        breaker_failures: int = 3,
        probe_interval_s: float = 0.5,
        regions: bool = True,
        staging_bytes: int = 64 << 20,
        connect_timeout_s: float = 5.0,
        reconnect_max_s: float = 10.0,
        enable_kv_events: bool = False,
        locality: str | None = None,
        medium: str | None = None,
        server_uids: Sequence[int] = (),
        describe_blocks: bool | None = None,
        kv_events_endpoint: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if unknown:
            bad = sorted(unknown)
            raise ValueError(f"unknown keys in the TierdSecondaryTier config: {bad}, docs/vllm.md")
        self.locality = Locality(locality) if locality is not None else None
        row_bytes = self.block_size_bytes
        if row_bytes <= 0 or primary_kv_view.nbytes % row_bytes:
            raise ValueError(f"vLLM's CPU view has rows of {row_bytes} bytes; cannot use it")
        # One uint8 row per chunk, sharing vLLM's memory (no copy).
        self._rows = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(-1, row_bytes)
        # A given namespace adds to the derived digest: two shapes under one name never meet.
        self.namespace = derive_namespace(offloading_spec, row_bytes, namespace)
        self.socket_path = str(socket) if socket else str(default_socket_path())
        self.settings = LinkSettings(
            self.socket_path,
            self.namespace,
            row_bytes,
            reconnect_max_s,
            tuple(int(uid) for uid in server_uids),
            lookup_deadline_s=lookup_deadline_s,
            job_deadline_s=job_deadline_s,
            load_deadline_s=load_deadline_s,
            breaker_failures=breaker_failures,
            probe_interval_s=probe_interval_s,
        )
        self._link = DaemonLink(
            self.settings,
            name=f"tierd-vllm-{tier_type}",
            map_pool=False,
            logger=engine_log,
            said_at_start=True,
        )
        # Half of staging_bytes for the store thread's connection, half for each load
        # thread's (a thread's connection maps its own on its first job; the pool starts
        # a thread only when every running one is busy, LOAD_THREADS at most).
        per_round = max(1, min(len(self._rows), staging_bytes // 2 // row_bytes))
        self._calls = EngineCalls(
            self._link, "vllm", staging_rows=per_round, map_pool=not regions, regions=regions
        )
        self._describer = describer_for(offloading_spec, describe_blocks, kv_events_endpoint)
        self.report = TierReport(
            Medium(medium) if medium is not None else self.medium,
            self.locality,
            event_config(offloading_spec, enable_kv_events),
        )
        self._events = EventFollower(self._link, self.report)
        self._jobs = Jobs(self._calls, self._describer, self._rows, self._events.following)
        try:
            self._link.call(self._link.client(), connect_timeout_s)
        except BlockSizeMismatch:
            self._link.close()
            raise
        except (TierdError, OSError) as exc:
            refusal = start_refusal(
                exc, self.socket_path, config="TierdSecondaryTier config", engine="the tier"
            )
            if refusal is not None:
                self._link.close()
                raise refusal from exc
            engine_log.warning(missing_daemon(self.socket_path, exc))  # blocks miss till then
        self._asker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierd-lookups")
        self._asking = threading.BoundedSemaphore(LOOKUPS_QUEUED)
        self._lookups = _Lookups(self, tier_type)
        _LIVE.add(self)
        log.info(
            "tierd secondary tier ready",
            socket=self.socket_path,
            namespace=self.namespace,
            connected=self._link.connected,
        )

    # -- lookups ----------------------------------------------------------------------

    def _present(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Ask the daemon, waiting at most the lookup deadline (nothing at all while the
        breaker is open); no answer is a miss."""
        try:
            return self._calls.present([bytes(k) for k in keys], self.settings.lookup_deadline_s)
        except (TierdError, OSError):
            return [False] * len(keys)

    def _lookup_step(
        self, batch: list[tuple[OffloadKey, ReqContext, int]], results: _Results
    ) -> None:
        """One step's lookups (unique keys): one request from the lookup thread, answered
        into ``results``; the step waits for it at most :data:`STEP_WAIT_S`."""

        def answer(found: list[bool]) -> None:
            results.put([(k, gen, hit) for (k, _, gen), hit in zip(batch, found, strict=True)])

        keys = [key for key, _, _ in batch]
        if not self._link.breaker.allow():
            answer([False] * len(keys))  # unsent: misses now, as an open breaker answers
            return
        if not self._asking.acquire(blocking=False):
            answer([False] * len(keys))  # the daemon is behind on earlier steps' lookups
            return
        try:
            future = self._asker.submit(self._present, keys)
        except RuntimeError:  # shut down meanwhile
            self._asking.release()
            answer([False] * len(keys))
            return

        def done(f: concurrent.futures.Future[list[bool]]) -> None:
            self._asking.release()
            answer(
                f.result() if not f.cancelled() and f.exception() is None else [False] * len(keys)
            )

        future.add_done_callback(done)
        concurrent.futures.wait([future], timeout=STEP_WAIT_S)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Forward to the daemon's touch (one admission use per key); sent, not waited
        for (nothing at all while the breaker is open)."""
        if keys:
            with contextlib.suppress(TierdError, OSError):  # unreachable: nothing to touch
                self._calls.touch([bytes(k) for k in keys], self.settings.lookup_deadline_s)

    # -- jobs -------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job: TransferJob, *, is_load: bool) -> None:
        keys = tuple(job.keys)
        if not is_load:
            self.report.storing(keys)
        self._jobs.submit(job.job_id, keys, [int(c) for c in job.chunk_ids], is_load=is_load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [self._result(done) for done in self._jobs.finished()]

    def _result(self, done: Done) -> JobResult:
        success = len(done.ok_keys) == len(done.keys)
        self.report.job(done.is_load, done.keys, done.ok_keys, done.error)
        if done.is_load and not success:
            ok = set(done.ok_keys)
            self._lookups.mark_miss([k for k in done.keys if k not in ok])
        return JobResult(
            job_id=done.job_id,
            success=success,
            successful_keys=done.ok_keys if done.is_load and not success and done.ok_keys else None,
            transfer_time=done.elapsed_s,
            transfer_bytes=len(done.ok_keys) * self.block_size_bytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        """Wait for every submitted job; never on a daemon that does not answer
        (:meth:`~tierd.integrations.vllm.tier_jobs.Jobs.drain`)."""
        self._jobs.drain()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.report.take_events()

    def shutdown(self) -> None:
        _LIVE.discard(self)
        self.drain_jobs()
        self._lookups.shutdown()
        self._asker.shutdown(wait=False, cancel_futures=True)
        self._calls.close()
        self._link.close()
        self._describer.close()
        # Let go of every view of vLLM's rows (ours, the jobs', the base class's): an
        # array over them keeps vLLM's mapping exported, unclosable.
        self._jobs.release()
        self._rows = np.empty((0, self._rows.shape[1]), dtype=np.uint8)
        self._primary_kv_view = memoryview(b"")

    # -- figures ----------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return TierReport.definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        connected = self._link.connected or self._calls.channel.connected
        return self.report.stats(connected=connected, breaker_open=self._link.breaker.is_open)

    def config_info(self) -> dict[str, str | int | float | bool]:
        return {}
