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
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from array import array
from dataclasses import dataclass, field

import msgpack
import xxhash

from tierd.logs import get_logger
from tierd.stores.fileio import FileIO

__all__ = ["Checkpoint", "Entry", "Snapshot", "fsync_dir", "load_snapshot", "save_snapshot"]

# A readable block: (key, generation its header must carry). A plain tuple, not a
# dataclass: the index holds one per block (millions), and building a frozen dataclass
# costs four times as long as a tuple, which is most of a restart's time.
Entry = tuple[bytes, int]

VERSION = 2
_U64 = struct.Struct("<Q")
_PENDING = struct.Struct("<IQ")
_log = get_logger("tierd.disk")


@dataclass(frozen=True, slots=True)
class Snapshot:
    epoch: int
    next_gen: int
    entries: dict[int, Entry]
    clean: bool = False  # written by a clean close, as its last act
    # Slot -> generation of writes in flight when it was taken; None for a version-1
    # snapshot, which did not record them (the caller must then scan).
    pending: dict[int, int] | None = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A request, queued in order with the journal records, to write a snapshot of
    ``entries`` (and the writes still ``pending``) and start a new journal on top of it."""

    epoch: int
    next_gen: int
    entries: dict[int, Entry]
    pending: dict[int, int]
    clean: bool = False


def _xxh(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def _packed(code: str, values: object) -> bytes:
    arr = array(code, values)  # type: ignore[call-overload]
    if sys.byteorder != "little":
        arr.byteswap()
    return bytes(arr.tobytes())


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


def encode(cp: Checkpoint, uuid: bytes) -> bytes:
    """The version-2 payload (msgpack) of ``cp``."""
    keys = [e[0] for e in cp.entries.values()]
    widths = {len(k) for k in keys}
    width = widths.pop() if len(widths) == 1 else 0
    doc: dict[str, object] = {
        "version": VERSION, "uuid": uuid, "epoch": cp.epoch, "next_gen": cp.next_gen,
        "clean": cp.clean, "slots": _packed("I", cp.entries.keys()),
        "gens": _packed("Q", (e[1] for e in cp.entries.values())),
        "key_bytes": width, "keys": b"".join(keys),
        "pending": b"".join(_PENDING.pack(s, g) for s, g in cp.pending.items()),
    }  # fmt: skip
    if not width:
        doc["lens"] = bytes(len(k) for k in keys)
    return bytes(msgpack.packb(doc))


def save_snapshot(io: FileIO, path: str, uuid: bytes, cp: Checkpoint) -> None:
    """Write the snapshot atomically: temporary file, fsync, rename, fsync the directory.
    On failure (ENOSPC, EIO) the temporary file is removed and the old snapshot stays."""
    payload = encode(cp, uuid)
    tmp = path + ".tmp"
    try:
        fd = io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(io, fd, _U64.pack(_xxh(payload)) + payload)
            io.fsync(fd)
        finally:
            io.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(io, os.path.dirname(path))


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


def _parse_v1(flat: object) -> dict[int, Entry]:
    if not isinstance(flat, list) or len(flat) % 3:
        raise ValueError("the slot list is not a list of (slot, key, gen) triples")
    entries: dict[int, Entry] = {}
    for i in range(0, len(flat), 3):
        slot, key, gen = flat[i : i + 3]
        if type(slot) is not int or type(key) is not bytes or type(gen) is not int:
            raise TypeError(f"slot entry {i // 3} is not (int, bin, int)")
        entries[slot] = (key, gen)
    return entries


def _parse_v2(doc: dict[str, object]) -> tuple[dict[int, Entry], dict[int, int]]:
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
    return dict(zip(slots, zip(keys, gens, strict=True), strict=True)), pending


def _split(blob: bytes, lens: object, count: int) -> list[bytes]:
    if type(lens) is not bytes or len(lens) != count or sum(lens) != len(blob):
        raise ValueError("the key lengths do not add up to the key array")
    keys, pos = [], 0
    for n in lens:
        keys.append(blob[pos : pos + n])
        pos += n
    return keys


def write_all(io: FileIO, fd: int, data: bytes) -> None:
    done = 0
    while done < len(data):
        done += io.write(fd, data[done:])


def fsync_dir(io: FileIO, directory: str) -> None:
    fd = io.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        io.fsync(fd)
    finally:
        io.close(fd)
