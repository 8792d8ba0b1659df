"""On-disk metadata of the disk store: block headers, the slot-index snapshot, the journal.

One slab directory holds three files: the slab (``tierd-slab.bin``), the index snapshot
(``tierd-index.msgpack``) and the journal (``tierd-journal.bin``). This module owns the
byte formats of the last two and of the per-slot block header, and the rule that rebuilds
a slab's index after a crash (:func:`reconcile`). The header is the truth about bytes; the
snapshot and journal are the truth about intent (which slots the store invalidated).

Block header (first 4096-byte page of every slot, little-endian; data follows at +4096)::

    magic "TIERDBLK" | version u16 | key_len u16 | flags u32 | slot u64 | gen u64
    | data_len u64 | data_xxh3 u64 | key 64s | header_xxh3 u64 (over all bytes before it)

Journal: a 48-byte file header (magic "TIERDJNL", version, base epoch, slab uuid, xxh3),
then fixed 88-byte records ``op u8 | key_len u8 | pad u16 | slot u32 | gen u64 | key 64s |
xxh3 u64``. Replay stops at the first record whose checksum fails (a torn tail).

The snapshot's format is :mod:`tierd.stores.disk_snapshot`'s. A journal extends the
snapshot whose ``epoch`` equals its base epoch; any other journal is stale and ignored.
``clean`` is true only in the snapshot a clean close writes last: a shutdown is clean
because it says so, never because a file is missing, so a journal deleted under a running
daemon still reads as a crash. A write in flight when a snapshot is taken is listed in it
as pending (its BEGIN record went to the journal before), so a crash right after the
checkpoint still knows to verify that slot.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import struct
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from tierd.stores.disk_snapshot import (
    Checkpoint,
    Entry,
    Snapshot,
    fsync_dir,
    load_snapshot,
    save_snapshot,
    write_all,
)
from tierd.stores.fileio import FileIO

__all__ = [
    "HEADER_BYTES",
    "BlockHeader",
    "Entry",
    "Journal",
    "Op",
    "Replay",
    "Snapshot",
    "data_checksum",
    "load_snapshot",
    "reconcile",
    "save_snapshot",
]

_HDR = struct.Struct("<8sHHIQQQQ64s")
HEADER_BYTES = _HDR.size + 8
_BLOCK_MAGIC = b"TIERDBLK"
_JNL_HDR = struct.Struct("<8sIIQ16s")
_JNL_MAGIC = b"TIERDJNL"
_REC = struct.Struct("<BBHIQ64s")
_REC_BYTES = _REC.size + 8
_U64 = struct.Struct("<Q")
_VERSION = 1  # of the block header and the journal


def _xxh(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def data_checksum(data: memoryview) -> int:
    return _xxh(data)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a slot's header page says about the block behind it."""

    slot: int
    gen: int
    key: bytes
    data_len: int
    data_xxh3: int

    def pack_into(self, page: memoryview) -> None:
        _HDR.pack_into(
            page, 0, _BLOCK_MAGIC, _VERSION, len(self.key), 0, self.slot, self.gen,
            self.data_len, self.data_xxh3, self.key,
        )  # fmt: skip
        _U64.pack_into(page, _HDR.size, _xxh(page[: _HDR.size]))

    @classmethod
    def unpack(cls, page: memoryview) -> BlockHeader | None:
        """The header in ``page``, or None when its magic, version or checksum is wrong
        (never written, torn, or overwritten by something else)."""
        fields = _HDR.unpack_from(page, 0)
        if fields[0] != _BLOCK_MAGIC or fields[1] != _VERSION or fields[2] > 64:
            return None
        if _U64.unpack_from(page, _HDR.size)[0] != _xxh(page[: _HDR.size]):
            return None
        _, _, key_len, _, slot, gen, data_len, csum, key = fields
        return cls(slot, gen, bytes(key[:key_len]), data_len, csum)


class Op(enum.IntEnum):
    BEGIN = 1  # a write to the slot started; its old contents are gone
    SET = 2  # the write finished; the slot holds (key, gen)
    DEL = 3  # the slot was invalidated (or its write failed) up to generation gen


Record = tuple[Op, int, bytes]  # (op, gen, key) for one slot


@dataclass(frozen=True, slots=True)
class Replay:
    """What a journal holds: its base epoch, the latest record per slot, and how many of
    its bytes (header included) are whole records."""

    epoch: int
    records: dict[int, Record]
    length: int


# -- journal ---------------------------------------------------------------------------


class Journal:
    """The append-only log of slot assignments and invalidations since the last snapshot.

    :meth:`append` and :meth:`checkpoint` run on the event loop's thread and only queue;
    :meth:`flush` runs on an I/O thread and writes the queue in order, so a checkpoint
    always covers exactly the records queued before it.
    """

    def __init__(self, io: FileIO, directory: str) -> None:
        self._io = io
        self.path = os.path.join(directory, "tierd-journal.bin")
        self.snapshot_path = os.path.join(directory, "tierd-index.msgpack")
        self.uuid = b""  # the slab's; set once the slab's superblock is read
        self._queue: deque[bytes | Checkpoint] = deque()
        self._lock = threading.Lock()
        self._fd = -1
        self._length = 0  # bytes of whole records (and the header) in the file
        self._torn = False  # a failed write left a partial record the file still holds
        self.bytes = 0  # size of the current journal file (read on the loop thread)

    @property
    def dirty(self) -> bool:
        """Whether records wait to be written."""
        return bool(self._queue)

    def append(self, op: Op, slot: int, gen: int, key: bytes = b"") -> None:
        rec = _REC.pack(op, len(key), 0, slot, gen, key)
        self._queue.append(rec + _U64.pack(_xxh(rec)))
        self.bytes += _REC_BYTES

    def checkpoint(
        self,
        epoch: int,
        next_gen: int,
        entries: dict[int, Entry],
        pending: dict[int, int],
        *,
        clean: bool = False,
    ) -> None:
        self._queue.append(Checkpoint(epoch, next_gen, dict(entries), dict(pending), clean))
        self.bytes = _JNL_HDR.size + 8

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
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
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
        save_snapshot(self._io, self.snapshot_path, self.uuid, cp)
        self._open_at(cp.epoch, None)

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
        self._length = self.bytes = length
        self._io.fsync(self._fd)

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
        if len(raw) < head_len or _U64.unpack_from(raw, _JNL_HDR.size)[0] != _xxh(
            raw[: _JNL_HDR.size]
        ):
            return None
        magic, version, _, epoch, owner = _JNL_HDR.unpack_from(raw)
        if magic != _JNL_MAGIC or version != _VERSION or owner != uuid:
            return None
        latest: dict[int, Record] = {}
        count = 0
        for op, slot, gen, key in _records(memoryview(raw)[head_len:]):
            latest[slot] = (op, gen, key)
            count += 1
        return Replay(epoch, latest, head_len + count * _REC_BYTES)


def _records(raw: memoryview) -> Iterator[tuple[Op, int, int, bytes]]:
    for pos in range(0, len(raw) - _REC_BYTES + 1, _REC_BYTES):
        body = raw[pos : pos + _REC.size]
        if _U64.unpack_from(raw, pos + _REC.size)[0] != _xxh(body):
            return  # torn tail: everything after it is unreliable
        op, key_len, _, slot, gen, key = _REC.unpack_from(body)
        yield Op(op), slot, gen, bytes(key[:key_len])


# -- recovery --------------------------------------------------------------------------


def reconcile(
    known: dict[int, Record], headers: dict[int, BlockHeader]
) -> tuple[dict[int, Entry], dict[int, BlockHeader]]:
    """Split the slots whose header is intact into (trusted, to verify).

    Trusted: the journal's last word on the slot is SET with the header's generation (the
    data was durable before that record was written). Dropped: the last word is DEL at or
    after the header's generation (invalidated, or its write failed). Everything else (a
    write in flight at the crash, a lost journal tail, no journal) must have its data
    checksum verified before the block is readable again.
    """
    trusted: dict[int, Entry] = {}
    verify: dict[int, BlockHeader] = {}
    for slot, hdr in headers.items():
        rec = known.get(slot)
        if rec is not None and rec[0] is Op.SET and rec[1] == hdr.gen and rec[2] == hdr.key:
            trusted[slot] = (hdr.key, hdr.gen)
        elif rec is not None and rec[0] is Op.DEL and rec[1] >= hdr.gen:
            continue
        else:
            verify[slot] = hdr
    return trusted, verify


def private(fd: int) -> None:
    """Make a file of the disk tier readable and writable by its owner only: cached
    blocks reveal the prompts they came from, and an older tierd created them 0644."""
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
