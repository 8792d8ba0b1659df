"""The disk store's file calls, and when its writes are made durable.

**File calls.** The thin layer between the disk store and the operating system.
Every system call the disk store makes on its slab, journal and index files goes through a
:class:`FileIO` object, so tests can pass a subclass that fails chosen calls with chosen
errnos (ENOSPC, EIO, EINVAL for O_DIRECT) without touching a real device. The default
implementation is a direct pass-through to :mod:`os`.

It also owns the alignment helpers O_DIRECT needs: page-aligned staging buffers
(anonymous ``mmap``, which the kernel hands out page-aligned) and buffer addresses.

**Durability**: the ``fsync`` modes and the periodic sync.

``always`` (the default): every write batch syncs its journal records (BEGIN) before the
blocks are written and fdatasyncs the slab after, before the write is acknowledged. A
crash of any kind (the process, the kernel, the power) loses no acknowledged block.

``batch``: writes are not synced one by one; at most ``interval`` seconds after a write,
one sync of the slab's data, then of its journal, covers every write made before it. A
power loss or kernel crash loses at most the blocks written in the last ``interval``
(plus the sync under way); a process crash (SIGKILL) loses nothing, as the kernel still
holds what was written. Headers and checksums make a block the sync did not cover a
miss, never wrong bytes.

``none``: the store never syncs block data or journal records while it serves (the
kernel writes back on its own schedule, ~30 s by default); a clean stop syncs. A power loss
or kernel crash may lose any block the kernel had not written back; a process crash loses
nothing; never wrong bytes.

In every mode a snapshot of the index (every ``journal_limit_bytes`` of journal) syncs
itself, and a clean close syncs the slab, the journal and the snapshot.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from enum import StrEnum

import numpy as np

__all__ = ["ALIGN", "FileIO", "Fsync", "PeriodicSync", "address_of", "aligned_buffer", "round_up"]

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


class Fsync(StrEnum):
    ALWAYS = "always"
    BATCH = "batch"
    NONE = "none"


class PeriodicSync:
    """In ``batch`` mode: after a write, one call of ``start`` (which submits the sync to
    an I/O thread) at most ``interval`` seconds later; writes meanwhile join it. Runs on
    the event loop's thread."""

    def __init__(self, interval: float, start: Callable[[], Future[object]]) -> None:
        if interval <= 0:
            raise ValueError(f"the sync interval must be positive, got {interval}")
        self.interval = interval
        self._start = start
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[Future[object]] = set()
        self.syncs = 0  # syncs started

    def written(self) -> None:
        """A write finished: make sure a sync comes within ``interval``."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.syncs += 1
        fut = self._start()
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)

    async def close(self) -> None:
        """No sync starts any more; the one under way is waited for (the clean close
        that follows syncs everything anyway)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut in list(self._running):
            await asyncio.wrap_future(fut)
