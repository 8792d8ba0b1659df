"""One block on a slab file: its header page and data moved in a single system call.

A block is written as one ``pwritev`` of a 4096-byte header page (slot, generation, key,
length, xxh3 of the data, xxh3 of the header; :mod:`tierd.stores.disk_index`) and the
data, and read back as one ``preadv`` whose header must name the expected slot, key,
generation and length and whose data must match its checksum: a torn, stale or corrupted
block reads as :data:`BAD_BLOCK`, never as wrong bytes.

This module owns that per-block routine and the per-thread, page-aligned staging page it
goes through when O_DIRECT is on and the caller's buffer is not page-aligned and a
multiple of 4096 bytes long. It runs on the disk store's I/O threads and holds no state
but that staging page; which slot holds which generation is :class:`~tierd.stores.
disk_slab.Slab`'s.
"""

from __future__ import annotations

import errno
import threading

from tierd.stores import disk_index as di
from tierd.stores.fileio import ALIGN, FileIO, address_of, aligned_buffer

__all__ = [
    "BAD_BLOCK",
    "OK",
    "ReadJob",
    "WriteJob",
    "read_block",
    "staging",
    "write_block",
]

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
    local, key, gen, data = job
    page = staging(ALIGN + data_io)
    hdr = page[:ALIGN]
    bb = len(data)
    di.BlockHeader(local, gen, key, bb, di.data_checksum(data)).pack_into(hdr)
    body = data
    if o_direct and not _direct_ok(data, data_io):
        body = page[ALIGN : ALIGN + data_io]
        body[:bb] = data
    try:
        done = io.pwritev(fd, [hdr, body], offset)
    except OSError as exc:
        return exc.errno or errno.EIO
    return OK if done == ALIGN + len(body) else errno.ENOSPC


def read_block(io: FileIO, fd: int, offset: int, job: ReadJob, data_io: int, o_direct: bool) -> int:
    """Read the block at ``offset`` into ``job``'s buffer and check it against the job's
    slot, key and generation; :data:`OK`, :data:`BAD_BLOCK` or an errno (the buffer then
    holds unspecified bytes)."""
    local, key, gen, out = job
    page = staging(ALIGN + data_io)
    bb = len(out)
    direct = not o_direct or _direct_ok(out, data_io)
    body = out if direct else page[ALIGN : ALIGN + data_io]
    try:
        done = io.preadv(fd, [page[:ALIGN], body], offset)
    except OSError as exc:
        return exc.errno or errno.EIO
    if done != ALIGN + len(body):
        return errno.EIO
    hdr = di.BlockHeader.unpack(page[:ALIGN])
    if hdr is None or (hdr.slot, hdr.key, hdr.gen, hdr.data_len) != (local, key, gen, bb):
        return BAD_BLOCK
    if di.data_checksum(body[:bb]) != hdr.data_xxh3:
        return BAD_BLOCK
    if not direct:
        out[:] = body[:bb]
    return OK
