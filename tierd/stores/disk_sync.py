"""When the disk store makes its writes durable: the ``fsync`` modes and the periodic sync.

``always`` (the default): every write batch syncs its journal records (BEGIN) before the
blocks are written and fdatasyncs the slab after, before the write is acknowledged. A
crash of any kind (the process, the kernel, the power) loses no acknowledged block.

``batch``: writes are not synced one by one; at most ``interval`` seconds after a write,
one sync of the slab's data, then of its journal, covers every write made before it. A
power loss or kernel crash loses at most the blocks written in the last ``interval``
(plus the sync under way); a process crash (SIGKILL) loses nothing, as the kernel still
holds what was written. Headers and checksums make a block the sync did not cover a
miss, never wrong bytes.

``none``: the store never syncs block data or journal records while it serves (the
kernel writes back on its own schedule, ~30 s by default); a clean stop syncs. A power loss
or kernel crash may lose any block the kernel had not written back; a process crash loses
nothing; never wrong bytes.

In every mode a snapshot of the index (every ``journal_limit_bytes`` of journal) syncs
itself, and a clean close syncs the slab, the journal and the snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from enum import StrEnum

__all__ = ["Fsync", "PeriodicSync"]


class Fsync(StrEnum):
    ALWAYS = "always"
    BATCH = "batch"
    NONE = "none"


class PeriodicSync:
    """In ``batch`` mode: after a write, one call of ``start`` (which submits the sync to
    an I/O thread) at most ``interval`` seconds later; writes meanwhile join it. Runs on
    the event loop's thread."""

    def __init__(self, interval: float, start: Callable[[], Future[object]]) -> None:
        if interval <= 0:
            raise ValueError(f"the sync interval must be positive, got {interval}")
        self.interval = interval
        self._start = start
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[Future[object]] = set()
        self.syncs = 0  # syncs started

    def written(self) -> None:
        """A write finished: make sure a sync comes within ``interval``."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.syncs += 1
        fut = self._start()
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)

    async def close(self) -> None:
        """No sync starts any more; the one under way is waited for (the clean close
        that follows syncs everything anyway)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut in list(self._running):
            await asyncio.wrap_future(fut)
