"""What opening a slab file finds out: its superblock, whether O_DIRECT works on it, and
the slot index it holds.

The superblock is the slab's first 4096-byte page: magic ``TIERDSLB``, a version, the
geometry (block bytes, slot size, slots, directory index, number of directories), the
slab's uuid, then the xxh3 of those bytes. A slab whose superblock is intact and records
the configured geometry is reused (:func:`read_superblock`); so is one that differs only
in its number of slots (the tier's capacity changed, or its share under ``block_sizes``):
the slab is resized and keeps every block whose slot still exists. Any other (another
block size, other directories, a damaged superblock) is formatted afresh
(:func:`format_slab`), its blocks gone, with a warning that says so.

:func:`recover_index` decides what a reused slab's index is: the snapshot of a clean close
as it stands; after a crash, the snapshot plus the journal, reading only the few slots the
journal leaves open (writes in flight at the crash, or whose SET record was still queued:
a slot's BEGIN record is always in the file before its block is written, so every block
on disk is named by one). Only when there is no usable snapshot and journal (deleted,
corrupted, or written by a release whose snapshot did not list the writes in flight)
does it read every slot's header (:func:`scan_headers`) and verify what they do not
vouch for (:func:`tierd.stores.disk.block_format.reconcile`). Headers and blocks are read
through callables the slab passes in, so a clean open reads neither. Everything here
runs on an I/O thread, at open.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import xxhash

from tierd.logs import get_logger
from tierd.stores.disk import block_format as di
from tierd.stores.disk import index as ix
from tierd.stores.disk import journal as dj
from tierd.stores.disk.io import ALIGN, FileIO, aligned_buffer

__all__ = [
    "DirectProbe",
    "Recovered",
    "Resume",
    "Superblock",
    "format_slab",
    "probe_direct",
    "check_block",
    "read_superblock",
    "recover_index",
    "remove_files",
    "scan_headers",
    "write_superblock",
]

_SUPER = struct.Struct("<8sIIQQQII16s")
_SUPER_MAGIC = b"TIERDSLB"
_U64 = struct.Struct("<Q")
_log = get_logger("tierd.disk")
_PROGRESS_EVERY_S = 5.0


# -- the superblock ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Superblock:
    """What an intact superblock of the configured block size and directories records."""

    uuid: bytes
    slots: int  # the slots the slab was formatted (or last resized) for


_SLOTS = 2  # the place of the number of slots in the geometry


def read_superblock(
    io: FileIO, fd: int, page: memoryview, geometry: tuple[int, ...], path: str
) -> Superblock | None:
    """The slab's :class:`Superblock` when its superblock (read into ``page``, an aligned
    4096-byte buffer) is intact and records ``geometry``, its number of slots aside; None
    when the slab must be formatted (a warning says why its blocks are discarded)."""
    got = io.preadv(fd, [page], 0)
    if got != ALIGN:
        return None  # a new (empty) file, or one shorter than a superblock
    if _U64.unpack_from(page, _SUPER.size)[0] != _xxh(page[: _SUPER.size]):
        _log.warning("slab superblock unreadable; discarding its blocks", path=path)
        return None
    magic, _, _, *geo, raw_uuid = _SUPER.unpack_from(page)
    mine = [g for i, g in enumerate(geometry) if i != _SLOTS]
    if magic == _SUPER_MAGIC and [g for i, g in enumerate(geo) if i != _SLOTS] == mine:
        return Superblock(bytes(raw_uuid), geo[_SLOTS])
    _log.warning(
        "slab of another block size or directory layout; discarding its blocks",
        path=path,
        found=dict(zip(("block_bytes", "directory", "directories"), _other(geo), strict=True)),
        configured=dict(
            zip(("block_bytes", "directory", "directories"), _other(geometry), strict=True)
        ),
    )
    return None


def _other(geometry: Sequence[int]) -> tuple[int, int, int]:
    """The fields of ``geometry`` a resize cannot keep blocks across (the slot size
    follows the block size)."""
    return geometry[0], geometry[3], geometry[4]


def write_superblock(
    io: FileIO, fd: int, page: memoryview, geometry: tuple[int, ...], uuid: bytes
) -> None:
    """Write (through ``page``) and fsync a superblock recording ``geometry`` and ``uuid``."""
    _SUPER.pack_into(page, 0, _SUPER_MAGIC, 1, 0, *geometry, uuid)
    _U64.pack_into(page, _SUPER.size, _xxh(page[: _SUPER.size]))
    io.pwritev(fd, [page], 0)
    io.fsync(fd)


def format_slab(
    io: FileIO,
    fd: int,
    page: memoryview,
    file_bytes: int,
    geometry: tuple[int, ...],
    uuid: bytes,
) -> None:
    """Empty the slab, preallocate its ``file_bytes`` and write its superblock."""
    io.truncate(fd, 0)
    io.allocate(fd, file_bytes)
    write_superblock(io, fd, page, geometry, uuid)


def _xxh(data: memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


# -- the O_DIRECT probe ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DirectProbe:
    """The descriptor for block I/O and why; ``error`` is set when O_DIRECT was required
    (``o_direct: true``) and failed: the slab must not open."""

    fd: int
    o_direct: bool
    reason: str
    error: OSError | None = None


def probe_direct(io: FileIO, path: str, mode: bool | str, buffered_fd: int) -> DirectProbe:
    """O_DIRECT if asked for (``mode`` True or "auto") and an aligned read and rewrite of
    the superblock through a descriptor of its own succeeds; else ``buffered_fd`` (with a
    warning when "auto" fell back)."""
    if mode is False or not io.o_direct_flag:
        reason = "disabled by configuration" if mode is False else "no O_DIRECT here"
        return DirectProbe(buffered_fd, False, reason)
    page = aligned_buffer(ALIGN)
    fd = -1
    try:
        fd = io.open(path, os.O_RDWR | io.o_direct_flag)
        if io.preadv(fd, [page], 0) != ALIGN or io.pwritev(fd, [page], 0) != ALIGN:
            raise OSError(errno.EIO, "short O_DIRECT transfer")
    except OSError as exc:
        if fd >= 0:
            io.close(fd)
        reason = f"O_DIRECT probe failed: {os.strerror(exc.errno or errno.EIO)}"
        if mode is True:
            return DirectProbe(-1, False, reason, exc)
        _log.warning("falling back to buffered I/O", path=path, reason=reason)
        return DirectProbe(buffered_fd, False, reason)
    return DirectProbe(fd, True, "probe passed")


# -- the slot index ----------------------------------------------------------------------


# A journal to go on with: the bytes of it to keep (None: start one on top of the
# snapshot) and the records to append, (op, slot, gen, key).
Resume = tuple[int | None, list[tuple[di.Op, int, int, bytes]]]


@dataclass(frozen=True, slots=True)
class Recovered:
    """A reused slab's index as :func:`recover_index` found it."""

    entries: ix.SlotIndex
    next_gen: int
    epoch: int
    recovery: str  # "clean" (the snapshot of a clean close) or "crash" (rebuilt)
    dropped: int = 0  # slots with an intact header that are not readable any more
    verified: int = 0  # slots whose block was read and checked at open
    scanned: bool = False  # every slot's header was read (no usable snapshot/journal)
    # The journal to go on with instead of writing a new snapshot at open: the bytes of
    # it to keep (None: start one on top of the snapshot), and the records to add (what
    # the slots checked at open turned out to hold). None: write a new snapshot.
    resume: Resume | None = None


# Checks one slot after a crash: the key of its intact block when its header carries
# ``gen`` (any generation when None) and its data its checksum; None otherwise.
Check = Callable[[int, int | None], bytes | None]


def recover_index(
    journal: dj.Journal,
    uuid: bytes,
    epoch: int,
    scan: Callable[[], dict[int, di.BlockHeader]],
    check: Check,
    path: str,
) -> Recovered:
    """The index of the slab whose ``journal`` this is. ``scan`` reads every slot's intact
    header (used only when no snapshot and journal describe the slab); ``check`` reads one
    block and verifies it. ``epoch`` is the slab's epoch, kept when there is no snapshot.

    After a crash the index is the snapshot plus the journal's records: a slot whose last
    word is SET is trusted without reading it (every read checks it anyway), one whose
    last word is BEGIN (a write in flight, or whose SET was not written yet) is checked,
    a DEL drops the slot. Only the slots the journal leaves open are read, so the time to
    recover grows with the journal (bounded by checkpoints), not with the slab."""
    found = _recover(journal, uuid, epoch, scan, check, path)
    if found.resume is not None:  # the journal is gone on with: its epoch stays
        return found
    # The open writes a new snapshot at the epoch after this one: past every journal a
    # crash left, so that none of them extends it if the open dies before it replaces
    # them (a stale journal replayed over a snapshot from a scan brings back what the
    # scan dropped).
    seen = [dj.Journal.base_epoch(p, uuid) for p in (journal.path, journal.old_path)]
    return replace(found, epoch=max([found.epoch, *(e for e in seen if e is not None)]))


def _recover(
    journal: dj.Journal,
    uuid: bytes,
    epoch: int,
    scan: Callable[[], dict[int, di.BlockHeader]],
    check: Check,
    path: str,
) -> Recovered:
    """:func:`recover_index`'s index, at the epoch of the snapshot it started from."""
    snap = ix.load_snapshot(journal.snapshot_path, uuid)
    # A clean close removes the journal; any journal left, even one whose header is
    # unreadable (a checkpoint that failed to restart it), means the daemon died and
    # blocks may have been written after the snapshot.
    rotated = os.path.exists(journal.old_path)  # a rotation's snapshot was not written
    crashed = os.path.exists(journal.path) or rotated
    if snap is not None and snap.clean and not crashed:
        resume: Resume | None = (None, []) if snap.pending is not None else None  # v1: rewrite
        return Recovered(snap.entries, snap.next_gen, snap.epoch, "clean", resume=resume)
    replay = dj.Journal.replay(journal.path, uuid) if crashed else None
    if rotated and snap is not None:
        old = dj.Journal.replay(journal.old_path, uuid)
        replay = _after_rotation(snap.epoch, old, replay, os.path.exists(journal.path))
    if snap is not None and snap.pending is not None and replay is not None:
        return _from_journal(snap, replay, check, path)
    if snap is not None and not crashed:
        _log.warning(
            "no record of a clean shutdown and no journal (deleted?); verifying the slab",
            path=path,
        )
    known: dict[int, di.Record] = {}
    if snap is not None:
        known = {s: (di.Op.SET, e[1], e[0]) for s, e in snap.entries.items()}
        epoch = snap.epoch
    if replay is not None and (snap is None or replay.epoch == snap.epoch):
        known.update(replay.records)  # an older journal's records predate the snapshot
    return _rebuild(known, scan(), check, epoch, path)


def _after_rotation(
    epoch: int, old: dj.Replay | None, new: dj.Replay | None, new_exists: bool
) -> dj.Replay | None:
    """The journal to replay over the snapshot of ``epoch`` when a rotation's snapshot
    may not have been written: the old journal's records then the new one's, when the
    snapshot is the one the old journal extends (``length`` None: not gone on with, the
    open writes a new snapshot); the new journal alone when the rotation's snapshot is
    in place; None when neither extends it (the caller scans)."""
    if new is not None and new.epoch == epoch:
        return new
    if old is None or old.epoch != epoch:
        return None
    if new is None:  # a crash between the two renames: the old journal holds everything
        return None if new_exists else dj.Replay(epoch, old.records, None)
    return dj.Replay(epoch, {**old.records, **new.records}, None)


def _from_journal(snap: ix.Snapshot, replay: dj.Replay, check: Check, path: str) -> Recovered:
    """The crash path: snapshot plus journal, checking only the slots left open. The
    journal is gone on with, the checked slots' outcomes appended to it."""
    entries = snap.entries
    unsure: dict[int, int] = dict(snap.pending or {})
    records = replay.records
    gens = [snap.next_gen - 1]
    current = replay.epoch == snap.epoch
    if current:  # else the journal predates the snapshot (a crash mid-checkpoint)
        for slot, (op, gen, key) in records.items():
            unsure.pop(slot, None)
            gens.append(gen)
            if op is di.Op.SET:
                entries[slot] = (key, gen)
                continue
            entries.pop(slot, None)
            if op is di.Op.BEGIN:
                unsure[slot] = gen
    else:
        gens += [rec[1] for rec in records.values()]
    dropped = 0
    outcomes: list[tuple[di.Op, int, int, bytes]] = []
    for slot, gen in unsure.items():
        found = check(slot, gen)
        if found is None:
            dropped += 1
            outcomes.append((di.Op.DEL, slot, gen, b""))
        else:
            entries[slot] = (found, gen)
            outcomes.append((di.Op.SET, slot, gen, found))
    _log.info(
        "rebuilt disk index after an unclean shutdown",
        path=path,
        source="journal",
        blocks=len(entries),
        journal_records=len(records),
        verified=len(unsure),
        dropped=dropped,
    )
    resume: Resume | None = (replay.length if current else None, outcomes)
    if current and replay.length is None:  # two journals: write a new snapshot at open
        resume = None
    return Recovered(
        entries, max(gens) + 1, snap.epoch, "crash", dropped, len(unsure), resume=resume
    )


def scan_headers(
    io: FileIO, fd: int, local_slots: int, offset: Callable[[int], int], block_bytes: int
) -> dict[int, di.BlockHeader]:
    """Every slot's intact header that names its own slot and this block size (slot
    ``local`` starts at ``offset(local)``). Progress goes to the log every few seconds:
    this reads one page per slot, minutes on a large slab with a cold cache."""
    page = aligned_buffer(ALIGN)
    found: dict[int, di.BlockHeader] = {}
    last = time.monotonic()
    for local in range(local_slots):
        if io.preadv(fd, [page], offset(local)) != ALIGN:
            continue
        hdr = di.BlockHeader.unpack(page)
        if hdr is not None and hdr.slot == local and hdr.data_len == block_bytes:
            found[local] = hdr
        if time.monotonic() - last >= _PROGRESS_EVERY_S:
            last = time.monotonic()
            _log.info(
                "scanning the slab's headers", slots=local + 1, of=local_slots, blocks=len(found)
            )
    return found


def _rebuild(
    known: dict[int, di.Record],
    headers: dict[int, di.BlockHeader],
    check: Check,
    epoch: int,
    path: str,
) -> Recovered:
    """Without a usable snapshot and journal: trust what they vouch for, verify the data
    checksum of the rest, drop what is bad."""
    trusted, unsure = di.reconcile(known, headers)
    for local, hdr in unsure.items():
        if check(local, hdr.gen) == hdr.key:
            trusted[local] = (hdr.key, hdr.gen)
    dropped = len(headers) - len(trusted)
    gens = [h.gen for h in headers.values()] + [r[1] for r in known.values()]
    _log.info(
        "rebuilt disk index after an unclean shutdown",
        path=path,
        source="scan",
        blocks=len(trusted),
        verified=len(unsure),
        dropped=dropped,
    )
    index, next_gen = ix.SlotIndex(trusted), max(gens, default=0) + 1
    return Recovered(index, next_gen, epoch, "crash", dropped, len(unsure), True)


def check_block(
    io: FileIO, fd: int, page: memoryview, offset: int, local: int, gen: int | None, size: int
) -> bytes | None:
    """The key of the block of slot ``local`` (at ``offset``, read into ``page``: a
    header page and the data) when its header is intact, names this slot, the block size
    ``size`` and ``gen`` (any when None), and its data matches its checksum."""
    try:
        done = io.preadv(fd, [page], offset)
    except OSError:
        return None
    hdr = di.BlockHeader.unpack(page[:ALIGN]) if done == len(page) else None
    if hdr is None or hdr.slot != local or hdr.data_len != size:
        return None
    if gen is not None and hdr.gen != gen:
        return None
    if di.data_checksum(page[ALIGN : ALIGN + size]) != hdr.data_xxh3:
        return None
    return hdr.key


def remove_files(paths: list[str]) -> None:
    """Remove ``paths``; one missing is fine, one that cannot be removed is logged."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("cannot remove", path=path, error=exc.strerror)
