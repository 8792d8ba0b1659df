"""Maps that stay cheap as they grow and churn: :class:`Fifo`, a dict whose oldest key is
found in constant time (the KV events' book), and :class:`Shards`, a dict that never
resizes all at once (the book, a tier's slots, the LRU policy's order).

A big dict that grows past its table is copied whole into one twice the size, in the
turn of the loop that put the key that did not fit, and a book's dicts of keys (the
descriptions, the hash index, the waiting ones) grow in step, so one put would make them
all resize at once. A dict that churns at its size is copied
the same way, to sweep out its deleted slots. :class:`Shards` cuts a dict into parts by
the keys' hashes (64, or as many as keep a part near 16,384 keys for a map of known
size): each part resizes on its own, at its own time, with its share of the keys.

A plain dict keeps insertion order, but taking its front out leaves a hole there that
the next look at its front (``next(iter(d))``) steps over again, until the dict next
resizes: a book at its budget, evicting its oldest description for each new one, would
step over ever more holes at every put.

Here each key has a sequence number, and the front is a cursor over the numbers that
only moves forward, so each number is stepped over once in all. The numbers' keys and
values are kept in buckets of 1,024 consecutive numbers, dropped once empty: they never
grow past 1,024, so none is ever copied big. The keys' numbers are :class:`Shards`.

A :class:`Fifo` key may carry a *tag* as well, a small int kept in the low bits of its
number (the book's levels holding a block): found, and changed, by the one look that
finds the key's number, with no map of its own.

Both hold ints, the caller's keys and its values only: with bytes keys and atomic values
(ints, floats, bytes) the garbage collector tracks a tuple of parts and a dict of buckets,
and nothing per key.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Iterator
from itertools import chain, filterfalse, takewhile
from typing import Any, Generic, TypeVar, overload

__all__ = ["MAX_PARTS", "ONE_DICT_KEYS", "PART_KEYS", "TAG_BITS", "Fifo", "Shards", "part_count"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")
_ABSENT: Any = object()

_SHIFT = 10  # a bucket holds the numbers sharing all but their low 10 bits
TAG_BITS = 16  # a Fifo key's tag: below 1 << TAG_BITS, in the low bits of its number
_TAGS = (1 << TAG_BITS) - 1
_BUCKET = _SHIFT + TAG_BITS  # a tagged number's bucket: the bits above these
_PARTS = 64  # of a Shards by default (and of a Fifo's): a power of two
_LOW = _PARTS - 1  # the bits of a key's hash that pick its part
PART_KEYS = 16_384  # about the most keys a part of a sized map holds: its resize is short
# The biggest map kept in one dict: its resize (an OrderedDict's) is still short enough,
# and a dict's steps are cheaper than parts'.
ONE_DICT_KEYS = 65_536
MAX_PARTS = 1024  # the most parts a sized map is cut into (a power of two)
_SALT = int.from_bytes(os.urandom(8), "little")


def _part(key: object) -> int:
    """The part of ``key``: its hash's low bits. Bytes and strings hash at random, so the
    parts fill at slightly different rates and resize at different times; ints hash to
    themselves, so consecutive ones would fill all 64 in step (all resizing within 64
    puts, as costly as one big dict's resize) and are mixed with a salt first."""
    if type(key) is int:
        return hash((_SALT, key)) & _LOW
    return hash(key) & _LOW


def part_count(size: int, part_keys: int = PART_KEYS, one_dict: int = ONE_DICT_KEYS) -> int:
    """How many parts (a power of two, at most :data:`MAX_PARTS`) keep a map of ``size``
    keys at about ``part_keys`` a part; one for a map of up to ``one_dict`` keys, whose
    resize is short enough, and which keeps its keys in the order they came (walks of
    its keys then read memory in the order it was allocated, faster than in hash
    order)."""
    if part_keys <= 0:
        raise ValueError(f"part_keys must be positive, got {part_keys}")
    if size <= one_dict:
        return 1
    parts = 1
    while parts * part_keys < size and parts < MAX_PARTS:
        parts *= 2
    return parts


class Shards(Generic[K, V]):
    """A dict of ``parts`` parts (a power of two), each key in the part of its hash's low
    bits (no order across parts; its length is counted part by part). A hot path may
    reach the parts directly: ``parts[hash(key) & low]`` for a key that is not an int."""

    __slots__ = ("low", "parts")

    def __init__(self, parts: int = _PARTS) -> None:
        if parts <= 0 or parts & (parts - 1):
            raise ValueError(f"parts must be a power of two, got {parts}")
        self.parts: tuple[dict[K, V], ...] = tuple({} for _ in range(parts))
        self.low = parts - 1

    def part_of(self, key: object) -> dict[K, V]:
        """The part ``key`` is in, or goes to (a dict: several steps on one key cost
        one look for its part)."""
        if type(key) is int:  # as _part: ints hash to themselves
            return self.parts[hash((_SALT, key)) & self.low]
        return self.parts[hash(key) & self.low]

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def __iter__(self) -> Iterator[K]:
        """The keys, part after part."""
        return chain.from_iterable(self.parts)

    def __contains__(self, key: object) -> bool:
        return key in self.part_of(key)

    # Batches of keys that are not ints (a tier's: bytes), at C speed in one part.

    def absent(self, keys: Iterable[K]) -> list[K]:
        """Those of ``keys`` that are not here, in order."""
        parts, low = self.parts, self.low
        if not low:
            return list(filterfalse(parts[0].__contains__, keys))
        return [key for key in keys if key not in parts[hash(key) & low]]

    def present(self, keys: Iterable[K]) -> list[K]:
        """Those of ``keys`` that are here, in order."""
        parts, low = self.parts, self.low
        if not low:
            return list(filter(parts[0].__contains__, keys))
        return [key for key in keys if key in parts[hash(key) & low]]

    def leading(self, keys: Iterable[K]) -> int:
        """How many of ``keys``, from the first on, are here."""
        parts, low = self.parts, self.low
        if not low:
            return len(list(takewhile(parts[0].__contains__, keys)))
        n = 0
        for key in keys:
            if key not in parts[hash(key) & low]:
                break
            n += 1
        return n

    def values_of(self, keys: Iterable[K]) -> list[V]:
        """The values of ``keys``, every one of them here."""
        parts, low = self.parts, self.low
        if not low:
            return list(map(parts[0].__getitem__, keys))
        return [parts[hash(key) & low][key] for key in keys]

    def put_all(self, keys: Iterable[K], values: Iterable[V]) -> None:
        """Set each of ``keys`` to its value in ``values``."""
        parts, low = self.parts, self.low
        if not low:
            parts[0].update(zip(keys, values, strict=True))
            return
        for key, value in zip(keys, values, strict=True):
            parts[hash(key) & low][key] = value

    def pop_all(self, keys: Iterable[K]) -> list[V]:
        """Take ``keys`` out, every one of them here: their values."""
        parts, low = self.parts, self.low
        if not low:
            return list(map(parts[0].pop, keys))
        return [parts[hash(key) & low].pop(key) for key in keys]

    def __getitem__(self, key: K) -> V:
        return self.part_of(key)[key]

    def __setitem__(self, key: K, value: V) -> None:
        self.part_of(key)[key] = value

    def __delitem__(self, key: K) -> None:
        del self.part_of(key)[key]

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: Any = None) -> Any:
        return self.part_of(key).get(key, default)

    @overload
    def pop(self, key: K) -> V: ...
    @overload
    def pop(self, key: K, default: D) -> V | D: ...
    def pop(self, key: K, default: Any = _ABSENT) -> Any:
        part = self.part_of(key)
        return part.pop(key) if default is _ABSENT else part.pop(key, default)

    def clear(self) -> None:
        for part in self.parts:
            part.clear()


class Fifo(Generic[K, V]):
    """Keys and their values in the order they were last put (:meth:`put` moves a key to
    the back); :meth:`oldest` is the front. Each key has a tag (0 unless put with one or
    changed by :meth:`retag_all`). (A key's part is found inline, not by a call of
    :func:`_part`: the book looks up its keys several times per event.)"""

    __slots__ = ("_buckets", "_count", "_head", "_next", "_seq")

    def __init__(self) -> None:
        self._seq: Shards[K, int] = Shards()  # key -> its number << TAG_BITS | its tag
        # number >> _SHIFT -> ({number: key}, {number: value}), in the order of the numbers
        self._buckets: dict[int, tuple[dict[int, K], dict[int, V]]] = {}
        self._head = 0  # no live number is below it
        self._next = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __contains__(self, key: object) -> bool:
        return key in self._seq.parts[_part(key) if type(key) is int else hash(key) & _LOW]

    def __getitem__(self, key: K) -> V:
        tagged = self._seq.parts[_part(key) if type(key) is int else hash(key) & _LOW][key]
        return self._buckets[tagged >> _BUCKET][1][tagged >> TAG_BITS]

    def __iter__(self) -> Iterator[K]:
        """The keys, oldest first (of a copy)."""
        return iter([key for key, _ in self.items()])

    def items(self) -> list[tuple[K, V]]:
        """(key, value) pairs, oldest first."""
        return list(chain.from_iterable(self.item_parts(len(self._buckets) or 1)))

    def item_parts(self, buckets: int) -> Iterator[list[tuple[K, V]]]:
        """The (key, value) pairs, oldest first, in parts of ``buckets`` buckets' worth,
        each part read as it is asked for: a pair put, moved or taken out meanwhile may
        be in a later part than its place, or in none. (A bucket's two dicts are in the
        same order, so a part is zips at C speed.)"""
        numbers = list(self._buckets)
        for start in range(0, len(numbers), buckets):
            part: list[tuple[K, V]] = []
            for number in numbers[start : start + buckets]:
                bucket = self._buckets.get(number)
                if bucket is not None:
                    part += zip(bucket[0].values(), bucket[1].values(), strict=True)
            yield part

    def get(self, key: K, default: V | None = None) -> V | None:
        tagged = self._seq.parts[_part(key) if type(key) is int else hash(key) & _LOW].get(key)
        return (
            default if tagged is None else self._buckets[tagged >> _BUCKET][1][tagged >> TAG_BITS]
        )

    def get_all(self, keys: Iterable[K]) -> list[V | None]:
        """:meth:`get` of each of ``keys`` (None where it is not in), in one call."""
        parts, buckets = self._seq.parts, self._buckets
        out: list[V | None] = []
        for key in keys:
            tagged = parts[_part(key) if type(key) is int else hash(key) & _LOW].get(key)
            out.append(
                None if tagged is None else buckets[tagged >> _BUCKET][1][tagged >> TAG_BITS]
            )
        return out

    def tag(self, key: K, default: int = 0) -> int:
        """``key``'s tag (``default`` when it is not in)."""
        tagged = self._seq.parts[_part(key) if type(key) is int else hash(key) & _LOW].get(key)
        return default if tagged is None else tagged & _TAGS

    def retag_all(
        self, keys: Iterable[K], add: int = 0, remove: int = 0
    ) -> tuple[list[V | None], list[int]]:
        """For each of ``keys``, in order: its value and its tag before (None and -1 where
        it is not in); its tag then gets the bits of ``add`` and loses those of
        ``remove``. (The book's levels at a tier event: one look per key for both.)"""
        parts, buckets = self._seq.parts, self._buckets
        values: list[V | None] = []
        tags: list[int] = []
        keep = ~(remove & _TAGS)  # (a key's number stays whole)
        for key in keys:
            part = parts[_part(key) if type(key) is int else hash(key) & _LOW]
            tagged = part.get(key)
            if tagged is None:
                values.append(None)
                tags.append(-1)
                continue
            part[key] = (tagged | add) & keep
            values.append(buckets[tagged >> _BUCKET][1][tagged >> TAG_BITS])
            tags.append(tagged & _TAGS)
        return values, tags

    def untag_all(self, keys: Iterable[K], remove: int) -> tuple[list[V | None], list[int]]:
        """:meth:`retag_all` taking the bits of ``remove`` away, where a key left with no
        tag is taken out as well (the book's last level: a block held nowhere else is
        gone), in the same one look per key."""
        parts, buckets = self._seq.parts, self._buckets
        values: list[V | None] = []
        tags: list[int] = []
        keep = ~(remove & _TAGS)
        for key in keys:
            part = parts[_part(key) if type(key) is int else hash(key) & _LOW]
            tagged = part.get(key)
            if tagged is None:
                values.append(None)
                tags.append(-1)
                continue
            tags.append(tagged & _TAGS)
            if tagged & _TAGS & keep:
                part[key] = tagged & keep
                values.append(buckets[tagged >> _BUCKET][1][tagged >> TAG_BITS])
                continue
            del part[key]
            values.append(self._unlist(tagged))
        return values, tags

    def tagged_items(self, pairs: Iterable[tuple[K, V]]) -> list[tuple[K, V, int]]:
        """Each (key, value) of ``pairs`` that is still in, with its tag."""
        parts = self._seq.parts
        out: list[tuple[K, V, int]] = []
        for key, value in pairs:
            tagged = parts[_part(key) if type(key) is int else hash(key) & _LOW].get(key)
            if tagged is not None:
                out.append((key, value, tagged & _TAGS))
        return out

    def put(self, key: K, value: V, tag: int = 0) -> None:
        """Set ``key`` to ``value`` (with ``tag``, below ``1 << TAG_BITS``), at the back."""
        if not 0 <= tag <= _TAGS:
            raise ValueError(f"a tag is below {1 << TAG_BITS}, not {tag}")
        numbers = self._seq.parts[
            _part(key) if type(key) is int else hash(key) & _LOW
        ]  # (the parts direct: half the calls)
        if key in numbers:
            self.pop(key)
        self._append(numbers, key, value, tag)

    def _append(self, numbers: dict[K, int], key: K, value: V, tag: int) -> None:
        """``key`` (not in; ``numbers`` is its part) at the back, with ``value``, ``tag``."""
        seq = self._next
        self._next = seq + 1
        self._count += 1
        numbers[key] = seq << TAG_BITS | tag
        bucket = self._buckets.get(seq >> _SHIFT)
        if bucket is None:
            bucket = self._buckets[seq >> _SHIFT] = ({}, {})
        bucket[0][seq] = key
        bucket[1][seq] = value

    def _unlist(self, tagged: int) -> V:
        """Take the number of ``tagged`` (a key's, taken out of its part) out of its
        bucket: the key's value."""
        self._count -= 1
        seq = tagged >> TAG_BITS
        keys, values = self._buckets[seq >> _SHIFT]
        del keys[seq]
        value = values.pop(seq)
        if not keys:
            del self._buckets[seq >> _SHIFT]
        return value

    def replace(self, key: K, value: V) -> tuple[V, int] | None:
        """Set ``key`` to ``value``, at the back, its tag kept: its value and tag before
        (None: it was not in; its tag is 0). (One look for the book's describe, which
        keeps the levels of a block described again.)"""
        numbers = self._seq.parts[_part(key) if type(key) is int else hash(key) & _LOW]
        tagged = numbers.get(key)
        if tagged is None:
            self._append(numbers, key, value, 0)
            return None
        old = self._unlist(tagged), tagged & _TAGS
        self._append(numbers, key, value, old[1])
        return old

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Take ``key`` out: its value (``default`` when it was not in)."""
        taken = self.pop_tagged(key)
        return default if taken is None else taken[0]

    def pop_tagged(self, key: K) -> tuple[V, int] | None:
        """Take ``key`` out: its value and tag (None when it was not in)."""
        tagged = self._seq.parts[_part(key) if type(key) is int else hash(key) & _LOW].pop(
            key, None
        )
        if tagged is None:
            return None
        return self._unlist(tagged), tagged & _TAGS

    def oldest(self) -> K | None:
        """The key at the front (None: empty)."""
        if not self._count:
            self._head = self._next
            return None
        buckets, head = self._buckets, self._head
        while True:
            bucket = buckets.get(head >> _SHIFT)
            if bucket is None:  # emptied: on to the next bucket's first number
                head = ((head >> _SHIFT) + 1) << _SHIFT
            elif head in bucket[0]:
                self._head = head
                return bucket[0][head]
            else:
                head += 1

    def clear(self) -> None:
        self._seq.clear()
        self._buckets.clear()
        self._head = self._next
        self._count = 0
