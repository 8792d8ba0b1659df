"""Tenants at run time: each with its own chain and pool, and who is which.

The daemon builds a :class:`TenantTable` from the config (:mod:`tierd.tenancy`); the
server asks it, for each new connection, which :class:`Grant` the peer's kernel
credentials (``SO_PEERCRED`` uid and primary gid) match: a uid match wins over a gid
match, and a peer that matches none is refused. A grant names the peer's tenant (whose
chain and pool its session uses, and nothing else) and whether it is an operator.

A grant may name no tenant: the daemon's own user, when the ``tenants:`` section does not
list it, may run operator commands (stats, flush, stop, ...) but holds no blocks.

A tenant may serve several block sizes (``block_sizes``): each size has a chain and pool
of its own, an equal share of the tenant's tiers, kept in the tenant's
:class:`SizeClasses`; a connection's hello names its size and the session then uses that
size's :class:`Tenant` (they share the tenant's name, patterns and namespace book).

Lease accounting lives here too: every tenant counts the blocks its connections hold in
open leases (reserved for a store or pinned by a load), against its own bound and each
connection's, so that one client cannot take its tenant's whole entry tier.
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierd.control.lease_ends import LeaseEnds
from tierd.control.namespaces import NamespaceBook

if TYPE_CHECKING:
    from tierd.chain import TierChain

__all__ = ["Grant", "PoolInfo", "SizeClasses", "Tenant", "TenantTable"]


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """A tenant's shared-memory pool, handed to its clients as the descriptor ``fd``
    (SCM_RIGHTS with the hello reply): slot ``s`` is ``[s*stride, s*stride+block_bytes)``."""

    fd: int
    name: str
    size: int
    stride: int
    num_blocks: int

    def to_dict(self) -> dict[str, Any]:
        """What the hello reply says of it (the descriptor travels beside the frame)."""
        return {
            "name": self.name,
            "size": self.size,
            "stride": self.stride,
            "num_blocks": self.num_blocks,
        }


@dataclass(slots=True)
class Tenant:
    """One tenant's chain, pool, namespace patterns and lease bounds (in blocks)."""

    name: str
    chain: TierChain
    pool: PoolInfo | None = None
    namespaces: tuple[str, ...] = ("*",)
    max_held: int = 1 << 62  # blocks all its connections may hold in open leases
    max_held_per_connection: int = 1 << 62
    held: int = 0  # blocks held in open leases now
    leases_expired: int = 0  # store leases aborted for not being committed in time
    lease_refusals: int = 0  # requests refused for a lease bound
    book: NamespaceBook = field(default_factory=NamespaceBook)  # its namespaces' names, figures
    sizes: SizeClasses | None = None  # its block sizes, when it serves more than one
    # Leases its connections left (closed) or let expire, ended a piece a turn.
    lease_ends: LeaseEnds = field(default_factory=LeaseEnds)

    @property
    def block_bytes(self) -> int:
        return self.chain.block_bytes

    def each_size(self) -> list[Tenant]:
        """This tenant at each block size it serves (itself alone without size classes)."""
        return [self] if self.sizes is None else list(self.sizes.by_size.values())

    def namespace_problem(self, name: str) -> str | None:
        """Why ``name`` is not one of this tenant's namespaces, or ``None``."""
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.namespaces):
            return None
        allowed = ", ".join(self.namespaces)
        return f"namespace {name!r} is not one of tenant {self.name!r}'s ({allowed})"

    def lease_problem(self, connection_held: int, more: int) -> str | None:
        """Why a connection holding ``connection_held`` blocks may not take ``more``."""
        if connection_held + more > self.max_held_per_connection:
            return (
                f"this connection would hold {connection_held + more} blocks in open leases;"
                f" at most {self.max_held_per_connection} (limits.lease_blocks_per_connection):"
                " finish some leases first, or ask for fewer blocks at once"
            )
        if self.held + more > self.max_held:
            return (
                f"tenant {self.name!r} would hold {self.held + more} blocks in open leases;"
                f" at most {self.max_held} (limits.lease_blocks_per_tenant)"
            )
        return None

    def counters(self) -> dict[str, int]:
        return {
            "leases_held_blocks": self.held,
            "leases_expired": self.leases_expired,
            "lease_refusals": self.lease_refusals,
        }


@dataclass(slots=True)
class SizeClasses:
    """One tenant's block sizes: at most ``limit``, the configured one first, the others
    opened (by ``open_size``, which also records them for the next start) when a hello
    first names them. Each size's :class:`Tenant` is in ``by_size``."""

    limit: int
    by_size: dict[int, Tenant]
    open_size: Callable[[int], Awaitable[Tenant]] | None = None
    smallest: int = 1  # the smallest size that may be opened (limits.min_block_bytes)
    _opening: dict[int, asyncio.Future[Tenant]] = field(default_factory=dict)

    def refusal(self, block_bytes: int) -> str | None:
        """Why a new size cannot be opened now, or ``None``."""
        if block_bytes in self.by_size or block_bytes in self._opening:
            return None
        if block_bytes < self.smallest:
            return (
                f"block size {block_bytes} is below the smallest this daemon opens,"
                f" {self.smallest} (limits.min_block_bytes: each block costs it bookkeeping)"
            )
        if len(self.by_size) + len(self._opening) >= self.limit or self.open_size is None:
            served = ", ".join(str(size) for size in self.by_size)
            return (
                f"this daemon serves {self.limit} block sizes at most (block_sizes) and has"
                f" them all ({served}): raise block_sizes in its config and restart it"
            )
        return None

    async def open(self, block_bytes: int) -> Tenant:
        """The tenant at ``block_bytes``, opened now if it is new: once, however many
        connections ask for it at the same time, and to its end even when the one that
        asked first goes away (a client whose hello timed out finds it open, or opening,
        when it asks again: an open cut short would be started again, and cut short again,
        by every retry)."""
        known = self.by_size.get(block_bytes)
        if known is not None:
            return known
        opening = self._opening.get(block_bytes)
        if opening is None:
            problem = self.refusal(block_bytes)
            if problem is not None or self.open_size is None:
                raise LookupError(problem)
            opening = asyncio.ensure_future(self._open_now(block_bytes, self.open_size))
            # Retrieved even when nobody waits any more (open_size logs its failures).
            opening.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._opening[block_bytes] = opening
        return await asyncio.shield(opening)

    async def _open_now(
        self, block_bytes: int, open_size: Callable[[int], Awaitable[Tenant]]
    ) -> Tenant:
        try:
            tenant = await open_size(block_bytes)
        finally:
            del self._opening[block_bytes]
        self.by_size[block_bytes] = tenant
        return tenant


@dataclass(frozen=True, slots=True)
class Grant:
    """Peers with one of ``uids`` (or, failing a uid match, one of ``gids``) belong to
    ``tenant`` (``None``: to none) and may run operator commands when ``operator``."""

    tenant: Tenant | None
    operator: bool
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @property
    def label(self) -> str:
        role = "operator" if self.operator else "member"
        return f"{self.tenant.name if self.tenant else '(no tenant)'} ({role})"


@dataclass(slots=True)
class TenantTable:
    """Every tenant, and the grants that say who is which."""

    tenants: list[Tenant] = field(default_factory=list)
    grants: list[Grant] = field(default_factory=list)

    def identify(self, uid: int, gid: int) -> Grant | None:
        """The grant of a peer: by its uid first, then by its primary gid."""
        for grant in self.grants:
            if uid in grant.uids:
                return grant
        for grant in self.grants:
            if gid in grant.gids:
                return grant
        return None

    def every(self) -> Iterator[Tenant]:
        """Every tenant at every block size it serves."""
        for tenant in self.tenants:
            yield from tenant.each_size()

    def chains(self) -> Iterator[TierChain]:
        return (tenant.chain for tenant in self.every())

    def named(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)
