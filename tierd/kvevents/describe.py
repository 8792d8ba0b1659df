"""A block's description as a client sends it (``describe``, docs/protocol.md), checked.

One map per block, in the engine's own terms (vLLM's ``BlockStored`` fields), sent as the
msgpack bytes of its own (a request's frame would otherwise hold three containers per
block: over the frame's bound on containers)::

    {"hashes": [h, ...], "parent": h | None, "tokens": [t, ...], "block_size": n,
     "lora_id": int | None, "lora_name": str | None, "extra_keys": [..] | None,
     "group": int | None}

A hash is an integer (signed or unsigned 64-bit: what msgpack carries) or a byte string
of at most 64 bytes, as the engine's router computes it. A tierd block may be several
engine blocks (a vLLM chunk): ``tokens`` holds ``block_size`` tokens per hash.
``extra_keys`` has one entry per hash (None, or a list of at most 64 scalars). Anything
else is refused with what is wrong and where.

Every description a client sends passes here, on the loop every client shares: it is
decoded and checked in one call at C speed (msgspec, against :class:`_Description`'s
types and bounds; checked by hand, field by field, it cost five times as long), then
encoded once for events (:func:`tierd.kvevents.wire.describe`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tierd.kvevents import wire
from tierd.kvevents.book import Entry

__all__ = ["MAX_HASHES", "MAX_TOKENS", "BadDescription", "parse_description"]

MAX_HASHES = 256  # engine blocks in one tierd block
MAX_TOKENS = 1 << 16  # tokens in one tierd block
_SCALARS = (int, float, str, bytes, bool, type(None))

# An integer hash is any msgpack integer: the signed and unsigned 64-bit ranges.
_Hash = int | Annotated[bytes, Meta(min_length=1, max_length=64)]
_Int64 = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class BadDescription(ValueError):
    """A description that cannot be one (the message says why)."""


class _Description(msgspec.Struct, forbid_unknown_fields=True):
    """A description's fields, their types and bounds (see the module's docstring)."""

    hashes: Annotated[list[_Hash], Meta(min_length=1, max_length=MAX_HASHES)]
    tokens: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 32)]], Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
    parent: _Hash | None = None
    lora_id: _Int64 | None = None
    lora_name: Annotated[str, Meta(max_length=256)] | None = None
    extra_keys: list[Annotated[list[Any], Meta(max_length=64)] | None] | None = None
    group: _Int64 | None = None


_decode = msgspec.msgpack.Decoder(_Description).decode


def _extra_keys(value: list[Any], count: int) -> list[Any]:
    if len(value) != count:
        raise BadDescription(f"extra_keys is not a list of {count} entries (one per hash)")
    for item in value:
        if item is not None and not all(
            isinstance(x, _SCALARS) and (not isinstance(x, str | bytes) or len(x) <= 256)
            for x in item
        ):
            raise BadDescription(
                "an extra_keys entry is not null or a list of at most 64 scalars"
                " (strings and bytes of at most 256)"
            )
    return value


def parse_description(packed: Any) -> Entry:
    """The book entry of one client description (its msgpack bytes);
    :class:`BadDescription`, saying what is wrong and where, if it is not one."""
    if type(packed) is not bytes:
        raise BadDescription("a description is the msgpack bytes (bin) of a map")
    try:
        d = _decode(packed)
    except msgspec.ValidationError as exc:
        raise BadDescription(str(exc)) from None
    except msgspec.DecodeError:
        raise BadDescription("not msgpack") from None
    except RecursionError:  # (extra_keys' entries, any msgpack at first: nested deep)
        raise BadDescription("its containers nest too deep") from None
    hashes, size = d.hashes, d.block_size
    expected = size * len(hashes)
    if expected > MAX_TOKENS:
        raise BadDescription(f"a block of more than {MAX_TOKENS} tokens")
    if len(d.tokens) != expected:
        raise BadDescription(f"tokens is not a list of {expected} (block_size per hash)")
    extra_keys = d.extra_keys
    if extra_keys is not None:
        _extra_keys(extra_keys, len(hashes))
    # (What msgpack decoded and the checks above let through, msgpack encodes.)
    described = wire.described(
        hashes, d.parent, d.tokens, size, d.lora_id, d.lora_name, extra_keys, d.group
    )
    return Entry(described, tuple(hashes))
