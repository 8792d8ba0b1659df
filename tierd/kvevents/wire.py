"""vLLM's KV-event wire format, built from pre-encoded msgpack pieces.

This module owns the bytes a router reads: one event is a msgpack map tagged with
``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), the other keys being
the field names of vLLM's ``kv_events`` structs; a batch is the array
``[ts, [events...], data_parallel_rank]``. vLLM's own encoder writes the rank as nil when
it is unset (an ``array_like`` struct keeps every position), and so does :func:`batch`.
Sequence numbers travel as 8 big-endian bytes; a replay request is ``[b"", start_seq]``
and its answer ends with ``[b"", b"", END_SEQ, b""]``.

What a block says of itself (hashes, parent, tokens, LoRA, extra keys) is encoded once,
by :func:`describe`, when the block arrives; every later event about it (a store on
another medium, a removal) is a map header and a few short strings around those bytes.
The book keeps each description as a *row* (:func:`row`: msgpack of ``[fields, pairs,
hashes, group_idx]``), and a :class:`Framer` (one per medium) makes a block's events
straight from its row, the bytes of :func:`stored` and :func:`removed` without decoding it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgpack
import msgspec

__all__ = [
    "END_SEQ",
    "Described",
    "Framer",
    "array_count",
    "batch",
    "bin_at",
    "cleared",
    "describe",
    "described",
    "removed",
    "replay_start",
    "row",
    "spans",
    "stored",
]

_FLOAT64 = struct.Struct(">Bd")
# msgspec's encoder: msgpack's bytes for every value here (bin for bytes, the smallest
# int), in a third of the time of msgpack's Packer, and safe to share between threads.
_pack = msgspec.msgpack.Encoder().encode


@lru_cache(maxsize=256)
def _text(value: str) -> bytes:
    """A short string (a key, a medium, a locality), encoded once."""
    return _pack(value)


def _header(count: int, fix: int, wide: int) -> bytes:
    """A map or array header for ``count`` items (msgpack spec: fix, 16 and 32 bits)."""
    if count < 16:
        return bytes((fix | count,))
    if count < 0x10000:
        return bytes((wide,)) + count.to_bytes(2, "big")
    if count < 0x100000000:
        return bytes((wide + 1,)) + count.to_bytes(4, "big")
    raise ValueError(f"{count} items do not fit a msgpack header")


def map_header(pairs: int) -> bytes:
    """The header of a map of ``pairs`` key/value pairs."""
    return _header(pairs, 0x80, 0xDE)


def array_header(items: int) -> bytes:
    """The header of an array of ``items`` elements."""
    return _header(items, 0x90, 0xDC)


_TYPE = _text("type")
_STORED = _TYPE + _text("BlockStored")
_REMOVED = _TYPE + _text("BlockRemoved")
_CLEARED = map_header(1) + _TYPE + _text("AllBlocksCleared")
_HASHES = _text("block_hashes")
_MEDIUM = _text("medium")
_GROUP = _text("group_idx")
_LOCALITY = _text("locality")
_OWNERSHIP = _text("ownership")


class Described(msgspec.Struct, frozen=True, gc=False):
    """What one stored block says of itself, pre-encoded for events. (A msgspec struct
    the garbage collector does not track: one is made per description, in a quarter of
    the time of a named tuple and a sixteenth of a frozen dataclass.)"""

    fields: bytes  # key/value pairs of a BlockStored map, concatenated, no map header
    pairs: int  # number of key/value pairs in ``fields``
    hashes: bytes  # msgpack of the block_hashes list alone (for removals)
    group_idx: int | None
    size: int  # bytes this costs (len(fields) + len(hashes)), for the book's budget


class _Stored(msgspec.Struct, omit_defaults=True):
    """A BlockStored map's fields after its type, in vLLM's order (``extra_keys`` and
    ``group_idx`` only when given: their defaults are left out)."""

    block_hashes: Any
    parent_block_hash: Any
    token_ids: Any
    block_size: int
    lora_id: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None


def describe(
    hashes: Sequence[int | bytes],
    parent: int | bytes | None,
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    group_idx: int | None = None,
) -> Described:
    """Encode a block's description once: the fields of its BlockStored events.

    ``lora_id`` and ``lora_name`` are always written (vLLM requires the keys; nil when
    unset); ``extra_keys`` and ``group_idx`` only when given. Raises ValueError for a
    block size below 1 and for values msgpack cannot carry (an int beyond 64 bits).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    try:
        return described(
            hashes if isinstance(hashes, list) else list(hashes),
            parent,
            tokens if isinstance(tokens, list) else list(tokens),
            block_size,
            lora_id,
            lora_name,
            None if extra_keys is None else list(extra_keys),
            group_idx,
        )
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
        raise ValueError(f"a block description msgpack cannot encode: {exc}") from exc


def described(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int,
    lora_id: int | None,
    lora_name: str | None,
    extra_keys: list[Any] | None,
    group_idx: int | None,
) -> Described:
    """:func:`describe` of values checked already (a client's, :mod:`.describe`): lists,
    a block size of at least 1; positional, for the loop's sake."""
    # One encoding of the map (at most 8 pairs: a fixmap, its header one byte, cut off),
    # its hashes once more alone (for removals).
    encoded = _pack(
        _Stored(hashes, parent, tokens, block_size, lora_id, lora_name, extra_keys, group_idx)
    )
    encoded_hashes = _pack(hashes)
    fields = encoded[1:]
    return Described(
        fields, encoded[0] & 0x0F, encoded_hashes, group_idx, len(fields) + len(encoded_hashes)
    )


def row(d: Described) -> bytes:
    """How the book keeps ``d``: msgpack of ``[fields, pairs, hashes, group_idx]``."""
    return _pack([d.fields, d.pairs, d.hashes, d.group_idx])


def bin_at(data: bytes, at: int) -> tuple[int, int]:
    """Where the bytes of the msgpack bin at ``at`` start and end."""
    tag = data[at]
    if tag == 0xC4:
        return at + 2, at + 2 + data[at + 1]
    if tag == 0xC5:
        return at + 3, at + 3 + int.from_bytes(data[at + 1 : at + 3], "big")
    if tag == 0xC6:
        return at + 5, at + 5 + int.from_bytes(data[at + 1 : at + 5], "big")
    raise ValueError(f"not a row: {tag:#x} where a bin should be")


def array_count(data: bytes, at: int) -> int:
    """How many items the msgpack array at ``at`` holds (read from its header)."""
    tag = data[at]
    if tag & 0xF0 == 0x90:
        return tag & 0x0F
    if tag == 0xDC:
        return int.from_bytes(data[at + 1 : at + 3], "big")
    if tag == 0xDD:
        return int.from_bytes(data[at + 1 : at + 5], "big")
    raise ValueError(f"not an array: {tag:#x}")


def spans(data: bytes) -> tuple[int, int, int, int]:
    """Where a row's fields and its hashes' bytes start and end (their bins found inline
    when under 256 bytes, the rule: one call for both)."""
    if data[1] == 0xC4:
        fields_at, fields_end = 3, 3 + data[2]
    else:
        fields_at, fields_end = bin_at(data, 1)
    at = fields_end + 1  # past the pairs (a fixint)
    if data[at] == 0xC4:
        return fields_at, fields_end, at + 2, at + 2 + data[at + 1]
    return (fields_at, fields_end, *bin_at(data, at))


class Framer:
    """The events of one medium (with ``locality``, ``ownership``), made from rows
    (:func:`row`): the very bytes of :func:`stored` and :func:`removed`, their constant
    parts encoded once (an event then costs two slices and a join, no decoding)."""

    __slots__ = ("_group", "_removed", "_stored", "_tail")

    def __init__(
        self, medium: str, *, locality: str | None = "LOCAL", ownership: str | None = None
    ) -> None:
        count, self._tail = _tail(medium, locality, ownership)
        # A BlockStored map's header by its description's pairs (7 at most: a fixint).
        self._stored = [map_header(1 + pairs + count) + _STORED for pairs in range(128)]
        self._removed = map_header(2 + count) + _REMOVED + _HASHES
        self._group = map_header(3 + count) + _REMOVED + _HASHES

    def stored(self, data: bytes) -> bytes:
        """The BlockStored event of the block whose row is ``data``."""
        if data[1] == 0xC4:  # (fields under 256 bytes: found here, not by a call)
            end = 3 + data[2]
            return b"".join((self._stored[data[end]], data[3:end], self._tail))
        start, end = bin_at(data, 1)
        return b"".join((self._stored[data[end]], data[start:end], self._tail))

    def removed(self, data: bytes) -> bytes:
        """The BlockRemoved event of the block whose row is ``data``."""
        _, _, start, end = spans(data)
        if data[end] == 0xC0:  # no group
            return b"".join((self._removed, data[start:end], self._tail))
        return b"".join((self._group, data[start:end], self._tail, _GROUP, data[end:]))


@lru_cache(maxsize=256)
def _tail(medium: str, locality: str | None, ownership: str | None) -> tuple[int, bytes]:
    """The pairs every block event ends with: medium, then locality and ownership if set."""
    parts = [_MEDIUM + _text(medium)]
    if locality is not None:
        parts.append(_LOCALITY + _text(locality))
    if ownership is not None:
        parts.append(_OWNERSHIP + _text(ownership))
    return len(parts), b"".join(parts)


def stored(
    d: Described, medium: str, *, locality: str | None = "LOCAL", ownership: str | None = None
) -> bytes:
    """One BlockStored event: the block's description as stored on ``medium``."""
    count, tail = _tail(medium, locality, ownership)
    return map_header(1 + d.pairs + count) + _STORED + d.fields + tail


def removed(
    d: Described, medium: str, *, locality: str | None = "LOCAL", ownership: str | None = None
) -> bytes:
    """One BlockRemoved event: the block's hashes (and group) left ``medium``."""
    count, tail = _tail(medium, locality, ownership)
    group = b"" if d.group_idx is None else _GROUP + _pack(d.group_idx)
    pairs = 2 + count + (d.group_idx is not None)
    return map_header(pairs) + _REMOVED + _HASHES + d.hashes + tail + group


def cleared() -> bytes:
    """One AllBlocksCleared event."""
    return _CLEARED


@lru_cache(maxsize=64)
def _rank(dp_rank: int | None) -> bytes:
    return bytes(msgpack.packb(dp_rank))


def batch(ts: float, events: Sequence[bytes], dp_rank: int | None) -> bytes:
    """A batch payload, as vLLM's encoder writes ``KVEventBatch``: ``[ts, events, rank]``."""
    head = b"\x93" + _FLOAT64.pack(0xCB, ts) + array_header(len(events))
    return b"".join([head, *events, _rank(dp_rank)])


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay_start(frames: Sequence[bytes]) -> int | None:
    """The first sequence number a ROUTER replay request ``[client, b"", start]`` asks
    for, or None when the request is malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return int.from_bytes(frames[2], "big")
