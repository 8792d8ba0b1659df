"""The daemon's side of an engine handing it a region: receiving the descriptor, and
checking what it is.

The server's connections read with plain ``read()`` (uvloop transports), which drops any
descriptor sent with a frame. So a ``register_region`` is a small exchange of its own:
the connection stops reading (:mod:`~tierd.control.engine_regions.registration` runs the whole
exchange), tells the client to send (a ``send_fd`` push), and
:func:`receive_fds` reads exactly one byte, with the descriptors riding on it
(``SCM_RIGHTS``), from a duplicate of the connection's socket, waiting on the loop (never
blocking it) under a deadline. Descriptors arrive close-on-exec; the caller owns them.

:func:`region_problem` says why a descriptor cannot be a region, or None. A region must be:

- open for reading and writing (not ``O_PATH``, not read-only, not ``O_APPEND``, where a
  positional write would append);
- a regular file in memory (tmpfs or hugetlbfs: a memfd, a ``/dev/shm`` file), so that a
  copy never waits on a device or a file system the client controls (a FUSE mount could
  hold a daemon thread forever);
- at least ``size`` bytes long now, and none of the daemon's own pools.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import functools
import os
import socket
import stat
import sys
from array import array
from collections.abc import Collection

from tierd.control.protocol import ErrorCode
from tierd.errors import ProtocolError

__all__ = ["FdRefused", "FileId", "file_id", "receive_fd", "receive_fds", "region_problem"]

FileId = tuple[int, int]  # (st_dev, st_ino)
_FDS_ROOM = 8  # descriptors read with the byte; more are closed by the kernel (MSG_CTRUNC)
_MEMORY_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x958458F6: "hugetlbfs"}
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first


class FdRefused(ProtocolError):
    """No single descriptor came; ``framing_lost``: the stream can no longer be trusted
    (nothing came in time, or a byte without a descriptor, maybe a frame's first)."""

    def __init__(self, message: str, *, framing_lost: bool) -> None:
        super().__init__(message, code=ErrorCode.BAD_REQUEST)
        self.framing_lost = framing_lost


async def receive_fd(fileno: int, deadline_s: float) -> int:
    """The one descriptor sent with one byte on the socket ``fileno`` within
    ``deadline_s``; any other outcome raises :class:`FdRefused` (extra descriptors
    closed) or, when the peer closed, a ``shutting_down`` :class:`ProtocolError`."""
    try:
        data, fds, cut = await receive_fds(fileno, deadline_s)
    except (TimeoutError, OSError) as exc:
        raise FdRefused(f"no descriptor came within {deadline_s} s", framing_lost=True) from exc
    if len(fds) == 1 and not cut:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if not data:
        raise ProtocolError("the connection closed", code=ErrorCode.SHUTTING_DOWN)
    more = " or more" if cut else ""
    raise FdRefused(
        f"exactly one descriptor must come with the byte, not {len(fds)}{more}",
        framing_lost=not fds,
    )


async def receive_fds(fileno: int, deadline_s: float) -> tuple[bytes, list[int], bool]:
    """Read one byte from the socket ``fileno`` and the descriptors sent with it: the
    byte (empty: the peer closed), the descriptors, and whether some were cut off.
    Raises ``TimeoutError`` when nothing arrives within ``deadline_s``."""
    loop = asyncio.get_running_loop()
    # A duplicate shares the connection's socket and its O_NONBLOCK: reads never block.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(fileno))
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                try:
                    data, ancillary, flags, _ = sock.recvmsg(
                        1, socket.CMSG_SPACE(_FDS_ROOM * 4), socket.MSG_CMSG_CLOEXEC
                    )
                except BlockingIOError:
                    await _readable(loop, sock.fileno())
                    continue
                fds: list[int] = []
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array("i", payload[: len(payload) - len(payload) % 4]))
                return data, fds, bool(flags & socket.MSG_CTRUNC)
    finally:
        sock.close()


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def file_id(fd: int) -> FileId:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def region_problem(fd: int, size: int, forbidden: Collection[FileId]) -> str | None:
    """Why ``fd`` cannot be a region of ``size`` bytes, or None when it can."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        st = os.fstat(fd)
    except OSError as exc:
        return f"the descriptor cannot be examined: {exc.strerror}"
    if flags & getattr(os, "O_PATH", 0):
        return "an O_PATH descriptor cannot be read or written: open the file O_RDWR"
    if not stat.S_ISREG(st.st_mode):
        return f"the region must be a regular file or a memfd, not {_kind(st.st_mode)}"
    if flags & os.O_ACCMODE != os.O_RDWR:
        return "the region must be open for reading and writing (O_RDWR)"
    if flags & os.O_APPEND:
        return "the region must not be open O_APPEND (positional writes would append)"
    fs = _file_system(fd)
    if fs is None:
        return "the region must be in memory (a memfd, or a file on tmpfs or hugetlbfs)"
    if (st.st_dev, st.st_ino) in forbidden:
        return "a pool of the daemon's own cannot be registered as a region"
    if size > st.st_size:
        return f"the region's size {size} is larger than its file ({st.st_size} bytes)"
    return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "this kind of file"


def _file_system(fd: int) -> str | None:
    """The name of the memory file system ``fd``'s file is on, or None for any other."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc().fstatfs(fd, buf) != 0:
        return None
    magic = int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder, signed=False)
    return _MEMORY_FILE_SYSTEMS.get(magic & 0xFFFFFFFF)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
