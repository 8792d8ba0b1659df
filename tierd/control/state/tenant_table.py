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
import contextlib
import fnmatch
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierd.control.figures.namespaces import NamespaceBook
from tierd.control.state.lease_ends import LeaseEnds

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
    users: int = 0  # connections greeted at this block size, open now
    idle_since: float = field(default_factory=time.monotonic)  # when the last one ended

    def greeted(self) -> None:
        """A connection's hello was answered at this tenant's block size."""
        self.users += 1

    def left(self) -> None:
        """A connection greeted at this block size is gone."""
        self.users -= 1
        if self.users == 0:
            self.idle_since = time.monotonic()

    def unused_for(self, now: float) -> float | None:
        """How long nothing has used this size (no connection, no lease left to end),
        or ``None`` while something does."""
        if self.users or self.held or len(self.lease_ends):
            return None
        return now - self.idle_since

    @property
    def block_bytes(self) -> int:
        return self.chain.block_bytes

    def each_size(self) -> list[Tenant]:
        """This tenant at each block size it serves (itself alone without size classes)."""
        return [self] if self.sizes is None else list(self.sizes.by_size.values())

    def size_report(self) -> dict[str, Any]:
        """Its block sizes: how many it may serve, after how long unused one makes room
        for a new one, and each open one's figures."""
        if self.sizes is None:
            only = {"configured": True, "connections": self.users, "unused_s": None}
            return {"limit": 1, "idle_s": None, "open": {str(self.block_bytes): only}}
        return {
            "limit": self.sizes.limit,
            "idle_s": self.sizes.idle_s,
            "open": self.sizes.sizes_figures(),
        }

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
    first names them. Each size's :class:`Tenant` is in ``by_size``.

    A size other than the configured one is given back (by ``close_size``: its blocks
    dropped, its share and slab freed, its record removed) by the operator
    (:meth:`give_back`), or when a hello names a new size, every size's room is taken,
    and one of them has been unused (no connection, no lease) for ``idle_s``: the least
    recently used of those makes the room."""

    limit: int
    by_size: dict[int, Tenant]
    open_size: Callable[[int], Awaitable[Tenant]] | None = None
    smallest: int = 1  # the smallest size that may be opened (limits.min_block_bytes)
    close_size: Callable[[int, Tenant], Awaitable[None]] | None = None
    idle_s: float = 300.0  # unused this long, a size makes room for a new one
    _opening: dict[int, asyncio.Future[Tenant]] = field(default_factory=dict)
    _closing: dict[int, asyncio.Future[None]] = field(default_factory=dict)

    @property
    def configured(self) -> int:
        """The configured block size: never given back."""
        return next(iter(self.by_size))

    def refusal(self, block_bytes: int) -> str | None:
        """Why a new size cannot be opened now, or ``None``."""
        if block_bytes in self.by_size or block_bytes in self._opening:
            return None
        if block_bytes < self.smallest:
            return (
                f"block size {block_bytes} is below the smallest this daemon opens,"
                f" {self.smallest} (limits.min_block_bytes: each block costs it bookkeeping)"
            )
        if self.open_size is None or (self._taken() >= self.limit and not self._reclaimable()):
            served = ", ".join(str(size) for size in self.by_size)
            return (
                f"this daemon serves {self.limit} block sizes at most (block_sizes) and has"
                f" them all ({served}), each used within limits.block_size_idle_s"
                f" ({self.idle_s:g} s): an operator may give one back (tierd sizes"
                " --give-back BYTES), or raise block_sizes in its config and restart it"
            )
        return None

    def _taken(self) -> int:
        return len(self.by_size) + len(self._opening) + len(self._closing)

    def _reclaimable(self) -> list[int]:
        """The sizes unused for ``idle_s`` or more, the longest unused first."""
        now = time.monotonic()
        idle = []
        for size, tenant in self.by_size.items():
            unused = tenant.unused_for(now)
            if size != self.configured and unused is not None and unused >= self.idle_s:
                idle.append((-unused, size))
        return [size for _, size in sorted(idle)]

    def unused_problem(self, block_bytes: int) -> str | None:
        """Why ``block_bytes`` cannot be given back now, or ``None``."""
        tenant = self.by_size.get(block_bytes)
        if tenant is None:
            if block_bytes in self._closing:
                return None
            served = ", ".join(str(size) for size in self.by_size)
            return f"block size {block_bytes} is not open (open: {served})"
        if block_bytes == self.configured:
            return f"block size {block_bytes} is the configured block_bytes: it is never given back"
        if tenant.unused_for(time.monotonic()) is None:
            return (
                f"block size {block_bytes} is in use: {tenant.users} connection(s),"
                f" {tenant.held} block(s) in leases"
            )
        if self.close_size is None:
            return "this daemon cannot give block sizes back"
        return None

    async def give_back(self, block_bytes: int) -> None:
        """Give ``block_bytes`` back (see the class); :class:`LookupError` saying why not.
        Once, however many ask; a hello naming it meanwhile waits and opens it anew."""
        closing = self._closing.get(block_bytes)
        if closing is None:
            problem = self.unused_problem(block_bytes)
            if problem is not None or self.close_size is None:
                raise LookupError(problem)
            tenant = self.by_size.pop(block_bytes)
            closing = asyncio.ensure_future(self.close_size(block_bytes, tenant))
            closing.add_done_callback(lambda done: done.cancelled() or done.exception())
            closing.add_done_callback(lambda _: self._closing.pop(block_bytes, None))
            self._closing[block_bytes] = closing
        try:
            await asyncio.shield(closing)
        finally:
            if closing.done() and self._closing.get(block_bytes) is closing:
                del self._closing[block_bytes]

    def sizes_figures(self) -> dict[str, dict[str, Any]]:
        """Per open size: whether it is the configured one, its connections, and for how
        long nothing has used it (``None`` while something does)."""
        now = time.monotonic()
        figures = {}
        for size, tenant in self.by_size.items():
            unused = tenant.unused_for(now)
            figures[str(size)] = {
                "configured": size == self.configured,
                "connections": tenant.users,
                "unused_s": None if unused is None else round(unused, 1),
            }
        return figures

    async def open(self, block_bytes: int) -> Tenant:
        """The tenant at ``block_bytes``, opened now if it is new: once, however many
        connections ask for it at the same time, and to its end even when the one that
        asked first goes away (a client whose hello timed out finds it open, or opening,
        when it asks again: an open cut short would be started again, and cut short again,
        by every retry)."""
        known = self.by_size.get(block_bytes)
        if known is not None:
            return known
        closing = self._closing.get(block_bytes)
        if closing is not None:  # being given back: opened anew once that is done
            with contextlib.suppress(Exception):
                await asyncio.shield(closing)
            return await self.open(block_bytes)
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
            while self._taken() > self.limit:  # room is made by a size long unused
                idle = self._reclaimable()
                if not idle:
                    raise LookupError(self.refusal(block_bytes) or "no room for a new block size")
                with contextlib.suppress(LookupError):
                    await self.give_back(idle[0])
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
