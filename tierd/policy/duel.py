"""Duel: ARC or LRU, whichever a sampled shadow of each finds better on the traffic now.

ARC wins where a frequent set must survive a stream of blocks seen once (small tiers);
LRU wins where most reuse is a second use after a long gap (a conversation's next turn
in a large tier), and there ARC's protected list of blocks seen twice crowds out the
ones that will come back. Neither wins everywhere: on the shared conversation trace ARC
is 0.023 above LRU at 1 % of the unique blocks and 0.018 below it at 25 %.

So this policy keeps ARC's lists and ghosts and chooses victims in one of two modes:
ARC's (T1 while it exceeds its target ``p``, else T2) or LRU's (the least recent of
both lists, by a stamp per key). The mode follows two shadow caches, an LRU and an ARC,
each fed only the keys whose hash falls in a fixed sample (set dueling, Qureshi et
al., ISCA'07, sized like SHARDS, Waldspurger et al., FAST'15): with a sampling rate
``r`` a shadow of ``r x capacity`` blocks sees what a full-size cache would. Their hit
counts are halved every few shadow-capacities of samples, so the choice follows a
change in the traffic; ties go to LRU. Nothing is fitted to a trace: the sample size
and the halving window are stated in shadow capacities, and the rest is learned.

Cost: a stamp per tracked key and the shadows (about ``max(1024, capacity/32)`` keys
each, plus their ghosts).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from itertools import filterfalse

from xxhash import xxh3_64_intdigest

from tierd.keys import BlockKey
from tierd.maps import PART_KEYS, Shards, part_count
from tierd.policy.arc import ARCPolicy
from tierd.policy.base import CachePolicy
from tierd.policy.lru import LRUPolicy
from tierd.policy.order import ONE_DICT_KEYS
from tierd.policy.registry import register_policy

__all__ = ["DuelPolicy"]

MIN_SHADOW = 1024
"""A shadow holds at least this many blocks (or the whole capacity, if smaller)."""
MIN_RATE = 1 / 32
"""The sampling rate never drops below this, so a shadow sees enough of a large tier."""
WINDOW = 4
"""Shadow hit counts are halved after this many shadow capacities of sampled keys."""


class Shadow:
    """A small cache that only counts hits: a request's sampled keys are looked up,
    the present ones touched and the missing ones stored, evicting as needed."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.hits = 0.0

    def access(self, keys: Sequence[BlockKey]) -> None:
        policy = self.policy
        present = [key for key in keys if key in policy]
        self.hits += len(present)
        policy.touch(present)
        self.add(keys)

    def add(self, keys: Sequence[BlockKey]) -> None:
        policy = self.policy
        new = [key for key in dict.fromkeys(keys) if key not in policy]
        if not new:
            return
        new = new[-policy.capacity :]
        need = len(policy) + len(new) - policy.capacity
        if need > 0:
            policy.evict(need)  # a shadow holds nothing, so this always succeeds
        policy.insert(new)

    def clear(self) -> None:
        self.policy.clear()
        self.hits = 0.0


@register_policy
class DuelPolicy(ARCPolicy):
    """ARC's lists, with victims chosen the ARC way or the LRU way as the shadows say."""

    name = "duel"

    def __init__(
        self, capacity: int, part_keys: int = PART_KEYS, one_dict: int = ONE_DICT_KEYS
    ) -> None:
        super().__init__(capacity, part_keys, one_dict)
        rate = max(MIN_RATE, min(1.0, MIN_SHADOW / capacity))
        self._threshold = int(rate * 2**64)
        size = max(1, round(capacity * rate))
        self._lru = Shadow(LRUPolicy(size))
        self._arc = Shadow(ARCPolicy(size))
        self._window = WINDOW * size
        self._samples = 0
        # A stamp per tracked key, in parts for a big tier (as ARC's lists: no put copies
        # a dict of all its keys); hot loops reach the parts directly.
        self._stamps: Shards[BlockKey, int] = Shards(part_count(capacity, part_keys, one_dict))
        self._clock = 0
        self.arc_mode = False

    @property
    def shadow_hits(self) -> tuple[float, float]:
        """The decayed hit counts of the LRU and the ARC shadow."""
        return self._lru.hits, self._arc.hits

    def _sample(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        threshold = self._threshold
        return [key for key in keys if xxh3_64_intdigest(key) < threshold]

    def insert(self, keys: Sequence[BlockKey]) -> None:
        super().insert(keys)
        parts, low, clock = self._stamps.parts, self._stamps.low, self._clock
        for key in keys:
            clock += 1
            parts[hash(key) & low][key] = clock
        self._clock = clock
        sampled = self._sample(keys)
        if sampled:
            self._lru.add(sampled)
            self._arc.add(sampled)

    def remove(self, key: BlockKey) -> bool:
        if super().remove(key):
            del self._stamps[key]
            return True
        return False

    def touch(self, keys: Sequence[BlockKey]) -> None:
        super().touch(keys)
        parts, low, clock = self._stamps.parts, self._stamps.low, self._clock
        for key in reversed(keys):
            part = parts[hash(key) & low]
            if key in part:
                clock += 1
                part[key] = clock
        self._clock = clock
        sampled = self._sample(keys)
        if not sampled:
            return
        lru, arc = self._lru, self._arc
        lru.access(sampled)
        arc.access(sampled)
        self.arc_mode = arc.hits > lru.hits
        self._samples += len(sampled)
        if self._samples >= self._window:
            lru.hits /= 2
            arc.hits /= 2
            self._samples = 0

    def release(self, key: BlockKey) -> None:
        super().release(key)
        if key in self._stamps:
            self._clock += 1
            self._stamps[key] = self._clock

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        victims = super().evict(n, protected)
        if victims:
            self._stamps.pop_all(victims)
        return victims

    def _choose(
        self, n: int, protected: Collection[BlockKey]
    ) -> tuple[list[BlockKey], list[BlockKey]]:
        if self.arc_mode:
            return super()._choose(n, protected)
        # LRU: merge the two lists (each least recent first) by stamp.
        stamps = self._stamps
        stamp = stamps.parts[0].__getitem__ if not stamps.low else stamps.__getitem__
        candidates1: Iterator[BlockKey] = filterfalse(protected.__contains__, self._t1)
        candidates2: Iterator[BlockKey] = filterfalse(protected.__contains__, self._t2)
        next1, next2 = next(candidates1, None), next(candidates2, None)
        from_t1: list[BlockKey] = []
        from_t2: list[BlockKey] = []
        while len(from_t1) + len(from_t2) < n:
            if next1 is not None and (next2 is None or stamp(next1) < stamp(next2)):
                from_t1.append(next1)
                next1 = next(candidates1, None)
            elif next2 is not None:
                from_t2.append(next2)
                next2 = next(candidates2, None)
            else:
                break
        return from_t1, from_t2

    def clear(self) -> None:
        super().clear()
        self._lru.clear()
        self._arc.clear()
        self._stamps.clear()
        self._samples = 0
        self.arc_mode = False
