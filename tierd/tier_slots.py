"""A tier's slots: which are free, in what order they are given out, and which a restart
keeps for blocks not adopted yet.

The seam with :mod:`tierd.tier`: a :class:`~tierd.tier.Tier` keeps the books of blocks
by key (states, pins, the policy's order, events); this module keeps slot numbers.
:class:`FreeSlots` gives out never-used slots first, then freed ones, last freed first.
What a restart brings back is here too: :func:`restored` and :func:`reserved` check the
slots a store found and rebuild the free list around them, :func:`one_slot_per_key` is
the one rule for a key found twice, and :class:`KeptBlocks` holds the slots of kept
blocks until the tier adopts them, a bounded number at a time, or until they are
dropped (and forgotten by the store).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Sequence
from operator import itemgetter
from typing import Any

from tierd.keys import BlockKey

__all__ = ["FreeSlots", "KeptBlocks", "one_slot_per_key", "reserved", "restored"]


class FreeSlots:
    """The free slots of ``num_blocks``: never-used ones first, in increasing order; then
    freed ones, a stack (the last freed is given out first)."""

    __slots__ = ("_freed", "_next_unused", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._next_unused = 0
        self._freed: list[int] = []

    @property
    def untouched(self) -> bool:
        """Whether no slot was ever given out (nor the free list rebuilt)."""
        return self._next_unused == 0

    def release(self, slots: Iterable[int]) -> None:
        """Free ``slots``, in that order (the last one is given out first)."""
        self._freed.extend(slots)

    def rebuild(self, stack: list[int]) -> None:
        """After a restart: ``stack`` is every free slot (its last given out first), and
        every slot counts as used once."""
        self._freed = stack
        self._next_unused = self.num_blocks

    def allocate(self, n: int) -> tuple[int, ...]:
        """``n`` free slots (the caller knows there are as many)."""
        start = self._next_unused
        if start == self.num_blocks and n > 0:  # the steady state: every slot used once
            freed = self._freed
            recycled = freed[-n:]
            del freed[-n:]
            recycled.reverse()
            return tuple(recycled)
        fresh = min(n, self.num_blocks - start)
        self._next_unused = start + fresh
        reuse = n - fresh
        if not reuse:
            return tuple(range(start, start + fresh))
        freed = self._freed
        recycled = freed[-reuse:]
        del freed[-reuse:]
        recycled.reverse()
        return (*range(start, start + fresh), *recycled)


class KeptBlocks:
    """Kept blocks not adopted yet: key -> reserved slot (:attr:`slots`), the order they
    are adopted in, and how the store forgets a slot.

    Until it is adopted a kept block is a miss, never evicted, and its slot is given to
    no store. One dropped before it is adopted (a delete, a clear) is gone for good: its
    slot is freed and forgotten by the store, so that it does not come back after a
    restart either; so is every copy but one of a key given twice."""

    def __init__(self) -> None:
        self.slots: dict[BlockKey, int] = {}
        self._order: Sequence[tuple[BlockKey, int]] = ()  # adoption order; dropped ones stay
        self._next = 0  # the position in ``_order`` adoption has reached
        self._forget: Callable[[list[int]], None] = _forget_nothing

    def keep(
        self, kept: Sequence[tuple[BlockKey, int]], forget: Callable[[list[int]], None]
    ) -> list[int]:
        """Hold ``kept`` (key, slot) for adoption in that order; ``forget`` is the store's
        invalidate. Returns the slots of the other copies of a key given twice, forgotten
        already (see :func:`one_slot_per_key`): the caller frees them."""
        self.slots, older = one_slot_per_key(kept)
        self._forget, self._order, self._next = forget, kept, 0
        if older:
            forget(older)
        return older

    def take(
        self, count: int, present: Container[BlockKey]
    ) -> tuple[dict[BlockKey, int], list[int]]:
        """Up to ``count`` kept blocks to adopt, key -> slot; at most ``count`` positions
        of the order are visited, those of blocks dropped meanwhile included, so a call is
        bounded. A key in ``present`` (stored again since the restart) keeps its new
        block: the kept copy's slot is returned second, forgotten already, to be freed."""
        kept, order = self.slots, self._order
        taken: dict[BlockKey, int] = {}
        stale: list[int] = []
        pos = self._next
        stop = min(len(order), pos + count)  # positions visited, dropped ones included
        while pos < stop:
            key, slot = order[pos]
            pos += 1
            if kept.get(key) != slot:
                continue  # dropped meanwhile (or an older copy, dropped at once)
            del kept[key]
            if key in present:
                stale.append(slot)
            else:
                taken[key] = slot
        self._next = pos
        if not kept:
            self._order, self._next = (), 0
        if stale:
            self._forget(stale)
        return taken, stale

    def drop(self, keys: Collection[BlockKey]) -> tuple[list[BlockKey], list[int]]:
        """Drop the kept blocks of ``keys`` before they are adopted; the store forgets
        their slots. Returns the keys dropped and their slots, for the caller to free."""
        kept = self.slots
        dropped = [key for key in keys if key in kept]
        slots = [kept.pop(key) for key in dropped]
        if slots:
            self._forget(slots)
        if not kept:  # nothing left to adopt: the order's tuples go too
            self._order, self._next = (), 0
        return dropped, slots


def restored(
    entries: Sequence[tuple[BlockKey, int]], num_blocks: int
) -> tuple[dict[BlockKey, int], list[int]]:
    """``entries`` (key, slot) of ready blocks as key -> slot, and the free stack around
    them; ``ValueError`` for a key or slot given twice or a slot out of range. Millions
    of blocks come back at a restart: every check and copy runs at C speed (dict, set,
    min/max, numpy), never one Python step per slot."""
    adopted = dict(entries)
    slots = list(adopted.values())
    if len(adopted) != len(entries) or len(set(slots)) != len(slots):
        raise ValueError("restore entries repeat a key or a slot")
    if slots and (min(slots) < 0 or max(slots) >= num_blocks):
        raise ValueError(f"restore slot out of range 0..{num_blocks - 1}")
    import numpy as np  # restarts only: a client command importing tierd never needs it

    return adopted, _free_stack(num_blocks, np.fromiter(slots, dtype=np.int64, count=len(slots)))


def reserved(kept: Sequence[tuple[BlockKey, int]], num_blocks: int) -> list[int]:
    """The free stack around the slots of ``kept`` (key, slot); ``ValueError`` for a
    slot out of range or given twice (a key given twice is :func:`one_slot_per_key`'s)."""
    import numpy as np  # restarts only, as restored

    taken = np.fromiter(map(itemgetter(1), kept), dtype=np.int64, count=len(kept))
    if taken.size and (taken.min() < 0 or taken.max() >= num_blocks):
        raise ValueError(f"reserved slot out of range 0..{num_blocks - 1}")
    stack = _free_stack(num_blocks, taken)
    if num_blocks - len(stack) != taken.size:
        raise ValueError("reserved slots repeat")
    return stack


def _free_stack(num_blocks: int, taken: Any) -> list[int]:
    """The slots of ``num_blocks`` not in ``taken`` (a numpy array of slots in range), as
    a stack whose top is the lowest: free slots come back lowest first."""
    import numpy as np  # restarts only

    free = np.ones(num_blocks, dtype=bool)
    free[taken] = False
    stack: list[int] = np.flatnonzero(free)[::-1].tolist()
    return stack


def _forget_nothing(slots: list[int]) -> None:
    """The default of :meth:`KeptBlocks.keep`'s ``forget``, before anything is kept."""


def one_slot_per_key(
    entries: Sequence[tuple[BlockKey, int]],
) -> tuple[dict[BlockKey, int], list[int]]:
    """``entries`` (key, slot) as key -> slot, one slot per key, and the slots of the
    other copies of a key given twice (a crash between a store and the invalidation of
    an older copy): the lowest slot is kept, whatever the order given. The one rule for a
    restart, whether the blocks are restored at once or reserved for adoption."""
    chosen = dict(entries)
    if len(chosen) == len(entries):  # the common case, at C speed
        return chosen, []
    chosen, others = {}, []
    for key, slot in sorted(entries, key=itemgetter(1)):
        if key in chosen:
            others.append(slot)
        else:
            chosen[key] = slot
    return chosen, others
