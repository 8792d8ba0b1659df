"""Least-recently-used: one ordered dict of evictable keys, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import filterfalse, islice, repeat

from tierd.keys import BlockKey
from tierd.policy.base import CachePolicy
from tierd.policy.registry import register_policy

__all__ = ["LRUPolicy"]


@register_policy
class LRUPolicy(CachePolicy):
    """Evicts the least recently inserted, touched or released key that is not held."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[BlockKey, None] = OrderedDict()
        self._held: dict[BlockKey, None] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._held

    def __len__(self) -> int:
        return len(self._order) + len(self._held)

    def insert(self, keys: Sequence[BlockKey]) -> None:
        # Keys are new to the policy (the tier inserts a key once, when it becomes ready).
        self._order.update(zip(keys, repeat(None)))

    def remove(self, key: BlockKey) -> bool:
        if key in self._order:
            del self._order[key]
            return True
        if key in self._held:
            del self._held[key]
            return True
        return False

    def touch(self, keys: Sequence[BlockKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def hold(self, key: BlockKey) -> None:
        if key in self._order:
            del self._order[key]
            self._held[key] = None

    def release(self, key: BlockKey) -> None:
        if key in self._held:
            del self._held[key]
            self._order[key] = None

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        order = self._order
        if n > len(order):
            return None
        victims = list(islice(order, n))
        # The protected keys are usually recent, so the least recent n rarely include one:
        # check that in one C-level pass, and only then scan past them.
        if protected and not _disjoint(protected, victims):
            victims = list(islice(filterfalse(protected.__contains__, order), n))
            if len(victims) < n:
                return None
        for key in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()
        self._held.clear()


def _disjoint(protected: Collection[BlockKey], keys: list[BlockKey]) -> bool:
    if isinstance(protected, set | frozenset):
        return protected.isdisjoint(keys)
    return not any(map(protected.__contains__, keys))
