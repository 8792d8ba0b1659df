"""A slab's index in memory, its snapshot on disk, and the walk that takes one.

**The index**, slot -> (key, generation), is kept where the garbage collector never walks.
The index holds an entry per block: millions on a big disk tier. Held as one dict of
``(key, generation)`` tuples it would be a container of millions of children, and every
collection of the generation it sat in would walk them all on the event loop, at moments
nobody chose. Freezing the daemon's objects once it is ready does not reliably spare it:
a full collection untracks a dict whose tuples it has untracked, so a frozen daemon could
miss the index, and the next write (a fresh tuple) tracks it again as a young object.

A dict whose keys and values are ints and bytes is never tracked at all. So
:class:`SlotIndex` keeps two of them, the keys and the generations of the same slots, and
hands entries out as tuples made on the way. It is a mutable mapping of slot -> entry
like the dict it replaces; :func:`~tierd.stores.disk.index.take` reads its two dicts
directly, at C speed.

**The snapshot**: its byte format, atomic write and tolerant read.

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

**A walk** (:class:`IndexWalk`) takes a checkpoint of a slab's index on the event loop in
bounded slices.
A snapshot of a big index is never a copy of the whole dict on the loop, nor a per-entry
encode on a thread that holds the GIL inside the next write. An :class:`IndexWalk` packs
:data:`~tierd.turns.CHECKPOINT_SLOTS` slots' entries per loop turn (:func:`take`, at C
speed), so a turn costs the same at any index size, and the index is never copied whole.

The index changes between slices. A slot changed ahead of the walk is packed as it is
when the walk reaches it; one changed behind it is *touched* (the slab calls
:meth:`IndexWalk.touch` on every change), and :meth:`IndexWalk.finish` packs the current
entries of the touched slots into a patch that replaces what the walk took for them. The
checkpoint is therefore exactly the index at the moment ``finish`` runs, and it is queued
with the journal records at that moment, as a checkpoint taken at once would be.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from itertools import accumulate, compress, pairwise
from typing import Any, overload

import msgpack
import numpy as np
import xxhash

from tierd import turns
from tierd.logs import get_logger
from tierd.stores.disk.io import FileIO

__all__ = [
    "Checkpoint",
    "Entry",
    "IndexPart",
    "SlotIndex",
    "Snapshot",
    "encode_pieces",
    "fsync_dir",
    "load_snapshot",
    "save_snapshot",
    "take",
]

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
        ("version", VERSION),
        ("uuid", uuid),
        ("epoch", cp.epoch),
        ("next_gen", cp.next_gen),
        ("clean", cp.clean),
        ("slots", _bin(_little([p.slots for p in parts], "<u4"))),
        ("gens", _bin(_little([p.gens for p in parts], "<u8"))),
        ("key_bytes", width),
        ("keys", _bin([p.keys for p in parts])),
        ("pending", _bin([pending])),
    ]
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


class IndexWalk:
    """Slots ``0 .. local_slots - 1`` packed a piece a turn (loop thread only)."""

    def __init__(self, local_slots: int) -> None:
        self.cursor = 0
        self.end = local_slots
        self._parts: list[IndexPart] = []
        self._touched: set[int] = set()

    @property
    def done(self) -> bool:
        return self.cursor >= self.end

    def step(self, entries: Mapping[int, Entry]) -> bool:
        """Pack the next slice; whether the walk is done."""
        start, stop = self.cursor, min(self.end, self.cursor + turns.CHECKPOINT_SLOTS)
        self._parts.append(take(entries, range(start, stop)))
        self.cursor = stop
        return self.done

    def touch(self, local: int) -> None:
        """``local`` changed: if the walk has passed it, the patch will carry it."""
        if local < self.cursor:
            self._touched.add(local)

    def finish(
        self, epoch: int, next_gen: int, entries: Mapping[int, Entry], pending: Mapping[int, int]
    ) -> Checkpoint:
        """The checkpoint of the index as it is now (costs the slots touched meanwhile)."""
        touched = sorted(self._touched)
        return Checkpoint(
            epoch,
            next_gen,
            tuple(self._parts),
            dict(pending),
            replaced=np.fromiter(touched, dtype=np.uint32, count=len(touched)),
            patch=take(entries, touched),
        )
