"""The disk store's slot-index snapshot: its byte format, atomic write and tolerant read.

A snapshot is ``xxh3 u64`` of the payload, then a msgpack map. Version 2 (written now)
keeps the index as packed little-endian arrays, so that a million blocks load in a
fraction of a second without one Python object per msgpack item::

    {version: 2, uuid, epoch, next_gen, clean,
     slots: bin (u32 per block), gens: bin (u64 per block),
     key_bytes: int (the width of every key, or 0 when widths differ),
     lens: bin (u8 per block; only when key_bytes is 0), keys: bin (the keys, concatenated),
     pending: bin ((u32 slot, u64 gen) per write in flight when the snapshot was taken)}

Version 1 (written by earlier releases) is read too: ``slots`` is a flat list
``[slot, key, gen, ...]`` and there is no ``pending`` (a crash after such a snapshot is
recovered by scanning the slab, as those releases did).

The snapshot is written to a temporary file, fsynced and renamed (a failed write removes
the temporary file and leaves the previous snapshot). One that cannot be read (torn,
forged, from another slab) is ignored and the caller rebuilds the index from the slab.

A snapshot is taken as :class:`IndexPart` packed arrays (:func:`take`, at C speed, a
bounded slice of slots at a time on the event loop) and written as those arrays: the
msgpack frame around them is made by hand (:func:`encode_pieces`), so no step walks the
entries one Python object at a time, and the big arrays are hashed and written as they are.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate, compress, pairwise
from typing import Any

import msgpack
import numpy as np
import xxhash

from tierd.logs import get_logger
from tierd.stores.disk_entries import Entry, SlotIndex
from tierd.stores.fileio import FileIO

__all__ = [
    "Checkpoint",
    "Entry",
    "IndexPart",
    "Snapshot",
    "encode_pieces",
    "fsync_dir",
    "load_snapshot",
    "save_snapshot",
    "take",
]

VERSION = 2
_U64 = struct.Struct("<Q")
_PENDING = struct.Struct("<IQ")
_log = get_logger("tierd.disk")


@dataclass(frozen=True, slots=True)
class Snapshot:
    epoch: int
    next_gen: int
    entries: SlotIndex
    clean: bool = False  # written by a clean close, as its last act
    # Slot -> generation of writes in flight when it was taken; None for a version-1
    # snapshot, which did not record them (the caller must then scan).
    pending: dict[int, int] | None = field(default_factory=dict)


U32s = np.ndarray[Any, np.dtype[np.uint32]]


@dataclass(frozen=True, slots=True)
class IndexPart:
    """Some entries of an index as packed arrays: slot (u32), generation (u64) and key
    length (u8) per entry, and the keys concatenated."""

    slots: U32s
    gens: np.ndarray[Any, np.dtype[np.uint64]]
    lens: np.ndarray[Any, np.dtype[np.uint8]]
    keys: bytes

    def without(self, slots: U32s) -> IndexPart:
        """This part less the entries of ``slots`` (sorted, unique)."""
        if not slots.size or not self.slots.size:
            return self
        keep = ~np.isin(self.slots, slots, assume_unique=True)
        if keep.all():
            return self
        key_bytes = np.frombuffer(self.keys, dtype=np.uint8)[np.repeat(keep, self.lens)]
        return IndexPart(self.slots[keep], self.gens[keep], self.lens[keep], key_bytes.tobytes())


def take(entries: Mapping[int, Entry], slots: Iterable[int]) -> IndexPart:
    """The entries of ``slots`` that ``entries`` (the slab's :class:`SlotIndex`) holds,
    packed at C speed (no Python step per entry)."""
    index = SlotIndex.of(entries)
    wanted = list(slots)
    got = list(map(index.keys_of.get, wanted))  # None where none (a key is never empty)
    where = list(compress(wanted, got))
    keys = list(filter(None, got))
    return IndexPart(
        np.fromiter(where, dtype=np.uint32, count=len(where)),
        np.fromiter(map(index.gens_of.__getitem__, where), dtype=np.uint64, count=len(where)),
        np.frombuffer(bytes(map(len, keys)), dtype=np.uint8),  # keys are at most 64 bytes
        b"".join(keys),
    )


def _no_slots() -> U32s:
    return np.zeros(0, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A snapshot to write: the index as ``parts``, less the entries of ``replaced``
    (sorted slots whose entry in a part went stale), plus ``patch`` (the current entries
    of those slots); the writes still ``pending``; the generation and epoch to record."""

    epoch: int
    next_gen: int
    parts: tuple[IndexPart, ...]
    pending: dict[int, int]
    clean: bool = False
    replaced: U32s = field(default_factory=_no_slots)
    patch: IndexPart | None = None

    @classmethod
    def of(
        cls,
        epoch: int,
        next_gen: int,
        entries: Mapping[int, Entry],
        pending: Mapping[int, int],
        *,
        clean: bool = False,
    ) -> Checkpoint:
        """The whole of ``entries`` at once (at open, at close, and in tests)."""
        return cls(epoch, next_gen, (take(entries, entries.keys()),), dict(pending), clean)


def _xxh(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def _unpacked(code: str, raw: object) -> array:  # type: ignore[type-arg]
    if type(raw) is not bytes:
        raise TypeError(f"a packed array is a {type(raw).__name__}, not bin")
    arr = array(code)
    if len(raw) % arr.itemsize:
        raise ValueError("a packed array's length is not a multiple of its item size")
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


Piece = bytes | memoryview  # a buffer written as it is


def _little(parts: list[np.ndarray[Any, Any]], dtype: str) -> list[Piece]:
    """Each array as little-endian bytes, without a copy where it is already so."""
    arrays = [np.ascontiguousarray(p, dtype=dtype) for p in parts]
    return [memoryview(a.data).cast("B") for a in arrays]


def _bin(chunks: list[Piece]) -> list[Piece]:
    """A msgpack bin of the chunks concatenated: its header, then the chunks."""
    size = sum(len(c) for c in chunks)
    if size < 1 << 8:
        head = struct.pack(">BB", 0xC4, size)
    elif size < 1 << 16:
        head = struct.pack(">BH", 0xC5, size)
    else:
        head = struct.pack(">BI", 0xC6, size)
    return [head, *chunks]


def _width(parts: list[IndexPart]) -> int:
    """The length of every key, or 0 when they differ (or there is none)."""
    sizes = [(int(p.lens.min()), int(p.lens.max())) for p in parts if p.lens.size]
    low = {lo for lo, _ in sizes} | {hi for _, hi in sizes}
    return low.pop() if len(low) == 1 else 0


def encode_pieces(cp: Checkpoint, uuid: bytes) -> list[Piece]:
    """The version-2 payload of ``cp`` as pieces to write one after another: exactly the
    msgpack encoding of the snapshot's map, the arrays of every part written as they
    are (no concatenation: a snapshot of millions of entries copies nothing big)."""
    parts = [part.without(cp.replaced) for part in cp.parts] + [cp.patch or take({}, ())]
    width = _width(parts)
    pending = b"".join(_PENDING.pack(s, g) for s, g in cp.pending.items())
    fields: list[tuple[str, object]] = [
        ("version", VERSION), ("uuid", uuid), ("epoch", cp.epoch), ("next_gen", cp.next_gen),
        ("clean", cp.clean), ("slots", _bin(_little([p.slots for p in parts], "<u4"))),
        ("gens", _bin(_little([p.gens for p in parts], "<u8"))), ("key_bytes", width),
        ("keys", _bin([p.keys for p in parts])), ("pending", _bin([pending])),
    ]  # fmt: skip
    if not width:
        fields.append(("lens", _bin([p.lens.tobytes() for p in parts])))
    pieces: list[Piece] = [struct.pack(">B", 0x80 | len(fields))]  # fixmap: <= 15 fields
    for name, value in fields:
        pieces.append(msgpack.packb(name))
        pieces += value if isinstance(value, list) else [msgpack.packb(value)]
    return pieces


def save_snapshot(
    io: FileIO, path: str, uuid: bytes, cp: Checkpoint, pieces: list[Piece] | None = None
) -> None:
    """Write the snapshot atomically: temporary file, fsync, rename, fsync the directory.
    On failure (ENOSPC, EIO) the temporary file is removed and the old snapshot stays.
    ``pieces``: ``cp`` already encoded (:func:`encode_pieces`), e.g. for a failed try."""
    pieces = encode_pieces(cp, uuid) if pieces is None else pieces
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    tmp = path + ".tmp"
    try:
        fd = io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(io, fd, _U64.pack(hasher.intdigest()))
            _write_paced(io, fd, pieces)
            io.fsync(fd)
        finally:
            io.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(io, os.path.dirname(path))


_PACE = 4 << 20  # bytes of a snapshot written between two syncs of it


def _write_paced(io: FileIO, fd: int, pieces: list[Piece]) -> None:
    """Write ``pieces``, syncing every :data:`_PACE` bytes: the device then takes a big
    snapshot a few MiB at a time, and a block write beside it waits for one such burst,
    not for the whole snapshot flushed at once."""
    since = 0
    for piece in pieces:
        view = memoryview(piece)
        for start in range(0, len(view), _PACE):
            part = view[start : start + _PACE]
            write_all(io, fd, part)
            since += len(part)
            if since >= _PACE:
                io.fdatasync(fd)
                since = 0


def load_snapshot(path: str, uuid: bytes) -> Snapshot | None:
    """The snapshot at ``path`` if it is intact and belongs to the slab ``uuid``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    if len(raw) < 8 or _U64.unpack_from(raw)[0] != _xxh(memoryview(raw)[8:]):
        _log.warning("index snapshot is torn; rebuilding the index from the slab", path=path)
        return None
    try:
        return _parse(msgpack.unpackb(memoryview(raw)[8:]), uuid)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        _log.warning(
            "index snapshot is unreadable; rebuilding the index from the slab",
            path=path,
            error=f"{type(exc).__name__}: {exc}",
        )
        return None


def _parse(doc: object, uuid: bytes) -> Snapshot | None:
    if not isinstance(doc, dict):
        raise TypeError(f"the snapshot body is a {type(doc).__name__}, not a map")
    if doc.get("uuid") != uuid:
        return None
    version = doc.get("version")
    if version == 1:
        entries, pending = _parse_v1(doc["slots"]), None
    elif version == VERSION:
        entries, pending = _parse_v2(doc)
    else:
        _log.warning("index snapshot has an unknown version; ignoring it", version=version)
        return None
    clean = doc.get("clean") is True
    return Snapshot(int(doc["epoch"]), int(doc["next_gen"]), entries, clean, pending)


def _parse_v1(flat: object) -> SlotIndex:
    if not isinstance(flat, list) or len(flat) % 3:
        raise ValueError("the slot list is not a list of (slot, key, gen) triples")
    entries = SlotIndex()
    for i in range(0, len(flat), 3):
        slot, key, gen = flat[i : i + 3]
        if type(slot) is not int or type(key) is not bytes or type(gen) is not int:
            raise TypeError(f"slot entry {i // 3} is not (int, bin, int)")
        entries[slot] = (key, gen)
    return entries


def _parse_v2(doc: dict[str, object]) -> tuple[SlotIndex, dict[int, int]]:
    slots, gens = _unpacked("I", doc["slots"]), _unpacked("Q", doc["gens"])
    blob, width = doc["keys"], doc["key_bytes"]
    if type(blob) is not bytes or type(width) is not int or len(slots) != len(gens):
        raise ValueError("the snapshot's arrays do not match")
    if width:
        if len(blob) != width * len(slots):
            raise ValueError("the key array does not hold one key per slot")
        keys = [blob[i : i + width] for i in range(0, len(blob), width)]
    else:
        keys = _split(blob, doc["lens"], len(slots))
    raw_pending = doc.get("pending", b"")
    if type(raw_pending) is not bytes or len(raw_pending) % _PENDING.size:
        raise ValueError("the pending list is not (slot, gen) pairs")
    pending = dict(_PENDING.iter_unpack(raw_pending))
    return SlotIndex.packed(slots, keys, gens), pending


def _split(blob: bytes, lens: object, count: int) -> list[bytes]:
    if type(lens) is not bytes or len(lens) != count or sum(lens) != len(blob):
        raise ValueError("the key lengths do not add up to the key array")
    return [blob[start:end] for start, end in pairwise(accumulate(lens, initial=0))]


def write_all(io: FileIO, fd: int, data: Piece) -> None:
    view = memoryview(data)  # a short write goes on without copying what is left
    done = 0
    while done < len(view):
        done += io.write(fd, view[done:])  # type: ignore[arg-type]  # any buffer will do


def fsync_dir(io: FileIO, directory: str) -> None:
    fd = io.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        io.fsync(fd)
    finally:
        io.close(fd)
