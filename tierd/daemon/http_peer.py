"""Who asks the metrics endpoint, and what of each tenant it is shown.

The endpoint listens on a loopback TCP port, where no peer credentials come with a
connection (``SO_PEERCRED`` is for Unix sockets). The kernel still records which uid
made the client's socket: its row in ``/proc/self/net/tcp`` (``tcp6``), the one whose
local end is the peer's address and port and whose remote end is ours, has a ``uid``
column. :func:`asker` reads it (in a thread: the file has a row per TCP socket of the
network namespace) and takes the uid's primary gid from the user database, and the
endpoint hands both to :meth:`TenantTable.identify`, the decision the control socket
makes for ``SO_PEERCRED``'s uid and gid. The gid is the login gid, not the process's
own: a gid match never gives a view that the same user would not get on the socket as
it logs in. A row without an inode (a socket its process has closed: the kernel's
TIME_WAIT rows read uid 0) or no row at all is nobody.

A :class:`View` is what a build shows: an operator every tenant's details; a member its
own tenant's, and every other tenant as totals under a name of no meaning (``#2``: its
place in the config's ``tenants:``, so that a series keeps its label from scrape to
scrape), its namespaces added up into one ``other`` row; anyone else (a uid of no
tenant, or one the kernel did not say) totals only, every tenant so renamed. Tenant
names are treated as details: they are chosen by an operator, and often name a team, a
customer or a model.
"""

from __future__ import annotations

import asyncio
import ipaddress
import pwd
import sys
from dataclasses import dataclass
from typing import Any

from tierd.control.figures.prometheus import OTHER
from tierd.control.state.tenant_table import Grant

__all__ = ["OPERATOR", "PUBLIC", "View", "asker", "shown_stats", "socket_owner"]

_NAMESPACE_SUMS = ("bytes", "lookups", "hit_blocks", "miss_blocks", "stored_blocks")


@dataclass(frozen=True, slots=True)
class View:
    """Whose details a build shows: every tenant's (``operator``), one tenant's (a
    member's ``tenant``) or none."""

    operator: bool = False
    tenant: str | None = None

    @classmethod
    def of(cls, grant: Grant | None) -> View:
        if grant is None:
            return PUBLIC
        if grant.operator:
            return OPERATOR
        return cls(tenant=grant.tenant.name) if grant.tenant is not None else PUBLIC

    @property
    def key(self) -> str:
        """One cache entry per view: at most the number of tenants + 2 of them."""
        return "operator" if self.operator else f"tenant:{self.tenant}" if self.tenant else ""

    def shows(self, tenant: str | None) -> bool:
        """Whether a tenant's details (its name, namespaces, clients) are shown."""
        return self.operator or (tenant is not None and tenant == self.tenant)

    def labels(self, tenants: list[str]) -> dict[str, str]:
        """Each tenant's name as shown: its own, or ``#N``, its place in the config (a
        name never has ``#``)."""
        return {name: name if self.shows(name) else f"#{n}" for n, name in enumerate(tenants, 1)}


OPERATOR = View(operator=True)
PUBLIC = View()


def shown_stats(stats: dict[str, Any], view: View) -> dict[str, Any]:
    """A ``stats`` snapshot (every tenant's, namespaces included) as ``view`` sees it: a
    new dict, ``stats`` itself is left as it is (other views' builds read it)."""
    tenants = stats.get("tenants")
    if view.operator or not tenants:
        return stats
    labels = view.labels(list(tenants))
    each = {
        labels[name]: part if view.shows(name) else _totals(part) for name, part in tenants.items()
    }
    return {**stats, "tenants": each}


def _totals(part: dict[str, Any]) -> dict[str, Any]:
    """A hidden tenant's figures: its namespaces added up into one row named ``other``
    (as the metrics name those past the top N), and ``namespace_count`` how many there
    are (the metrics' ``tierd_namespaces`` and the page's count take it over the rows)."""
    if "namespaces" not in part:
        return part
    rows = part["namespaces"]
    folded = [_added_up(rows)] if rows else []
    return {**part, "namespaces": folded, "namespace_count": len(rows)}


def _added_up(rows: list[dict[str, Any]]) -> dict[str, Any]:
    blocks: dict[str, int] = {}
    for row in rows:
        for tier, count in row["blocks"].items():
            blocks[tier] = blocks.get(tier, 0) + count
    sums = {key: sum(row[key] for row in rows) for key in _NAMESPACE_SUMS}
    return {"namespace": OTHER, "id": "", "blocks": blocks, **sums, "last_used": None}


async def asker(peer: Any, ours: Any) -> tuple[int, int] | None:
    """The uid of the process at the other end of a loopback TCP connection (``peer``
    and ``ours``: the socket's ``peername`` and ``sockname``) and that uid's login gid
    (-1 when the user database has none); ``None`` when the kernel does not say."""
    return await asyncio.to_thread(_credentials, peer, ours)


def _credentials(peer: Any, ours: Any) -> tuple[int, int] | None:
    try:
        uid = socket_owner(peer, ours)
    except (OSError, ValueError, TypeError, IndexError):
        return None
    if uid is None:
        return None
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = -1  # no grant lists -1
    return uid, gid


def socket_owner(peer: Any, ours: Any, net: str = "/proc/self/net") -> int | None:
    """The uid column of the client's row in ``net``/tcp or tcp6 (the one whose local
    end is ``peer`` and remote end ``ours``); ``None`` when there is none, or it has no
    inode (closed by its process: TIME_WAIT rows read uid 0)."""
    for table, needle in _needles(peer, ours):
        with open(f"{net}/{table}", encoding="ascii", errors="replace") as rows:
            for row in rows:
                if needle not in row:
                    continue
                fields = row.split()
                if fields[1] + " " + fields[2] != needle:
                    continue
                uid, inode = int(fields[7]), int(fields[9])
                return uid if inode != 0 else None
    return None


def _needles(peer: Any, ours: Any) -> list[tuple[str, str]]:
    """(table, "LOCAL REMOTE") of the client's row as the kernel writes it, in each
    table it may be in: a client's IPv6 socket may reach an IPv4 address as mapped."""
    them = ipaddress.ip_address(str(peer[0]).partition("%")[0])
    us = ipaddress.ip_address(str(ours[0]).partition("%")[0])
    if isinstance(them, ipaddress.IPv6Address) and them.ipv4_mapped is not None:
        them = them.ipv4_mapped
    if isinstance(us, ipaddress.IPv6Address) and us.ipv4_mapped is not None:
        us = us.ipv4_mapped
    ends = ((them, int(peer[1])), (us, int(ours[1])))
    if isinstance(them, ipaddress.IPv4Address) and isinstance(us, ipaddress.IPv4Address):
        mapped = [(ipaddress.IPv6Address(f"::ffff:{a}"), port) for a, port in ends]
        return [("tcp", _row(ends)), ("tcp6", _row(mapped))]
    return [("tcp6", _row(ends))]


def _row(ends: Any) -> str:
    return " ".join(f"{_hex(address)}:{port:04X}" for address, port in ends)


def _hex(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The kernel's text of an address: each 32-bit word of it in the host's order."""
    packed = address.packed
    words = (packed[i : i + 4] for i in range(0, len(packed), 4))
    return "".join(f"{int.from_bytes(w, sys.byteorder):08X}" for w in words)
