"""One block on a slab file: its header page and data moved in a single system call.

A block is written as one ``pwritev`` of a 4096-byte header page (slot, generation, key,
length, xxh3 of the data, xxh3 of the header; :mod:`tierd.stores.disk_index`) and the
data, and read back as one ``preadv`` whose header must name the expected slot, key,
generation and length and whose data must match its checksum: a torn, stale or corrupted
block reads as :data:`BAD_BLOCK`, never as wrong bytes. Blocks of adjacent slots are read
in one ``preadv`` (each header page, each block's data; :func:`read_run`) and each
checked the same way: at 128 KiB blocks a load from disk was one system call per block.

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
    "read_run",
    "runs_with",
    "staging",
    "write_block",
    "write_run",
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
    heads = staging(len(jobs) * ALIGN)  # write_block's page, if it runs, comes after
    buffers: list[memoryview] = []
    for i, job in enumerate(jobs):
        head = heads[i * ALIGN : (i + 1) * ALIGN]
        _header(job).pack_into(head)
        buffers += [head, job[3]]
    try:
        done = io.pwritev(fd, buffers, offset)
    except OSError:
        done = -1
    if done == len(jobs) * (ALIGN + data_io):
        return [OK] * len(jobs)
    at = [offset + i * (ALIGN + data_io) for i in range(len(jobs))]
    return [write_block(io, fd, a, j, data_io, o_direct) for a, j in zip(at, jobs, strict=True)]


def _header(job: WriteJob) -> di.BlockHeader:
    local, key, gen, data = job
    return di.BlockHeader(local, gen, key, len(data), di.data_checksum(data))


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
    heads = staging(len(jobs) * ALIGN)  # read_block's page, if it runs, comes after
    buffers: list[memoryview] = []
    for i, job in enumerate(jobs):
        buffers += [heads[i * ALIGN : (i + 1) * ALIGN], job[3]]
    try:
        done = io.preadv(fd, buffers, offset)
    except OSError:
        done = -1
    if done != len(jobs) * (ALIGN + data_io):
        at = [offset + i * (ALIGN + data_io) for i in range(len(jobs))]
        return [read_block(io, fd, a, j, data_io, o_direct) for a, j in zip(at, jobs, strict=True)]
    return [_checked(heads[i * ALIGN : (i + 1) * ALIGN], j, j[3]) for i, j in enumerate(jobs)]


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
    hdr = di.BlockHeader.unpack(head)
    if hdr is None or (hdr.slot, hdr.key, hdr.gen, hdr.data_len) != (local, key, gen, len(out)):
        return BAD_BLOCK
    if di.data_checksum(body) != hdr.data_xxh3:
        return BAD_BLOCK
    return OK
