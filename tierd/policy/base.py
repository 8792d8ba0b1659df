"""The cache-policy seam: ordering and victim choice for the ready blocks of one tier.

A policy never sees slots, bytes or reference counts. The tier tells it which keys are
ready (``insert``/``remove``), which are in use and so must not be evicted
(``hold``/``release``), and which were used (``touch``); the policy answers ``evict``.

Held keys are never scanned past call after call (a scan over many pinned blocks per
call is quadratic): ARC keeps them apart from the evictable ones; LRU keeps them in
place, marked, and moves each one eviction steps over to the recent end (a pin moves
nothing; see ``tierd/policy/lru.py``). ``hold_all``/``release_all`` take a load's keys in
one call. The ``protected`` keys that
``evict`` receives are only the few keys a single call must keep (the keys being stored);
a container rather than a predicate keeps the victim scan free of Python calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import ClassVar

from tierd.keys import BlockKey

__all__ = ["CachePolicy"]


class CachePolicy(ABC):
    """Recency/frequency order over the ready keys of a tier of ``capacity`` blocks.

    Promises, checked by the contract suite in ``tests/test_policy_contract.py``:

    - ``insert`` adds new keys as evictable and most recent, in order; ``remove`` forgets
      a key and says whether it was there; neither raises for a key in the wrong state.
    - ``touch(keys)`` walks ``keys`` tail to head, so the first key ends up most recent;
      unknown keys are ignored.
    - ``hold`` makes a key unevictable until the matching ``release``.
    - ``evict(n, protected)`` is atomic: it returns exactly ``n`` keys, none of them held
      or in ``protected``, and removes them; or it returns ``None`` and changes nothing.
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the key is tracked (held or evictable)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are tracked."""

    def get(self, key: BlockKey) -> bool:
        """Whether ``key`` is tracked (the tier owns the slot index, so this is membership)."""
        return key in self

    @abstractmethod
    def insert(self, keys: Sequence[BlockKey]) -> None:
        """Track keys that just became ready, in order; they start evictable.

        The keys are not tracked yet: a tier inserts a key once, when it becomes ready."""

    @abstractmethod
    def remove(self, key: BlockKey) -> bool:
        """Forget ``key`` without recording it as evicted; False if it was not tracked."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` used, tail to head, so ``keys[0]`` ends up the most recent."""

    @abstractmethod
    def hold(self, key: BlockKey) -> None:
        """Make a tracked key unevictable (its block is being read)."""

    @abstractmethod
    def release(self, key: BlockKey) -> None:
        """Undo ``hold``: the key is evictable again, as the most recently used."""

    def hold_all(self, keys: Sequence[BlockKey]) -> None:
        """``hold`` each of ``keys``, in order (one call for a load's keys)."""
        for key in keys:
            self.hold(key)

    def release_all(self, keys: Sequence[BlockKey]) -> None:
        """``release`` each of ``keys``, in order (one call for a load's keys)."""
        for key in keys:
            self.release(key)

    @abstractmethod
    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        """Choose and remove ``n`` victims, or return ``None`` and change nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, including any history the policy keeps."""
