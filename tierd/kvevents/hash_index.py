"""The book's index from engine block hashes to the keys described with them, for the
existence query (``blocks_held``): a :class:`HashIndex`.

Routers that listen never ask, so a book makes one only at the first ask
(:meth:`tierd.kvevents.book.DescriptorBook.index_part`) and reads its rows into it a part
at a time, the caller's turn between parts. From its first part on, the book adds each
description it puts and removes each it drops: the parts not read yet and the changes made
meanwhile end up in it alike (a key put since the index began may be in a part read later
too: it is listed once).

A hash maps to its key's bytes, or, rarely, to a tuple of the keys that share it: nothing
per entry that the garbage collector tracks, but those tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator

import msgpack

from tierd.keys import BlockKey
from tierd.kvevents import wire
from tierd.maps import Shards

__all__ = ["HashIndex"]

_Keys = BlockKey | tuple[BlockKey, ...]  # the keys of one hash: one key, or a tuple


class HashIndex:
    """Engine hash -> the keys described with it (see the module's docstring)."""

    __slots__ = ("_at", "_keys", "_part", "_row_of", "_rows_a_part", "_unread")

    def __init__(
        self,
        rows: Iterator[list[tuple[BlockKey, bytes]]],
        row_of: Callable[[BlockKey], bytes | None],
        rows_a_part: int,
    ) -> None:
        """An index of the book whose ``(key, row)`` pairs ``rows`` gives, a list at a
        time, read ``rows_a_part`` pairs a part (:meth:`read_part`); ``row_of`` gives a
        key's row now (None: not described)."""
        self._keys: Shards[Hashable, _Keys] = Shards()
        self._unread: Iterator[list[tuple[BlockKey, bytes]]] | None = rows
        self._row_of = row_of
        self._rows_a_part = rows_a_part
        self._part: list[tuple[BlockKey, bytes]] = []  # the list being read, from _at
        self._at = 0

    @property
    def whole(self) -> bool:
        return self._unread is None

    def read_part(self) -> bool:
        """The next part of the book's rows read in: True when none is left."""
        if self._unread is None:
            return True
        if self._at >= len(self._part):
            part = next(self._unread, None)
            if part is None:
                self._unread, self._part = None, []
                return True
            self._part, self._at = part, 0
        at, row_of = self._at, self._row_of
        self._at = at + self._rows_a_part
        for key, row in self._part[at : self._at]:
            # A list is read over several parts, the book changing between them: a pair
            # put or dropped since is in the index already, or must not be.
            if row_of(key) is row:
                self.add(key, _hashes_of(row))
        return False

    def add(self, key: BlockKey, hashes: Iterable[Hashable]) -> None:
        """``key`` was described with ``hashes`` (listed once, if it was already)."""
        part_of = self._keys.part_of
        for h in hashes:
            part = part_of(h)
            had = part.get(h)
            if had is None:
                part[h] = key
            elif key not in _listed(had):
                part[h] = (*_listed(had), key)

    def remove(self, key: BlockKey, hashes: Iterable[Hashable]) -> None:
        """``key``'s description, with ``hashes``, was dropped."""
        part_of = self._keys.part_of
        for h in hashes:
            part = part_of(h)
            had = part.pop(h, None)
            if had is None or had == key:
                continue
            keys = tuple(k for k in _listed(had) if k != key)
            if keys:
                part[h] = keys[0] if len(keys) == 1 else keys

    def keys_of(self, h: Hashable) -> tuple[BlockKey, ...]:
        """The keys described with ``h``."""
        return _listed(self._keys.get(h, ()))


def _hashes_of(row: bytes) -> list[Hashable]:
    """The engine hashes a book's row lists."""
    _, _, start, end = wire.spans(row)
    return msgpack.unpackb(row[start:end])  # type: ignore[no-any-return]


def _listed(keys: _Keys | tuple[()]) -> tuple[BlockKey, ...]:
    """The keys of one hash as a tuple."""
    return (keys,) if isinstance(keys, bytes) else keys
