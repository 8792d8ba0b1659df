"""The LRU policy's order: :class:`DictOrder`, one ``OrderedDict``, for an order of up to
:data:`ONE_DICT_KEYS` keys; :class:`PartedOrder`, which never resizes all at once, for a
bigger one (:func:`recency_order` picks). Both have the same methods and answers."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice, repeat
from typing import Generic, TypeVar

from tierd.maps import ONE_DICT_KEYS, PART_KEYS, Shards, part_count

__all__ = ["GENERATION", "ONE_DICT_KEYS", "DictOrder", "PartedOrder", "recency_order"]

K = TypeVar("K")
GENERATION = 4_096  # the most keys of a generation


def recency_order(
    capacity: int, part_keys: int = PART_KEYS, one_dict: int = ONE_DICT_KEYS
) -> DictOrder[K] | PartedOrder[K]:
    """The order for ``capacity`` keys: one dict up to ``one_dict``, else in parts."""
    if capacity <= one_dict:
        return DictOrder()
    return PartedOrder(capacity, part_keys)


class DictOrder(Generic[K]):
    """Keys least recent first in one ``OrderedDict`` (a small order; see PartedOrder)."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    def append(self, keys: Sequence[K]) -> None:
        order = self._order
        before = len(order)
        order.update(zip(keys, repeat(None)))
        if len(order) - before != len(keys):  # a key was here already: each one moves
            deque(map(order.move_to_end, keys), maxlen=0)

    def to_end(self, keys: Iterable[K]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def present(self, keys: Iterable[K]) -> list[K]:
        order = self._order
        return [key for key in keys if key in order]

    def move(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: K) -> bool:
        return self._order.pop(key, 0) is None

    def take(self, keys: Iterable[K]) -> None:
        deque(map(self._order.__delitem__, keys), maxlen=0)

    def take_oldest(self, n: int) -> None:
        deque(map(self._order.popitem, repeat(False, n)), maxlen=0)  # last=False

    def oldest(self, n: int) -> list[K]:
        return list(islice(self._order, n)) if n > 0 else []

    def clear(self) -> None:
        self._order.clear()


class PartedOrder(Generic[K]):
    """Keys least recent first, kept in pieces none of which grows with them all.

    A big tier's order as one ``OrderedDict`` would be copied whole, on the loop, in the
    put that outgrew its table or filled it with the holes its deletions leave (a tier
    churning at its capacity does both).

    Here the order is a run of generations, each a dict of at most ``generation`` keys
    (4,096) in the order they came (dicts keep insertion order), the oldest generation
    first. A key put or moved to the recent end goes into the newest generation, which
    is closed once full and a fresh one opened; a key leaves its generation when it is
    moved, taken or discarded, and an emptied generation goes. Which generation holds a
    key is a :class:`~tierd.maps.Shards` sized for ``capacity``. The least recent keys
    are the front of the oldest generations, read at C speed. A closed generation is
    copied into a fresh dict (its order kept) each time its keys halve below half a
    generation, so that a table never holds more than twice its keys' worth of holes
    (its front, where eviction reads, included), and no copy is bigger than a
    generation. The price is a second dict step a key, on every insert, touch and
    eviction: this is for orders too big for one dict (:data:`ONE_DICT_KEYS`).
    """

    __slots__ = ("_fill", "_gen_of", "_gens", "_newest", "_open", "_size", "_thin")

    def __init__(
        self, capacity: int, part_keys: int = PART_KEYS, generation: int = GENERATION
    ) -> None:
        if generation < 2:
            raise ValueError(f"a generation holds at least 2 keys, got {generation}")
        self._size = generation  # the most keys a generation is given
        # A closed generation is thinned when its keys fall to one of these (_thin).
        self._thin = frozenset([0, *(1 << i for i in range((generation // 2).bit_length()))])
        self._gen_of: Shards[K, int] = Shards(part_count(capacity, part_keys, one_dict=0))
        self._open: dict[K, None] = {}  # the newest generation
        self._newest = 0  # its number
        self._gens: dict[int, dict[K, None]] = {0: self._open}  # oldest first
        self._fill = 0  # keys ever put into the open generation

    def __contains__(self, key: object) -> bool:
        return key in self._gen_of.parts[hash(key) & self._gen_of.low]

    def __len__(self) -> int:
        return len(self._gen_of)

    def __iter__(self) -> Iterator[K]:
        """The keys, least recent first (of the generations as they are now: the order
        must not change while this is read)."""
        return chain.from_iterable(self._gens.values())

    def append(self, keys: Iterable[K]) -> None:
        """Put ``keys`` at the recent end, in order (the last one most recent); a key
        already here is moved there."""
        self._put(keys, True)

    def to_end(self, keys: Iterable[K]) -> None:
        """Move the present ``keys``, in that order, to the recent end (the last one most
        recent); absent ones are skipped."""
        self._put(keys, False)

    def present(self, keys: Iterable[K]) -> list[K]:
        """Those of ``keys`` that are here, in order."""
        parts, low = self._gen_of.parts, self._gen_of.low
        return [key for key in keys if key in parts[hash(key) & low]]

    def move(self, key: K) -> None:
        """Move ``key``, if present, to the recent end (a pin or its release: a key at
        a time, so without :meth:`to_end`'s loop)."""
        shards = self._gen_of
        part = shards.parts[hash(key) & shards.low]
        number = part.get(key)
        if number is None:
            return
        if number == self._newest and self._fill < self._size - 1:
            gen = self._open  # the common case: a recent key, in the open generation
            del gen[key]
            gen[key] = None
            self._fill += 1
            return
        self._put((key,), False)

    def discard(self, key: K) -> bool:
        """Forget ``key``; whether it was here."""
        number = self._gen_of.parts[hash(key) & self._gen_of.low].pop(key, None)
        if number is None:
            return False
        self._leave(key, number)
        return True

    def take(self, keys: Iterable[K]) -> None:
        """Forget ``keys``, every one of them present."""
        parts, low, leave = self._gen_of.parts, self._gen_of.low, self._leave
        for key in keys:
            leave(key, parts[hash(key) & low].pop(key))

    def _put(self, keys: Iterable[K], new: bool) -> None:
        """Put ``keys`` at the recent end, in order: every one (``new``) or the present
        ones only. (One loop for both, with the generation's bookkeeping inline: these
        are the order's hot paths, a Python step a key.)"""
        shards, gens = self._gen_of, self._gens
        parts, low = shards.parts, shards.low
        gen, newest, fill = self._open, self._newest, self._fill
        size, thin = self._size, self._thin
        for key in keys:
            part = parts[hash(key) & low]
            number = part.get(key)
            if number is None:
                if not new:
                    continue
            elif number == newest:
                del gen[key]
            else:
                old = gens[number]
                del old[key]
                if len(old) in thin:
                    self._thin_out(number, old)
            part[key] = newest
            gen[key] = None
            fill += 1
            if fill == size:
                newest += 1
                gen = gens[newest] = {}
                fill = 0
                self._open, self._newest = gen, newest
                if not gens[newest - 1]:  # every key of it moved on meanwhile
                    del gens[newest - 1]
        self._fill = fill

    def take_oldest(self, n: int) -> None:
        """Forget the ``n`` least recent keys (:meth:`oldest`'s answer): whole
        generations at once, the rest of the last one at C speed."""
        shards, gens, newest = self._gen_of, self._gens, self._newest
        parts, low = shards.parts, shards.low
        emptied: list[int] = []
        for number, gen in gens.items():
            if n <= 0:
                break
            if n >= len(gen) and number != newest:
                n -= len(gen)
                emptied.append(number)
                keys: Iterable[K] = gen
            else:
                keys = list(islice(gen, n))
                n = 0
                deque(map(gen.__delitem__, keys), maxlen=0)
                if len(gen) in self._thin and number != newest:  # (never emptied here)
                    self._thin_out(number, gen)
            for key in keys:
                del parts[hash(key) & low][key]
        for number in emptied:
            del gens[number]

    def oldest(self, n: int) -> list[K]:
        """The ``n`` least recent keys, least recent first (all of them if fewer)."""
        found: list[K] = []
        if n <= 0:
            return found
        for gen in self._gens.values():
            found += islice(gen, n - len(found))
            if len(found) == n:
                break
        return found

    def clear(self) -> None:
        self._gen_of.clear()
        self._open = {}
        self._newest, self._fill = 0, 0
        self._gens = {0: self._open}

    # The mapping methods of an OrderedDict that ARC's lists use key by key, so that a big
    # tier's ARC runs on a PartedOrder (and a small one's on an OrderedDict, at C speed).

    def __setitem__(self, key: K, _value: None) -> None:
        """Add ``key`` at the recent end; one already here stays where it is."""
        if key not in self:
            self._put((key,), True)

    def __delitem__(self, key: K) -> None:
        if not self.discard(key):
            raise KeyError(key)

    def move_to_end(self, key: K) -> None:
        """Move ``key`` to the recent end; ``KeyError`` if it is not here."""
        if key not in self:
            raise KeyError(key)
        self._put((key,), False)

    def _leave(self, key: K, number: int) -> None:
        """Take ``key`` out of generation ``number``."""
        gen = self._gens[number]
        del gen[key]
        if len(gen) in self._thin and number != self._newest:
            self._thin_out(number, gen)

    def _thin_out(self, number: int, gen: dict[K, None]) -> None:
        """A closed generation whose keys just fell to a power of two up to half a
        generation, or to none: it goes once empty, and is copied small (its order
        kept) otherwise, so that its table never holds more than twice its keys' worth
        of holes."""
        if gen:
            self._gens[number] = dict(gen)
        else:
            del self._gens[number]
