"""The daemon's figures: one JSON-able snapshot, and the same as Prometheus text.

:func:`collect_stats` reads the chain (per tier, per route, whole chain);
:func:`render_prometheus` turns a snapshot, with the server's own ``server`` section,
into the text exposition format through prometheus-client, so names and escaping follow
the format exactly, together with the server's latency histograms
(:mod:`tierd.control.timing`). Every family is documented in ``docs/metrics.md``.

Per tier, ``hits`` counts block hits served by that tier (its highest holder at lookup
time) and ``misses`` the looked-up blocks that reached it and were not there: the chain's
misses plus the hits served by the tiers below it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tierd.chain import TierChain


__all__ = ["OTHER", "collect_stats", "merge_stats", "render_prometheus", "top_namespaces"]


def collect_stats(chain: TierChain) -> dict[str, Any]:
    chain_stats = chain.stats()
    hits = chain_stats.hits_by_level
    remote_hits = chain.remote.hits if chain.remote is not None else 0
    tiers = []
    for index, level in enumerate(chain.levels):
        tier = level.tier.stats()
        tiers.append(
            {
                "name": tier.name,
                "medium": str(tier.medium),
                "policy": tier.policy,
                "capacity": tier.capacity,
                "used": tier.used,
                "pinned": tier.pinned,
                "writing": tier.writing,
                "adopting": tier.adopting,
                "hits": hits[index],
                "misses": chain_stats.miss_blocks + sum(hits[index + 1 :]) + remote_hits,
                "stores": tier.stores,
                "evictions": tier.evictions,
                "demotions": level.demotions,
                "promotions": level.promotions,
                "dropped": level.dropped,
                "refused": level.refused,
                "io_errors": level.io_errors,
            }
        )
    routes = [
        {
            "src": str(route.src),
            "dst": str(route.dst),
            "bytes": route.bytes,
            "blocks": route.blocks,
            "failures": route.failures,
            "busy_s": round(route.busy_s, 6),
            "gb_per_s": round(route.gb_per_s, 3),
            "in_flight_bytes": route.in_flight_bytes,
        }
        for route in chain.transfer.stats().values()
        if route.blocks or route.failures or route.in_flight_bytes
    ]
    looked_up = chain_stats.hit_blocks + chain_stats.miss_blocks
    remote = None
    if chain.remote is not None:
        side = chain.remote
        remote = {
            **side.level.stats(),
            "lookup_hits": side.hits,
            "sent": side.sent,
            "admission_refused": side.refused,
            "promotions": side.promotions,
            "read_errors": side.read_errors,
        }
    return {
        "block_bytes": chain.block_bytes,
        "tiers": tiers,
        "remote": remote,
        "routes": routes,
        "chain": {
            "lookups": chain_stats.lookups,
            "hit_blocks": chain_stats.hit_blocks,
            "miss_blocks": chain_stats.miss_blocks,
            "hit_ratio": round(chain_stats.hit_blocks / looked_up, 6) if looked_up else 0.0,
            "events_published": chain_stats.events_published,
            "events_dropped": chain_stats.events_dropped,
        },
    }


def merge_stats(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot for several chains of the same tiers (one per tenant): counts and
    sizes add up, tier by tier and route by route; ratios are computed again."""
    first = snapshots[0]
    tiers = [_add(list(level)) for level in zip(*(s["tiers"] for s in snapshots), strict=True)]
    by_route: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for snapshot in snapshots:
        for route in snapshot["routes"]:
            by_route.setdefault((route["src"], route["dst"]), []).append(route)
    routes = []
    for group in by_route.values():
        route = _add(group)
        if len(group) > 1:
            busy = route["busy_s"]
            route["gb_per_s"] = round(route["bytes"] / busy / 1e9, 3) if busy else 0.0
        routes.append(route)
    chain = _add([s["chain"] for s in snapshots])
    looked_up = chain["hit_blocks"] + chain["miss_blocks"]
    chain["hit_ratio"] = round(chain["hit_blocks"] / looked_up, 6) if looked_up else 0.0
    remotes = [s["remote"] for s in snapshots if s.get("remote")]
    merged = {
        "block_bytes": first["block_bytes"],
        "tiers": tiers,
        "remote": _merge_remote(remotes) if remotes else None,
        "routes": routes,
        "chain": chain,
    }
    if all("leases" in s for s in snapshots):  # a tenant's own lease counters
        merged["leases"] = _add([s["leases"] for s in snapshots])
    return merged


def _merge_remote(remotes: list[dict[str, Any]]) -> dict[str, Any]:
    """One remote level over several tenants: counts added up, the worst breaker state, the
    latest error with its time (never a sum of times); a stack's levels the same way."""
    remote = _add(remotes)
    states = [r["state"] for r in remotes if r["state"] != "closed"]
    remote["state"] = states[0] if states else "closed"
    latest = max(remotes, key=lambda r: float(r.get("last_error_at", 0.0)))
    for key in ("last_error", "last_error_at", "recovered"):
        remote[key] = latest.get(key, remote.get(key))
    if "levels" in remote:
        per_tenant = [r["levels"] for r in remotes]
        remote["levels"] = [_merge_remote(list(level)) for level in zip(*per_tenant, strict=True)]
    return remote


def _add(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key; anything else taken from the first item."""
    out = dict(items[0])
    for key, value in out.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = sum(item.get(key, 0) for item in items)
    return out


# (stats key, metric suffix, help, is a counter)
_TIER_METRICS = [
    ("capacity", "capacity_blocks", "Slots in the tier", False),
    ("used", "used_blocks", "Blocks held (ready or being written)", False),
    ("pinned", "pinned_blocks", "Blocks pinned by loads", False),
    ("writing", "writing_blocks", "Blocks being written", False),
    ("adopting", "adopting_blocks", "Blocks kept across a restart, not adopted yet", False),
    ("hits", "hits", "Block hits served by this tier", True),
    ("misses", "misses", "Looked-up blocks that reached this tier and were not there", True),
    ("stores", "stores", "Blocks stored", True),
    ("evictions", "evictions", "Blocks evicted", True),
    ("demotions", "demotions", "Blocks copied down on eviction", True),
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
            count.add_metric([name], len(snapshot.get("namespaces", ())))
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
        for name, snapshot in sorted(tenants.items()):
            for tier in snapshot["tiers"]:
                used.add_metric([name, tier["name"]], tier["used"])
                quota.add_metric([name, tier["name"]], tier["capacity"])
            for key, family in families.items():
                family.add_metric([name], snapshot["leases"][key])
        yield from (used, quota, *families.values())

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
