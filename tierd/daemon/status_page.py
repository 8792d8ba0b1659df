"""The status page's figures: what ``/status.json`` on the metrics endpoint answers
(:mod:`tierd.daemon.metrics_http` serves it, with the page itself, ``status.html``).

The figures are those ``stats`` answers an operator (every tenant, namespaces included),
shaped for one page: the tiers, routes, chain and remote level as they are; the
namespaces holding most bytes (``metrics.namespaces_top`` of them, then one ``other`` row
per tenant, as in the metrics); the :data:`TENANTS_SHOWN` tenants holding most blocks;
the processes connected to the control socket (from each connection's peer credentials,
its hello and ``/proc/PID/comm``); and the recent errors.

Who sees which of them is the asker's :class:`~tierd.daemon.http_peer.View`: an operator
all of them; a tenant's member its own tenant's namespaces and processes, the other
tenants as totals under a name of no meaning (``#N``); anyone else the totals only (the
tiers, routes, chain, remote level, server counters and recent errors, which are the
daemon's, and each tenant's totals so renamed). One snapshot (:meth:`StatusFigures.take`)
serves every view's build: :func:`render` makes one view's JSON of it.

The daemon keeps no log of errors, only counters (error replies by code, connections
refused and dropped, a tier's I/O errors, failed copies, expired leases, the remote
level's faults) and the remote level's last error. :class:`StatusFigures` compares the
counters with the previous build's and keeps what grew in a ring of
:data:`RECENT_ERRORS` entries: the page polls every second, so the ring says when
errors came, to within a build. A counter that grows build after build (a lost remote
server) extends one entry, from its first build to its last, rather than filling the
ring. What a build reads on the event loop costs the number of
tenants, namespaces and connections, never of blocks; the JSON is made in a thread.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierd.control.figures.prometheus import top_namespaces
from tierd.control.state.context import ServerContext
from tierd.daemon.http_peer import View, shown_stats

__all__ = ["CLIENTS_SHOWN", "RECENT_ERRORS", "TENANTS_SHOWN", "Peer", "StatusFigures"]

RECENT_ERRORS = 50  # entries kept in the ring
TENANTS_SHOWN = 50  # tenants holding most blocks; the rest are counted
CLIENTS_SHOWN = 100  # processes; the rest are counted

# Remote counters whose growth is a fault (the others are traffic).
_REMOTE_FAULTS = (
    *("errors", "timeouts", "corrupt", "malformed", "write_errors", "dropped"),
    "breaker_opened",
)


class Peer(Protocol):
    """What the page reads of one control connection (a :class:`Connection`)."""

    peer: tuple[int, int, int]  # pid, uid, gid

    @property
    def session(self) -> Any: ...


@dataclass(slots=True)
class StatusFigures:
    """Builds ``/status.json`` for one daemon, keeping the recent errors between builds.

    ``take`` runs on the loop (a snapshot), ``render`` in a thread (the JSON of one
    view); one snapshot is taken at a time (the endpoint shares it among the views' builds
    and each build among the requests of its view that wait on it)."""

    ctx: ServerContext
    connections: Collection[Peer] = ()
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_ERRORS))
    _seen: dict[str, int] | None = None  # the error counters at the last build
    _growing: dict[str, dict[str, Any]] = field(default_factory=dict)  # grew at the last build
    _remote_error_at: dict[str, float] = field(default_factory=dict)

    def take(self) -> dict[str, Any]:
        """The snapshot a build renders: read on the loop, copied by value."""
        stats = self.ctx.stats(namespaces=True)
        now = time.time()
        self._note_counters(stats, now)
        self._note_remote_errors(stats)
        return {
            "stats": stats,
            "clients": [_connection_row(conn) for conn in self.connections],
            "recent": [dict(entry) for entry in self.recent],
            "at": now,
            "top": self.ctx.namespaces_top,
        }

    def _note_counters(self, stats: dict[str, Any], now: float) -> None:
        counters = dict(_error_counters(stats))
        before, self._seen = self._seen, counters
        growing: dict[str, dict[str, Any]] = {}
        for what, total in counters.items():
            grew = total - (before or {}).get(what, 0)
            if grew <= 0:
                continue
            entry = self._growing.get(what)
            if entry is not None and self._unlink(entry):  # it grew at the last build too
                entry.update(count=entry["count"] + grew, total=total, until=now)
            else:
                since = " (since start)" if before is None else ""
                entry = {"at": now, "until": now, "what": what + since, "count": grew}
                entry["total"] = total
            self.recent.append(entry)
            growing[what] = entry
        self._growing = growing

    def _unlink(self, entry: dict[str, Any]) -> bool:
        """Take ``entry`` out of the ring (to go back in as the newest); False if it has
        left the ring already."""
        for index, kept in enumerate(self.recent):
            if kept is entry:
                del self.recent[index]
                return True
        return False

    def _note_remote_errors(self, stats: dict[str, Any]) -> None:
        for level in _remote_levels(stats.get("remote")):
            at = float(level.get("last_error_at") or 0.0)
            name = f"remote level {level.get('name', '?')}"
            if level.get("last_error") and at > self._remote_error_at.get(name, 0.0):
                self._remote_error_at[name] = at
                error = {"at": at, "until": at, "what": name, "detail": str(level["last_error"])}
                self.recent.append(error)


def render(snapshot: dict[str, Any], view: View) -> bytes:
    """The JSON of a :meth:`StatusFigures.take` snapshot as ``view`` sees it (run in a
    thread; the snapshot is shared by every view's build and left as it is)."""
    stats = snapshot["stats"]
    server = stats["server"]
    tenants = stats.get("tenants") or {}
    namespaces = sum(len(t.get("namespaces", ())) for t in tenants.values())
    shown = shown_stats(stats, view).get("tenants") or {}
    every = _processes(snapshot["clients"])
    clients = [entry for entry in every if view.shows(entry["tenant"])]
    for entry in clients[:CLIENTS_SHOWN]:
        entry["process"] = _command_name(entry["pid"])
    page = {
        "generated_at": round(snapshot["at"], 3),
        "version": server["version"],
        "uptime_s": server["uptime_s"],
        "shutting_down": server["shutting_down"],
        "view": {"operator": view.operator, "tenant": view.tenant},
        "block_bytes": stats["block_bytes"],
        "server": {k: v for k, v in server.items() if k not in ("version", "uptime_s")},
        "chain": stats["chain"],
        "tiers": stats["tiers"],
        "routes": stats["routes"],
        "remote": stats["remote"],
        "leases": stats.get("leases"),
        "tenants": _tenant_rows(shown)[:TENANTS_SHOWN],
        "tenants_total": len(tenants),
        "namespaces": [_namespace_row(*item) for item in top_namespaces(shown, snapshot["top"])],
        "namespaces_total": namespaces,
        "clients": clients[:CLIENTS_SHOWN],
        "clients_total": len(every),
        "clients_hidden": len(every) - len(clients),  # of tenants this view does not show
        "recent_errors": sorted(snapshot["recent"], key=lambda e: -e["until"]),
    }
    return json.dumps(page, separators=(",", ":")).encode()


def _error_counters(stats: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """(what, total) of every counter whose growth is an error."""
    server = stats["server"]
    for code, n in server["errors"].items():
        yield f"error replies: {code}", n
    for reason, n in server.get("refused", {}).items():
        yield f"connections refused: {reason}", n
    for reason, n in server.get("dropped", {}).items():
        yield f"connections dropped: {reason}", n
    for tier in stats["tiers"]:
        # A tier's dropped blocks are not here: the last tier's evictions (with no level
        # below) and the admission policy's refusals count there, traffic of a healthy
        # node (31,479 in one run kept the page red); a copy down that failed is an
        # error, and is one of its route's failed copies below.
        yield f"tier {tier['name']}: I/O errors", tier["io_errors"]
    for route in stats["routes"]:
        yield f"route {route['src']} -> {route['dst']}: failed copies", route["failures"]
    yield "events dropped", stats["chain"]["events_dropped"]
    leases = stats.get("leases") or {}
    yield "store leases expired", leases.get("leases_expired", 0)
    yield "requests refused for a lease bound", leases.get("lease_refusals", 0)
    for level in _remote_levels(stats.get("remote")):
        for key in _REMOTE_FAULTS:
            name = f"remote level {level.get('name', '?')}"
            yield f"{name}: {key.replace('_', ' ')}", level.get(key, 0)


def _remote_levels(remote: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not remote:
        return []
    return list(remote["levels"]) if "levels" in remote else [remote]


def _connection_row(conn: Peer) -> dict[str, Any]:
    session = conn.session
    pid, uid, _ = conn.peer
    tenant = session.tenant
    return {
        "pid": pid,
        "uid": uid,
        "tenant": tenant.name if tenant is not None else None,
        "namespace": session.namespace,
        "leases": len(session.leases),
    }


def _processes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Connections grouped by process (and tenant: a process that changed its uid
    between connections is shown to each tenant's view apart), most connections first."""
    by_pid: dict[tuple[int, str | None], dict[str, Any]] = {}
    for row in rows:
        entry = by_pid.setdefault(
            (row["pid"], row["tenant"]),
            {"pid": row["pid"], "uid": row["uid"], "tenant": row["tenant"], "namespaces": []},
        )
        entry["connections"] = entry.get("connections", 0) + 1
        entry["leases"] = entry.get("leases", 0) + row["leases"]
        if row["namespace"] is not None and row["namespace"] not in entry["namespaces"]:
            entry["namespaces"].append(row["namespace"])
    return sorted(by_pid.values(), key=lambda e: (-e["connections"], e["pid"]))


def _command_name(pid: int) -> str | None:
    """The command name of a process (``/proc/PID/comm``; ``None`` where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read(64).strip() or None
    except OSError:
        return None  # gone since, or hidden (hidepid)


def _tenant_rows(tenants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = [
        {
            "name": name,
            "used": {t["name"]: t["used"] for t in snapshot["tiers"]},
            "quota": {t["name"]: t["capacity"] for t in snapshot["tiers"]},
            "hit_ratio": snapshot["chain"]["hit_ratio"],
            "namespaces": snapshot.get("namespace_count", len(snapshot.get("namespaces", ()))),
            **snapshot["leases"],
        }
        for name, snapshot in tenants.items()
    ]
    rows.sort(key=lambda row: (-sum(row["used"].values()), row["name"]))
    return rows


def _namespace_row(tenant: str, label: str, row: dict[str, Any]) -> dict[str, Any]:
    keys = ("blocks", "bytes", "lookups", "hit_blocks", "miss_blocks", "stored_blocks")
    return {"tenant": tenant, "namespace": label, **{key: row[key] for key in keys}}
