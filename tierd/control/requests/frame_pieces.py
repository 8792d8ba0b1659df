"""A reply too big to build in one go (a ``get`` of up to a frame of blocks), encoded in
pieces: its blocks a piece at a time (:func:`encode_bins`, into :class:`EncodedBins`),
then its frame (:func:`frame_in_pieces`): the same bytes :func:`~tierd.control.protocol.encode`
would make of the whole message, each piece written as it is (a message of the one field
:data:`~tierd.control.protocol.FRAME_PIECE`). Packed and written at once, a frame of
blocks would hold the event loop (every tenant's) for as long as all of it takes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from tierd.control.protocol import HEADER

__all__ = ["PIECE_BYTES", "EncodedBins", "encode_bins", "frame_in_pieces"]

# Bytes of blocks one piece of a reply encoded in pieces holds (one block at least): a
# piece is copied, then written, in a turn of the loop each, so this bounds what such a
# turn costs the loop (fresh pages faulted in included).
PIECE_BYTES = 1 << 18


@dataclass(frozen=True, slots=True)
class EncodedBins:
    """A list of ``count`` bin values (a get's blocks) encoded already, in ``pieces``
    (each :func:`encode_bins`' of whole items): the last field of a reply sent in pieces
    (:func:`frame_in_pieces`)."""

    count: int
    pieces: list[bytes]


def encode_bins(items: Sequence[Any]) -> bytes:
    """``items`` (bytes-like, each of one dimension of bytes) as msgpack encodes them in a
    list: each one's bin header, then its bytes. One copy of the bytes."""
    parts: list[Any] = []
    for item in items:
        size = len(item)
        if size < 1 << 8:
            parts.append(_BIN8.pack(0xC4, size))
        elif size < 1 << 16:
            parts.append(_BIN16.pack(0xC5, size))
        else:
            parts.append(_BIN32.pack(0xC6, size))
        parts.append(item)
    return b"".join(parts)


def frame_in_pieces(message: Mapping[str, Any]) -> list[bytes]:
    """The frame :func:`encode` makes of ``message``, whose last field's value is an
    :class:`EncodedBins` (a list of those bins for :func:`encode`), in pieces: the length
    prefix and the other fields with the first piece of bins, then the other pieces as
    they are. No piece is copied but the first. The pieces are taken out of the
    :class:`EncodedBins` (its list is left empty): each is freed once its writer drops
    it, not all at once with the message."""
    *fields, (name, bins) = message.items()
    if not isinstance(bins, EncodedBins):
        raise TypeError("the last field of a reply in pieces must be EncodedBins")
    pack = msgpack.Packer(use_bin_type=True).pack
    head = b"".join(
        [_map_header(len(message)), *(pack(key) + pack(value) for key, value in fields)]
    )
    head += pack(name) + _array_header(bins.count)
    pieces = bins.pieces[:]
    bins.pieces.clear()
    body = len(head) + sum(len(piece) for piece in pieces)
    first = HEADER.pack(body) + head
    if not pieces:
        return [first]
    pieces[0] = first + pieces[0]
    return pieces


_BIN8, _BIN16, _BIN32 = struct.Struct(">BB"), struct.Struct(">BH"), struct.Struct(">BI")


def _map_header(size: int) -> bytes:
    header: bytes = msgpack.Packer().pack_map_header(size)
    return header


def _array_header(size: int) -> bytes:
    header: bytes = msgpack.Packer().pack_array_header(size)
    return header
