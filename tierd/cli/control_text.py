"""What the control commands print: a ``stats`` reply as tables (tiers, tenants, routes)
and summary lines, an event as one line, a ``health`` uptime as a duration; with
``--json``, a stats reply or an event as one JSON line instead. Pure functions of the
daemon's replies: the commands themselves are in :mod:`tierd.cli.control_cmd`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from tierd.control.protocol import NAMESPACE_ID_BYTES
from tierd.units import format_bytes

__all__ = [
    "duration",
    "event_text",
    "last_error_text",
    "namespace_name",
    "namespace_table",
    "stats_text",
]

_KEYS_SHOWN = 4
_COPIES = "(blocks per tier: a block in several tiers counts once in each; bytes: all copies)"


def stats_text(stats: dict[str, Any], as_json: bool) -> str:
    """A ``stats`` reply for people (or as JSON): tables, then the summary lines."""
    if as_json:
        return json.dumps(stats)
    parts = [_tier_table(stats["tiers"]), _route_table(stats["routes"])]
    if stats.get("tenant"):
        parts.insert(0, f"tenant {stats['tenant']} (its own tiers only)")
    tenants = stats.get("tenants") or {}
    if len(tenants) > 1:
        parts.insert(1, _tenant_table(tenants))
    sized = {name: t["block_sizes"] for name, t in tenants.items() if "block_sizes" in t}
    if stats.get("tenant") and "block_sizes" in stats:  # a member's own tenant
        sized = {stats["tenant"]: stats["block_sizes"]}
    if sized:  # the tier table adds up blocks of every size: each size's own
        parts.insert(1, _size_table(sized))
    by_tenant = {name: t["namespaces"] for name, t in tenants.items() if "namespaces" in t}
    if "namespaces" in stats and stats.get("tenant"):  # a member's own tenant
        by_tenant = {stats["tenant"]: stats["namespaces"]}
    if by_tenant:
        parts.insert(-1, namespace_table(by_tenant))
    chain = stats["chain"]
    looked_up = chain["hit_blocks"] + chain["miss_blocks"]
    parts.append(
        f"chain hit ratio {_ratio(chain['hit_blocks'], looked_up)} "
        f"({chain['hit_blocks']:,} of {looked_up:,} looked-up blocks)"
    )
    remote = stats.get("remote")
    if remote:
        parts.append(
            f"remote {remote['name']} ({remote.get('medium', 'REMOTE')}) {remote['endpoint']}:"
            f" breaker {remote['state']},"
            f" {remote['lookup_hits']:,} lookup hits, {remote['hits']:,} blocks read,"
            f" {remote['stores']:,} written, {remote['skipped']:,} skipped,"
            f" {remote['corrupt']:,} corrupt, {remote['timeouts']:,} timeouts,"
            f" {remote['errors']:,} errors, {remote['dropped']:,} dropped"
            + (f" ({last_error_text(remote)})" if remote["last_error"] else "")
        )
    kv = stats.get("kv_events")
    if kv:
        where = (
            f"{kv['endpoint']} (replay {kv['replay_endpoint'] or 'off'})"
            if "endpoint" in kv
            else f"on {len(kv['streams'])} streams, one a tenant ({', '.join(kv['streams'])})"
        )
        parts.append(
            f"kv events {where},"
            f" incarnation {kv['incarnation']}: {kv['events']:,} events,"
            f" {kv['dropped_batches']:,} batches dropped, {kv['undescribed']:,} blocks not"
            f" described, {kv['described']:,} descriptions kept"
        )
    server = stats.get("server")
    if server is not None:
        errors = server["errors"]
        detail = ", ".join(f"{code} {n:,}" for code, n in sorted(errors.items()))
        parts.append(
            f"server: {_count(server['connections'], 'connection')},"
            f" {_count(server['leases'], 'lease')}, {_count(server['requests'], 'request')},"
            f" {_count(sum(errors.values()), 'error')}" + (f" ({detail})" if detail else "")
        )
    return "\n\n".join(parts)


_TIER_COUNTERS = (
    "hits",
    "misses",
    "hit ratio",
    "stores",
    "evictions",
    "demotions",
    "promotions",
    "io_errors",
)


def _tier_table(tiers: list[dict[str, Any]]) -> str:
    header = ["tier", "medium", "used/capacity", *_TIER_COUNTERS]
    rows = []
    for tier in tiers:
        used, capacity = tier["used"], tier["capacity"]
        share = f"{used / capacity:.1%}" if capacity else "-"
        figures = {**tier, "hit ratio": _ratio(tier["hits"], tier["hits"] + tier["misses"])}
        rows.append(
            [
                tier["name"],
                tier["medium"],
                f"{used:,}/{capacity:,} ({share})",
                *(_number(figures[key]) for key in _TIER_COUNTERS),
            ]
        )
    return _table(header, rows, left=2)


def _tenant_table(tenants: dict[str, dict[str, Any]]) -> str:
    """Each tenant's share of each tier, and its leases."""
    names = [tier["name"] for tier in next(iter(tenants.values()))["tiers"]]
    rows = [
        [
            name,
            *(f"{t['used']:,}/{t['capacity']:,}" for t in snapshot["tiers"]),
            f"{snapshot['leases']['leases_held_blocks']:,}",
            f"{snapshot['leases']['leases_expired']:,}",
        ]
        for name, snapshot in tenants.items()
    ]
    return _table(["tenant", *names, "leased", "expired"], rows, left=1)


def _size_table(sized: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Each tenant's block sizes (``block_sizes``): each one's tiers and hit ratio."""
    first = next(iter(next(iter(sized.values())).values()))
    names = [tier["name"] for tier in first["tiers"]]
    rows = [
        [
            tenant,
            format_bytes(int(size)),
            *(f"{t['used']:,}/{t['capacity']:,}" for t in part["tiers"]),
            _ratio(
                part["chain"]["hit_blocks"],
                part["chain"]["hit_blocks"] + part["chain"]["miss_blocks"],
            ),
        ]
        for tenant, sizes in sized.items()
        for size, part in sizes.items()
    ]
    return _table(["tenant", "block size", *names, "hit ratio"], rows, left=2)


def namespace_table(by_tenant: dict[str, list[dict[str, Any]]], now: float | None = None) -> str:
    """One row per namespace: blocks per tier, bytes of every copy, lookups' hit ratio,
    stores, last use (the tenant column when there are several tenants). A block held by
    two tiers counts in both: the table says so under it."""
    rows_in = [(tenant, row) for tenant, rows in by_tenant.items() for row in rows]
    if not rows_in:
        return "namespaces: none holds blocks yet"
    now = time.time() if now is None else now
    tiers = list(rows_in[0][1]["blocks"])
    several = len(by_tenant) > 1
    header = [*(["tenant"] if several else []), "namespace", "id", *tiers, "bytes (copies)"]
    header.append("hit ratio")
    header += ["stored", "last used"]
    rows = []
    for tenant, row in rows_in:
        looked_up = row["hit_blocks"] + row["miss_blocks"]
        last = row["last_used"]
        rows.append(
            [
                *([tenant] if several else []),
                namespace_name(row["namespace"]),
                row["id"],
                *(f"{row['blocks'].get(tier, 0):,}" for tier in tiers),
                f"{row['bytes']:,}",
                _ratio(row["hit_blocks"], looked_up),
                f"{row['stored_blocks']:,}",
                f"{duration(max(0.0, now - last))} ago" if last else "-",
            ]
        )
    table = _table(header, rows, left=3 if several else 2)
    return f"{table}\n{_COPIES}" if len(tiers) > 1 else table


def namespace_name(name: str | None) -> str:
    """A namespace's name as a terminal shows it: as given when every character prints;
    else with each one that does not (a tab, an escape sequence, a newline: names that
    a permissive ``namespaces.pattern`` lets through) and each backslash escaped, the way
    Python writes them (``\\t``, ``\\x1b``), so a name cannot move the cursor, recolour
    the terminal or break a table's row. ``(unnamed)``: no client named it."""
    if name is None:
        return "(unnamed)"
    if name.isprintable():
        return name
    return "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
        for c in name
    )


def _route_table(routes: list[dict[str, Any]]) -> str:
    if not routes:
        return "routes: no copies yet"
    rows = [[f"{r['src']}->{r['dst']}", f"{r['bytes']:,}", f"{r['gb_per_s']:.3f}"] for r in routes]
    return _table(["route", "bytes", "GB/s"], rows, left=1)


def _table(header: list[str], rows: list[list[str]], left: int) -> str:
    """Columns padded to their widest cell: the first ``left`` to the left, the rest
    (figures) to the right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _number(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def event_text(event: dict[str, Any], dropped: int, batch: int, as_json: bool, split: bool) -> str:
    """One line per event; ``split`` shows a key as ``<namespace id>:<client key>``. In
    JSON, ``batch`` numbers the pushes this reader received, from 1 (text mode prints a
    ``batch N (K events)`` line before each)."""
    if as_json:
        keys = [bytes(key).hex() for key in event["keys"]]
        return json.dumps({**event, "keys": keys, "dropped": dropped, "batch": batch})
    keys = [
        f"{key[:NAMESPACE_ID_BYTES].hex()}:{key[NAMESPACE_ID_BYTES:].hex()}"
        if split
        else bytes(key).hex()
        for key in event["keys"]
    ]
    shown = " ".join(keys[:_KEYS_SHOWN]) + (" ..." if len(keys) > _KEYS_SHOWN else "")
    count = f"{len(keys)} key{'s' if len(keys) != 1 else ''}"
    return f"{event['kind']} {event['medium']} {event['tier']} {count}: {shown}"


def duration(seconds: float) -> str:
    """``42.1 s``, ``5m 03s``, ``2h 05m``, ``3d 04h``."""
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def last_error_text(remote: Mapping[str, Any], now: float | None = None) -> str:
    """``last error 42.1 s ago, answered since: unreachable: ...``: the remote level's
    last failure with its age, and whether calls have been answered after it."""
    at = float(remote.get("last_error_at") or 0.0)
    age = f" {duration(max((time.time() if now is None else now) - at, 0.0))} ago" if at else ""
    since = ", answered since" if remote.get("recovered") else ""
    return f"last error{age}{since}: {remote['last_error']}"


def _count(n: int, noun: str) -> str:
    """``1 connection``, ``2 connections``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
