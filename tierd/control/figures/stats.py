"""The daemon's figures: one JSON-able snapshot (:mod:`tierd.control.figures.prometheus` turns
it into Prometheus text).

:func:`collect_stats` reads the chain (per tier, per route, whole chain);
:func:`merge_stats` adds up the snapshots of several chains of the same tiers.

Per tier, ``hits`` counts block hits served by that tier (its highest holder at lookup
time) and ``misses`` the looked-up blocks that reached it and were not there: the chain's
misses plus the hits served by the tiers below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierd.chain import TierChain


__all__ = ["collect_stats", "merge_stats"]


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
                "quarantined": tier.quarantined,
                "hits": hits[index],
                "misses": chain_stats.miss_blocks + sum(hits[index + 1 :]) + remote_hits,
                "stores": tier.stores,
                "evictions": tier.evictions,
                "demotions": level.demotions,
                "written_behind": level.written_behind,
                "copies_dropped": level.copies_dropped,
                "behind": chain.behind_backlog(index),
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
    """One remote level over several tenants: counts added up, the worst breaker states, the
    latest error with its time (never a sum of times); a stack's levels the same way."""
    remote = _add(remotes)
    for key in ("state", "write_state"):
        states = [r[key] for r in remotes if r.get(key, "closed") != "closed"]
        if key in remote or states:
            remote[key] = states[0] if states else "closed"
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
