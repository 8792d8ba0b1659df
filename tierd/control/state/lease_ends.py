"""Leases the daemon ends on its own, a piece a turn of the event loop.

A client's lease is ended by the client (``complete_store``, ``abort_store``,
``complete_load``) or by the daemon: when the client's connection closes with leases
open, and when a store lease outlives ``store_lease_ttl_s`` (then it is *withdrawn*: its
keys go, and its slots stay out of use until the client is done with them or gone:
:mod:`tierd.control.requests.leases`). Ending a lease is a Python
step per key (a reserved slot freed, a pinned key moved to its policy's recent end), and
a connection may hold half the entry tier in leases: ended at once, they would hold the
loop that every tenant shares for as long as all their keys' steps take.

:func:`finish` ends a handle at once; :func:`finish_in_pieces` ends it 512 keys a turn
(a client's own ``abort_store`` and ``complete_load`` too, when not :func:`small`).
:class:`LeaseEnds` (one per tenant) takes what the daemon ends on its own and ends it
with one task, a handle after the other and 512 keys a turn, so however many leases a
tenant's connections leave or let expire together, the loop does at most one piece of
them per turn. :meth:`LeaseEnds.close` ends what is left at once (the server's stop).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import structlog

from tierd.chain import LoadHandle, StoreHandle
from tierd.turns import LOAD_KEYS, STORE_KEYS, next_turn

__all__ = ["Lease", "LeaseEnds", "finish", "finish_in_pieces", "small"]

log = structlog.get_logger("tierd.control")

Lease = StoreHandle | LoadHandle


def finish(handle: Lease) -> None:
    """Give ``handle``'s blocks back to the chain at once: abort a store, release a load."""
    if isinstance(handle, StoreHandle):
        handle.abort()
    else:
        handle.release()


async def finish_in_pieces(handle: Lease) -> None:
    """:func:`finish`, a piece of the keys a turn of the loop; what is left is finished
    at once if this is cancelled."""
    if isinstance(handle, StoreHandle):
        await handle.abort_in_pieces()
    else:
        await handle.release_in_pieces(LOAD_KEYS)


def small(handle: Lease) -> bool:
    """Whether ``handle`` is ended at once: no more keys than one piece."""
    return len(handle.keys) <= min(STORE_KEYS, LOAD_KEYS)


class LeaseEnds:
    """The leases one tenant's connections left to the daemon to end, ended in order by
    one task, a piece a turn; a small one is ended at once. Each may come with what to
    call once it is ended (its blocks are then given back to the lease bounds). An
    expired store lease is *withdrawn* instead (:meth:`withdraw`): its keys go, its slots
    stay out of use until it is ended too."""

    def __init__(self) -> None:
        self._queue: deque[_Entry] = deque()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        """Leases waiting to be ended, the one being ended included."""
        return len(self._queue)

    def add(self, handle: Lease, then: Callable[[], None] | None = None) -> None:
        self._put((handle, then, False))

    def withdraw(self, handle: StoreHandle) -> None:
        """Withdraw ``handle``'s write (:meth:`StoreHandle.withdraw`), a piece a turn:
        ended later by :meth:`add`, queued behind this, which frees its slots."""
        self._put((handle, None, True))

    def _put(self, entry: _Entry) -> None:
        if small(entry[0]):
            _end(*entry)
            return
        self._queue.append(entry)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        queue = self._queue
        try:
            while queue:
                await next_turn()  # a turn between two leases, as between two pieces
                handle, then, withdraw = queue[0]
                try:
                    if withdraw and isinstance(handle, StoreHandle):
                        await handle.withdraw_in_pieces()
                    else:
                        await finish_in_pieces(handle)
                except Exception:  # the chain's fault, not the tenant's: go on
                    log.exception("ending a lease failed", blocks=len(handle.keys))
                queue.popleft()
                if then is not None:
                    then()
        finally:
            while queue:  # cancelled: the rest at once (finishing twice is a no-op)
                _end(*queue.popleft())
            self._task = None

    async def close(self) -> None:
        """End every lease left at once, and stop the task."""
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # its own cancellation is not raised here
        while self._queue:
            _end(*self._queue.popleft())


_Entry = tuple[Lease, Callable[[], None] | None, bool]  # handle, then, withdraw


def _end(handle: Lease, then: Callable[[], None] | None, withdraw: bool = False) -> None:
    if withdraw and isinstance(handle, StoreHandle):
        handle.withdraw()
    else:
        finish(handle)
    if then is not None:
        then()
