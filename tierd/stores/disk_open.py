"""What opening a slab file finds out: its superblock, whether O_DIRECT works on it, and
the slot index it holds.

The superblock is the slab's first 4096-byte page: magic ``TIERDSLB``, a version, the
geometry (block bytes, slot size, slots, directory index, number of directories), the
slab's uuid, then the xxh3 of those bytes. A slab whose superblock is intact and records
the configured geometry is reused (:func:`read_superblock`); any other is formatted afresh
(:func:`format_slab`), its blocks gone.

:func:`recover_index` decides what a reused slab's index is: the snapshot of a clean close
as it stands; after a crash (a journal left behind, or no record of a clean close), what
the snapshot and the journal vouch for, checked against every slot's header, with the
data checksum of the rest verified (:func:`tierd.stores.disk_index.reconcile`). Headers
are read by :func:`scan_headers`, blocks by the slab itself
(:class:`tierd.stores.disk_slab.Slab`): both come in as callables, so that a clean open
reads neither. Everything here runs on an I/O thread, at open.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from tierd.logs import get_logger
from tierd.stores import disk_index as di
from tierd.stores.fileio import ALIGN, FileIO, aligned_buffer

__all__ = [
    "DirectProbe",
    "Recovered",
    "format_slab",
    "probe_direct",
    "read_superblock",
    "recover_index",
    "scan_headers",
]

_SUPER = struct.Struct("<8sIIQQQII16s")
_SUPER_MAGIC = b"TIERDSLB"
_U64 = struct.Struct("<Q")
_log = get_logger("tierd.disk")


# -- the superblock ----------------------------------------------------------------------


def read_superblock(
    io: FileIO, fd: int, page: memoryview, geometry: tuple[int, ...], path: str
) -> bytes | None:
    """The slab's uuid when its superblock (read into ``page``, an aligned 4096-byte
    buffer) is intact and records ``geometry``; None when the slab must be formatted (a
    changed geometry is logged)."""
    got = io.preadv(fd, [page], 0)
    if got == ALIGN and _U64.unpack_from(page, _SUPER.size)[0] == _xxh(page[: _SUPER.size]):
        magic, _, _, *geo, raw_uuid = _SUPER.unpack_from(page)
        if magic == _SUPER_MAGIC and tuple(geo) == geometry:
            return bytes(raw_uuid)
        _log.warning("slab geometry changed; discarding its blocks", path=path)
    return None


def format_slab(
    io: FileIO,
    fd: int,
    page: memoryview,
    file_bytes: int,
    geometry: tuple[int, ...],
    uuid: bytes,
) -> None:
    """Empty the slab, preallocate its ``file_bytes`` and write (through ``page``) and
    fsync a superblock recording ``geometry`` and ``uuid``."""
    io.truncate(fd, 0)
    io.allocate(fd, file_bytes)
    _SUPER.pack_into(page, 0, _SUPER_MAGIC, 1, 0, *geometry, uuid)
    _U64.pack_into(page, _SUPER.size, _xxh(page[: _SUPER.size]))
    io.pwritev(fd, [page], 0)
    io.fsync(fd)


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


@dataclass(frozen=True, slots=True)
class Recovered:
    """A reused slab's index as :func:`recover_index` found it."""

    entries: dict[int, di.Entry]
    next_gen: int
    epoch: int
    recovery: str  # "clean" (the snapshot of a clean close) or "crash" (rebuilt)
    dropped: int = 0  # slots with an intact header that are not readable any more


def recover_index(
    journal: di.Journal,
    uuid: bytes,
    epoch: int,
    scan: Callable[[], dict[int, di.BlockHeader]],
    verify: Callable[[int, di.BlockHeader], bool],
    path: str,
) -> Recovered:
    """The index of the slab whose ``journal`` this is. ``scan`` reads every slot's intact
    header; ``verify`` reads one block and checks it against its header. ``epoch`` is
    the slab's epoch, kept when there is no snapshot."""
    snap = di.load_snapshot(journal.snapshot_path, uuid)
    # A clean close removes the journal; any journal left, even one whose header is
    # unreadable (a checkpoint that failed to restart it), means the daemon died and
    # blocks may have been written after the snapshot.
    crashed = os.path.exists(journal.path)
    if snap is not None and snap.clean and not crashed:
        return Recovered(snap.entries, snap.next_gen, snap.epoch, "clean")
    if snap is not None and not crashed:
        _log.warning(
            "no record of a clean shutdown and no journal (deleted?); verifying the slab",
            path=path,
        )
    replay = di.Journal.replay(journal.path, uuid) if crashed else None
    known: dict[int, di.Record] = {}
    if snap is not None:
        known = {s: (di.Op.SET, e.gen, e.key) for s, e in snap.entries.items()}
        epoch = snap.epoch
    if replay is not None and (snap is None or replay[0] == snap.epoch):
        known.update(replay[1])  # an older journal's records predate the snapshot
    return _rebuild(known, scan(), verify, epoch, path)


def scan_headers(
    io: FileIO, fd: int, local_slots: int, offset: Callable[[int], int], block_bytes: int
) -> dict[int, di.BlockHeader]:
    """Every slot's intact header that names its own slot and this block size (slot
    ``local`` starts at ``offset(local)``)."""
    page = aligned_buffer(ALIGN)
    found: dict[int, di.BlockHeader] = {}
    for local in range(local_slots):
        if io.preadv(fd, [page], offset(local)) != ALIGN:
            continue
        hdr = di.BlockHeader.unpack(page)
        if hdr is not None and hdr.slot == local and hdr.data_len == block_bytes:
            found[local] = hdr
    return found


def _rebuild(
    known: dict[int, di.Record],
    headers: dict[int, di.BlockHeader],
    verify: Callable[[int, di.BlockHeader], bool],
    epoch: int,
    path: str,
) -> Recovered:
    """After a crash: trust what the journal vouches for, verify the data checksum of the
    rest, drop what is bad."""
    trusted, unsure = di.reconcile(known, headers)
    for local, hdr in unsure.items():
        if verify(local, hdr):
            trusted[local] = di.Entry(hdr.key, hdr.gen)
    dropped = len(headers) - len(trusted)
    gens = [h.gen for h in headers.values()] + [r[1] for r in known.values()]
    _log.info(
        "rebuilt disk index after an unclean shutdown",
        path=path, blocks=len(trusted), verified=len(unsure), dropped=dropped,
    )  # fmt: skip
    return Recovered(trusted, max(gens, default=0) + 1, epoch, "crash", dropped)
