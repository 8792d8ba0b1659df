"""A block's description as a client sends it (``describe``, docs/protocol.md), checked.

One map per block, in the engine's own terms (vLLM's ``BlockStored`` fields)::

    {"hashes": [h, ...], "parent": h | None, "tokens": [t, ...], "block_size": n,
     "lora_id": int | None, "lora_name": str | None, "extra_keys": [..] | None,
     "group": int | None}

A hash is an integer (signed or unsigned 64-bit) or a byte string of at most 64 bytes,
as the engine's router computes it. A tierd block may be several engine blocks (a vLLM
chunk): ``tokens`` holds ``block_size`` tokens per hash. ``extra_keys`` has one entry per
hash (None, or a list of scalars). Anything else is refused with what is wrong.
"""

from __future__ import annotations

from typing import Any

import msgpack

from tierd.kvevents import wire
from tierd.kvevents.book import Entry

__all__ = ["MAX_HASHES", "MAX_TOKENS", "BadDescription", "parse_description"]

MAX_HASHES = 256  # engine blocks in one tierd block
MAX_TOKENS = 1 << 16  # tokens in one tierd block
_FIELDS = frozenset(
    {"hashes", "parent", "tokens", "block_size", "lora_id", "lora_name", "extra_keys", "group"}
)
_SCALARS = (int, float, str, bytes, bool, type(None))


class BadDescription(ValueError):
    """A description that cannot be one (the message says why)."""


_LOWEST, _PAST_HIGHEST = -(1 << 63), 1 << 64  # a hash, signed or unsigned 64-bit


def _hash(value: Any, what: str) -> int | bytes:
    if isinstance(value, bool):
        raise BadDescription(f"{what} is a boolean, not a hash")
    if isinstance(value, int):
        if not _LOWEST <= value < _PAST_HIGHEST:
            raise BadDescription(f"{what} is out of the 64-bit range")
        return value
    if isinstance(value, bytes) and 0 < len(value) <= 64:
        return value
    raise BadDescription(f"{what} is not an integer or 1-64 bytes")


def _opt_int(raw: dict[str, Any], name: str) -> int | None:
    value = raw.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadDescription(f"{name} is not an integer")
    if value is not None and not -(1 << 63) <= value < (1 << 63):
        raise BadDescription(f"{name} is out of range")
    return value


def _extra_keys(value: Any, count: int) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        raise BadDescription(f"extra_keys is not a list of {count} entries (one per hash)")
    for item in value:
        if item is not None and not (
            isinstance(item, list)
            and len(item) <= 64
            and all(isinstance(x, _SCALARS) for x in item)
        ):
            raise BadDescription("an extra_keys entry is not null or a list of at most 64 scalars")
    return value


def _tokens(value: Any, expected: int) -> list[int]:
    if not isinstance(value, list) or len(value) != expected:
        raise BadDescription(f"tokens is not a list of {expected} (block_size per hash)")
    # At C speed: every element an int (not a bool), all within [0, 2**32).
    if set(map(type, value)) != {int} or min(value) < 0 or max(value) >= 1 << 32:
        raise BadDescription("a token id is not an integer in [0, 2**32)")
    return value


def unpack_description(packed: Any) -> Any:
    """A description travels as msgpack bytes of its own (a request's frame would
    otherwise hold three containers per block: over the frame's bound on containers)."""
    if type(packed) is not bytes:
        raise BadDescription("a description is the msgpack bytes (bin) of a map")
    try:
        return msgpack.unpackb(
            packed,
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_TOKENS,
            max_map_len=len(_FIELDS),
            max_str_len=256,
            max_bin_len=64,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise BadDescription("a description is not a msgpack map within bounds") from None


def parse_description(raw: Any) -> Entry:
    """The book entry of one client description (a map, unpacked by
    :func:`unpack_description`); :class:`BadDescription` if it is not one."""
    if not isinstance(raw, dict):
        raise BadDescription("a description is a map")
    if not _FIELDS.issuperset(raw):
        unknown = set(raw) - _FIELDS
        raise BadDescription(f"unknown field {sorted(map(str, unknown))[0]!r}")
    get = raw.get
    hashes_raw = get("hashes")
    if not isinstance(hashes_raw, list) or not 0 < len(hashes_raw) <= MAX_HASHES:
        raise BadDescription(f"hashes is not a list of 1-{MAX_HASHES} hashes")
    hashes = hashes_raw  # (checked in place: a hash is kept as it came)
    for h in hashes:
        if type(h) is not int or not _LOWEST <= h < _PAST_HIGHEST:  # (the common case)
            _hash(h, "a hash")
    parent = get("parent")
    parent = None if parent is None else _hash(parent, "parent")
    size = get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise BadDescription("block_size is not a positive integer")
    if size * len(hashes) > MAX_TOKENS:
        raise BadDescription(f"a block of more than {MAX_TOKENS} tokens")
    tokens = _tokens(get("tokens"), size * len(hashes))
    lora_name = get("lora_name")
    if lora_name is not None and (not isinstance(lora_name, str) or len(lora_name) > 256):
        raise BadDescription("lora_name is not a string of at most 256 characters")
    lora_id, extra_keys, group = get("lora_id"), get("extra_keys"), get("group")
    described = wire.describe(
        hashes,
        parent,
        tokens,
        size,
        lora_id=None if lora_id is None else _opt_int(raw, "lora_id"),
        lora_name=lora_name,
        extra_keys=None if extra_keys is None else _extra_keys(extra_keys, len(hashes)),
        group_idx=None if group is None else _opt_int(raw, "group"),
    )
    return Entry(described, tuple(hashes))
