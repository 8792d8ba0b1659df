"""One connection's lease book: the blocks it holds in open leases, and their bounds.

A lease names the blocks of a :class:`~tierd.chain.StoreHandle` (slots reserved for a
store) or a :class:`~tierd.chain.LoadHandle` (blocks pinned for a load) by an id only the
connection that opened it can finish. :class:`Leases` keeps those ids for one session:

- **Bounds.** :meth:`Leases.hold` counts blocks as held, by the connection and by its
  tenant, *before* the chain is asked for them, so pipelined requests cannot all pass
  the bounds. What it returns, a :class:`Hold`, is the only owner of those counts: used
  as a context manager it gives back on exit whatever was not moved out of it with
  :meth:`Hold.keep` (the blocks the chain did grant), and :meth:`Hold.release` is
  idempotent. A registered lease keeps its hold until the lease ends.
- **Expiry.** A store lease not finished within ``store_lease_ttl_s`` loses its right to
  commit: its write is *withdrawn* (its keys go, so that other writes may store them,
  nothing of it is ever served), but its slots are *quarantined*: given to no other
  block while the client may still be writing into them (a stalled process resumes and
  finishes its copy). They are freed when the client says it is done with the lease
  (its ``complete_store`` or ``abort_store``, answered with the expiry's error) or its
  connection ends, and count against the connection's and the tenant's lease bounds
  until then, so a stalled client holds only its own share. The id is remembered (the
  last ``_EXPIRED_MEMORY``), so finishing it later gets a clear error.
- **End of life.** :meth:`Leases.close` hands every lease left to the tenant's
  :class:`~tierd.control.state.lease_ends.LeaseEnds`, which ends them a piece a turn of the
  loop, as it does an expired lease's and that of a handle registered after the close
  (its request outlived the client). Their blocks count against the tenant's bound until
  they are ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import structlog

from tierd.chain import LoadHandle, StoreHandle
from tierd.control.protocol import ErrorCode
from tierd.control.state.context import ServerContext
from tierd.control.state.lease_ends import Lease, finish
from tierd.control.state.tenant_table import Tenant
from tierd.errors import ProtocolError

__all__ = ["Hold", "Lease", "Leases"]

log = structlog.get_logger("tierd.control")

_H = TypeVar("_H", StoreHandle, LoadHandle)
_EXPIRED_MEMORY = 1024  # lease ids remembered as expired, for a clear error


class Leases:
    """The open leases of one connection, by id. Every block they hold counts against the
    connection's bounds and its tenant's until the lease ends; after :meth:`close` no
    lease is left open and none can be opened."""

    def __init__(self, ctx: ServerContext, conn: int = 0) -> None:
        self.ctx = ctx
        self.conn = conn  # the connection's id, in log lines
        self.tenant: Tenant | None = None  # set when the connection is admitted
        self.closed = False
        self.open: dict[int, Lease] = {}
        self.held = 0  # blocks this connection holds in open leases
        self._held_by_lease: dict[int, Hold] = {}
        self._expiry: dict[int, asyncio.TimerHandle] = {}
        # Expired store leases whose slots the client may still touch, with their holds.
        self.quarantined: dict[int, tuple[StoreHandle, Hold | None]] = {}
        self._expired: dict[int, None] = {}  # recently expired lease ids, oldest first
        ctx.lease_books.add(self)

    def __len__(self) -> int:
        """How many leases are open."""
        return len(self.open)

    def hold(self, blocks: int) -> Hold:
        """Count ``blocks`` as held by this connection before asking the chain for them
        (so pipelined requests cannot all pass the bounds); refused past a bound."""
        tenant = self.tenant
        if tenant is None:
            return Hold(self._give, 0)
        problem = tenant.lease_problem(self.held, blocks)
        if problem is not None:
            tenant.lease_refusals += 1
            raise ProtocolError(problem, code=ErrorCode.CAPACITY)
        self.held += blocks
        tenant.held += blocks
        return Hold(self._give, blocks)

    def _give(self, blocks: int) -> None:
        """``blocks`` are held no more: handed to each :class:`Hold`, which calls it once."""
        if blocks and self.tenant is not None:
            self.held -= blocks
            self.tenant.held -= blocks

    def register(self, handle: Lease, held: Hold) -> int:
        """Register ``handle`` under a new lease id, with the hold of its blocks; if the
        connection closed meanwhile (the request outlived its client), give the blocks
        back at once. A store lease is aborted if not finished within ``store_lease_ttl_s``."""
        if self.closed:
            self._end_later(handle, held)
            raise ProtocolError("the connection closed", code=ErrorCode.SHUTTING_DOWN)
        lease = self.ctx.new_lease_id()
        self.open[lease] = handle
        self._held_by_lease[lease] = held
        if isinstance(handle, StoreHandle):
            loop = asyncio.get_running_loop()
            ttl = self.ctx.limits.store_lease_ttl_s
            self._expiry[lease] = loop.call_later(ttl, self._expire, lease)
        return lease

    def end(self, lease: int) -> Lease:
        """Forget ``lease`` (the caller finishes its handle): its blocks are free."""
        handle, held = self._forget(lease)
        if held is not None:
            held.release()
        return handle

    def _forget(self, lease: int) -> tuple[Lease, Hold | None]:
        """Take ``lease`` out of the book: its handle, and the hold of its blocks."""
        timer = self._expiry.pop(lease, None)
        if timer is not None:
            timer.cancel()
        return self.open.pop(lease), self._held_by_lease.pop(lease, None)

    def _end_later(self, handle: Lease, held: Hold | None) -> None:
        """Hand ``handle`` to the tenant's lease ends (a piece a turn); its blocks stay
        counted until it is ended."""
        release = held.release if held is not None else None
        if self.tenant is not None:
            self.tenant.lease_ends.add(handle, release)
            return
        finish(handle)  # no tenant holds no lease: never the case
        if release is not None:
            release()

    def named(self, lease: int, kind: type[_H]) -> _H:
        """The handle of ``lease``, which must be of ``kind`` and held here. A store lease
        that expired gets its error, and its quarantined slots are freed: a client that
        finishes or aborts a lease is done writing into it."""
        handle = self.open.get(lease)
        if isinstance(handle, kind):
            return handle
        what = "store" if kind is StoreHandle else "load"
        if kind is StoreHandle and (lease in self._expired or lease in self.quarantined):
            ended = self.quarantined.pop(lease, None)
            if ended is not None:
                self._end_later(*ended)
            ttl = self.ctx.limits.store_lease_ttl_s
            message = (
                f"store lease {lease} expired: it was not finished within {ttl} s"
                " (limits.store_lease_ttl_s); nothing of it was stored"
            )
        else:
            message = f"lease {lease} is not a {what} lease held by this connection"
        raise ProtocolError(message, code=ErrorCode.UNKNOWN_LEASE)

    def _expire(self, lease: int) -> None:
        """A store lease outlived ``store_lease_ttl_s``: withdraw its write, and keep its
        slots (and their count against the bounds) until the client is done or gone."""
        self._expiry.pop(lease, None)
        handle = self.open.pop(lease, None)
        if not isinstance(handle, StoreHandle):
            return
        held = self._held_by_lease.pop(lease, None)
        self.quarantined[lease] = (handle, held)
        if self.tenant is not None:
            self.tenant.lease_ends.withdraw(handle)
            self.tenant.leases_expired += 1
        else:
            handle.withdraw()  # no tenant holds no lease: never the case
        self._expired[lease] = None
        if len(self._expired) > _EXPIRED_MEMORY:
            del self._expired[next(iter(self._expired))]
        log.info(
            "store lease expired",
            conn=self.conn,
            lease=lease,
            blocks=len(handle.keys),
            ttl_s=self.ctx.limits.store_lease_ttl_s,
        )

    def close(self) -> None:
        """The connection is gone: end every lease left (a piece a turn), free the slots
        of those that expired; refuse new ones."""
        self.closed = True
        self.ctx.lease_books.discard(self)
        for lease in list(self.open):
            self._end_later(*self._forget(lease))
        quarantined, self.quarantined = self.quarantined, {}
        for handle, held in quarantined.values():
            self._end_later(handle, held)


class Hold:
    """Blocks counted as held by one connection and its tenant, given back once: by
    :meth:`release` (idempotent) or on leaving a ``with`` block. :meth:`keep` moves some
    of them into a new hold that outlives the block (a lease's, or a job's)."""

    __slots__ = ("_give", "blocks")

    def __init__(self, give: Callable[[int], None], blocks: int) -> None:
        self._give = give  # what gives held blocks back to the bounds they were counted in
        self.blocks = blocks

    def keep(self, blocks: int) -> Hold:
        """Move ``blocks`` of this hold into a new one; the rest stays here."""
        if not 0 <= blocks <= self.blocks:
            raise ValueError(f"a hold of {self.blocks} blocks cannot keep {blocks}")
        self.blocks -= blocks
        return Hold(self._give, blocks)

    def release(self) -> None:
        """Give the blocks back to the bounds; a second call gives nothing."""
        blocks, self.blocks = self.blocks, 0
        self._give(blocks)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()
