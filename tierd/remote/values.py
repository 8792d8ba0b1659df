"""One value per block on the shared server: a header that names the block, then its bytes.

Layout (little-endian)::

    magic  b"TDKV"   4 bytes
    version          1 byte   (1)
    key length       2 bytes
    payload length   4 bytes
    xxh3-64 of the payload   8 bytes
    the key          key length bytes
    the payload      payload length bytes

A value is only ever believed whole: :func:`decode_block` checks the magic, the version,
that the key is the one asked for, that the payload has the block size this daemon uses
and that its checksum matches, and says which check failed. The server is shared by
other daemons (maybe older, maybe with another block size) and by anyone who can reach
it, so a value that fails a check is a miss, never bytes.
"""

from __future__ import annotations

import struct

from xxhash import xxh3_64_intdigest

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "decode_block",
    "encode_block",
    "encode_into",
    "key_space",
]

MAGIC = b"TDKV"
VERSION = 1
_HEADER = struct.Struct("<4sBHIQ")
HEADER_BYTES = _HEADER.size


def encode_block(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """The value stored for ``key``: header, key, payload (one copy of the payload)."""
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, VERSION, len(key), view.nbytes, xxh3_64_intdigest(view))
    return b"".join((header, key, view))


def encode_into(buffer: bytearray, key: bytes, payload: bytes | bytearray | memoryview) -> int:
    """Write the value stored for ``key`` at the start of ``buffer`` (which must hold
    ``HEADER_BYTES + len(key) + len(payload)`` bytes) and return its length: the same bytes
    as :func:`encode_block`, in a buffer the caller reuses, so a write costs one copy of the
    payload into memory already mapped rather than into a fresh allocation."""
    view = memoryview(payload).cast("B")
    start = HEADER_BYTES + len(key)
    end = start + view.nbytes
    _HEADER.pack_into(buffer, 0, MAGIC, VERSION, len(key), view.nbytes, xxh3_64_intdigest(view))
    target = memoryview(buffer)
    target[HEADER_BYTES:start] = key
    target[start:end] = view
    return end


def key_space(block_bytes: int) -> bytes:
    """What follows the configured prefix in every server key: the format version and
    the block size (``v1.65536:``), so that daemons that could not read each other's
    values never find them, and so never delete them as corrupt."""
    return f"v{VERSION}.{block_bytes}:".encode()


def decode_block(key: bytes, value: object, block_bytes: int) -> memoryview | str:
    """The payload of ``value`` (bytes, or any buffer: an object store's body) if it is
    ``key``'s block of ``block_bytes`` bytes, intact; otherwise the reason it is not (a
    short phrase for counters and logs)."""
    try:
        view = memoryview(value).cast("B")  # type: ignore[arg-type]  # checked here
    except TypeError:
        return f"a reply of type {type(value).__name__}, not a value"
    if view.nbytes < HEADER_BYTES:
        return "shorter than a header"
    magic, version, key_len, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        return "not a tierd block"
    if version != VERSION:
        return f"format version {version}, not {VERSION}"
    if length != block_bytes:
        return f"a block of {length} bytes, not {block_bytes}"
    if view.nbytes != HEADER_BYTES + key_len + length:
        return "length does not match its header"
    if view[HEADER_BYTES : HEADER_BYTES + key_len] != key:
        return "holds another key's block"
    payload = view[HEADER_BYTES + key_len :]
    if xxh3_64_intdigest(payload) != checksum:
        return "checksum mismatch"
    return payload
