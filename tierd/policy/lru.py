"""Least-recently-used: the tracked keys least recent first, in one ``OrderedDict`` for a
small tier, and for a big one in a :class:`~tierd.policy.order.PartedOrder`, whose parts
each resize on their own (one dict is copied whole, on the loop, in the put that outgrows
it).

Pinned keys stay where they are, marked in a set; a release moves its key to the recent
end. (Taking pinned keys out of the order would delete keys from it at every load, and a
dict reclaims the dead entries deletions leave by rebuilding itself whole, on the loop.)
Eviction skips held keys; those it had to
step over go to the recent end, so each is stepped over once until the whole order has
turned over again: a pin costs a set insert, and the move a pin needs is paid only if
eviction reaches its key while it is held.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tierd.keys import BlockKey
from tierd.maps import PART_KEYS
from tierd.policy.base import CachePolicy
from tierd.policy.order import ONE_DICT_KEYS, DictOrder, PartedOrder, recency_order
from tierd.policy.registry import register_policy

__all__ = ["LRUPolicy"]


@register_policy
class LRUPolicy(CachePolicy):
    """Evicts the least recently inserted, touched or released key that is not held."""

    name = "lru"

    def __init__(
        self, capacity: int, part_keys: int = PART_KEYS, one_dict: int = ONE_DICT_KEYS
    ) -> None:
        super().__init__(capacity)
        self._order: DictOrder[BlockKey] | PartedOrder[BlockKey] = recency_order(
            capacity, part_keys, one_dict
        )
        self._held: set[BlockKey] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, keys: Sequence[BlockKey]) -> None:
        # Keys are new to the policy (the tier inserts a key once, when it becomes ready).
        self._order.append(keys)

    def remove(self, key: BlockKey) -> bool:
        if self._order.discard(key):
            self._held.discard(key)
            return True
        return False

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self._order.to_end(reversed(keys))

    def hold(self, key: BlockKey) -> None:
        if key in self._order:  # marked, not moved: its release moves it (see evict)
            self._held.add(key)

    def release(self, key: BlockKey) -> None:
        if key in self._held:
            self._held.discard(key)
            self._order.move(key)

    def hold_all(self, keys: Sequence[BlockKey]) -> None:
        self._held.update(self._order.present(keys))

    def release_all(self, keys: Sequence[BlockKey]) -> None:
        held = self._held
        released = [key for key in keys if key in held]
        held.difference_update(released)
        self._order.to_end(released)

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        order, held = self._order, self._held
        if n > len(order) - len(held):
            return None
        victims = order.oldest(n)
        # Held and protected keys are usually recent, so the least recent n rarely include
        # one: check that in C-level passes, and only then scan past them.
        if (held and not held.isdisjoint(victims)) or (
            protected and not _disjoint(protected, victims)
        ):
            found = self._scan(n, protected)
            if found is None:
                return None
            order.take(found)
            return found
        order.take_oldest(n)
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
        order.to_end(stepped)
        return victims if len(victims) == n else None

    def clear(self) -> None:
        self._order.clear()
        self._held.clear()


def _disjoint(protected: Collection[BlockKey], keys: list[BlockKey]) -> bool:
    if isinstance(protected, set | frozenset):
        return protected.isdisjoint(keys)
    return not any(map(protected.__contains__, keys))
