"""The frames of ``tierd top`` (:mod:`tierd.cli.top_cmd`), as plain lines: a pure function
of two consecutive ``stats`` snapshots and the time between them.

A frame is the header (version, uptime, clients, leases, requests per second, errors, the
chain's hit ratio), packed into as many lines as the width needs; per tier its occupancy
(with a bar), hit ratio and counters; the remote level, when there is one; bytes per
second on each copy route. Rates are differences between the snapshots; the first frame
shows ``-`` for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierd.cli.control_text import last_error_text

__all__ = ["render_frame"]

_BAR_MIN, _BAR_MAX = 5, 40  # occupancy bar width, in characters
# (stats key, column label) of the per-tier counters table
_COUNTERS = (
    ("stores", "stores"),
    ("evictions", "evictions"),
    ("demotions", "demotions"),
    ("promotions", "promotions"),
    ("pinned", "pinned"),
    ("io_errors", "io errors"),
)


def render_frame(
    prev: Mapping[str, Any] | None, cur: Mapping[str, Any], elapsed_s: float, width: int = 100
) -> list[str]:
    """The lines of one frame for the ``stats`` snapshot ``cur``, each at most ``width``
    characters. Rates (requests/s, route bytes/s) are the differences from ``prev``, taken
    ``elapsed_s`` seconds earlier; without ``prev`` (the first frame) they show ``-``."""
    rate_base = prev if prev is not None and elapsed_s > 0 else None
    # The header's figures are packed into as many lines as the width needs, never cut.
    header = [*_server_fields(rate_base, cur, elapsed_s), *_chain_fields(cur.get("chain") or {})]
    lines = [*_pack(header, width), ""]
    lines += _tier_lines(cur.get("tiers") or [], width)
    if cur.get("remote"):
        lines += ["", *_pack(_remote_fields(cur["remote"]), width)]
    lines += ["", *_route_lines(rate_base, cur.get("routes") or [], elapsed_s)]
    return [line[:width] for line in lines]


def _pack(fields: list[str], width: int) -> list[str]:
    """``fields`` two spaces apart, a new line whenever the next one would not fit (a
    field longer than the whole line is cut later, like any line)."""
    lines: list[str] = []
    line = ""
    for field in fields:
        if line and len(line) + 2 + len(field) > width:
            lines.append(line)
            line = field
        else:
            line = f"{line}  {field}" if line else field
    return [*lines, line]


def _server_fields(
    prev: Mapping[str, Any] | None, cur: Mapping[str, Any], elapsed_s: float
) -> list[str]:
    server = cur.get("server")
    if not server:
        return ["tierd (no server figures in this snapshot)"]
    requests = int(server.get("requests", 0))
    before = (prev or {}).get("server") or {}
    rate = _rate(requests - int(before["requests"]), elapsed_s) if "requests" in before else "-"
    errors: dict[str, int] = dict(server.get("errors") or {})
    detail = ", ".join(f"{code} {n:,}" for code, n in sorted(errors.items()))
    state = " (shutting down)" if server.get("shutting_down") else ""
    return [
        f"tierd {server.get('version', '?')}{state}",
        f"up {_duration(server.get('uptime_s', 0))}",
        f"clients {server.get('connections', 0):,}",
        f"leases {server.get('leases', 0):,}",
        f"subscribers {server.get('subscribers', 0):,}",
        f"requests {requests:,} ({rate}/s)",
        f"errors {sum(errors.values()):,}" + (f" ({detail})" if detail else ""),
    ]


def _chain_fields(chain: Mapping[str, Any]) -> list[str]:
    hit, miss = int(chain.get("hit_blocks", 0)), int(chain.get("miss_blocks", 0))
    return [
        f"chain hit ratio {_percent(hit, hit + miss)} ({hit:,} of {hit + miss:,} looked-up blocks)",
        f"lookups {int(chain.get('lookups', 0)):,}",
        f"events dropped {int(chain.get('events_dropped', 0)):,}",
    ]


def _tier_lines(tiers: list[Mapping[str, Any]], width: int) -> list[str]:
    """Two tables: occupancy and hit ratio (with a bar as wide as the line allows), then
    the counters."""
    if not tiers:
        return ["no tiers"]
    head = ["tier", "medium", "used/capacity", "use%", "hit%"]
    rows = [head, *(_occupancy_row(tier) for tier in tiers)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    # The bar takes what the other columns leave of the line, within bounds.
    bar = max(_BAR_MIN, min(_BAR_MAX, width - sum(widths) - 2 * len(widths) - 2))
    bars = [" " * (bar + 2)]
    bars += [_bar(int(t.get("used", 0)), int(t.get("capacity", 0)), bar) for t in tiers]
    occupancy = [[*row[:3], fill, *row[3:]] for row, fill in zip(rows, bars, strict=True)]
    counters = [["tier", *(label for _, label in _COUNTERS)]]
    counters += [
        [str(t.get("name", "?")), *(f"{int(t.get(key, 0)):,}" for key, _ in _COUNTERS)]
        for t in tiers
    ]
    return [*_table(occupancy, left=4), "", *_table(counters, left=1)]


def _remote_fields(remote: Mapping[str, Any]) -> list[str]:
    """The remote level in one packed paragraph: where, its breaker, its counters."""
    fields = [
        f"remote {remote.get('name', '?')} ({remote.get('medium', 'REMOTE')})"
        f" {remote.get('endpoint', '?')}",
        f"breaker {remote.get('state', '?')}",
    ]
    for key in ("lookup_hits", "hits", "misses", "stores", "skipped", "corrupt", "timeouts"):
        fields.append(f"{key.replace('_', ' ')} {int(remote.get(key, 0)):,}")
    for key in ("errors", "dropped", "write_errors"):
        fields.append(f"{key.replace('_', ' ')} {int(remote.get(key, 0)):,}")
    if remote.get("last_error"):
        fields.append(last_error_text(remote))
    return fields


def _occupancy_row(tier: Mapping[str, Any]) -> list[str]:
    used, capacity = int(tier.get("used", 0)), int(tier.get("capacity", 0))
    hits, misses = int(tier.get("hits", 0)), int(tier.get("misses", 0))
    return [
        str(tier.get("name", "?")),
        str(tier.get("medium", "?")),
        f"{used:,}/{capacity:,}",
        _percent(used, capacity),
        _percent(hits, hits + misses),
    ]


def _table(rows: list[list[str]], *, left: int) -> list[str]:
    """Columns padded to their widest cell: the first ``left`` to the left, the rest
    (figures) to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _bar(used: int, capacity: int, width: int) -> str:
    filled = round(width * used / capacity) if capacity > 0 else 0
    filled = max(0, min(width, filled))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _route_lines(
    prev: Mapping[str, Any] | None, routes: list[Mapping[str, Any]], elapsed_s: float
) -> list[str]:
    if not routes:
        return ["routes: no copies yet"]
    before = (
        None
        if prev is None
        else {(r["src"], r["dst"]): int(r["bytes"]) for r in prev.get("routes") or []}
    )
    rows = [["route", "bytes/s", "total", "blocks", "failures", "in flight"]]
    for route in routes:
        moved = int(route.get("bytes", 0))
        rate = "-"
        if before is not None:
            # A route shows up in the stats with its first copy: absent before means 0 bytes.
            delta = max(0, moved - before.get((route["src"], route["dst"]), 0))
            rate = _size(delta / elapsed_s) + "/s"
        rows.append(
            [
                f"{route['src']}->{route['dst']}",
                rate,
                _size(moved),
                f"{int(route.get('blocks', 0)):,}",
                f"{int(route.get('failures', 0)):,}",
                _size(int(route.get("in_flight_bytes", 0))),
            ]
        )
    return _table(rows, left=1)


def _rate(delta: int, elapsed_s: float) -> str:
    return f"{max(0, delta) / elapsed_s:,.1f}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _size(amount: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if amount >= 1 << shift:
            return f"{amount / (1 << shift):.1f} {unit}"
    return f"{amount:.0f} B"


def _duration(seconds: float) -> str:
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f}s"
