"""Byte movement between an engine's registered region and block buffers.

A region is a file descriptor of the engine's own host memory (a memfd, a ``/dev/shm``
file). A client may truncate its file or punch holes in it at any time, so:

- **Reads** (a store: region -> block buffers) are ``os.preadv`` calls on the
  descriptor, never through a mapping: a truncated file is a short read (those keys
  fail), never a SIGBUS, and a hole reads as zeros without creating a page.
- **Writes** (a load: block buffers -> region) go only into a region the daemon has
  sealed (:func:`map_for_loads`, on its first load): ``F_SEAL_SHRINK``,
  ``F_SEAL_GROW`` and ``F_SEAL_FUTURE_WRITE``, so that its file can neither shrink (no
  SIGBUS through the daemon's mapping) nor grow, and no page of it can go (the kernel
  refuses a hole punched, ``fallocate`` or ``MADV_REMOVE``); its owner writes it through
  the mappings it made before. Each write goes through the daemon's own mapping of the
  region (a ``pwritev`` on ``/proc/self/mem`` at its addresses: one call for a run of
  pieces, the GIL let go; the file itself refuses ``write``), made only where every
  page of its range exists (``mincore`` right before it): a load never fills a hole of
  a sparse file, and since no page can vanish between that check and the write, the
  daemon never creates a page in a client's file (it would be charged to the daemon's
  memory: a client that punched its window between a check and a ``pwritev`` on the
  file, a new window each round, had the daemon pay 12 MiB a round until a 512 MiB
  cgroup killed it).

A block is cut into *pieces* (:class:`Layout`): one piece per block for an engine whose
block is one row of its region, two (K and V) for a page-first layout. ``offsets[i][j]``
is where piece ``j`` of key ``i`` lies in the region. Runs of pieces that are contiguous in
the region are coalesced into one call (up to ``IOV_MAX`` buffers), and a whole job runs
as one function in one thread (:func:`read_region`, :func:`write_region`): the caller
hands it to an executor once per job, never once per block.

Bounds: :func:`bounds_problem` checks every (offset, length) against the registered size
before anything moves.

Deadlines: a call moves at most :data:`CALL_BYTES` (larger pieces are cut), and no call
starts at or past the job's ``until``. So the last byte of a job lands at most one
bounded call after ``until``; a client that reuses its memory the moment it gives a
job up must keep a margin, or (as tierd's own integrations do) load only into memory
it reuses after the daemon has answered (``docs/protocol.md``, 5.19).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "CALL_BYTES",
    "LOAD_SEALS",
    "MAX_PIECES",
    "Layout",
    "bounds_problem",
    "map_for_loads",
    "read_region",
    "unmap",
    "write_region",
]

CALL_BYTES = 1 << 20  # bytes per call at most: the deadline is checked between calls
MAX_PIECES = 64  # pieces per block: two for K and V, one per layer at most in practice
_IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))

# fcntl's memfd seals (<linux/fcntl.h>): what a region loaded into is sealed with.
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE = 0x2, 0x4, 0x10
LOAD_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE

Offsets = npt.NDArray[np.uint64]
_Call = Callable[[int, Sequence[memoryview], int], int]


@dataclass(frozen=True, slots=True)
class Layout:
    """How a block is cut into pieces: ``pieces[j]`` bytes starting at ``starts[j]``."""

    pieces: tuple[int, ...]
    starts: tuple[int, ...]

    @classmethod
    def of(cls, pieces: Sequence[int], block_bytes: int) -> Layout | str:
        """The layout of ``pieces``, or why they do not cut a block of ``block_bytes``."""
        if not 0 < len(pieces) <= MAX_PIECES:
            return f"a block is cut into 1 to {MAX_PIECES} pieces, not {len(pieces)}"
        if any(type(p) is not int or p <= 0 for p in pieces):
            return "every piece must be a positive number of bytes"
        if sum(pieces) != block_bytes:
            return f"the pieces add up to {sum(pieces)} bytes, not the block size {block_bytes}"
        starts = [0]
        for piece in pieces[:-1]:
            starts.append(starts[-1] + piece)
        return cls(tuple(pieces), tuple(starts))


def bounds_problem(offsets: Offsets, layout: Layout, size: int) -> str | None:
    """Why some piece of ``offsets`` (shape: keys x pieces) would pass the region's
    ``size`` bytes, or None when every one lies inside it."""
    pieces = np.array(layout.pieces, dtype=np.uint64)
    if int(pieces.max()) > size:
        return f"a piece of {int(pieces.max())} bytes cannot lie in a region of {size} bytes"
    # offset + piece <= size, written so that it cannot wrap around 2**64.
    bad = offsets > (np.uint64(size) - pieces)
    if not bad.any():
        return None
    key, piece = (int(i) for i in np.argwhere(bad)[0])
    return (
        f"offset {int(offsets[key, piece])} of key {key}, piece {piece}"
        f" ({layout.pieces[piece]} bytes) passes the region's {size} bytes"
    )


def read_region(
    fd: int,
    offsets: list[list[int]],
    blocks: Sequence[memoryview],
    layout: Layout,
    until: float | None = None,
) -> list[bool]:
    """Read each block's pieces from the region into ``blocks[i]``; per block, whether
    all its bytes arrived (a truncated file or a failed call fails the blocks it cut).
    ``until`` (``time.monotonic()``): no call starts past it (those blocks fail)."""
    return _move(os.preadv, fd, offsets, blocks, layout, until)


def write_region(
    address: int,
    offsets: list[list[int]],
    blocks: Sequence[memoryview],
    layout: Layout,
    until: float | None = None,
) -> list[bool]:
    """Write ``blocks[i]``'s pieces into the region mapped at ``address`` (by
    :func:`map_for_loads`, sealed); per block, whether all were written. No call starts
    past ``until`` (the engine has given the job up by then, and may have reused the
    memory), and no call writes where the file has no page (a hole): those pieces fail
    their block unwritten, so the daemon never creates a page in a client's file."""
    return _move(_MappedWrites(address), address, offsets, blocks, layout, until)


class _MappedWrites:
    """A write call into the region mapped at ``address`` (``length`` bytes), where every
    page of the range exists: one ``pwritev`` on this process's ``/proc/self/mem`` at the
    mapping's addresses (the kernel copies through the daemon's own writable mapping,
    made before the seal; the GIL let go, as for any positional write)."""

    def __init__(self, address: int) -> None:
        self.address = address
        self.length = _mapped_length(address)

    def __call__(self, _: int, buffers: Sequence[memoryview], offset: int) -> int:
        total = sum(len(b) for b in buffers)
        if offset < 0 or offset + total > self.length or _absent(self.address + offset, total):
            return 0
        return os.pwritev(_own_memory(), buffers, self.address + offset)


def _own_memory() -> int:
    """This process's ``/proc/self/mem``, open for writing (opened again after a fork:
    the descriptor names the memory of the process that opened it)."""
    pid = os.getpid()
    known = _OWN_MEMORY.get(pid)
    if known is None:
        _OWN_MEMORY.clear()
        known = _OWN_MEMORY[pid] = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    return known


_OWN_MEMORY: dict[int, int] = {}


class RegionNotSealable(OSError):
    """A region a load cannot be written into: its file cannot be sealed."""


@dataclass(slots=True)
class _Mapping:
    """The daemon's one mapping of a sealed file, shared by every region of it."""

    address: int
    length: int
    users: int


# By (device, inode): a file sealed for loads is mapped once. Its seal refuses any new
# writable mapping, so a second region of the same file (another connection's, say) can
# only use this one. On the event loop only.
_SHARED: dict[tuple[int, int], _Mapping] = {}
_KEYS: dict[int, tuple[int, int]] = {}  # address -> its file's key


def map_for_loads(fd: int, size: int) -> int:
    """The region's file mapped here, read-write, its first ``size`` bytes at least, and
    sealed with :data:`LOAD_SEALS` (once for all its loads, whichever region of it asks
    first); the mapping's address (give it back with :func:`unmap`). Raises
    :class:`RegionNotSealable`, saying why, for a file that cannot be sealed (not a memfd
    made with ``MFD_ALLOW_SEALING``, or sealed against writes already) or that holds less
    than ``size`` bytes."""
    try:
        _own_memory()
    except OSError as exc:
        raise RegionNotSealable(
            exc.errno or errno.EACCES,
            f"this daemon cannot write its own memory (/proc/self/mem): {exc.strerror}",
        ) from None
    stat = os.fstat(fd)
    key = (stat.st_dev, stat.st_ino)
    known = _SHARED.get(key)
    if known is None:
        length = max(size, stat.st_size)
        address = _sealed_mapping(fd, length)
        known = _SHARED[key] = _Mapping(address, length, 0)
        _KEYS[address] = key
    held = os.fstat(fd).st_size  # sealed: it cannot change from here on
    if held < size or known.length < size:  # shrunk after registering, or grown meanwhile
        if not known.users:
            _forget(key)
        raise RegionNotSealable(
            errno.EINVAL,
            f"the region's file holds {held} bytes, less than the {size} registered"
            " (it was shrunk): no load is written into it",
        )
    known.users += 1
    return known.address


def _sealed_mapping(fd: int, length: int) -> int:
    libc = _libc()
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        number = ctypes.get_errno()
        raise RegionNotSealable(
            number,
            "the region cannot be mapped for writing (is it sealed against writes"
            f" already?): {os.strerror(number)}",
        )
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, LOAD_SEALS)
        if fcntl.fcntl(fd, F_GET_SEALS) & LOAD_SEALS != LOAD_SEALS:
            raise OSError(errno.EPERM, "the seals did not hold")
    except OSError as exc:
        libc.munmap(ctypes.c_void_p(address), length)
        raise RegionNotSealable(
            exc.errno or errno.EPERM,
            "a load writes only into a region it can seal against shrinking, growing and"
            " losing pages (a memfd made with MFD_ALLOW_SEALING, not sealed yet against"
            f" writes; mapped by its owner before it is registered): {exc.strerror or exc}",
        ) from None
    return int(address)


def _mapped_length(address: int) -> int:
    key = _KEYS.get(address)
    known = _SHARED.get(key) if key is not None else None
    return known.length if known is not None else 0


def unmap(address: int, size: int) -> None:
    """A region of the file mapped at ``address`` is done with it: the mapping goes with
    the last one (``size``: the region's, for the record)."""
    key = _KEYS.get(address)
    known = _SHARED.get(key) if key is not None else None
    if known is None or key is None:
        return
    known.users -= 1
    if known.users <= 0:
        _forget(key)


def _forget(key: tuple[int, int]) -> None:
    known = _SHARED.pop(key)
    del _KEYS[known.address]
    _libc().munmap(ctypes.c_void_p(known.address), known.length)


def _move(
    call: _Call,
    fd: int,
    offsets: list[list[int]],
    blocks: Sequence[memoryview],
    layout: Layout,
    until: float | None,
) -> list[bool]:
    ok = [True] * len(blocks)
    pieces, starts = layout.pieces, layout.starts
    run = _Run(call, fd, ok, until)
    for i, (row, block) in enumerate(zip(offsets, blocks, strict=True)):
        for offset, piece, start in zip(row, pieces, starts, strict=True):
            run.add(i, offset, block[start : start + piece])
    run.flush()
    return ok


class _Run:
    """Pieces contiguous in the region, moved by calls of at most :data:`CALL_BYTES`
    (a larger piece is cut); a short, failed, late or refused call fails the blocks of
    the pieces it did not move whole. Once one call was late, every later one is."""

    def __init__(self, call: _Call, fd: int, ok: list[bool], until: float | None) -> None:
        self.call, self.fd, self.ok, self.until = call, fd, ok, until
        self.start = self.next = 0
        self.buffers: list[memoryview] = []
        self.owners: list[int] = []

    def add(self, owner: int, offset: int, buffer: memoryview) -> None:
        while True:
            if self.buffers and (
                offset != self.next
                or len(self.buffers) >= _IOV_MAX
                or self.next - self.start >= CALL_BYTES
            ):
                self.flush()
            if not self.buffers:
                self.start = offset
            part = buffer[: CALL_BYTES - (self.next - self.start if self.buffers else 0)]
            self.buffers.append(part)
            self.owners.append(owner)
            self.next = offset + len(part)
            if len(part) == len(buffer):
                return
            offset, buffer = offset + len(part), buffer[len(part) :]

    def flush(self) -> None:
        if not self.buffers:
            return
        want = self.next - self.start
        try:
            if self.until is not None and time.monotonic() >= self.until:
                done = 0  # the engine may have reused this memory by now
            else:
                done = self.call(self.fd, self.buffers, self.start)
        except OSError:
            done = 0
        if done < want:
            at = 0
            for owner, buffer in zip(self.owners, self.buffers, strict=True):
                at += len(buffer)
                if at > done:
                    self.ok[owner] = False
        self.buffers, self.owners = [], []


def _absent(address: int, length: int) -> bool:
    """Whether some page of ``[address, address + length)`` (in a region mapped by
    :func:`map_for_loads`) has no page in the file: a write there would create it. Asked
    of the kernel with ``mincore``; work in proportion to the range. A page swapped out
    counts as missing: that load fails, safely."""
    libc = _libc()
    first = address - address % _PAGE
    span = address + length - first
    present = (ctypes.c_ubyte * -(-span // _PAGE))()
    if libc.mincore(ctypes.c_void_p(first), span, present) != 0:
        return True
    return b"\x00" in bytes(present)  # the kernel writes 1 for a page there, else 0


_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc
