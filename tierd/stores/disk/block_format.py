"""A block of the disk store on disk: its header, its write and read, and the rule of
recovery.

**The header and recovery.**
One slab directory holds the slab (``tierd-slab.bin``), the index snapshot
(``tierd-index.msgpack``, :mod:`tierd.stores.disk.index`) and the journal
(``tierd-journal.bin``, with ``tierd-journal.old.bin`` while a checkpoint is written:
:mod:`tierd.stores.disk.journal`). This module owns the per-slot block header, the journal's
operations, and the rule that rebuilds a slab's index from its headers when a crash left
no usable snapshot and journal (:func:`reconcile`; :mod:`tierd.stores.disk.opening` decides
when). The header is the truth about bytes; the snapshot and journal are the truth about
intent (which slots the store invalidated).

Block header (first 4096-byte page of every slot, little-endian; data follows at +4096)::

    magic "TIERDBLK" | version u16 | key_len u16 | flags u32 | slot u64 | gen u64
    | data_len u64 | data_xxh3 u64 | key 64s | header_xxh3 u64 (over all bytes before it)

**A block's write and read**: its header page and data moved in a single system call.

A block is written as one ``pwritev`` of a 4096-byte header page (slot, generation, key,
length, xxh3 of the data, xxh3 of the header; :mod:`tierd.stores.disk.block_format`) and the
data, and read back as one ``preadv`` whose header must name the expected slot, key,
generation and length and whose data must match its checksum: a torn, stale or corrupted
block reads as :data:`BAD_BLOCK`, never as wrong bytes. Blocks of adjacent slots are
written in one ``pwritev`` and read in one ``preadv`` (each header page, then each block's
data; :func:`write_run`, :func:`read_run`), each block still headed and checked on its
own: at 128 KiB blocks a load or a store was one system call per block.

This module owns that per-block routine and the per-thread, page-aligned staging page it
goes through when O_DIRECT is on and the caller's buffer is not page-aligned and a
multiple of 4096 bytes long. It runs on the disk store's I/O threads and holds no state
but that staging page; which slot holds which generation is :class:`~tierd.stores.disk.slab.Slab`'s.
"""

from __future__ import annotations

import enum
import errno
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from tierd.stores.disk.index import Entry
from tierd.stores.disk.io import ALIGN, FileIO, address_of, aligned_buffer

__all__ = [
    "BAD_BLOCK",
    "BlockHeader",
    "HEADER_BYTES",
    "OK",
    "Op",
    "ReadJob",
    "Record",
    "WriteJob",
    "data_checksum",
    "read_block",
    "read_run",
    "reconcile",
    "runs_with",
    "staging",
    "write_block",
    "write_run",
]

_HDR = struct.Struct("<8sHHIQQQQ64s")
HEADER_BYTES = _HDR.size + 8
_BLOCK_MAGIC = b"TIERDBLK"
_U64 = struct.Struct("<Q")
_VERSION = 1  # of the block header


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
            page,
            0,
            _BLOCK_MAGIC,
            _VERSION,
            len(self.key),
            0,
            self.slot,
            self.gen,
            self.data_len,
            self.data_xxh3,
            self.key,
        )
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


OK = 0  # a chunk routine's per-block result; a positive value is an errno
BAD_BLOCK = -1  # header, key, generation or checksum did not match

WriteJob = tuple[int, bytes, int, memoryview]  # (local slot, key, gen, data)
ReadJob = tuple[int, bytes, int, memoryview]  # (local slot, key, gen, out)

_tls = threading.local()


def staging(nbytes: int) -> memoryview:
    """This thread's page-aligned scratch buffer of at least ``nbytes``."""
    buf: memoryview | None = getattr(_tls, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = aligned_buffer(nbytes)
        _tls.buf = buf
    return buf[:nbytes]


def _direct_ok(view: memoryview, data_io: int) -> bool:
    return len(view) == data_io and address_of(view) % ALIGN == 0


def write_block(
    io: FileIO, fd: int, offset: int, job: WriteJob, data_io: int, o_direct: bool
) -> int:
    """Write ``job``'s header page and data at ``offset`` (``data_io``: the data's size
    rounded up to a page); :data:`OK` or an errno."""
    data = job[3]
    page = staging(ALIGN + data_io)
    hdr = page[:ALIGN]
    bb = len(data)
    _header(job).pack_into(hdr)
    body = data
    if o_direct and not _direct_ok(data, data_io):
        body = page[ALIGN : ALIGN + data_io]
        body[:bb] = data
    try:
        done = io.pwritev(fd, [hdr, body], offset)
    except OSError as exc:
        return exc.errno or errno.EIO
    return OK if done == ALIGN + len(body) else errno.ENOSPC


def write_run(
    io: FileIO, fd: int, offset: int, jobs: list[WriteJob], data_io: int, o_direct: bool
) -> list[int]:
    """Write blocks of adjacent slots, the first at ``offset``, with one ``pwritev``
    (each header page, then each job's data, which must be ``data_io`` bytes and, under
    O_DIRECT, page-aligned: :func:`runs_with`). A write that fails or comes back short
    is made again a block at a time (each block rewritten whole, with the same header),
    so each block gets its own code. Crash-wise it is those writes in a row: each block
    is judged at recovery by its own header and checksum."""
    heads, buffers = _interleaved(jobs)
    for i, job in enumerate(jobs):
        _header(job).pack_into(heads[i])
    try:
        done = io.pwritev(fd, buffers, offset)
    except OSError:
        done = -1
    if done == len(jobs) * (ALIGN + data_io):
        return [OK] * len(jobs)
    return _one_by_one(write_block, io, fd, offset, jobs, data_io, o_direct)


def _header(job: WriteJob) -> BlockHeader:
    local, key, gen, data = job
    return BlockHeader(local, gen, key, len(data), data_checksum(data))


def read_block(io: FileIO, fd: int, offset: int, job: ReadJob, data_io: int, o_direct: bool) -> int:
    """Read the block at ``offset`` into ``job``'s buffer and check it against the job's
    slot, key and generation; :data:`OK`, :data:`BAD_BLOCK` or an errno (the buffer then
    holds unspecified bytes)."""
    out = job[3]
    page = staging(ALIGN + data_io)
    direct = not o_direct or _direct_ok(out, data_io)
    body = out if direct else page[ALIGN : ALIGN + data_io]
    try:
        done = io.preadv(fd, [page[:ALIGN], body], offset)
    except OSError as exc:
        return exc.errno or errno.EIO
    if done != ALIGN + len(body):
        return errno.EIO
    code = _checked(page[:ALIGN], job, body[: len(out)])
    if code == OK and not direct:
        out[:] = body[: len(out)]
    return code


def read_run(
    io: FileIO, fd: int, offset: int, jobs: list[ReadJob], data_io: int, o_direct: bool
) -> list[int]:
    """Read blocks of adjacent slots, the first at ``offset``, with one ``preadv`` (each
    header page, then each job's buffer, which must be ``data_io`` bytes and, under
    O_DIRECT, page-aligned: :func:`runs_with`), and check each as :func:`read_block`
    does. A read that fails or comes back short is made again a block at a time, so each
    block gets its own code."""
    heads, buffers = _interleaved(jobs)
    try:
        done = io.preadv(fd, buffers, offset)
    except OSError:
        done = -1
    if done != len(jobs) * (ALIGN + data_io):
        return _one_by_one(read_block, io, fd, offset, jobs, data_io, o_direct)
    return [_checked(head, job, job[3]) for head, job in zip(heads, jobs, strict=True)]


def _interleaved(
    jobs: list[ReadJob] | list[WriteJob],
) -> tuple[list[memoryview], list[memoryview]]:
    """A header page per job (this thread's staging buffer: the single-block routines'
    page, if they run after, comes after the run's) and the run's buffers, each header
    page followed by its job's data."""
    pages = staging(len(jobs) * ALIGN)
    heads = [pages[i * ALIGN : (i + 1) * ALIGN] for i in range(len(jobs))]
    buffers: list[memoryview] = []
    for head, job in zip(heads, jobs, strict=True):
        buffers += [head, job[3]]
    return heads, buffers


def _one_by_one(
    one: Callable[..., int],
    io: FileIO,
    fd: int,
    offset: int,
    jobs: list[Any],
    data_io: int,
    o_direct: bool,
) -> list[int]:
    """A run made again a block at a time (after a failed or short call), so each block
    gets its own code."""
    slot = ALIGN + data_io
    return [one(io, fd, offset + i * slot, job, data_io, o_direct) for i, job in enumerate(jobs)]


def runs_with(
    jobs: list[ReadJob] | list[WriteJob], data_io: int, o_direct: bool
) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of ``jobs`` that :func:`read_run` or
    :func:`write_run` can move at once: consecutive jobs of consecutive slots whose
    buffers are ``data_io`` bytes (and page-aligned under O_DIRECT), at most
    :data:`RUN_BLOCKS`; every other job is a run of one."""
    fits = [_runnable(job[3], data_io, o_direct) for job in jobs]
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(jobs) + 1):
        joins = (
            i < len(jobs)
            and i - start < RUN_BLOCKS
            and jobs[i][0] == jobs[i - 1][0] + 1
            and fits[i]
            and fits[start]
        )
        if not joins:
            runs.append((start, i))
            start = i
    return runs


RUN_BLOCKS = 64  # blocks per preadv at most (two buffers each, well under IOV_MAX)


def _runnable(view: memoryview, data_io: int, o_direct: bool) -> bool:
    return _direct_ok(view, data_io) if o_direct else len(view) == data_io


def _checked(head: memoryview, job: ReadJob, body: memoryview) -> int:
    """Whether the header page and the data read match ``job``'s slot, key,
    generation, length and checksum: :data:`OK` or :data:`BAD_BLOCK`."""
    local, key, gen, out = job
    hdr = BlockHeader.unpack(head)
    if hdr is None or (hdr.slot, hdr.key, hdr.gen, hdr.data_len) != (local, key, gen, len(out)):
        return BAD_BLOCK
    if data_checksum(body) != hdr.data_xxh3:
        return BAD_BLOCK
    return OK
