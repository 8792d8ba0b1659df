"""Adaptive Replacement Cache, after Megiddo & Modha (FAST'03).

Resident keys live in T1 (seen once) or T2 (seen again); B1 and B2 remember the keys
recently evicted from each. A key that comes back while in B1 raises the T1 target ``p``,
one that comes back while in B2 lowers it, and either is re-inserted into T2. Eviction
takes from T1 while T1 is above its target, else from T2, and falls back to the other list
when the preferred one has nothing evictable. Each ghost list is bounded by the capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from itertools import filterfalse

from tierd.keys import BlockKey
from tierd.policy.base import CachePolicy
from tierd.policy.registry import register_policy

__all__ = ["ARCPolicy"]


@register_policy
class ARCPolicy(CachePolicy):
    """ARC over evictable keys; held keys keep their list (T1 or T2) aside until released."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._held1: dict[BlockKey, None] = {}
        self._held2: dict[BlockKey, None] = {}
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._held1 or key in self._held2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._held1) + len(self._held2)

    @property
    def t1_size(self) -> int:
        return len(self._t1) + len(self._held1)

    @property
    def t2_size(self) -> int:
        return len(self._t2) + len(self._held2)

    def in_ghost(self, key: BlockKey) -> str | None:
        """``"b1"`` or ``"b2"`` if ``key`` is remembered in a ghost list, else ``None``."""
        return "b1" if key in self._b1 else "b2" if key in self._b2 else None

    def insert(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key not in self:
                self._insert_one(key)

    def _insert_one(self, key: BlockKey) -> None:
        if key in self._b1:
            self.p = min(self.p + max(1.0, len(self._b2) / len(self._b1)), float(self.capacity))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(self.p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def remove(self, key: BlockKey) -> bool:
        for group in (self._t1, self._t2, self._held1, self._held2):
            if key in group:
                del group[key]
                return True
        return False

    def touch(self, keys: Sequence[BlockKey]) -> None:
        t1, t2, held1, held2 = self._t1, self._t2, self._held1, self._held2
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None
            elif key in held1:
                del held1[key]
                held2[key] = None

    def hold(self, key: BlockKey) -> None:
        _shift(key, ((self._t1, self._held1), (self._t2, self._held2)))

    def release(self, key: BlockKey) -> None:
        _shift(key, ((self._held1, self._t1), (self._held2, self._t2)))

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        if n > len(self._t1) + len(self._t2):
            return None
        from_t1, from_t2 = self._choose(n, protected)
        if len(from_t1) + len(from_t2) < n:
            return None
        for key in from_t1:
            del self._t1[key]
            self._remember(self._b1, key)
        for key in from_t2:
            del self._t2[key]
            self._remember(self._b2, key)
        return [*from_t1, *from_t2]

    def _choose(
        self, n: int, protected: Collection[BlockKey]
    ) -> tuple[list[BlockKey], list[BlockKey]]:
        """Pick victims without changing anything: T1 while it exceeds ``p``, else T2."""
        candidates1: Iterator[BlockKey] = filterfalse(protected.__contains__, self._t1)
        candidates2: Iterator[BlockKey] = filterfalse(protected.__contains__, self._t2)
        from_t1: list[BlockKey] = []
        from_t2: list[BlockKey] = []
        t1_size = self.t1_size
        done1 = done2 = False
        while len(from_t1) + len(from_t2) < n and not (done1 and done2):
            prefer_t1 = t1_size > self.p or done2
            if prefer_t1 and not done1:
                key = next(candidates1, None)
                if key is None:
                    done1 = True
                    continue
                from_t1.append(key)
                t1_size -= 1
            else:
                key = next(candidates2, None)
                if key is None:
                    done2 = True
                    continue
                from_t2.append(key)
        return from_t1, from_t2

    def _remember(self, ghost: OrderedDict[BlockKey, None], key: BlockKey) -> None:
        ghost[key] = None
        if len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def clear(self) -> None:
        for group in (self._t1, self._t2, self._held1, self._held2, self._b1, self._b2):
            group.clear()
        self.p = 0.0


def _shift(
    key: BlockKey, moves: Sequence[tuple[dict[BlockKey, None], dict[BlockKey, None]]]
) -> None:
    """Move ``key`` from the first list of the first pair that holds it to that pair's
    second list (the key keeps its T1 or T2 side while it is held)."""
    for source, target in moves:
        if key in source:
            del source[key]
            target[key] = None
            return
