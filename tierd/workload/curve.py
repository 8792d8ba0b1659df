"""The LRU hit ratio of a trace at every capacity, in one pass (``tierd simulate --curve``).

The result equals, capacity for capacity, what :func:`tierd.workload.simulate` measures
with ``--policy lru``: a request counts only the leading run of its keys that are cached,
then its cached keys are touched tail to head and its missing keys stored (in request
order, so the last one stored is the most recent).

Why this is not plain Mattson stack distances: the order a request leaves its keys in
depends on the capacity. At a capacity where key ``x`` was a hit it sits below the
request's misses and below the hits before it; where it was a miss it sits near the top.
So a bigger tier can lose ``x`` sooner than a smaller one, and "cached at capacity C" is
not the same as "stack distance <= C". What does hold, for every capacity ``C`` at least
as large as the largest request (every request is then stored whole): just after a
request ``R`` its keys are the ``|R|`` most recent, and later requests only put keys
above them. So when a later request looks ``x`` up, its depth at capacity ``C`` is::

    1 + s + #{y in R' after x in R: y was missed by R at C} + b * [x was hit by R at C]

where ``R`` is the last request that used ``x``, ``R'`` the keys whose last request is
still ``R``, ``s`` the number of distinct keys used since ``R`` (a Fenwick tree over
request numbers), and ``b`` the keys of ``R'`` before ``x``. ``x`` is cached at ``C``
exactly when that depth is at most ``C``. Each key keeps the capacities at which its last
request hit it, as a list of intervals (almost always one: ``[t, end)``); the formula
turns those of its request's later keys into its own, a sweep over their end points.

Capacities below the largest request are left out: a tier smaller than a request stores
none of it, which no single pass can follow. Pure Python, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierd.keys import BlockKey
from tierd.workload.trace import Trace

__all__ = ["DEFAULT_SHARES", "CurvePoint", "HitRatioCurve", "lru_curve"]

DEFAULT_SHARES = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0)
"""The shares of the unique blocks (in %) the table reports."""

Intervals = tuple[int, ...]
"""Flattened half-open intervals ``(lo0, hi0, lo1, hi1, ...)``, sorted and disjoint."""

_EMPTY: Intervals = ()


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """The hit ratio at one capacity (``share`` of the unique blocks, in %)."""

    capacity: int
    share: float
    hits: int
    hit_ratio: float


@dataclass(frozen=True, slots=True)
class HitRatioCurve:
    """LRU block hits at every capacity from ``min_capacity`` (the largest request, in
    distinct blocks) to ``unique_blocks`` (nothing is evicted from there on)."""

    requests: int
    block_accesses: int
    unique_blocks: int
    min_capacity: int
    hits: tuple[int, ...]  # hits[i] is the hit count at capacity min_capacity + i
    seconds: float

    def hits_at(self, capacity: int) -> int:
        """Block hits of an LRU tier of ``capacity`` blocks; ``ValueError`` below
        :attr:`min_capacity`."""
        if capacity < self.min_capacity:
            raise ValueError(
                f"the curve starts at {self.min_capacity:,} blocks (the largest request); "
                f"got {capacity:,}"
            )
        return self.hits[min(capacity, self.unique_blocks) - self.min_capacity]

    def hit_ratio(self, capacity: int) -> float:
        accesses = self.block_accesses
        return self.hits_at(capacity) / accesses if accesses else 0.0

    def point(self, share: float) -> CurvePoint | None:
        """The point at ``share`` % of the unique blocks (rounded down, as
        ``--capacity 5%`` is), or ``None`` when that is below :attr:`min_capacity`."""
        capacity = max(1, int(self.unique_blocks * share / 100))
        if capacity < self.min_capacity:
            return None
        return CurvePoint(capacity, share, self.hits_at(capacity), self.hit_ratio(capacity))

    def points(self, shares: Sequence[float] = DEFAULT_SHARES) -> list[CurvePoint]:
        return [p for p in map(self.point, shares) if p is not None]

    def capacities(self) -> range:
        return range(self.min_capacity, self.unique_blocks + 1)

    def to_dict(self, shares: Sequence[float] = DEFAULT_SHARES) -> dict[str, Any]:
        """A JSON-ready summary: the table's points, not every capacity."""
        return {
            "policy": "lru",
            "requests": self.requests,
            "block_accesses": self.block_accesses,
            "unique_blocks": self.unique_blocks,
            "min_capacity": self.min_capacity,
            "max_hit_ratio": self.hit_ratio(self.unique_blocks) if self.unique_blocks else 0.0,
            "seconds": self.seconds,
            "points": [
                {"capacity": p.capacity, "share": p.share, "hits": p.hits, "hit_ratio": p.hit_ratio}
                for p in self.points(shares)
            ],
        }


class _Fenwick:
    """Counts of keys per request number (the request that used them last)."""

    __slots__ = ("_tree",)

    def __init__(self, size: int) -> None:
        self._tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        tree = self._tree
        index += 1
        while index < len(tree):
            tree[index] += delta
            index += index & -index

    def prefix(self, index: int) -> int:
        """The sum over positions ``0..index``."""
        tree = self._tree
        index += 1
        total = 0
        while index > 0:
            total += tree[index]
            index -= index & -index
        return total


def lru_curve(trace: Trace) -> HitRatioCurve:
    """The LRU hit count of ``trace`` at every capacity it can be computed for."""
    started = time.perf_counter()
    key_lists = trace.key_lists()
    distinct = [
        keys if len(set(keys)) == len(keys) else tuple(dict.fromkeys(keys)) for keys in key_lists
    ]
    unique = trace.unique_blocks
    low = max(map(len, distinct), default=1)
    if unique < low:  # only for a Trace built by hand with a wrong count
        raise ValueError(f"trace says {unique} unique blocks but a request has {low}")
    diff = _sweep(key_lists, distinct, low, unique + 1)
    hits: list[int] = []
    running = 0
    for change in diff[low : unique + 1]:
        running += change
        hits.append(running)
    return HitRatioCurve(
        requests=len(key_lists),
        block_accesses=trace.block_accesses,
        unique_blocks=unique,
        min_capacity=low,
        hits=tuple(hits),
        seconds=time.perf_counter() - started,
    )


def _sweep(
    key_lists: Sequence[Sequence[BlockKey]],
    distinct: Sequence[Sequence[BlockKey]],
    low: int,
    end: int,
) -> list[int]:
    """Differences of the hit count over capacities ``0..end`` (``diff[c]`` is added at
    capacity ``c`` and after)."""
    full: Intervals = (low, end)
    diff = [0] * (end + 1)
    fenwick = _Fenwick(len(key_lists))
    last: dict[BlockKey, int] = {}  # key -> number of the request that used it last
    where: dict[BlockKey, int] = {}  # key -> its place among that request's distinct keys
    cached: dict[BlockKey, Intervals] = {}  # key -> capacities at which that request hit it
    members: list[Sequence[BlockKey]] = []
    seen = 0
    for number, (keys, own) in enumerate(zip(key_lists, distinct, strict=True)):
        now: dict[BlockKey, Intervals] = {}
        for key in own:
            previous = last.get(key)
            if previous is None:
                now[key] = _EMPTY
                continue
            since = seen - fenwick.prefix(previous)  # distinct keys used after it
            if since >= end - 1:  # deeper than the largest capacity
                now[key] = _EMPTY
                continue
            now[key] = _cached_now(
                key, since, members[previous], previous, where[key], last, cached, low, end
            )
        run = full
        for key in keys:  # the leading run: every key so far cached
            run = _intersect(run, now[key])
            if not run:
                break
            for i in range(0, len(run), 2):
                diff[run[i]] += 1
                diff[run[i + 1]] -= 1
        for place, key in enumerate(own):
            previous = last.get(key)
            if previous is None:
                seen += 1
            else:
                fenwick.add(previous, -1)
            last[key] = number
            where[key] = place
            cached[key] = now[key]
        fenwick.add(number, len(own))
        members.append(own)
    return diff


def _cached_now(
    key: BlockKey,
    since: int,
    request: Sequence[BlockKey],
    number: int,
    place: int,
    last: dict[BlockKey, int],
    cached: dict[BlockKey, Intervals],
    low: int,
    end: int,
) -> Intervals:
    """The capacities at which ``key`` is cached now (see the module's formula)."""
    before = 0
    later: list[Intervals] = []
    for i, other in enumerate(request):
        if i == place or last[other] != number:
            continue
        if i < place:
            before += 1
        else:
            later.append(cached[other])
    mine = cached[key]
    depth = 1 + since + len(later)
    if depth + (before if mine else 0) <= low:
        return (low, end)
    steps: list[tuple[int, int]] = []
    for spans in later:  # cached at C by the last request: not above ``key`` there
        for i in range(0, len(spans), 2):
            steps.append((spans[i], -1))
            steps.append((spans[i + 1], 1))
    if before:
        for i in range(0, len(mine), 2):
            steps.append((mine[i], before))
            steps.append((mine[i + 1], -before))
    steps.sort()
    out: list[int] = []
    at = low
    for position, change in steps:
        if position > at:
            _emit(out, at, position, depth)
            at = position
        depth += change
    _emit(out, at, end, depth)
    return tuple(out)


def _emit(out: list[int], lo: int, hi: int, depth: int) -> None:
    """Add ``[max(lo, depth), hi)``: the capacities of a stretch of constant ``depth``
    that hold it."""
    start = max(lo, depth)
    if start >= hi:
        return
    if out and out[-1] == start:
        out[-1] = hi
    else:
        out += (start, hi)


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    if len(a) == 2 and len(b) == 2:
        lo, hi = max(a[0], b[0]), min(a[1], b[1])
        return (lo, hi) if lo < hi else _EMPTY
    out: list[int] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i], b[j]), min(a[i + 1], b[j + 1])
        if lo < hi:
            out += (lo, hi)
        if a[i + 1] < b[j + 1]:
            i += 2
        else:
            j += 2
    return tuple(out)
