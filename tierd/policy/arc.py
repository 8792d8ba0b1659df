"""Adaptive Replacement Cache, after Megiddo & Modha (FAST'03).

Resident keys live in T1 (seen once) or T2 (seen again); B1 and B2 remember the keys
recently evicted from each. A key that comes back while in B1 raises the T1 target ``p``,
one that comes back while in B2 lowers it, and either is re-inserted into T2. Eviction
takes from T1 while T1 is above its target, else from T2, and falls back to the other list
when the preferred one has nothing evictable. Each ghost list is bounded by the capacity.

Each of the four lists is an ``OrderedDict`` for a small tier and a
:class:`~tierd.policy.order.PartedOrder` (generations over parts) for a big one, which
never copies a dict of all its keys (an ``OrderedDict`` copies them all, on the loop, in
the put that outgrows its table). Both answer the mapping methods used key by key
here; a batch goes in at C speed into an ``OrderedDict`` (:func:`_append`, :func:`_take`,
:func:`_forget_oldest`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from itertools import filterfalse, repeat
from typing import Protocol

from tierd.keys import BlockKey
from tierd.maps import PART_KEYS
from tierd.policy.base import CachePolicy
from tierd.policy.order import ONE_DICT_KEYS, PartedOrder
from tierd.policy.registry import register_policy

__all__ = ["ARCPolicy"]


class _Group(Protocol):
    """Where a key may be: a list or a held set."""

    def __contains__(self, key: object) -> bool: ...
    def __setitem__(self, key: BlockKey, value: None) -> None: ...
    def __delitem__(self, key: BlockKey) -> None: ...


# A list of ARC's, least recent first: an OrderedDict for a small tier, a PartedOrder
# for a big one (the helpers below take either, and nothing else).
_List = OrderedDict[BlockKey, None] | PartedOrder[BlockKey]


@register_policy
class ARCPolicy(CachePolicy):
    """ARC over evictable keys; held keys keep their list (T1 or T2) aside until released."""

    name = "arc"

    def __init__(
        self, capacity: int, part_keys: int = PART_KEYS, one_dict: int = ONE_DICT_KEYS
    ) -> None:
        super().__init__(capacity)
        self.p = 0.0  # target size of T1

        def order() -> _List:
            if capacity <= one_dict:
                return OrderedDict()
            return PartedOrder(capacity, part_keys)

        self._t1, self._t2, self._b1, self._b2 = order(), order(), order(), order()
        # Held keys, by the list they keep (as many as the leases pin at once).
        self._held1: dict[BlockKey, None] = {}
        self._held2: dict[BlockKey, None] = {}

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
        t1, t2, held1, held2, b1, b2 = (
            self._t1,
            self._t2,
            self._held1,
            self._held2,
            self._b1,
            self._b2,
        )
        to_t1: list[BlockKey] = []
        to_t2: list[BlockKey] = []  # both put in place at once, in order
        for key in dict.fromkeys(keys):
            if key in t1 or key in t2 or key in held1 or key in held2:
                continue
            if key in b1:
                self.p = min(self.p + max(1.0, len(b2) / len(b1)), float(self.capacity))
                del b1[key]
                to_t2.append(key)
            elif key in b2:
                self.p = max(self.p - max(1.0, len(b1) / len(b2)), 0.0)
                del b2[key]
                to_t2.append(key)
            else:
                to_t1.append(key)
        if to_t1:
            _append(t1, to_t1)
        if to_t2:
            _append(t2, to_t2)

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
        if from_t1:
            _take(self._t1, from_t1)
            self._remember(self._b1, from_t1)
        if from_t2:
            _take(self._t2, from_t2)
            self._remember(self._b2, from_t2)
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

    def _remember(self, ghost: _List, keys: list[BlockKey]) -> None:
        """Put ``keys`` at the recent end of ``ghost``, forgetting its oldest beyond the
        capacity (as one key after the other would)."""
        _append(ghost, keys)
        _forget_oldest(ghost, len(ghost) - self.capacity)

    def clear(self) -> None:
        for group in (self._t1, self._t2, self._held1, self._held2, self._b1, self._b2):
            group.clear()
        self.p = 0.0


def _shift(key: BlockKey, moves: Sequence[tuple[_Group, _Group]]) -> None:
    """Move ``key`` from the first list of the first pair that holds it to that pair's
    second list (the key keeps its T1 or T2 side while it is held)."""
    for source, target in moves:
        if key in source:
            del source[key]
            target[key] = None
            return


def _append(order: _List, keys: list[BlockKey]) -> None:
    """Put ``keys``, none of them in ``order``, at its recent end, in order."""
    if isinstance(order, PartedOrder):
        order.append(keys)
    else:
        order.update(zip(keys, repeat(None)))


def _take(order: _List, keys: list[BlockKey]) -> None:
    """Take ``keys``, every one of them in ``order``, out of it."""
    if isinstance(order, PartedOrder):
        order.take(keys)
    else:
        deque(map(order.__delitem__, keys), maxlen=0)


def _forget_oldest(order: _List, n: int) -> None:
    """Take the ``n`` least recent keys out of ``order`` (none if ``n`` is not positive)."""
    if n <= 0:
        return
    if isinstance(order, PartedOrder):
        order.take_oldest(n)
    else:
        deque(map(order.popitem, repeat(False, n)), maxlen=0)  # last=False
