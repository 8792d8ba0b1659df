"""Copies below of blocks held above: the first blocks a demotion's room is made of.

A promotion copies a block up and leaves the lower copy (the promoted block is clean).
That copy is a duplicate: dropping it loses nothing while a level above holds the
block, whereas a victim chosen by the lower level's policy is, in a chain filled by
demotions, a block held nowhere else. So when a demotion into a full level needs room,
the level first drops copies of blocks a level above holds, and its policy chooses
victims only for what is still missing; only in a level whose admission is ``always``
(under another rule the block, demoted again when the level above evicts it, would face
admission again and could be refused). (Reading back everything a chain of 16 CPU
over 32 disk blocks held, oldest first, served 32 of 48 when the disk's policy chose:
each promotion's demotion evicted the disk's least recent block, the next one to read.)

:class:`UpperCopies` owns, per level, the keys promoted out of it (a queue as long as
the levels above it together, oldest first: no more of them can be held above; an entry
whose block has left either level since is dropped when reached, at most
:data:`SKIP_STALE` a call, so that no call's work grows with the level), and the keys
of promotions in flight whose bytes were read into private buffers first
(:meth:`UpperCopies.swap`): a swap. Their lower copies may go as soon as they are read,
so that the demotions the promotion causes take their slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tierd.chain.levels import ChainLevels
from tierd.keys import BlockKey

__all__ = ["SKIP_STALE", "UpperCopies"]

SKIP_STALE = 1024  # stale entries one call steps over at most (the rest: at later calls)


class UpperCopies:
    """Which blocks of each level a level above holds too (promoted ones), and the room
    a demotion makes by dropping them."""

    def __init__(self, levels: ChainLevels) -> None:
        self._levels = levels
        self._promoted: dict[int, deque[BlockKey]] = {}  # level -> keys copied up from it
        self._swaps: dict[int, dict[BlockKey, None]] = {}  # level -> keys read out to move up

    def promoted(self, index: int, keys: Sequence[BlockKey]) -> None:
        """``keys`` of level ``index`` were copied to a level above; their copies at
        ``index`` go first when a demotion into it needs room."""
        if not keys or not self._levels.levels[index].admission.always:
            # Under another rule a dropped copy's block, demoted again later, would face
            # admission again and might be refused: lost, where its copy would have hit.
            return
        queue = self._promoted.get(index)
        if queue is None:
            above = sum(tier.num_blocks for tier in self._levels.tiers[:index])
            queue = self._promoted[index] = deque(maxlen=max(1, above))
        queue.extend(keys)

    def swap(self, index: int, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """A promotion read ``keys`` of level ``index`` into private buffers and will
        write them above: their blocks at ``index`` may go for room now (they are the
        first to). Returns the keys registered, for :meth:`end_swap`."""
        swaps = self._swaps.setdefault(index, {})
        fresh = [key for key in dict.fromkeys(keys) if key not in swaps]
        swaps.update(dict.fromkeys(fresh))
        return fresh

    def end_swap(self, index: int, keys: Sequence[BlockKey]) -> None:
        """The promotion of :meth:`swap` ended (written above, or failed)."""
        swaps = self._swaps.get(index, {})
        for key in keys:
            swaps.pop(key, None)

    def spare(self, index: int) -> int:
        """About how many blocks of level ``index`` a demotion could drop for room now:
        the promoted ones still at both levels, counted after dropping stale entries at
        the front of the queue (so stale ones further in may be counted)."""
        queue = self._promoted.get(index)
        if not queue:
            return 0
        for _ in range(SKIP_STALE):
            if not queue or self._duplicate(index, queue[0]):
                break
            queue.popleft()
        return len(queue)

    def make_room(self, index: int, count: int) -> int:
        """Drop blocks of level ``index`` held above, or read out by a swap, until
        ``count`` blocks fit without evicting by the policy (or none of those is left);
        pinned ones stay. Returns how many were dropped."""
        tier = self._levels.tiers[index]
        need = count - tier.free
        if need <= 0:
            return 0
        chosen: dict[BlockKey, None] = {}
        for key in self._swaps.get(index, ()):
            if len(chosen) == need:
                break
            if key in tier and not tier.is_pinned(key):
                chosen[key] = None
        queue = self._promoted.get(index)
        busy: list[BlockKey] = []
        looks = need + SKIP_STALE  # each entry looked at leaves the queue, or goes back
        while queue and len(chosen) < need and looks > 0:
            looks -= 1
            key = queue.popleft()
            if key in chosen or not self._duplicate(index, key):
                continue  # gone from one of the two levels since (or listed twice)
            if tier.is_pinned(key):
                busy.append(key)  # being read: it may go at a later demotion
            else:
                chosen[key] = None
        if queue is not None and busy:
            queue.extendleft(reversed(busy))
        if not chosen:
            return 0
        tier.discard(list(chosen))
        self._levels.levels[index].copies_dropped += len(chosen)
        return len(chosen)

    def _duplicate(self, index: int, key: BlockKey) -> bool:
        """Whether level ``index`` and a level above it both hold ``key`` ready."""
        tiers = self._levels.tiers
        return key in tiers[index] and any(key in tier for tier in tiers[:index])
