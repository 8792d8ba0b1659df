"""When the disk store checkpoints its slabs' indexes, and how a snapshot gets written.

After each write the store asks :meth:`Checkpoints.after_write` to look at its slabs: a
slab whose journal outgrew ``journal_limit_bytes`` starts an
:class:`~tierd.stores.disk.index.IndexWalk`; a task of this object takes one slice of it
per slab per loop turn, and once it is whole has a writer thread's flush rotate the
journal at that point (:meth:`~tierd.stores.disk.journal.Journal.rotate`), then the
snapshot written on a thread of its own. Nothing here grows with the index on the loop,
and no write waits for a snapshot.

A snapshot that cannot be written (a full file system) is said once in the log and tried
again after 5 s, then 10, 20, ... up to 5 minutes (encoded once, whatever the number of
tries); meanwhile the journal goes on growing and a crash replays it whole, so nothing
is lost. A rotation whose new journal file cannot be made counts the same way.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierd.logs import get_logger
from tierd.stores.disk.index import IndexWalk
from tierd.turns import next_turn

if TYPE_CHECKING:
    from tierd.stores.disk.slab import Slab

__all__ = ["Checkpoints"]

_log = get_logger("tierd.disk")


_RETRY_S = (5.0, 300.0)  # the first retry after 5 s, doubling up to 5 minutes


@dataclass(slots=True)
class _Snapshots:
    """A slab's snapshot writes (mutable bookkeeping, loop and snapshot thread)."""

    failures: int = 0  # failed in a row
    retry_at: float = 0.0  # monotonic time before which none is tried again
    writing: bool = False  # one is on the snapshot thread


class Checkpoints:
    """Checkpoints of ``slabs``' indexes; ``flush`` submits a slab's journal flush to a
    writer thread, ``pool`` is the snapshot thread."""

    def __init__(
        self,
        slabs: Sequence[Slab],
        limit: int,
        flush: Callable[[Slab], Future[int]],
        pool: ThreadPoolExecutor,
    ) -> None:
        self._slabs = list(slabs)
        self._limit = limit
        self._flush = flush
        self._pool = pool
        self._state = {id(slab): _Snapshots() for slab in self._slabs}
        self._walker: asyncio.Task[None] | None = None
        self._writes: set[Future[None]] = set()

    @property
    def failures(self) -> int:
        """Snapshot writes (and rotations) failed in a row, over every slab."""
        return sum(state.failures for state in self._state.values())

    def after_write(self) -> None:
        """Start the checkpoints due and the snapshot retries due (loop thread)."""
        for slab in self._slabs:
            state = self._state[id(slab)]
            if (exc := slab.journal.given_up()) is not None:  # the journal goes on
                self._failed(slab, state, exc)
            if self._due(slab, state):
                slab.walk = IndexWalk(slab.cfg.local_slots)
            elif slab.journal.due is not None:
                self._write(slab)
        if self._walker is None and any(slab.walk for slab in self._slabs):
            self._walker = asyncio.get_running_loop().create_task(self._walk())

    def _due(self, slab: Slab, state: _Snapshots) -> bool:
        return (
            slab.journal.bytes > self._limit
            and slab.walk is None
            and not slab.journal.rotating
            and not slab.read_only
            and time.monotonic() >= state.retry_at
        )

    async def _walk(self) -> None:
        try:
            while walking := [slab for slab in self._slabs if slab.walk is not None]:
                for slab in walking:
                    if slab.walk_step():  # whole: rotated by the next flush
                        await asyncio.wrap_future(self._flush(slab))
                        self._write(slab)
                await next_turn()  # slices of the walk, the disk threads between them
        finally:
            self._walker = None

    def _write(self, slab: Slab) -> None:
        """Write ``slab``'s due snapshot on the snapshot thread, unless one is being
        written or a failed one waits for its retry time."""
        state = self._state[id(slab)]
        if slab.journal.due is None or state.writing or time.monotonic() < state.retry_at:
            return
        state.writing = True
        fut = self._pool.submit(self._written, slab, state)
        self._writes.add(fut)
        fut.add_done_callback(self._writes.discard)

    def _written(self, slab: Slab, state: _Snapshots) -> None:
        """The snapshot thread's part: write it, and keep the books of failures."""
        try:
            slab.journal.write_due()
        except OSError as exc:
            self._failed(slab, state, exc)
            return
        finally:
            state.writing = False
        if state.failures:
            _log.info(
                "disk index snapshot written again",
                path=slab.journal.snapshot_path,
                failures=state.failures,
            )
            state.failures, state.retry_at = 0, 0.0

    def _failed(self, slab: Slab, state: _Snapshots, exc: OSError) -> None:
        state.failures += 1
        delay = min(_RETRY_S[1], _RETRY_S[0] * 2 ** (state.failures - 1))
        state.retry_at = time.monotonic() + delay
        if state.failures == 1:
            _log.warning(
                "cannot write the disk index snapshot: the journal goes on growing (a crash"
                " replays it, losing nothing) and the snapshot is retried with backoff",
                path=slab.journal.snapshot_path,
                error=str(exc),
                errno=exc.errno or errno.EIO,
                retry_in_s=delay,
            )

    def retry_now(self) -> None:
        """Forget the backoff: the next write retries at once (an operator freed space)."""
        for state in self._state.values():
            state.retry_at = 0.0

    async def finish_walks(self) -> None:
        """Wait until no checkpoint is being walked (each is rotated into its journal)."""
        if self._walker is not None:
            await asyncio.wait([self._walker])

    async def write_due(self) -> None:
        """Write the snapshots due now (not one waiting for its retry time), and wait
        for every snapshot write under way."""
        for slab in self._slabs:
            self._write(slab)
        for fut in list(self._writes):
            await asyncio.wrap_future(fut)

    async def close(self) -> None:
        """Stop walking (the clean close's own snapshot supersedes it) and wait for the
        snapshot write under way."""
        if self._walker is not None:
            self._walker.cancel()
            await asyncio.wait([self._walker])
        for fut in list(self._writes):
            await asyncio.wrap_future(fut)
