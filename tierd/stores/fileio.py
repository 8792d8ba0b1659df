"""The thin layer between the disk store and the operating system's file calls.

Every system call the disk store makes on its slab, journal and index files goes through a
:class:`FileIO` object, so tests can pass a subclass that fails chosen calls with chosen
errnos (ENOSPC, EIO, EINVAL for O_DIRECT) without touching a real device. The default
implementation is a direct pass-through to :mod:`os`.

It also owns the alignment helpers O_DIRECT needs: page-aligned staging buffers
(anonymous ``mmap``, which the kernel hands out page-aligned) and buffer addresses.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence

import numpy as np

__all__ = ["ALIGN", "FileIO", "address_of", "aligned_buffer", "round_up"]

# O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's logical
# block size; 4096 covers every NVMe and 4Kn drive.
ALIGN = 4096

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def round_up(value: int, align: int = ALIGN) -> int:
    return (value + align - 1) // align * align


def aligned_buffer(nbytes: int) -> memoryview:
    """A zeroed, page-aligned, writable buffer of ``round_up(nbytes)`` bytes."""
    return memoryview(mmap.mmap(-1, round_up(max(nbytes, 1))))


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers included)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class FileIO:
    """Pass-through to :mod:`os`; subclass and override a method to inject faults.

    Methods are called from the store's I/O threads as well as from the event loop's
    thread, so an override must be thread-safe.
    """

    o_direct_flag = _O_DIRECT

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        # A store's files are never opened through a link: one planted in its directory
        # would have the daemon format, or write, the file it names. (A directory may
        # be configured through a link; preflight checks who owns it.)
        if not flags & os.O_DIRECTORY:
            flags |= os.O_NOFOLLOW
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def write(self, fd: int, data: bytes) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def allocate(self, fd: int, nbytes: int) -> None:
        """Reserve ``nbytes`` for the file: ``posix_fallocate`` where the file system
        supports it, else ``ftruncate`` (sparse; ENOSPC may then come at write time)."""
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in _NO_FALLOCATE:
                raise
            os.ftruncate(fd, nbytes)

    def truncate(self, fd: int, nbytes: int) -> None:
        os.ftruncate(fd, nbytes)


_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
