"""The scheduler's side of tierd's pool as vLLM's CPU tier: vLLM's ``OffloadingManager``
whose decisions are the daemon's (:class:`~tierd.integrations.core.pool_leases.PoolLeases`).

- **lookup** answers RETRY for a key it has not asked about yet; the step's keys go to
  the daemon when the step ends, as one pin request per request and KV group, sent
  without waiting (``prepare_load``, ``wait_s: 0``). A later step finds the answers: the
  leading keys the daemon pinned are HITs (their rows stay pinned from then on, so the
  HIT still holds when vLLM loads it), the rest MISSes. No scheduler step waits on the
  daemon for a lookup; an answer not come within ``load_deadline_s`` is a miss.
- **prepare_load** hands vLLM the pinned rows (no round trip); **complete_load** (vLLM's
  workers are done) unpins them. A request that ends without loading unpins at once.
- **prepare_store** reserves rows (one round trip, at most ``job_deadline_s``); vLLM's
  workers fill them and **complete_store** commits them: only then are they visible to
  other engines. Keys the daemon holds or another engine is writing are not stored again.
- **events**: a stored event for each block this engine's store committed, a removed
  event when the daemon lets one of them go (its event stream), medium ``CPU``.
- **descriptions**: with vLLM's KV events published through zmq, each committed store's
  blocks are described to the daemon (what they are in the engine's terms:
  :mod:`tierd.integrations.vllm.block_descriptions`), from a thread of its own, so that the daemon's
  KV events announce them, fully described, to routers and to every engine's stream
  (:mod:`tierd.integrations.vllm.connector`). At most :data:`DESCRIBING` stores wait to be
  described; past it a store goes undescribed (counted by the describer as unknown).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tierd.errors import TierdError
from tierd.integrations.core.link import BlockSizeMismatch, DaemonLink
from tierd.integrations.core.one_flag import missing_daemon
from tierd.integrations.core.params import start_refusal
from tierd.integrations.core.pool_leases import Asked, NoPool, PoolLeases, Rows
from tierd.integrations.vllm.block_descriptions import describer_for
from tierd.integrations.vllm.tier_report import EventFollower, TierReport, event_config
from tierd.logs import get_logger

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

__all__ = ["TierdPoolManager", "TierdRowsSpec", "live_managers"]

log = get_logger("tierd.integrations.vllm")
engine_log = logging.getLogger("vllm.tierd")  # vLLM's own format and level

_FENCE_STEPS = 2  # after a reset, steps until vLLM's workers are done with flushed jobs
DESCRIBING = 64  # committed stores waiting to be described, at most
_LIVE: weakref.WeakSet[TierdPoolManager] = weakref.WeakSet()


def live_managers() -> list[TierdPoolManager]:
    """The managers of this process not yet shut down (for tools and tests: vLLM keeps
    them deep inside its scheduler)."""
    return list(_LIVE)


class TierdRowsSpec(CPULoadStoreSpec):  # type: ignore[misc]
    """Rows of tierd's pool: ``block_ids`` are the pool's slots, in the pool ``pool``
    (the daemon's name for it: a restarted daemon has another)."""

    def __init__(self, block_ids: Sequence[int], pool: str) -> None:
        super().__init__(list(block_ids))
        self.pool = pool

    def __repr__(self) -> str:
        return f"TierdRowsSpec({self.pool}, {self.block_ids!r})"


@dataclass(slots=True, eq=False)
class _Request:
    """One request's lookups: keys pinned (HIT), missed, asked about, to ask about."""

    pinned: dict[bytes, tuple[Rows, int]] = field(default_factory=dict)
    missed: set[bytes] = field(default_factory=set)
    queued: dict[bytes, None] = field(default_factory=dict)  # to ask at the step's end
    asking: set[bytes] = field(default_factory=set)
    rows: list[Rows] = field(default_factory=list)  # the pin leases it holds
    loading: bool = False  # a load job of its rows is under way
    finished: bool = False


class TierdPoolManager(OffloadingManager):  # type: ignore[misc]
    """vLLM's CPU-tier manager whose decisions are the daemon's (module docstring)."""

    def __init__(self, spec: Any) -> None:
        """``spec``: the engine's :class:`~tierd.integrations.vllm.pool_spec.TierdPoolSpec`."""
        self.spec = spec
        self.settings = spec.settings()
        self.namespace = self.settings.namespace
        self.socket_path = self.settings.socket_path
        self._link = DaemonLink(
            self.settings,
            name="tierd-vllm-pool",
            map_pool=False,
            logger=engine_log,
            said_at_start=True,
        )
        self.report = TierReport(
            Medium.CPU, None, event_config(spec, spec.options.enable_kv_events)
        )
        self._events = EventFollower(self._link, self.report)
        self._leases = PoolLeases(self._link)
        self._requests: dict[str, _Request] = {}
        self._asks: dict[Asked, str] = {}  # pin requests under way, by whose
        self._storing: dict[frozenset[bytes], Rows] = {}  # reservations vLLM fills
        self._fences: list[list[Any]] = []  # [steps left, pins, reservations] after a reset
        self._polled = False  # the answers come so far are taken this step
        self._describer = describer_for(spec, None)  # on: vLLM's events go out through zmq
        self._describing: ThreadPoolExecutor | None = None
        self._waiting = threading.BoundedSemaphore(DESCRIBING)
        if self._describer.book is not None:
            self._describing = ThreadPoolExecutor(1, thread_name_prefix="tierd-vllm-describe")
        self._check_daemon()
        _LIVE.add(self)
        log.info("tierd pool tier ready", socket=self.socket_path, namespace=self.namespace)

    def _check_daemon(self) -> None:
        """At start-up: a daemon that answers must serve this engine's rows from a pool
        (else vLLM stops here, saying what to change); one that does not answer is a
        warning, and every lookup misses until it does."""
        timeout = self.spec.options.connect_timeout_s
        try:
            self._link.call(self._link.client(), timeout)
            self._leases.line(_after(timeout))
        except (BlockSizeMismatch, NoPool) as exc:
            self._close()
            message = f"tierd at {self.socket_path} cannot be vLLM's CPU tier: {exc}"
            raise ValueError(message) from exc
        except (TierdError, OSError) as exc:
            refusal = start_refusal(
                exc, self.socket_path, config="tierd pool config", engine="the engine"
            )
            if refusal is not None:
                self._close()
                raise refusal from exc
            engine_log.warning(missing_daemon(self.socket_path, exc))

    # -- lookups ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._polled:
            self._collect()
        request = self._requests.setdefault(req_context.req_id, _Request())
        name = bytes(key)
        if name in request.pinned:
            return LookupResult.HIT
        if name in request.missed:
            return LookupResult.MISS
        if name not in request.asking:
            request.queued[name] = None
        return LookupResult.RETRY

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return CacheHitSource.HOST  # pinned in the pool, tierd's host memory

    def on_schedule_end(self, context: Any = None) -> None:
        """The step's lookups go to the daemon (never waited for); fences move on."""
        self._collect()
        batches: list[list[bytes]] = []
        owners: list[str] = []
        for req_id, request in self._requests.items():
            if request.queued:
                for keys in _by_group(list(request.queued)):
                    batches.append(keys)
                    owners.append(req_id)
                request.asking.update(request.queued)
                request.queued.clear()
        if batches:
            asked = self._leases.ask(batches)
            if len(asked) == len(batches):
                self._asks.update(zip(asked, owners, strict=True))
            else:  # nothing was sent (the daemon unreachable, the breaker open): misses
                for keys, req_id in zip(batches, owners, strict=True):
                    request = self._requests[req_id]
                    request.asking.difference_update(keys)
                    request.missed.update(keys)
        self._polled = False
        self._step_fences()

    def _collect(self) -> None:
        """Take the pin answers come so far, and the commits' results."""
        self._polled = True
        if self._asks:
            for asked, rows in self._leases.answers(list(self._asks)).items():
                self._answered(self._asks.pop(asked), asked, rows)
        for rows, stored in self._leases.committed():
            self.report.job(False, _keys(rows.keys), _keys(rows.keys if stored else []))

    def _answered(self, req_id: str, asked: Asked, rows: Rows | None) -> None:
        request = self._requests.get(req_id)
        if request is None or request.finished:
            if rows is not None:
                self._leases.release(rows)
            return
        request.asking.difference_update(asked.keys)
        got = 0
        if rows is not None:
            if request.rows and request.rows[0].pool != rows.pool and not request.loading:
                self._unpin(request)  # pins in a restarted daemon's old pool: asked again
            request.rows.append(rows)
            for key, slot in zip(rows.keys, rows.slots, strict=True):
                request.pinned[key] = (rows, slot)
            got = len(rows.keys)
        request.missed.update(asked.keys[got:])

    def _unpin(self, request: _Request) -> None:
        for rows in request.rows:
            self._leases.release(rows)
        request.rows.clear()
        request.pinned.clear()

    # -- loads ------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        request = self._requests[req_context.req_id]
        held = [request.pinned.get(bytes(key)) for key in keys]
        found = [h for h in held if h is not None]
        pools = {rows.pool for rows, _ in found}
        if len(found) != len(held) or len(pools) > 1:
            raise RuntimeError(
                "vLLM loads blocks tierd did not pin for this request (a lookup it never"
                " answered HIT): please report this with vLLM's version"
            )
        request.loading = True
        return TierdRowsSpec([slot for _, slot in found], pools.pop() if pools else "")

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        request = self._requests.get(req_context.req_id)
        if request is None:
            return
        request.loading = False
        self.report.job(True, list(keys), list(keys))
        self._unpin(request)
        if request.finished:
            self._requests.pop(req_context.req_id, None)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # vLLM's connector never touches; the daemon's loads and stores do

    # -- stores -----------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        names = [bytes(key) for key in keys]
        self._events.following(self.settings.job_deadline_s)
        rows = self._leases.reserve(names)
        if rows is None:  # no room now (the pool pinned full): vLLM asks again later
            return None
        if rows.lease is not None:
            self._storing[frozenset(rows.keys)] = rows
            self.report.storing(_keys(rows.keys))
        return PrepareStoreOutput(
            keys_to_store=_keys(rows.keys),
            store_spec=TierdRowsSpec(rows.slots, rows.pool),
            evicted_keys=[],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        rows = self._storing.pop(frozenset(bytes(key) for key in keys), None)
        if rows is not None:
            self._leases.commit(rows, success)
            if success:
                self._describe_soon(list(rows.keys))

    def _describe_soon(self, names: list[bytes]) -> None:
        """Describe a committed store's blocks, off the scheduler's thread."""
        if self._describing is None or not self._waiting.acquire(blocking=False):
            if self._describing is not None:
                self._describer.unknown += len(names)
            return
        try:
            self._describing.submit(self._describe, names)
        except RuntimeError:  # shut down meanwhile
            self._waiting.release()

    def _describe(self, names: list[bytes]) -> None:
        deadline_s = self.settings.job_deadline_s + self.settings.lookup_deadline_s
        try:
            self._describer.describe(lambda k, b: self._send_description(k, b, deadline_s), names)
        except (TierdError, OSError):
            self._describer.refused += len(names)
        finally:
            self._waiting.release()

    def _send_description(self, keys: list[bytes], blocks: list[bytes], deadline_s: float) -> None:
        future = self._link.start(
            lambda c: c.request("describe", keys=keys, blocks=blocks), deadline_s
        )
        future.result(deadline_s + 1.0)

    # -- requests ---------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._requests.setdefault(req_context.req_id, _Request())
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        request = self._requests.get(req_context.req_id)
        if request is None:
            return
        request.finished = True
        request.queued.clear()
        if not request.loading:  # its load's end unpins it, and forgets it
            self._unpin(request)
            self._requests.pop(req_context.req_id, None)

    # -- reset, events, figures -------------------------------------------------------

    def reset_cache(self) -> None:
        """vLLM's ``reset_prefix_cache``: forget this engine's lookups and jobs. The pool
        is the node's, other engines' blocks in it: nothing in it is deleted. vLLM
        discards the jobs in flight, never completing them, while its workers may still
        copy them: their rows are released (pins) or given back (reservations) after
        the workers are done (:data:`_FENCE_STEPS` steps, or vLLM's
        ``on_reset_flushed``)."""
        pins: list[Rows] = []
        for request in self._requests.values():
            if request.loading:
                pins += request.rows
                request.rows, request.pinned, request.loading = [], {}, False
            else:
                self._unpin(request)
            request.missed.clear()
        stores = list(self._storing.values())
        self._storing.clear()
        self._fences.append([_FENCE_STEPS, pins, stores])

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every job in flight at the reset has been reported by the workers."""
        for fence in self._fences:
            fence[0] = 0
        self._step_fences(advance=False)

    def _step_fences(self, advance: bool = True) -> None:
        left = []
        for fence in self._fences:
            if advance:
                fence[0] -= 1
            if fence[0] > 0:
                left.append(fence)
                continue
            for rows in fence[1]:
                self._leases.release(rows)
            for rows in fence[2]:
                self._leases.commit(rows, False)
        self._fences = left

    def has_pending_work(self) -> bool:
        return bool(self._asks or self._fences)

    def take_events(self) -> Iterable[OffloadingEvent]:
        for rows, stored in self._leases.committed():
            self.report.job(False, _keys(rows.keys), _keys(rows.keys if stored else []))
        return self.report.take_events()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.report.stats(
            connected=self._leases.connected, breaker_open=self._link.breaker.is_open
        )

    def config_info(self) -> dict[str, str | int | float | bool]:
        return {}

    def shutdown(self) -> None:
        self._close()

    def _close(self) -> None:
        _LIVE.discard(self)
        if self._describing is not None:
            self._describing.shutdown(wait=False, cancel_futures=True)
        self._describer.close()
        self._leases.close()
        self._link.close()


def _by_group(keys: list[bytes]) -> list[list[bytes]]:
    """``keys`` by KV group (an offload key ends with its group's index, 4 bytes), each
    in the order given: the daemon pins a leading run per group."""
    groups: dict[bytes, list[bytes]] = {}
    for key in keys:
        groups.setdefault(key[-4:], []).append(key)
    return list(groups.values())


def _keys(names: Iterable[bytes]) -> list[OffloadKey]:
    return [OffloadKey(name) for name in names]


def _after(seconds: float) -> float:
    import time

    return time.monotonic() + seconds
