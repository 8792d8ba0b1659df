"""A slab's index, slot -> (key, generation), kept where the garbage collector never walks.

The index holds an entry per block: millions on a big disk tier. Held as one dict of
``(key, generation)`` tuples it was a container of millions of children, and every
collection of the generation it sat in walked them all: 30-70 ms of the event loop per
million entries, and 65-150 ms for a full collection, at moments nobody chose. Freezing
the daemon's objects once it is ready did not reliably spare it: a full collection
untracks a dict whose tuples it has untracked, so a frozen daemon could miss the index,
and the next write (a fresh tuple) tracked it again as a young object.

A dict whose keys and values are ints and bytes is never tracked at all. So
:class:`SlotIndex` keeps two of them, the keys and the generations of the same slots, and
hands entries out as tuples made on the way. It is a mutable mapping of slot -> entry
like the dict it replaces; :func:`~tierd.stores.disk_snapshot.take` reads its two dicts
directly, at C speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, overload

__all__ = ["Entry", "SlotIndex"]

# A readable block: (key, generation its header must carry). A plain tuple, not a
# dataclass: entries are made per lookup, and in millions at a restart.
Entry = tuple[bytes, int]


class SlotIndex(MutableMapping[int, Entry]):
    """Slot -> :data:`Entry`, held as ``keys_of`` (slot -> key) and ``gens_of`` (slot ->
    generation), which always hold the same slots in the same order."""

    __slots__ = ("gens_of", "keys_of")

    def __init__(self, entries: Mapping[int, Entry] | Iterable[tuple[int, Entry]] = ()) -> None:
        self.keys_of: dict[int, bytes] = {}
        self.gens_of: dict[int, int] = {}
        self.update(entries)

    @classmethod
    def of(cls, entries: Mapping[int, Entry]) -> SlotIndex:
        """``entries`` as a :class:`SlotIndex` (itself when it is one)."""
        return entries if isinstance(entries, SlotIndex) else cls(entries)

    @classmethod
    def packed(cls, slots: Iterable[int], keys: Iterable[bytes], gens: Iterable[int]) -> SlotIndex:
        """The index of parallel ``slots``, ``keys`` and ``gens`` (at C speed)."""
        index = cls()
        slots = list(slots)
        index.keys_of = dict(zip(slots, keys, strict=True))
        index.gens_of = dict(zip(slots, gens, strict=True))
        if len(index.keys_of) != len(slots):
            raise ValueError("a slot is listed twice")
        return index

    def __getitem__(self, slot: int) -> Entry:
        return self.keys_of[slot], self.gens_of[slot]

    @overload
    def get(self, slot: int) -> Entry | None: ...
    @overload
    def get(self, slot: int, default: Any) -> Any: ...
    def get(self, slot: int, default: Any = None) -> Any:
        key = self.keys_of.get(slot)
        return default if key is None else (key, self.gens_of[slot])

    def __setitem__(self, slot: int, entry: Entry) -> None:
        key, gen = entry
        self.keys_of[slot] = key
        self.gens_of[slot] = gen

    def __delitem__(self, slot: int) -> None:
        del self.keys_of[slot]
        del self.gens_of[slot]

    def pop(self, slot: int, *default: Any) -> Any:
        if slot in self.keys_of:
            return self.keys_of.pop(slot), self.gens_of.pop(slot)
        if default:
            return default[0]
        raise KeyError(slot)

    def update(  # type: ignore[override]  # no keyword form: slots are ints
        self, entries: Mapping[int, Entry] | Iterable[tuple[int, Entry]] = ()
    ) -> None:
        keys, gens = self.keys_of, self.gens_of
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        for slot, (key, gen) in pairs:
            keys[slot] = key
            gens[slot] = gen

    def clear(self) -> None:
        self.keys_of.clear()
        self.gens_of.clear()

    def __contains__(self, slot: object) -> bool:
        return slot in self.keys_of

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys_of)

    def __len__(self) -> int:
        return len(self.keys_of)

    def __repr__(self) -> str:
        return f"SlotIndex({len(self)} entries)"
