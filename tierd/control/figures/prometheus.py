"""The daemon's figures as Prometheus text.

:func:`render_prometheus` turns a stats snapshot (:mod:`tierd.control.figures.stats`), with the
server's own ``server`` section, into the text exposition format through
prometheus-client, so names and escaping follow the format exactly, together with the
server's latency histograms (:mod:`tierd.control.figures.timing`). Every family is documented in
``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["OTHER", "render_prometheus", "top_namespaces"]


_TIER_METRICS = [
    ("capacity", "capacity_blocks", "Slots in the tier", False),
    ("used", "used_blocks", "Blocks held (ready or being written)", False),
    ("pinned", "pinned_blocks", "Blocks pinned by loads", False),
    ("writing", "writing_blocks", "Blocks being written", False),
    ("adopting", "adopting_blocks", "Blocks kept across a restart, not adopted yet", False),
    ("quarantined", "quarantined_blocks", "Slots of expired store leases, kept from reuse", False),
    ("hits", "hits", "Block hits served by this tier", True),
    ("misses", "misses", "Looked-up blocks that reached this tier and were not there", True),
    ("stores", "stores", "Blocks stored", True),
    ("evictions", "evictions", "Blocks evicted", True),
    ("demotions", "demotions", "Blocks copied down on eviction", True),
    ("written_behind", "written_behind", "Blocks copied down behind stores (write_behind)", True),
    ("promotions", "promotions", "Blocks copied up into this tier", True),
    ("dropped", "dropped", "Dirty blocks lost at eviction", True),
    ("refused", "refused", "Demotions into this tier refused (admission or room)", True),
    ("io_errors", "io_errors", "Blocks whose copy in or out failed", True),
]


_TENANT_METRICS = [
    ("leases_held_blocks", "Blocks a tenant's connections hold in open leases"),
    ("leases_expired", "Store leases aborted for not being committed in time"),
    ("lease_refusals", "Requests refused for a lease bound"),
]


_REMOTE_COUNTERS = [
    ("lookups", "Batched existence checks sent to the remote level"),
    ("lookup_hits", "Block hits lookups found only on the remote level"),
    ("hits", "Blocks read from the remote level and verified"),
    ("misses", "Blocks asked of the remote level and not served"),
    ("stores", "Blocks written to the remote level"),
    ("skipped", "Blocks not written: the server held them already"),
    ("corrupt", "Values that failed a check (deleted, served as misses)"),
    ("malformed", "Replies of the wrong shape (served as misses)"),
    ("busy", "Calls that found no free pooled connection within their deadline"),
    ("errors", "Calls that failed to reach the server"),
    ("timeouts", "Calls past the per-call deadline"),
    ("write_errors", "Blocks the server refused to store"),
    ("dropped", "Blocks not sent: write queue full or breaker open"),
    ("refused", "Calls refused at once by the open circuit breaker"),
    ("breaker_opened", "Times the circuit breaker opened"),
    ("promotions", "Blocks copied from the remote level into a local tier"),
    ("bytes_written", "Bytes written to the remote level"),
    ("bytes_read", "Bytes read from the remote level"),
]


_NAMESPACE_COUNTERS = [
    ("lookups", "Lookups sent by a namespace's clients"),
    ("hit_blocks", "Looked-up blocks of a namespace found in some tier"),
    ("miss_blocks", "Looked-up blocks of a namespace found nowhere"),
    ("stored_blocks", "Blocks a namespace's clients stored"),
]
OTHER = "other"  # the label of every namespace past the top N, added up per tenant


def top_namespaces(
    tenants: dict[str, dict[str, Any]], top: int
) -> list[tuple[str, str, dict[str, Any]]]:
    """(tenant, namespace label, row) for the ``top`` namespaces holding most bytes over
    all tenants, then one ``other`` row per tenant adding up the rest: the metrics'
    label sets stay at most ``top`` + one per tenant, however many namespaces there are.
    A namespace no client named since the names were last saved is ``id:<hex>``."""
    every = [
        (tenant, row)
        for tenant, snapshot in sorted(tenants.items())
        for row in snapshot.get("namespaces", ())
    ]
    every.sort(key=lambda item: (-item[1]["bytes"], item[0], item[1]["id"]))
    out = [(t, row["namespace"] or f"id:{row['id']}", row) for t, row in every[:top]]
    rest: dict[str, list[dict[str, Any]]] = {}
    for tenant, row in every[top:]:
        rest.setdefault(tenant, []).append(row)
    for tenant, rows in sorted(rest.items()):
        blocks: dict[str, int] = {}
        for row in rows:
            for tier, count in row["blocks"].items():
                blocks[tier] = blocks.get(tier, 0) + count
        other = {key: sum(row[key] for row in rows) for key, _ in _NAMESPACE_COUNTERS}
        other.update(blocks=blocks, bytes=sum(row["bytes"] for row in rows))
        out.append((tenant, OTHER, other))
    return out


class _SnapshotCollector(Collector):
    def __init__(self, stats: dict[str, Any], top: int) -> None:
        self._stats = stats
        self._top = top

    def collect(self) -> Iterator[Metric]:
        yield from self._tiers(self._stats["tiers"])
        yield from self._routes(self._stats["routes"])
        if self._stats.get("remote"):
            yield from self._remote(self._stats["remote"])
        chain = self._stats["chain"]
        for key in ("lookups", "hit_blocks", "miss_blocks", "events_published", "events_dropped"):
            yield CounterMetricFamily(f"tierd_{key}", f"Chain {key.replace('_', ' ')}", chain[key])
        server = self._stats.get("server")
        if server is not None:
            yield from self._server(server)
        if self._stats.get("tenants"):
            yield from self._tenants(self._stats["tenants"])
            yield from self._namespaces(self._stats["tenants"])

    def _namespaces(self, tenants: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        if not any("namespaces" in snapshot for snapshot in tenants.values()):
            return
        labels = ["tenant", "namespace"]
        count = GaugeMetricFamily(
            "tierd_namespaces", "Namespaces holding blocks or used", labels=["tenant"]
        )
        for name, snapshot in sorted(tenants.items()):
            # A tenant whose namespaces are folded into one row says how many there are.
            n = snapshot.get("namespace_count", len(snapshot.get("namespaces", ())))
            count.add_metric([name], n)
        blocks = GaugeMetricFamily(
            "tierd_namespace_blocks",
            "Blocks a namespace holds in a tier (top N namespaces by bytes, then 'other')",
            labels=[*labels, "tier"],
        )
        held = GaugeMetricFamily(
            "tierd_namespace_bytes", "Bytes a namespace holds in all tiers", labels=labels
        )
        counters = {
            key: CounterMetricFamily(f"tierd_namespace_{key}", text, labels=labels)
            for key, text in _NAMESPACE_COUNTERS
        }
        for tenant, label, row in top_namespaces(tenants, self._top):
            for tier, n in row["blocks"].items():
                blocks.add_metric([tenant, label, tier], n)
            held.add_metric([tenant, label], row["bytes"])
            for key, family in counters.items():
                family.add_metric([tenant, label], row[key])
        yield from (count, blocks, held, *counters.values())

    def _tenants(self, tenants: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "tierd_tenant_used_blocks", "Blocks a tenant holds", labels=["tenant", "tier"]
        )
        quota = GaugeMetricFamily(
            "tierd_tenant_quota_blocks", "A tenant's quota of a tier", labels=["tenant", "tier"]
        )
        families = {
            key: (GaugeMetricFamily if key == "leases_held_blocks" else CounterMetricFamily)(
                f"tierd_tenant_{key}", text, labels=["tenant"]
            )
            for key, text in _TENANT_METRICS
        }
        labels = ["tenant", "block_bytes", "tier"]
        sized_used = GaugeMetricFamily(
            "tierd_block_size_used_blocks", "Blocks of one block size a tenant holds", labels=labels
        )
        sized_share = GaugeMetricFamily(
            "tierd_block_size_capacity_blocks",
            "A block size's share of a tenant's tier, in blocks of that size",
            labels=labels,
        )
        for name, snapshot in sorted(tenants.items()):
            for tier in snapshot["tiers"]:
                used.add_metric([name, tier["name"]], tier["used"])
                quota.add_metric([name, tier["name"]], tier["capacity"])
            for key, family in families.items():
                family.add_metric([name], snapshot["leases"][key])
            for size, part in snapshot.get("block_sizes", {}).items():  # block_sizes above 1
                for tier in part["tiers"]:
                    sized_used.add_metric([name, size, tier["name"]], tier["used"])
                    sized_share.add_metric([name, size, tier["name"]], tier["capacity"])
        yield from (used, quota, *families.values(), sized_used, sized_share)

    def _tiers(self, tiers: list[dict[str, Any]]) -> Iterator[Metric]:
        for key, suffix, text, counter in _TIER_METRICS:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                f"tierd_tier_{suffix}", text, labels=["tier", "medium"]
            )
            for tier in tiers:
                family.add_metric([tier["name"], tier["medium"]], tier[key])
            yield family

    def _remote(self, remote: dict[str, Any]) -> Iterator[Metric]:
        # A stack: one sample per level; the chain's own counts go with the first level.
        levels = remote.get("levels")
        rows = [{**remote, **levels[0]}, *levels[1:]] if levels else [remote]
        labels = ["remote", "endpoint"]
        families = []
        for key, text in _REMOTE_COUNTERS:
            family = CounterMetricFamily(f"tierd_remote_{key}", text, labels=labels)
            for row in rows:
                family.add_metric([row["name"], row["endpoint"]], row.get(key, 0))
            families.append(family)
        queued = "Bytes queued to write"
        pending = GaugeMetricFamily("tierd_remote_pending_bytes", queued, labels=labels)
        state = GaugeMetricFamily(
            "tierd_remote_breaker_open",
            "1 while the circuit breaker refuses calls (open or probing)",
            labels=labels,
        )
        for row in rows:
            pending.add_metric([row["name"], row["endpoint"]], row["pending_bytes"])
            state.add_metric([row["name"], row["endpoint"]], 0 if row["state"] == "closed" else 1)
        yield from (*families, pending, state)

    def _routes(self, routes: list[dict[str, Any]]) -> Iterator[Metric]:
        moved = CounterMetricFamily("tierd_route_bytes", "Bytes copied", labels=["src", "dst"])
        blocks = CounterMetricFamily("tierd_route_blocks", "Blocks copied", labels=["src", "dst"])
        failed = CounterMetricFamily(
            "tierd_route_failures", "Blocks whose copy failed", labels=["src", "dst"]
        )
        busy = CounterMetricFamily(
            "tierd_route_busy_seconds", "Time with a copy in flight", labels=["src", "dst"]
        )
        for route in routes:
            labels = [route["src"], route["dst"]]
            moved.add_metric(labels, route["bytes"])
            blocks.add_metric(labels, route["blocks"])
            failed.add_metric(labels, route["failures"])
            busy.add_metric(labels, route["busy_s"])
        yield from (moved, blocks, failed, busy)

    def _server(self, server: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "tierd_connections", "Open client connections", server["connections"]
        )
        yield GaugeMetricFamily(
            "tierd_leases", "Open leases (pins and reservations)", server["leases"]
        )
        yield CounterMetricFamily("tierd_requests", "Requests received", server["requests"])
        errors = CounterMetricFamily("tierd_errors", "Error replies", labels=["code"])
        for code, count in sorted(server["errors"].items()):
            errors.add_metric([code], count)
        yield errors
        refused = CounterMetricFamily(
            "tierd_connections_refused", "Connections refused at accept", labels=["reason"]
        )
        for reason, count in sorted(server.get("refused", {}).items()):
            refused.add_metric([reason], count)
        yield refused
        dropped = CounterMetricFamily(
            "tierd_connections_dropped",
            "Connections closed by a guard (deadline, budget, stall)",
            labels=["reason"],
        )
        for reason, count in sorted(server.get("dropped", {}).items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield GaugeMetricFamily("tierd_subscribers", "Event subscribers", server["subscribers"])
        yield GaugeMetricFamily("tierd_uptime_seconds", "Seconds since start", server["uptime_s"])


def render_prometheus(
    stats: dict[str, Any], collectors: Iterable[Collector] = (), *, top: int = 20
) -> str:
    """The Prometheus text exposition of a :func:`collect_stats` snapshot, followed by
    ``collectors`` (the server's latency histograms); ``top``: how many namespaces get
    labels of their own (:func:`top_namespaces`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(stats, top))
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()
