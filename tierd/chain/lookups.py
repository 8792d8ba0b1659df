"""Lookups: which leading keys the chain holds, and where, with the counts they keep.

:class:`Lookups` owns the chain's lookup counters (lookups made, block hits and misses,
hits by level; the remote level's hits are its side's). It reads the levels' indexes and
asks the remote level whether it holds what no local level does; it never moves, pins
or waits for a block.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.chain.levels import ChainLevels
from tierd.chain.values import LookupResult
from tierd.keys import BlockKey

__all__ = ["Lookups"]


class Lookups:
    """Lookups over the levels of ``levels``, counted."""

    def __init__(self, levels: ChainLevels) -> None:
        self._levels = levels
        self.lookups = self.hit_blocks = self.miss_blocks = 0
        self.hits_by_level = [0] * len(levels.levels)

    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        """How many leading keys are ready at some level, and where. A lookup is a query:
        it may be repeated while a request waits (``in_flight``), so it counts no use."""
        tiers = self._levels.tiers
        top, hits = tiers[0], self.hits_by_level
        found: list[int] = []
        in_flight = False
        pos, n = 0, len(keys)
        while pos < n:
            run = top.ready_run(keys, pos)  # the hot case: a run of hits at the top level
            if run:
                found += [0] * run
                hits[0] += run
                pos += run
                continue
            key = keys[pos]
            for index in range(1, len(tiers)):
                if key in tiers[index]:
                    found.append(index)
                    hits[index] += 1
                    pos += 1
                    break
            else:
                in_flight = any(tier.is_writing(key) for tier in tiers)
                break
        self.lookups += 1
        self.hit_blocks += len(found)
        self.miss_blocks += n - len(found)
        media = tuple(map(self._levels.media.__getitem__, found))
        return LookupResult(len(found), tuple(found), media, in_flight)

    async def find(self, keys: Sequence[BlockKey]) -> LookupResult:
        """:meth:`lookup`, then, with a remote level, the rest of the leading run across
        local and remote levels alike: past the local run, the keys no local level holds
        are asked of the remote level in one batched existence check (faults there are
        misses, bounded by its deadline), and the run goes on through keys held locally
        or remotely until the first key held nowhere. Under LRU a prefix's head ages out
        first, so a head on the remote level with its tail still local is the usual shape.
        Without a remote level it is :meth:`lookup` and never awaits."""
        local = self.lookup(keys)
        remote = self._levels.remote
        if remote is None or local.in_flight or local.count == len(keys):
            return local
        holders = self._holders(keys, local.count)
        missing = [
            key for key, holder in zip(keys[local.count :], holders, strict=True) if holder is None
        ]
        run = await remote.level.exists(missing)
        if not run:
            return local
        where = len(self._levels.levels)  # the remote level comes after the local ones
        levels = list(local.levels)
        for holder in holders:
            if holder is None:
                if run == 0:
                    break  # held nowhere: the run ends here
                run -= 1
                holder = where
            levels.append(holder)
        found = levels[local.count :]
        for holder in found:
            if holder == where:
                remote.hits += 1
            else:
                self.hits_by_level[holder] += 1
        self.hit_blocks += len(found)
        self.miss_blocks -= len(found)
        media = (*self._levels.media, remote.level.medium)
        stop = keys[len(levels)] if len(levels) < len(keys) else None
        tiers = self._levels.tiers
        in_flight = stop is not None and any(tier.is_writing(stop) for tier in tiers)
        return LookupResult(len(levels), tuple(levels), tuple(media[i] for i in levels), in_flight)

    def _holders(self, keys: Sequence[BlockKey], start: int) -> list[int | None]:
        """For each key from ``keys[start]`` on, the highest local level holding it ready
        (``None``: none does)."""
        tiers = self._levels.tiers
        return [
            next((i for i, tier in enumerate(tiers) if key in tier), None) for key in keys[start:]
        ]

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some local level holds it ready (in flight: False). Unlike
        :meth:`lookup` it does not stop at a miss; it counts one lookup and its hits."""
        by_level = self.hits_by_level
        held = [False] * len(keys)
        for i, key in enumerate(keys):
            index = self._holder(key)
            if index is not None:
                held[i] = True
                by_level[index] += 1
        hits = held.count(True)
        self.lookups += 1
        self.hit_blocks += hits
        self.miss_blocks += len(keys) - hits
        return held

    def held_locally(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some local level holds it ready; a query that counts nothing."""
        return [self._holder(key) is not None for key in keys]

    def _holder(self, key: BlockKey) -> int | None:
        """The fastest level that holds ``key`` ready."""
        return next((i for i, tier in enumerate(self._levels.tiers) if key in tier), None)

    async def find_each(self, keys: Sequence[BlockKey]) -> list[bool]:
        """:meth:`holds`, then, with a remote level, one batched existence check there for
        the keys no local level holds (faults there are misses, bounded by its deadline)."""
        held = self.holds(keys)
        remote = self._levels.remote
        if remote is None or all(held):
            return held
        missing = [i for i, flag in enumerate(held) if not flag]
        there = await remote.level.present([keys[i] for i in missing])
        for i, flag in zip(missing, there, strict=True):
            held[i] = flag
        found = sum(there)
        remote.hits += found
        self.hit_blocks += found
        self.miss_blocks -= found
        return held
