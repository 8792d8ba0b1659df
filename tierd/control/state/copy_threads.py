"""The threads that copy region jobs, shared fairly between tenants and connections.

A region job's bytes move in a thread (positional syscalls on the engine's descriptor).
One first-come-first-served pool would let one tenant's backlog decide everyone's wait
(a few keys' load behind another tenant's thousands of pieces), and a tenant writing into
its own memfd while the daemon copies into it would hold every thread on that file's
inode lock. So work is queued per tenant, and within a tenant per connection,
and handed to threads in turn:

- A job is cut into *slices* by its caller (:func:`slices`, a few MiB each) and each
  slice queues on its own: a long job takes its turn slice by slice, behind nobody's
  whole backlog.
- A thread that comes free takes the next tenant with queued work, round robin, and
  within it the next connection, round robin.
- One tenant runs at most ``threads - 1`` slices at once, and one connection at most
  ``threads - 2`` (at least one): whatever a client's own files do to its copies (a held
  inode lock, a slow fault), threads are left for the other tenants, and for the other
  connections of its tenant (an untenanted daemon is one tenant: every engine of it).

The loop's own share of a job (its pins, slots, slices' hand-overs and replies) is fair
per tenant too (:class:`TenantJobs`): at most ``limits.region_jobs_per_tenant`` jobs of
one tenant run at once, the others wait their turn in order, costing the loop nothing.
Bounded per connection alone, a tenant with many engines would take as many connections'
share of the loop, at the cost of the other tenants' lookups.

Threads. The event loop owns all the bookkeeping: the queues per tenant and connection,
the counts of slices running, the threads' start and stop, and :class:`TenantJobs`. The
copy threads own nothing: each takes a slice (its callable and how to report it) from a
``queue.SimpleQueue`` (locked by itself), runs it, and hands the outcome back to the loop
with ``call_soon_threadsafe``; the loop's work per slice is constant. What a slice
touches (the engine's descriptor, a store's buffers) its caller keeps still until it has
ended: :meth:`FairThreads.run` returns only then, even when cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from typing import Any, TypeVar

from tierd.stores.base import background_priority, settle

__all__ = ["FairThreads", "SLICE_BYTES", "TenantJobs", "slices"]

T = TypeVar("T")
SLICE_BYTES = 8 << 20  # bytes of one queued slice of a job, at most (one block more)
_Work = tuple[Callable[[], Any], asyncio.Future[Any]]
_Handed = tuple[Callable[[], Any], Callable[[Any], object]]
_STOP: Any = object()  # handed to a thread: it ends


def slices(count: int, block_bytes: int, most: int = SLICE_BYTES) -> Iterator[range]:
    """``range(count)`` cut into runs of at most ``most`` bytes of blocks (one block at
    least per run)."""
    step = max(1, most // max(1, block_bytes))
    for start in range(0, count, step):
        yield range(start, min(count, start + step))


class FairThreads:
    """``threads`` copy threads; :meth:`run` queues a callable under a (tenant,
    connection) owner and returns its result once it ran."""

    def __init__(self, threads: int = 4, name: str = "tierd-region") -> None:
        self.threads = threads
        self.per_tenant = max(1, threads - 1)
        self.per_connection = max(1, threads - 2)
        # Threads of our own, all started at once: work is handed over only when one is
        # free, so none ever waits in a queue behind another's. (An executor starts its
        # threads lazily, and may stay short of its number while those it has wait on a
        # client's file lock: another tenant's slice would then wait with them.)
        self._work: queue.SimpleQueue[_Handed] = queue.SimpleQueue()
        self._name = name
        self._started = False
        self._closing = False
        # tenant -> connection -> queued work; both orders are the round robin's
        self._queues: dict[Hashable, dict[Hashable, deque[_Work]]] = {}
        self._running: dict[Hashable, int] = {}  # by tenant, and by (tenant, connection)
        self._busy = 0

    async def run(self, tenant: Hashable, conn: Hashable, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread when its owner's turn comes; returns only once it
        ended, even when the caller is cancelled meanwhile (then re-raised). Cancelled
        before its turn, it never runs."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        queue = self._queues.setdefault(tenant, {}).setdefault(conn, deque())
        work: _Work = (fn, future)
        queue.append(work)
        self._dispatch()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if work in queue:  # not started: it never will
                queue.remove(work)
                self._forget(tenant, conn)
                raise
            await settle(future)
            raise

    def _dispatch(self) -> None:
        while self._busy < self.threads:
            picked = self._next()
            if picked is None:
                return
            owners, (fn, future) = picked
            self._busy += 1
            for owner in owners:
                self._running[owner] = self._running.get(owner, 0) + 1
            if not self._started:
                self._start()
            ended = functools.partial(self._ended, owners, future)
            report = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, ended)
            self._work.put((fn, report))

    def _start(self) -> None:
        self._started = True
        for i in range(self.threads):
            thread = threading.Thread(target=self._serve, name=f"{self._name}_{i}", daemon=True)
            thread.start()

    def close(self) -> None:
        """Stop the threads once no work is running or queued (the server is gone; work
        handed over later starts them again)."""
        self._closing = True
        self._stop_if_idle()

    def _stop_if_idle(self) -> None:
        if self._closing and self._started and not self._busy and not self._queues:
            self._started = False
            for _ in range(self.threads):
                self._work.put(_STOP)

    def _serve(self) -> None:
        """One copy thread: run each callable handed over, report its outcome. It runs at
        a lower priority than the event loop's thread (``background_priority``)."""
        background_priority()
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            fn, report = item
            try:
                outcome: Any = (True, fn())
            except BaseException as exc:  # handed to the awaiting task, raised there
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                report(outcome)
            del fn, report, outcome, item

    def _next(self) -> tuple[tuple[Hashable, Hashable], _Work] | None:
        """The first tenant in turn with queued work and a thread to spare, and its
        first connection in turn with one to spare; both move to the back of their
        orders. Returns the (tenant, (tenant, connection)) owners and the work."""
        for tenant in list(self._queues):
            if self._running.get(tenant, 0) >= self.per_tenant:
                continue
            conns = self._queues[tenant]
            for conn in list(conns):
                if self._running.get((tenant, conn), 0) >= self.per_connection:
                    continue
                queue = conns.pop(conn)
                work = queue.popleft()
                if queue:
                    conns[conn] = queue
                del self._queues[tenant]
                if conns:
                    self._queues[tenant] = conns
                return (tenant, (tenant, conn)), work
        return None

    def _forget(self, tenant: Hashable, conn: Hashable) -> None:
        conns = self._queues.get(tenant)
        if conns is not None and not conns.get(conn, True):
            del conns[conn]
        if conns is not None and not conns:
            del self._queues[tenant]

    def _ended(
        self,
        owners: tuple[Hashable, Hashable],
        future: asyncio.Future[Any],
        outcome: tuple[bool, Any],
    ) -> None:
        self._busy -= 1
        for owner in owners:
            self._running[owner] -= 1
            if not self._running[owner]:
                del self._running[owner]
        if not future.done():
            ok, value = outcome
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        self._dispatch()
        self._stop_if_idle()


class TenantJobs:
    """At most ``limit()`` jobs of one tenant run at once (read at each turn: a reload
    changes it); the others wait, first come first served, and a turn given up (the
    request cancelled) passes on."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._running: dict[Hashable, int] = {}
        self._waiting: dict[Hashable, deque[asyncio.Future[None]]] = {}

    def running(self, tenant: Hashable) -> int:
        return self._running.get(tenant, 0)

    def waiting(self, tenant: Hashable) -> int:
        return len(self._waiting.get(tenant, ()))

    @contextlib.asynccontextmanager
    async def turn(self, tenant: Hashable) -> AsyncIterator[None]:
        """One job of ``tenant`` runs inside: entered once its turn has come."""
        if self._running.get(tenant, 0) < max(1, self._limit()) and not self._waiting.get(tenant):
            self._running[tenant] = self._running.get(tenant, 0) + 1
        else:
            waiting = self._waiting.setdefault(tenant, deque())
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waiting.append(granted)
            try:
                await granted
            except asyncio.CancelledError:
                if granted in waiting:  # never given its turn
                    waiting.remove(granted)
                    if not waiting:
                        del self._waiting[tenant]
                else:  # given it, and cancelled before it began: the next one's
                    self._pass_on(tenant)
                raise
        try:
            yield
        finally:
            self._pass_on(tenant)

    def _pass_on(self, tenant: Hashable) -> None:
        """A job of ``tenant`` ended: the first waiting takes its turn, else one fewer runs
        (and, below the limit, more than one waiting may start: a raised limit)."""
        waiting = self._waiting.get(tenant)
        running = self._running[tenant] - 1
        while waiting and running < max(1, self._limit()):
            granted = waiting.popleft()
            if not granted.done():  # a cancelled waiter is done: skipped
                granted.set_result(None)
                running += 1
        if waiting is not None and not waiting:
            del self._waiting[tenant]
        if running:
            self._running[tenant] = running
        else:
            del self._running[tenant]
