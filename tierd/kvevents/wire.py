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
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import msgpack

__all__ = [
    "END_SEQ",
    "Described",
    "batch",
    "cleared",
    "describe",
    "removed",
    "replay_start",
    "stored",
]

_FLOAT64 = struct.Struct(">Bd")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


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


class Described(NamedTuple):
    """What one stored block says of itself, pre-encoded for events. (A named tuple: the
    book makes one per event it announces, and a frozen dataclass cost four times as
    long to make.)"""

    fields: bytes  # key/value pairs of a BlockStored map, concatenated, no map header
    pairs: int  # number of key/value pairs in ``fields``
    hashes: bytes  # msgpack of the block_hashes list alone (for removals)
    group_idx: int | None
    size: int  # bytes this costs (len(fields) + len(hashes)), for the book's budget


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
    rest: dict[str, Any] = {
        "parent_block_hash": parent,
        "token_ids": tokens if isinstance(tokens, list) else list(tokens),
        "block_size": block_size,
        "lora_id": lora_id,
        "lora_name": lora_name,
    }
    if extra_keys is not None:
        rest["extra_keys"] = list(extra_keys)
    if group_idx is not None:
        rest["group_idx"] = group_idx
    try:
        encoded_hashes = _pack(hashes if isinstance(hashes, list) else list(hashes))
        # One packing of the map, its header cut off: the pairs, in order (at most 7
        # pairs: a fixmap's header is one byte).
        body = _pack(rest)[1:]
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"a block description msgpack cannot encode: {exc}") from exc
    pairs = rest
    fields = _HASHES + encoded_hashes + body
    return Described(
        fields=fields,
        pairs=len(pairs) + 1,
        hashes=encoded_hashes,
        group_idx=group_idx,
        size=len(fields) + len(encoded_hashes),
    )


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


def batch(ts: float, events: Sequence[bytes], dp_rank: int | None) -> bytes:
    """A batch payload, as vLLM's encoder writes ``KVEventBatch``: ``[ts, events, rank]``."""
    return b"".join(
        (
            b"\x93",
            _FLOAT64.pack(0xCB, ts),
            array_header(len(events)),
            *events,
            _pack(dp_rank),
        )
    )


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay_start(frames: Sequence[bytes]) -> int | None:
    """The first sequence number a ROUTER replay request ``[client, b"", start]`` asks
    for, or None when the request is malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return int.from_bytes(frames[2], "big")
