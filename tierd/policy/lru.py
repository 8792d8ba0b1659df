"""Least-recently-used: one ordered dict of the tracked keys, least recent first.

Pinned keys stay in the order, marked in a set: a pin and its release move a key to the
recent end without deleting it from the dict. Deleting leaves a dead entry that the dict
reclaims by rebuilding itself whole, an O(keys) pause on the event loop (33-48 ms at
240,000 keys) that a load of a few thousand keys used to bring about every few dozen
loads. Eviction skips held keys; those it had to step over go to the recent end, so
each is stepped over once until the whole order has turned over again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import islice, repeat

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
        self._held: set[BlockKey] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, keys: Sequence[BlockKey]) -> None:
        # Keys are new to the policy (the tier inserts a key once, when it becomes ready).
        self._order.update(zip(keys, repeat(None)))

    def remove(self, key: BlockKey) -> bool:
        if key in self._order:
            del self._order[key]
            self._held.discard(key)
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
            self._held.add(key)
            self._order.move_to_end(key)  # out of eviction's way while it is read

    def release(self, key: BlockKey) -> None:
        if key in self._held:
            self._held.discard(key)
            self._order.move_to_end(key)

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        order, held = self._order, self._held
        if n > len(order) - len(held):
            return None
        victims = list(islice(order, n))
        # Held and protected keys are usually recent, so the least recent n rarely include
        # one: check that in C-level passes, and only then scan past them.
        if (held and not held.isdisjoint(victims)) or (
            protected and not _disjoint(protected, victims)
        ):
            found = self._scan(n, protected)
            if found is None:
                return None
            victims = found
        for key in victims:
            del order[key]
        return victims

    def _scan(self, n: int, protected: Collection[BlockKey]) -> list[BlockKey] | None:
        """The ``n`` least recent keys neither held nor protected, or ``None``. The held
        keys stepped over move to the recent end, so no later call steps over them again
        until the order has turned over (where a held key sits is never observable: its
        release moves it to the recent end anyway)."""
        order, held = self._order, self._held
        victims: list[BlockKey] = []
        stepped: list[BlockKey] = []
        for key in order:
            if key in held:
                stepped.append(key)
            elif key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        move = order.move_to_end
        for key in stepped:
            move(key)
        return victims if len(victims) == n else None

    def clear(self) -> None:
        self._order.clear()
        self._held.clear()


def _disjoint(protected: Collection[BlockKey], keys: list[BlockKey]) -> bool:
    if isinstance(protected, set | frozenset):
        return protected.isdisjoint(keys)
    return not any(map(protected.__contains__, keys))
