"""The pinned CPU pool: every slot in one shared-memory file, page-locked for CUDA.

Layout, for any process that maps the pool::

    file    = an anonymous memfd (memfd=True: what the daemon uses), handed to clients
              as a file descriptor; or <shm_dir>/<name> (default
              /dev/shm/tierd-<pid>-<random>), which ``CpuStore(..., create=False)`` maps
    size    = num_blocks * stride         (exactly; no power-of-two rounding)
    stride  = block_bytes rounded up to a multiple of 4096
    slot s  = bytes [s * stride, s * stride + block_bytes)   (every slot 4096-aligned)

A memfd has no path: nothing in /dev/shm can be opened by another user, or reaped by
another daemon, and it is gone with the last descriptor and mapping. It is sealed at its
size (``F_SEAL_SHRINK | F_SEAL_GROW``), so a client that holds it cannot truncate it
under the daemon (which would kill the daemon with SIGBUS on its next touch). A named
file is created with ``O_CREAT | O_EXCL`` and its final mode (default ``0o600``) in one
call, so it is never visible with looser permissions, and it is unlinked on close unless
``keep=True``. With CUDA the mapping is registered with ``cudaHostRegister`` in chunks
(progress in the log) and unregistered before it is unmapped; without CUDA it is plain
shared memory and ``stats().details`` says ``pinned: False`` with the reason.

Every page is allocated and mapped at start, in parallel 64 MiB steps by several
threads (:func:`tierd.prefault.populate`): one thread, a chunk at a time, took 46-52 s
for 64 GiB. Registering with CUDA goes a chunk (``register_chunk_bytes``) at a time.
Both call ``progress(stage, done, total)`` as they go, so a service manager can extend
its start timeout while work is being done (the daemon sends ``EXTEND_TIMEOUT_USEC``); a
stop interrupts both between steps: a signal raises between two allocation steps, and
cancelling the open stops the registration thread after its current chunk and
unregisters what it did. A copy must
not cross two registrations: :attr:`CpuStore.dma_boundary` is the chunk in slots.

Views (memoryviews and tensors) keep the mapping alive: closing the store drops its own
references and unmaps at once when no view is left, or when the last one is dropped.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tierd.errors import StoreIOError
from tierd.keys import Medium
from tierd.logs import get_logger
from tierd.prefault import PopulateUnsupported, address_of, populate, populate_flags
from tierd.stores.base import INLINE_COPY_BYTES, StoreStats, settle
from tierd.stores.cuda import (
    CudaCallError,
    RegistrationStopped,
    cuda_unavailable_reason,
    host_register,
    host_unregister,
)
from tierd.stores.memory import HostPoolStore

__all__ = ["PAGE", "CpuStore", "StartProgress", "default_pool_name"]

# progress(stage, done, total): stage is "allocating" or "pinning"; bytes done of total.
StartProgress = Callable[[str, int, int], None]

log = get_logger(__name__)

PAGE = 4096


def default_pool_name() -> str:
    """A fresh pool name, unique per process and call."""
    return f"tierd-{os.getpid()}-{secrets.token_hex(6)}"


class CpuStore(HostPoolStore):
    """A shared-memory host pool, page-locked when CUDA is present.

    ``memfd=True``: an anonymous, sealed memfd named ``name`` (for ``/proc/PID/maps``);
    :attr:`fd` is the descriptor to hand to clients. Otherwise a file: ``name`` under
    ``shm_dir`` (unique default), ``mode`` its permissions at creation, ``keep`` leaves it
    behind on close, and ``create=False`` maps an existing pool (made by another store
    or process) instead; such a store never unlinks it.
    ``pin=False`` skips page-locking. ``register_chunk_bytes``: how much to allocate and
    register per call (rounded down to whole slots). ``pin_device``: the CUDA device index
    the registering thread uses (``None``: the current one; the pages are pinned for
    every device). ``progress``: see the module docstring. ``cudart``: the CUDA runtime
    binding (``None``: torch's; tests pass a fake).
    """

    medium = Medium.CPU

    def __init__(
        self,
        *,
        num_blocks: int,
        block_bytes: int,
        name: str | None = None,
        mode: int = 0o600,
        keep: bool = False,
        create: bool = True,
        pin: bool = True,
        shm_dir: str = "/dev/shm",
        memfd: bool = False,
        register_chunk_bytes: int = 1 << 30,
        inline_limit: int = INLINE_COPY_BYTES,
        pin_device: int | None = None,
        progress: StartProgress | None = None,
        cudart: Any = None,
    ) -> None:
        stride = -(-block_bytes // PAGE) * PAGE
        super().__init__(
            num_blocks=num_blocks, block_bytes=block_bytes, stride=stride, inline_limit=inline_limit
        )
        self.name = default_pool_name() if name is None else name
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"invalid pool name {self.name!r}")
        if memfd and not create:
            raise ValueError("a memfd pool is always created: it has no name to map")
        self.memfd = memfd
        self.path = f"memfd:{self.name}" if memfd else os.path.join(shm_dir, self.name)
        self.mode = mode
        self.keep = keep or not create or memfd
        self.create = create
        self._fd = -1  # the memfd, kept open to hand to clients
        self.pin = pin
        self.register_chunk_bytes = max(1, register_chunk_bytes // stride) * stride
        self.pin_device = pin_device
        self._progress = progress
        self._cudart = cudart
        self.size = num_blocks * stride
        self._mmap: mmap.mmap | None = None
        self._pinned_chunks: list[int] = []
        self._pin_details: dict[str, Any] = {"pinned": False, "reason": "not opened"}
        self._stop_allocating = threading.Event()
        self._progress_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    async def _open(self) -> None:
        # Allocating and populating many GiB takes seconds: off the loop, so that a pool
        # opened while the daemon serves (a new block size) stalls no other client. A
        # cancellation stops the allocation after the chunk under way.
        self._stop_allocating = threading.Event()
        mapped = asyncio.get_running_loop().run_in_executor(None, self._map)
        try:
            self._mmap = await settle(mapped, self._stop_allocating.set)
        except asyncio.CancelledError:
            if mapped.done() and not mapped.cancelled() and mapped.exception() is None:
                self._mmap = mapped.result()  # made just as the stop came: undone now
                self._release()
            raise
        try:
            self._attach(self._mmap)
            if self.pin:
                await self._register()
            else:
                self._pin_details = {"pinned": False, "reason": "pinning disabled"}
        except BaseException:
            self._release()
            raise

    async def _close(self) -> None:
        if self._pinned_chunks:
            # Unregistering many GiB takes seconds: not on the loop.
            chunks = self._pinned_chunks
            await settle(asyncio.get_running_loop().run_in_executor(None, self._unpin, chunks))
        self._release()

    def _unpin(self, chunks: list[int]) -> None:
        try:
            host_unregister(chunks, cudart=self._cudart)  # empties ``chunks``
        except CudaCallError as exc:
            log.error("cannot unregister the host pool", path=self.path, error=str(exc))

    @property
    def fd(self) -> int | None:
        """The memfd to hand to clients (with SCM_RIGHTS), while open; ``None`` for a
        pool file."""
        return self._fd if self._fd >= 0 else None

    def _map(self) -> mmap.mmap:
        if self.memfd:
            return self._map_memfd()
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if self.create else 0)
        try:
            fd = os.open(self.path, flags, self.mode)
        except OSError as exc:
            raise self._io_error("cannot open the shared-memory pool", exc) from exc
        try:
            if self.create:
                # The umask may have stripped bits from the requested mode; widening
                # through our own descriptor leaves no window with looser permissions.
                if os.fstat(fd).st_mode & 0o7777 != self.mode:
                    os.fchmod(fd, self.mode)
                os.ftruncate(fd, self.size)
                return self._filled(fd)
            if (found := os.fstat(fd).st_size) != self.size:
                raise OSError(0, f"pool file holds {found} bytes, expected {self.size}")
            return mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | populate_flags())
        except OSError as exc:
            if self.create:
                self._unlink()
            if isinstance(exc, StoreIOError):
                raise
            raise self._io_error("cannot map the shared-memory pool", exc) from exc
        finally:
            os.close(fd)

    def _map_memfd(self) -> mmap.mmap:
        try:
            fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise self._io_error("cannot create the shared-memory pool", exc) from exc
        try:
            os.ftruncate(fd, self.size)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            mapping = self._filled(fd)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, StoreIOError):
                raise
            raise self._io_error("cannot map the shared-memory pool", exc) from exc
        self._fd = fd
        return mapping

    def _filled(self, fd: int) -> mmap.mmap:
        """The pool mapped with every page allocated and mapped now: a shared-memory file
        maps fine past the free space of its file system and then kills the process
        with SIGBUS on the first touch of a page that cannot be had, and the daemon's
        copies into fresh slots would fault on every 4 KiB page. In parallel steps
        (:func:`~tierd.prefault.populate`: several threads, each waiting in the kernel);
        on a kernel without ``MADV_POPULATE_WRITE``, a chunk at a time as before
        (``posix_fallocate``, then ``MAP_POPULATE``)."""
        mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        try:
            populate(
                address_of(mapping),
                self.size,
                stop=self._stop_allocating,
                progress=self._populated,
            )
        except PopulateUnsupported:
            mapping.close()
            self._allocate(fd)
            return mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | populate_flags())
        except OSError as exc:
            mapping.close()
            if exc.errno in (errno.ENOMEM, errno.EFAULT, errno.ENOSPC):
                raise self._no_room(exc) from exc
            raise
        return mapping

    def _populated(self, done: int) -> None:
        """Progress of :meth:`_filled` (from any of its threads)."""
        if self._progress is not None:
            with self._progress_lock:
                self._progress("allocating", done, self.size)

    def _allocate(self, fd: int) -> None:
        """Allocate every page now, a chunk at a time (a kernel without
        ``MADV_POPULATE_WRITE``)."""
        try:
            # A chunk at a time: a stop signal raises between two (a 128 GiB pool takes
            # about a minute), and the progress keeps a service manager waiting.
            chunk = self.register_chunk_bytes
            for offset in range(0, self.size, chunk):
                if self._stop_allocating.is_set():
                    raise OSError(errno.ECANCELED, "the pool's allocation was stopped")
                os.posix_fallocate(fd, offset, min(chunk, self.size - offset))
                if self._progress is not None:
                    self._progress("allocating", min(offset + chunk, self.size), self.size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise self._no_room(exc) from exc

    def _no_room(self, exc: OSError) -> StoreIOError:
        """The pool's pages cannot be had: how many bytes it needs, and where."""
        number = exc.errno
        if number == errno.EFAULT:  # MADV_POPULATE_WRITE: a page that a touch would SIGBUS
            number = errno.ENOMEM if self.memfd else errno.ENOSPC
        reason = os.strerror(number) if number else str(exc)
        need = f"it needs {self.size:,} bytes ({self.size / (1 << 20):.1f} MiB)"
        if self.memfd:
            message = (
                f"cannot allocate the shared-memory pool: {need} of memory"
                f" ({reason}); lower the tier's capacity"
            )
        else:
            shm_dir = os.path.dirname(self.path)
            free = os.statvfs(shm_dir)
            message = (
                f"cannot allocate the shared-memory pool: {need} in {shm_dir}, which"
                f" has {free.f_bavail * free.f_frsize:,} bytes free"
                f" ({reason}); lower the tier's capacity or grow {shm_dir}"
            )
        return self._io_error(message, exc)

    def _release(self) -> None:
        """Unregister, drop the mapping (now, or with the last view) and unlink."""
        if self._pinned_chunks:
            self._unpin(self._pinned_chunks)
        self._detach()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.debug("pool views outlive the store; unmapped with the last", path=self.path)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self.keep:
            self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot unlink the pool file", path=self.path, error=str(exc))

    def _io_error(self, message: str, exc: OSError) -> StoreIOError:
        return StoreIOError(message, path=self.path, errno=exc.errno, medium=str(self.medium))

    # -- pinning ---------------------------------------------------------------------

    @property
    def dma_boundary(self) -> int:
        """Slots per registration chunk: a copy between this pool and a GPU must not cross
        a multiple of it (one registration per host range of a copy)."""
        return self.register_chunk_bytes // self.stride

    async def _register(self) -> None:
        reason = cuda_unavailable_reason() if self._cudart is None else None
        if reason is not None:
            self._pin_details = {"pinned": False, "reason": reason}
            return
        started = time.perf_counter()
        log.info("pinning host pool", path=self.path, bytes=self.size)
        stop = threading.Event()
        work = partial(self._register_sync, stop)
        try:
            # Registering many GiB takes seconds: keep it off the loop; a cancellation
            # (a stop during start-up) stops it after the chunk under way.
            await settle(asyncio.get_running_loop().run_in_executor(None, work), stop.set)
        except RegistrationStopped as exc:
            log.info("pinning stopped", path=self.path, error=str(exc))
            raise
        except RuntimeError as exc:  # CudaCallError, or CUDA failing to initialise
            log.warning("host pool left unpinned", path=self.path, error=str(exc))
            self._pin_details = {"pinned": False, "reason": str(exc)}
            return
        seconds = time.perf_counter() - started
        log.info("pinned host pool", path=self.path, bytes=self.size, seconds=round(seconds, 3))
        self._pin_details = {"pinned": True, "register_seconds": seconds}

    def _register_sync(self, stop: threading.Event) -> None:
        def progress(done: int, total: int) -> None:
            if total > self.register_chunk_bytes:
                log.info("pinning host pool", path=self.path, done=done, total=total)
            if self._progress is not None:
                self._progress("pinning", done, total)

        if self.pin_device is not None and self._cudart is None:
            import torch  # the GPU extra's: loaded already (a GPU tier is configured)

            # This worker thread's first CUDA call would otherwise make a context on GPU 0.
            torch.cuda.set_device(self.pin_device)
        address = int(self._pool.ctypes.data)
        self._pinned_chunks = host_register(
            address,
            self.size,
            chunk_bytes=self.register_chunk_bytes,
            progress=progress,
            stop=stop,
            cudart=self._cudart,
        )

    @property
    def pinned(self) -> bool:
        return bool(self._pinned_chunks)

    def stats(self) -> StoreStats:
        details = {"path": self.path, "stride": self.stride, "size": self.size}
        details.update(self._pin_details)
        return self._counters.snapshot(self, details)
