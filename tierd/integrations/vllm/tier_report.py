"""What ``TierdSecondaryTier`` reports to vLLM: per-engine figures and KV events.

Figures are this engine's own, so that a dashboard summing over engines adds up: blocks
it stored into tierd, blocks it loaded back (its hits: a lookup that finds a block is not
a hit until the block is loaded), failed jobs, and two gauges, connected and breaker open.
Daemon-wide figures (blocks held per tier, the daemon's hits) are not exported here: every
engine would export the same value and a sum over engines would count it N times; the
daemon exports them once (``tierd metrics``, docs/metrics.md).

A failed job (a load that did not fill every row, a store the daemon did not take
whole) is also a warning, at most one per kind every :data:`WARN_EVERY_S` (the next one
says how many failed meanwhile): a load that fails is a prefix vLLM recomputes, and an
operator must see that without turning on debug logs.

Events (vLLM's ``enable_kv_events``): *stored* for every block of a successful store job,
*removed* when the daemon's event stream says a block this engine stored left its last
tier (:class:`~tierd.integrations.core.residency.Residency`), both with the tier's configured
medium and locality.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
)

from tierd.client import Client
from tierd.errors import TierdError
from tierd.integrations.core.link import DaemonLink
from tierd.integrations.core.residency import Residency
from tierd.logs import get_logger

__all__ = [
    "EventFollower",
    "METRIC_BREAKER_OPEN",
    "METRIC_CONNECTED",
    "METRIC_FAILED",
    "METRIC_LOADED",
    "METRIC_STORED",
    "TierReport",
    "WARN_EVERY_S",
]

log = get_logger("tierd.integrations.vllm")
WARN_EVERY_S = 30.0  # at most one failed-job warning per kind this often

METRIC_STORED = "vllm:kv_offload_tierd_blocks_stored"
METRIC_LOADED = "vllm:kv_offload_tierd_blocks_loaded"
METRIC_FAILED = "vllm:kv_offload_tierd_failed_jobs"
METRIC_CONNECTED = "vllm:kv_offload_tierd_connected"
METRIC_BREAKER_OPEN = "vllm:kv_offload_tierd_breaker_open"


# What a failed job's warning says, by kind (a load: True): its event, the field naming
# how many blocks moved, the error when the daemon gave none, and what vLLM does then.
_FAILED = {
    True: (
        "tierd load failed",
        "loaded",
        "the daemon did not hold every block",
        "vLLM recomputes the blocks not loaded",
    ),
    False: (
        "tierd store failed",
        "stored",
        "the daemon did not take every block",
        "vLLM keeps its own copy; tierd does not hold these blocks",
    ),
}


class TierReport:
    """Counters since the last ``stats`` and events since the last ``take_events``."""

    def __init__(self, medium: Medium, locality: Locality | None, events: bool) -> None:
        self.medium = medium
        self.locality = locality
        self.residency = Residency() if events else None
        self._counts = {METRIC_STORED: 0, METRIC_LOADED: 0, METRIC_FAILED: 0}
        self._stored: list[list[OffloadKey]] = []
        self._warned: dict[bool, float] = {}  # per kind (is_load), when last said
        self._unsaid: dict[bool, int] = {}  # per kind, failures since then not said
        self._lock = threading.Lock()

    @staticmethod
    def definitions() -> dict[str, OffloadingMetricMetadata]:
        return {
            METRIC_STORED: OffloadingCounterMetadata("Blocks this engine stored into tierd"),
            METRIC_LOADED: OffloadingCounterMetadata(
                "Blocks this engine loaded from tierd (its hits)"
            ),
            METRIC_FAILED: OffloadingCounterMetadata("tierd store/load jobs that failed"),
            METRIC_CONNECTED: OffloadingGaugeMetadata("1 while the tierd daemon is connected"),
            METRIC_BREAKER_OPEN: OffloadingGaugeMetadata(
                "1 while the tierd breaker is open (lookups miss, jobs fail at once)"
            ),
        }

    def storing(self, keys: Sequence[OffloadKey]) -> None:
        """A store job of ``keys`` is about to start (before its first round: a removal
        of one of them while it runs must not be missed); :meth:`job` ends it."""
        if self.residency is not None:
            self.residency.storing(bytes(k) for k in keys)

    def job(
        self,
        is_load: bool,
        keys: Sequence[OffloadKey],
        ok: Sequence[OffloadKey],
        error: str | None = None,
    ) -> None:
        """A finished job: ``ok`` the keys it moved (``error``: why not the rest)."""
        with self._lock:
            self._counts[METRIC_LOADED if is_load else METRIC_STORED] += len(ok)
            if len(ok) != len(keys):
                self._counts[METRIC_FAILED] += 1
            if not is_load and ok and self.residency is not None:
                self._stored.append(list(ok))
        if not is_load and self.residency is not None:
            self.residency.ended([bytes(k) for k in keys], [bytes(k) for k in ok])
        if len(ok) != len(keys):
            self._warn(is_load, len(keys), len(ok), error)

    def _warn(self, is_load: bool, keys: int, moved: int, error: str | None) -> None:
        """Say that a job failed, unless one of its kind was said recently."""
        now = time.monotonic()
        with self._lock:
            last = self._warned.get(is_load)
            if last is not None and now - last < WARN_EVERY_S:
                self._unsaid[is_load] = self._unsaid.get(is_load, 0) + 1
                return
            self._warned[is_load] = now
            unsaid = self._unsaid.pop(is_load, 0)
        event, moved_as, default, consequence = _FAILED[is_load]
        log.warning(
            event,
            keys=keys,
            **{moved_as: moved},
            error=error or default,
            failed_unsaid=unsaid,
            consequence=consequence,
        )

    def take_events(self) -> list[OffloadingEvent]:
        if self.residency is None:
            return []
        with self._lock:
            stored, self._stored = self._stored, []
        events = [self._event(keys, removed=False) for keys in stored]
        gone = self.residency.take_gone()
        if gone:
            events.append(self._event([OffloadKey(k) for k in gone], removed=True))
        return events

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=self.medium, removed=removed, locality=self.locality
        )

    def stats(self, *, connected: bool, breaker_open: bool) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        with self._lock:
            for name, value in self._counts.items():
                if value:
                    stats.increase_counter(name, value)
                self._counts[name] = 0
        stats.set_gauge(METRIC_CONNECTED, int(connected))
        stats.set_gauge(METRIC_BREAKER_OPEN, int(breaker_open))
        return stats


def event_config(spec: Any, enabled: bool) -> bool:
    """Events are emitted when the tier asks for them and vLLM's KV events are on."""
    events = getattr(spec, "kv_events_config", None)
    return enabled and getattr(events, "enable_kv_cache_events", False) is True


class EventFollower:
    """Follows the daemon's event stream into ``report``'s residency (which of this
    engine's blocks the daemon still holds), on the link's connection: subscribed on
    each new connection, before any job goes on it. Nothing when events are off."""

    def __init__(self, link: DaemonLink, report: TierReport) -> None:
        self._link = link
        self._report = report
        self._subscription: asyncio.Future[Any] | None = None  # the link's loop's only
        self._followed: Client | None = None  # the connection whose events are read
        self._reader: asyncio.Future[None] | None = None  # the link's loop's only
        if report.residency is not None:
            link.on_connect.append(self._watch)

    def _watch(self, client: Client) -> None:
        """On each new connection (on the link's loop): follow the daemon's events. The
        subscription goes out now, ahead of any job on the connection, so that no event
        of this engine's blocks is missed (a removal of a block whose storing went
        unseen would be taken for its last)."""
        self._subscription = client.send("subscribe")
        self._followed = client
        self._reader = asyncio.ensure_future(self._read(client))

    def following(self, deadline_s: float) -> None:
        """Before a store (on any thread): the link follows the daemon's events, its
        subscription answered, so no event of the store's blocks is missed. A link found
        lost reconnects (and subscribes) now. Never fails the store."""
        subscription = self._subscription
        if self._report.residency is None:
            return
        if self._followed is not None and subscription is not None and subscription.done():
            return  # followed: its reader runs (it forgets the client when the stream ends)

        async def follow() -> None:
            await self._link.run(lambda c: c.health())
            if self._subscription is not None:
                await asyncio.shield(self._subscription)

        with contextlib.suppress(TierdError, OSError):
            self._link.call(follow(), deadline_s)

    async def _read(self, client: Client) -> None:
        residency = self._report.residency
        if residency is None:
            return
        try:
            with contextlib.suppress(TierdError, OSError):  # the connection ended: so do we
                tiers = (await client.stats()).get("tiers", [])
                if tiers:
                    residency.bottom = str(tiers[-1].get("name"))
                async for push in client.events():
                    residency.on_push(push)
        finally:
            if self._followed is client:
                self._followed = None
