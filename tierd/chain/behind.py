"""Write-behind: blocks stored into a level copied down soon after, off the store's path.

A store into a full level waits for its victims' demotion: their bytes are copied to the
level below before their slots are reused, so with a disk tier below, every store into a
full CPU tier waits for a disk write and its syncs. A level with ``write_behind`` copies
each block a client stores into it down in the background, soon after the store ends:
by the time the block is evicted, the level below holds it, and its eviction is a drop.
The store path never waits for this copy; the disk's time moves off it whenever the disk
keeps up.

- Per level, one queue of keys stored and not yet copied (keys only: no bytes are held),
  at most the level's size (older ones are the first to be evicted, demoted then as
  ever), and one task at a time draining it, a batch at a time, oldest first.
- A batch's blocks are pinned above while they are copied (:meth:`Movement.copy_down`),
  so no eviction reuses a slot being read; a batch is at most a quarter of the level
  (and :data:`BATCH_BYTES`, :data:`BATCH_BLOCKS`). A reservation that finds no room
  while a batch is pinned waits for it and tries again (:meth:`WriteBehind.unpin`): the
  background never makes a store fail.
- A block the level no longer holds ready, or that the level below holds or is writing
  already, is skipped. Nothing is copied while the level below has an admission rule
  other than ``always``: a rule decides at eviction, when the block's uses are known.
- :meth:`WriteBehind.pause` ends the tasks after their batch (a flush copies everything
  itself, and nothing may be copying when the stores close); :meth:`resume` starts them
  again on what is still queued.
- :meth:`WriteBehind.backlog` says how many blocks are still to be looked at (queued, or
  in the batch being copied) and :meth:`WriteBehind.settled` waits until none is: an
  ordered replay waits for that after each store, so that where its next call finds the
  blocks does not depend on how fast the disk wrote them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog

from tierd.chain.levels import ChainLevels
from tierd.errors import TierdError
from tierd.keys import BlockKey
from tierd.turns import next_turn

__all__ = ["BATCH_BLOCKS", "BATCH_BYTES", "WriteBehind"]

log = structlog.get_logger("tierd.chain")

CopyDown = Callable[[int, list[BlockKey]], Awaitable[list[BlockKey]]]
"""Copies a batch of a level's ready blocks to the level below, pinned above meanwhile
(:meth:`tierd.chain.moves.Movement.copy_down`); answers the keys moved."""

BATCH_BYTES = 32 << 20  # bytes of blocks one copy down moves at most
BATCH_BLOCKS = 512  # and blocks: the loop's share of a batch stays a short turn


class WriteBehind:
    """The write-behind queues and tasks of one chain's levels."""

    def __init__(self, levels: ChainLevels, copy_down: CopyDown) -> None:
        self._levels = levels
        self._copy_down = copy_down
        self._queues: dict[int, deque[BlockKey]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._copying: dict[int, int] = {}  # blocks in the batch being copied, per level
        self._paused = 0

    def stored(self, index: int, keys: Sequence[BlockKey]) -> None:
        """``keys`` became ready at level ``index`` through a client's store."""
        levels = self._levels.levels
        if not keys or not levels[index].write_behind or index + 1 >= len(levels):
            return
        queue = self._queues.get(index)
        if queue is None:
            queue = self._queues[index] = deque(maxlen=levels[index].tier.num_blocks)
        queue.extend(keys)
        self._start(index)

    def _start(self, index: int) -> None:
        if self._paused or index in self._tasks or not self._queues.get(index):
            return
        task = asyncio.get_running_loop().create_task(
            self._drain(index), name=f"write-behind-{index}"
        )
        self._tasks[index] = task
        task.add_done_callback(functools.partial(self._ended, index))

    def _ended(self, index: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(index) is task:  # cancelled before it ran: its finally did not
            del self._tasks[index]

    async def _drain(self, index: int) -> None:
        try:
            await self._copy_queued(index)
        finally:  # at once, not in a callback: a store right after starts a new task
            del self._tasks[index]

    async def _copy_queued(self, index: int) -> None:
        level = self._levels.levels[index]
        lower = self._levels.levels[index + 1]
        queue = self._queues[index]
        bounds = (level.tier.num_blocks // 4, BATCH_BYTES // level.store.block_bytes, BATCH_BLOCKS)
        most = max(1, min(bounds))
        while queue and not self._paused and level.write_behind and lower.admission.always:
            batch: list[BlockKey] = []
            for _ in range(min(len(queue), 4 * most)):  # bounded work per turn of the loop
                key = queue.popleft()
                if key in level.tier and key not in lower.tier and not lower.tier.is_writing(key):
                    batch.append(key)
                    if len(batch) == most:
                        break
            batch = list(dict.fromkeys(batch))
            if not batch:  # a run of keys gone or copied already
                await next_turn()
                continue
            self._copying[index] = len(batch)
            try:
                moved = await self._copy_down(index, batch)
            except TierdError as exc:  # the blocks stay dirty: their eviction demotes them
                log.warning("write-behind stopped", tier=level.tier.name, error=str(exc))
                return
            except Exception:  # logged whole: the stores go on without it
                log.exception("write-behind failed", tier=level.tier.name)
                return
            finally:
                self._copying[index] = 0
            level.written_behind += len(moved)

    def backlog(self, index: int) -> int:
        """Blocks stored into level ``index`` that write-behind has still to look at: the
        queue and the batch being copied (0 while nothing will take them: no task runs,
        none is paused to resume later, as after a failed copy until the next store)."""
        if index not in self._tasks and not self._paused:
            return 0
        return len(self._queues.get(index, ())) + self._copying.get(index, 0)

    async def settled(self) -> None:
        """Wait until no task is copying behind stores: every queue drained (or left
        while paused, or after a failed copy). Tasks start only from stores and
        :meth:`resume`, so with no caller storing meanwhile this ends after the queued
        blocks' copies."""
        me = asyncio.current_task()
        while tasks := [task for task in self._tasks.values() if task is not me]:
            await asyncio.wait(tasks)

    async def unpin(self, index: int) -> bool:
        """Wait for the batch of level ``index`` being copied (and so pinned) to end, for a
        reservation there that found no room; whether one was. Its next batch starts
        after the caller's next step. (A batch reserves only at levels below its own,
        so no two batches ever wait for each other.)"""
        task = self._tasks.get(index)
        if task is None or task is asyncio.current_task():
            return False
        self._paused += 1  # it takes no next batch meanwhile
        try:
            await asyncio.wait([task])
        finally:
            self.resume()
        return True

    async def pause(self) -> None:
        """Take no new batch, and wait for the batches being copied but the caller's own
        (until :meth:`resume`; pauses nest)."""
        self._paused += 1
        me = asyncio.current_task()
        tasks = [task for task in self._tasks.values() if task is not me]
        try:
            if tasks:
                await asyncio.wait(tasks)
        except BaseException:
            self.resume()
            raise

    def resume(self) -> None:
        """Start again on what is still queued."""
        self._paused = max(0, self._paused - 1)
        for index in list(self._queues):
            self._start(index)

    async def close(self) -> None:
        """End for good: wait for the batches being copied; drop what is queued."""
        await self.pause()
        self._queues.clear()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """:meth:`pause` for the ``async with`` block, then :meth:`resume`."""
        await self.pause()
        try:
            yield
        finally:
            self.resume()
