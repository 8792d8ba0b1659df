"""What every session of one server shares: the tenants, the limits, the counters.

The composition root (the daemon) builds a :class:`ServerContext` from plain values; no
config model reaches this layer. Sessions read limits from it and report to its
counters; ``stats``/``metrics``/``health`` replies are built here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from tierd.control.figures.namespaces import namespace_rows
from tierd.control.figures.prometheus import render_prometheus
from tierd.control.figures.recorder import TraceRecorder
from tierd.control.figures.stats import collect_stats, merge_stats
from tierd.control.figures.timing import RequestTiming
from tierd.control.protocol import NAMESPACE_ID_BYTES, PROTOCOL_VERSION, ErrorCode
from tierd.control.state.copy_threads import FairThreads, TenantJobs
from tierd.control.state.tenant_table import Grant, PoolInfo, Tenant, TenantTable
from tierd.keys import MAX_KEY_BYTES
from tierd.version import __version__

if TYPE_CHECKING:
    from tierd.kvevents.feed import EventFeed

__all__ = ["Limits", "PoolInfo", "ServerContext"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request and per-server bounds (the config's ``limits`` section)."""

    max_frame_bytes: int = 64 << 20
    max_keys_per_request: int = 4096
    max_connections: int = 1024
    max_requests_in_flight: int = 256  # per connection; reading pauses beyond it
    event_queue_batches: int = 1024
    hello_timeout_s: float = 5.0  # a connection that has not said hello by then is closed
    frame_deadline_s: float = 30.0  # a started frame must complete within this (while read)
    partial_frame_bytes: int = 256 << 20  # unfinished frames, all connections together
    output_buffer_bytes: int = 16 << 20  # unsent replies (and reserved ones) per connection
    output_stall_s: float = 60.0  # replies left unread this long close the connection
    store_lease_ttl_s: float = 30.0  # a store lease not finished by then is aborted
    load_wait_s: float = 5.0  # a load waits this long at most on another client's store
    region_jobs_per_tenant: int = 8  # region jobs of one tenant run at once; others wait


@dataclass(slots=True)
class ServerContext:
    """Shared state of one server. ``check_namespace`` returns a problem or ``None``."""

    tenants: TenantTable
    limits: Limits = field(default_factory=Limits)
    config: dict[str, Any] = field(default_factory=dict)
    check_namespace: Callable[[str], str | None] = lambda name: None
    request_stop: Callable[[], None] | None = None  # the ``stop`` operation; None: refused
    # The ``reload`` operation (reads the file off the loop); None: refused.
    reload: Callable[[], Awaitable[dict[str, Any]]] | None = None
    namespaces_top: int = 20  # namespaces with labels of their own in the metrics
    recorder: TraceRecorder | None = None  # live traffic to a trace; None: not configured
    kv_feed: EventFeed | None = None  # KV events for routers; None: kv_events is off
    shutting_down: bool = False
    connections: int = 0
    requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # connections, by reason
    dropped: Counter[str] = field(default_factory=Counter)  # closed by a guard, by reason
    started: float = field(default_factory=time.monotonic)
    timing: RequestTiming = field(default_factory=RequestTiming)
    copy_threads: FairThreads = field(default_factory=FairThreads)  # region jobs' copies
    region_jobs: TenantJobs = field(init=False)  # their turns, per tenant
    # Every live connection's lease book (a :class:`~tierd.control.requests.leases.Leases` adds
    # itself when made and leaves when closed): the ``leases`` figure of ``stats``.
    lease_books: set[Sized] = field(default_factory=set)
    _next_lease: int = 0

    def __post_init__(self) -> None:
        self.region_jobs = TenantJobs(lambda: self.limits.region_jobs_per_tenant)

    @property
    def default_block_bytes(self) -> int:
        """The configured block size (what a connection of no tenant is told)."""
        return self.tenants.tenants[0].chain.block_bytes

    @property
    def max_keys(self) -> int:
        return self.limits.max_keys_per_request

    @property
    def max_key_bytes(self) -> int:
        return MAX_KEY_BYTES - NAMESPACE_ID_BYTES

    @property
    def event_queue_batches(self) -> int:
        return self.limits.event_queue_batches

    def namespace_id(self, name: str) -> bytes:
        """The 8-byte prefix of a namespace's keys: stable across restarts."""
        return xxhash.xxh3_64_digest(name.encode())

    def new_lease_id(self) -> int:
        self._next_lease += 1
        return self._next_lease

    def count_error(self, code: ErrorCode) -> None:
        self.errors[str(code)] += 1

    def hello_fields(self, prefix: bytes, tenant: Tenant | None) -> dict[str, Any]:
        """The hello reply: the block size, the tenant's own tiers and pool."""
        chain = tenant.chain if tenant is not None else None
        return {
            "server": f"tierd {__version__}",
            "protocol": PROTOCOL_VERSION,
            "block_bytes": chain.block_bytes if chain is not None else self.default_block_bytes,
            "tenant": tenant.name if tenant is not None else None,
            # Block sizes the tenant may serve at once (block_sizes): above 1, a hello
            # naming its own size is served at it.
            "block_sizes": tenant.sizes.limit if tenant is not None and tenant.sizes else 1,
            "tiers": [
                {
                    "name": level.tier.name,
                    "medium": str(level.medium),
                    "policy": level.tier.policy.name,
                    "capacity": level.tier.num_blocks,
                }
                for level in (chain.levels if chain is not None else [])
            ],
            "entry": chain.levels[chain.entry].tier.name if chain is not None else None,
            "pool": tenant.pool.to_dict() if tenant is not None and tenant.pool else None,
            "namespace_id": prefix.hex(),
            "max_frame_bytes": self.limits.max_frame_bytes,
            "max_keys_per_request": self.limits.max_keys_per_request,
            "max_key_bytes": self.max_key_bytes,
            "store_lease_ttl_s": self.limits.store_lease_ttl_s,
            # Blocks this connection may hold in open leases at once (0: no tenant).
            "max_lease_blocks": (
                min(tenant.max_held_per_connection, tenant.max_held) if tenant else 0
            ),
        }

    def server_fields(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "connections": self.connections,
            "requests": self.requests,
            "errors": dict(self.errors),
            "refused": dict(self.refused),
            "dropped": dict(self.dropped),
            "leases": sum(len(book) for book in self.lease_books),
            "subscribers": sum(chain.bus.subscriber_count for chain in self.tenants.chains()),
            "shutting_down": self.shutting_down,
        }

    def stats(self, grant: Grant | None = None, *, namespaces: bool = False) -> dict[str, Any]:
        """Every tenant's tiers added up, and each tenant's own (for an operator, or
        ``grant=None``: the daemon itself); a member sees its own tenant only. With
        ``namespaces``, each tenant's part lists its namespaces (a pass over every tier's
        index: asked for, not on every stats request)."""
        if grant is not None and not grant.operator and grant.tenant is not None:
            tenant = grant.tenant
            own = self._tenant_stats(tenant, namespaces)
            return {**own, "tenant": tenant.name, "server": self.server_fields()}
        each = {
            tenant.name: self._tenant_stats(tenant, namespaces) for tenant in self.tenants.tenants
        }
        merged = merge_stats(list(each.values()))
        out = {**merged, "tenants": each, "server": self.server_fields()}
        if self.kv_feed is not None:
            out["kv_events"] = self.kv_feed.stats()
        return out

    @staticmethod
    def _tenant_stats(tenant: Tenant, namespaces: bool) -> dict[str, Any]:
        """A tenant's figures; one that serves several block sizes has them added up,
        and each size's own under ``block_sizes`` (by size)."""
        sizes = tenant.each_size()
        if len(sizes) == 1:
            own = _sized_stats(tenant, namespaces)
        else:
            each = {sized.block_bytes: _sized_stats(sized, False) for sized in sizes}
            own = merge_stats(list(each.values()))
            own["block_sizes"] = {str(size): part for size, part in each.items()}
            if namespaces:
                own["namespaces"] = namespace_rows(tenant.book, *(s.chain for s in sizes))
        if tenant.sizes is not None:  # which size holds a share, and how used
            own["sizes"] = tenant.size_report()
        return own

    def metrics(self) -> str:
        return render_prometheus(
            self.stats(namespaces=True), self.timing.collectors(), top=self.namespaces_top
        )

    def health(self) -> dict[str, Any]:
        """Whether the daemon serves: ``status`` ``ok``, ``stopping``, or ``unhealthy`` when
        a remote level does not work (its breaker open, its writes all refused, an S3
        server that does not keep objects write-once); ``remote`` says per level."""
        remote = self.remote_health()
        status = "ok" if all(line["ok"] for line in remote) else "unhealthy"
        return {
            "status": "stopping" if self.shutting_down else status,
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "connections": self.connections,
            "remote": remote,
        }

    def remote_health(self) -> list[dict[str, Any]]:
        """Each remote level's health, over every tenant's chain (one line per level)."""
        by_name: dict[str, dict[str, Any]] = {}
        for chain in self.tenants.chains():
            if chain.remote is None:
                continue
            for line in chain.remote.level.health():
                seen = by_name.setdefault(
                    line["name"], {"name": line["name"], "ok": True, "problems": [], "notes": []}
                )
                seen["ok"] = seen["ok"] and line["ok"]
                for key in ("problems", "notes"):
                    seen[key] += [text for text in line[key] if text not in seen[key]]
        return list(by_name.values())


def _sized_stats(tenant: Tenant, namespaces: bool) -> dict[str, Any]:
    own = {**collect_stats(tenant.chain), "leases": tenant.counters()}
    if namespaces:
        own["namespaces"] = namespace_rows(tenant.book, tenant.chain)
    return own
