"""The disk store's journal: the append-only log of slot assignments and invalidations
since the last snapshot, and its rotation at a checkpoint.

Journal file: a 48-byte header (magic "TIERDJNL", version, base epoch, slab uuid, xxh3),
then fixed 88-byte records ``op u8 | key_len u8 | pad u16 | slot u32 | gen u64 | key 64s |
xxh3 u64``. Replay stops at the first record whose checksum fails (a torn tail). A journal
extends the snapshot whose ``epoch`` equals its base epoch; any other journal is stale
and ignored.

``clean`` is true only in the snapshot a clean close writes last: a shutdown is clean
because it says so, never because a file is missing, so a journal deleted under a running
daemon still reads as a crash. A write in flight when a snapshot is taken is listed in it
as pending (its BEGIN record went to the journal before), so a crash right after the
checkpoint still knows to verify that slot.

A checkpoint while the store serves does not stop the journal: at its place among the
records the journal is *rotated* (the file becomes ``tierd-journal.old.bin`` and a new one
starts, based on the new epoch: constant work), and the snapshot is written afterwards on
a thread of its own. Until it is in place the old journal stays, so a crash meanwhile
replays the previous snapshot, the old journal, then the new one. A snapshot that cannot
be written (a full file system) leaves both journals as they are, to be retried; a
rotation whose new file cannot be made is given up, and the journal goes on growing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from tierd.stores.disk.block_format import Op, Record, private
from tierd.stores.disk.index import (
    Checkpoint,
    Piece,
    encode_pieces,
    fsync_dir,
    save_snapshot,
    write_all,
)
from tierd.stores.disk.io import FileIO

__all__ = ["Journal", "Replay"]

_JNL_HDR = struct.Struct("<8sIIQ16s")
_JNL_MAGIC = b"TIERDJNL"
_REC = struct.Struct("<BBHIQ64s")
_REC_BYTES = _REC.size + 8
_U64 = struct.Struct("<Q")
_VERSION = 1  # of the journal


def _xxh(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


@dataclass(frozen=True, slots=True)
class _Rotate:
    """Queued with the records: rotate the journal here, for ``cp`` (written later)."""

    cp: Checkpoint


@dataclass(frozen=True, slots=True)
class Replay:
    """What a journal holds: its base epoch, the latest record per slot, and how many of
    its bytes (header included) are whole records."""

    epoch: int
    records: dict[int, Record]
    length: int | None  # None: records of two journals (after a rotation), not one file


# -- journal ---------------------------------------------------------------------------


class Journal:
    """The append-only log of slot assignments and invalidations since the last snapshot.

    :meth:`append`, :meth:`checkpoint` and :meth:`rotate` run on the event loop's thread
    and only queue; :meth:`flush` runs on an I/O thread and writes the queue in order, so
    a checkpoint always covers exactly the records queued before it. :meth:`write_due`
    writes a rotation's snapshot, on a thread of its own.
    """

    def __init__(self, io: FileIO, directory: str) -> None:
        self._io = io
        self.path = os.path.join(directory, "tierd-journal.bin")
        self.snapshot_path = os.path.join(directory, "tierd-index.msgpack")
        self.old_path = os.path.join(directory, "tierd-journal.old.bin")  # see the module doc
        self.uuid = b""  # the slab's; set once the slab's superblock is read
        self._queue: deque[bytes | Checkpoint | _Rotate] = deque()
        self._lock = threading.Lock()
        self._snap_lock = threading.Lock()  # one snapshot written at a time
        self.due: Checkpoint | None = None  # a rotation's snapshot, not written yet
        self._pieces: list[Piece] | None = None  # ``due`` encoded (kept across failures)
        self.rotating = False  # a rotation is queued, or its snapshot is not written yet
        self.rotation_error: OSError | None = None  # why the last rotation was given up
        self._fd = -1
        self._length = 0  # bytes of whole records (and the header) in the file
        self._torn = False  # a failed write left a partial record the file still holds
        # Size of the current journal file with its queued records: the loop thread's
        # alone (and the opener's, before the slab serves), never an I/O thread's.
        self.bytes = 0
        self._unrotated = 0  # ``bytes`` when the rotation under way was queued

    @property
    def dirty(self) -> bool:
        """Whether records wait to be written."""
        return bool(self._queue)

    def append(self, op: Op, slot: int, gen: int, key: bytes = b"") -> None:
        rec = _REC.pack(op, len(key), 0, slot, gen, key)
        self._queue.append(rec + _U64.pack(_xxh(rec)))
        self.bytes += _REC_BYTES

    def checkpoint(self, cp: Checkpoint) -> None:
        """Queue ``cp``: the flush that reaches it writes the snapshot and starts the
        journal afresh on top of it (at open and close; it supersedes a rotation)."""
        self._queue.append(cp)
        self.bytes, self._unrotated = _JNL_HDR.size + 8, 0

    def rotate(self, cp: Checkpoint) -> None:
        """Queue a rotation for ``cp``, whose snapshot :meth:`write_due` writes later."""
        self._queue.append(_Rotate(cp))
        self.rotating = True
        self.bytes, self._unrotated = _JNL_HDR.size + 8, self.bytes

    def given_up(self) -> OSError | None:
        """Why the last rotation was given up, once (None: it was not); the loop thread's
        call. The journal went on growing in its file: ``bytes`` counts it whole again."""
        exc, self.rotation_error = self.rotation_error, None
        if exc is not None and self._unrotated:
            self.bytes += self._unrotated - (_JNL_HDR.size + 8)
        self._unrotated = 0
        return exc

    def flush(self, sync: bool) -> None:
        """Write everything queued so far; fsync when ``sync``. Thread-safe."""
        with self._lock:
            # Items leave the queue only once written, so a failure (ENOSPC) keeps them
            # for the next flush, in order. Only this thread pops; the loop thread only
            # appends, so a copy of the queue's head stays its head.
            while self._queue:
                items = list(self._queue)
                head = items[0]
                if isinstance(head, bytes):
                    chunk: list[bytes] = []
                    for item in items:
                        if not isinstance(item, bytes):
                            break
                        chunk.append(item)
                    self._write(chunk, sync)
                elif isinstance(head, _Rotate):
                    self._rotate(head.cp)
                    chunk = [b""]
                else:
                    self._start(head)
                    chunk = [b""]
                for _ in chunk:
                    self._queue.popleft()

    def sync(self) -> None:
        """fdatasync what has been written so far (an I/O thread's call)."""
        with self._lock:
            if self._fd >= 0:
                self._io.fdatasync(self._fd)

    def close(self, remove: bool) -> None:
        with self._lock:
            if self._fd >= 0:
                self._io.close(self._fd)
                self._fd = -1
            if remove:
                for path in (self.path, self.old_path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                fsync_dir(self._io, os.path.dirname(self.path))

    def _write(self, chunk: list[bytes], sync: bool) -> None:
        """Append ``chunk`` whole, or leave the file as it was: a record cut short (a
        full file system takes part of a write, then refuses the rest) would end the
        replay there, and every record appended after it would be lost at a crash."""
        if chunk and self._fd < 0:
            raise OSError(errno.EBADF, "the journal has not been started")
        if not chunk:
            return
        if self._torn:  # an earlier cut-back failed: it must succeed before anything more
            self._io.truncate(self._fd, self._length)
            self._torn = False
        data = b"".join(chunk)
        try:
            write_all(self._io, self._fd, data)
        except OSError:
            self._torn = True
            with contextlib.suppress(OSError):  # retried before the next append
                self._io.truncate(self._fd, self._length)
                self._torn = False
            raise
        self._length += len(data)
        if sync:
            self._io.fdatasync(self._fd)

    def _start(self, cp: Checkpoint) -> None:
        with self._snap_lock:  # after a rotation's snapshot being written, and instead of it
            self.due, self._pieces = None, None
            save_snapshot(self._io, self.snapshot_path, self.uuid, cp)
        self._open_at(cp.epoch, None)
        self._drop_old()
        self.rotating = False

    def _rotate(self, cp: Checkpoint) -> None:
        """Go on in a new journal based on ``cp``'s epoch, keeping this one as the old
        journal until ``cp`` is written. When the new file cannot be made, the rotation
        is given up (``rotation_error``) and this journal goes on growing. Under the lock."""
        if self._torn:  # a cut-back that failed must succeed before the file is kept
            self._io.truncate(self._fd, self._length)
            self._torn = False
        nxt = self.path + ".next"
        try:
            fd = self._new_file(nxt, cp.epoch)
            if self._fd >= 0:
                self._io.fdatasync(self._fd)  # the old journal's records, whatever the mode
            os.replace(self.path, self.old_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(nxt)
            self.rotating, self.rotation_error = False, exc
            return
        try:
            os.replace(nxt, self.path)
            fsync_dir(self._io, os.path.dirname(self.path))
        except OSError as exc:
            self._io.close(fd)
            os.replace(self.old_path, self.path)  # as it was: the journal goes on growing
            with contextlib.suppress(OSError):
                os.unlink(nxt)
            self.rotating, self.rotation_error = False, exc
            return
        if self._fd >= 0:
            self._io.close(self._fd)
        self._fd, self._length = fd, _JNL_HDR.size + 8
        self.due, self.rotation_error = cp, None

    def _new_file(self, path: str, epoch: int) -> int:
        """A new journal file at ``path`` holding only a header naming ``epoch``; fsynced."""
        fd = self._io.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        try:
            private(fd)
            head = _JNL_HDR.pack(_JNL_MAGIC, _VERSION, 0, epoch, self.uuid)
            write_all(self._io, fd, head + _U64.pack(_xxh(head)))
            self._io.fsync(fd)
        except OSError:
            self._io.close(fd)
            raise
        return fd

    def write_due(self) -> bool:
        """Write the snapshot of the last rotation, then drop the old journal; whether
        one was due. OSError when it cannot (the journals stay as they are: retry)."""
        with self._snap_lock:
            cp = self.due
            if cp is None:
                return False
            if self._pieces is None:  # encoded once, however often the write fails
                self._pieces = encode_pieces(cp, self.uuid)
            save_snapshot(self._io, self.snapshot_path, self.uuid, cp, self._pieces)
            self.due, self._pieces = None, None
        # Not under the journal's lock: appends go on meanwhile (no rotation can start
        # before ``rotating`` is cleared, and a checkpoint at close drops it as well).
        self._drop_old()
        self.rotating = False
        return True

    def _drop_old(self) -> None:
        try:
            os.unlink(self.old_path)
        except FileNotFoundError:
            return
        fsync_dir(self._io, os.path.dirname(self.path))

    def resume(
        self, epoch: int, length: int | None, records: list[tuple[Op, int, int, bytes]]
    ) -> None:
        """Go on appending to the journal a crash left (its first ``length`` bytes are
        whole records: a torn tail is cut off), or, when ``length`` is None, start one on
        top of the snapshot of ``epoch`` as it stands; then append ``records`` (op, slot,
        gen, key) and write them. No snapshot is written: opening a slab of a million
        blocks does not rewrite its index. OSError when it cannot."""
        with self._lock:
            self._open_at(epoch, length)
        self.bytes = self._length  # the opener's thread: the slab does not serve yet
        for op, slot, gen, key in records:
            self.append(op, slot, gen, key)
        self.flush(sync=True)

    def _open_at(self, epoch: int, length: int | None) -> None:
        """The journal file open for appending, holding its first ``length`` bytes, or
        (None) only a fresh header naming ``epoch``; fsynced. Under the lock."""
        if self._fd < 0:
            self._fd = self._io.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            private(self._fd)
        self._torn = False
        if length is None:
            self._length = 0
            self._io.truncate(self._fd, 0)
            head = _JNL_HDR.pack(_JNL_MAGIC, _VERSION, 0, epoch, self.uuid)
            write_all(self._io, self._fd, head + _U64.pack(_xxh(head)))
            length = len(head) + 8
        else:
            self._io.truncate(self._fd, length)
        self._length = length
        self._io.fsync(self._fd)

    @staticmethod
    def base_epoch(path: str, uuid: bytes) -> int | None:
        """The base epoch in the header of the journal at ``path``; None when there is
        none, or its header is not intact, or it belongs to another slab."""
        try:
            with open(path, "rb") as f:
                raw = f.read(_JNL_HDR.size + 8)
        except FileNotFoundError:
            return None
        return _epoch_of(raw, uuid)

    @staticmethod
    def replay(path: str, uuid: bytes) -> Replay | None:
        """The journal at ``path``: its base epoch, latest record per slot and the bytes
        of whole records (header included) before any torn tail; None when there is none
        or it belongs to another slab."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        head_len = _JNL_HDR.size + 8
        epoch = _epoch_of(raw, uuid)
        if epoch is None:
            return None
        latest: dict[int, Record] = {}
        count = 0
        for op, slot, gen, key in _records(memoryview(raw)[head_len:]):
            latest[slot] = (op, gen, key)
            count += 1
        return Replay(epoch, latest, head_len + count * _REC_BYTES)


def _epoch_of(raw: bytes, uuid: bytes) -> int | None:
    """The base epoch of a journal that starts with ``raw``, when its header is intact
    and names slab ``uuid``."""
    head_len = _JNL_HDR.size + 8
    if len(raw) < head_len or _U64.unpack_from(raw, _JNL_HDR.size)[0] != _xxh(raw[: _JNL_HDR.size]):
        return None
    magic, version, _, epoch, owner = _JNL_HDR.unpack_from(raw)
    if magic != _JNL_MAGIC or version != _VERSION or owner != uuid:
        return None
    return int(epoch)


def _records(raw: memoryview) -> Iterator[tuple[Op, int, int, bytes]]:
    for pos in range(0, len(raw) - _REC_BYTES + 1, _REC_BYTES):
        body = raw[pos : pos + _REC.size]
        if _U64.unpack_from(raw, pos + _REC.size)[0] != _xxh(body):
            return  # torn tail: everything after it is unreliable
        op, key_len, _, slot, gen, key = _REC.unpack_from(body)
        yield Op(op), slot, gen, bytes(key[:key_len])
