"""Pages of a shared pool allocated and mapped ahead of use, in parallel.

A shared mapping starts with no page-table entries: the first touch of each 4 KiB page
in each process is a fault, and the first touch of a page of the file itself allocates
it. Both are paid here, ahead of use, with ``MADV_POPULATE_WRITE`` (Linux 5.14): the
kernel allocates and maps a range at once, and returns an error where a touch would have
raised SIGBUS (no memory for the file's pages) instead of killing the process.

- :func:`populate`: the daemon's pool at start-up, every page, in 64 MiB steps taken
  by several threads at once (each waits in the kernel, the GIL released): a 64 GiB pool
  took 46-52 s allocated a chunk at a time by one thread (``posix_fallocate``, then
  ``MAP_POPULATE``); the kernel fills different ranges of one file in parallel.
- :class:`Prefault`: a client's mapping of the pool, in one background thread once
  mapped (copies into fresh pool slots otherwise paid the faults on the copying thread:
  under SGLang a 64-page store into never-touched slots moved 0.16x of a memcpy, 0.73x
  into slots touched before, ``scripts/bench sglang``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable

from tierd.logs import get_logger

__all__ = ["PopulateUnsupported", "Prefault", "address_of", "populate", "populate_flags"]

log = get_logger("tierd.prefault")
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, since Linux 5.14
STEP_BYTES = 64 << 20
MAX_THREADS = 16


class PopulateUnsupported(OSError):
    """The kernel has no ``MADV_POPULATE_WRITE`` (before Linux 5.14)."""


def populate_flags() -> int:
    """``MAP_POPULATE`` where the platform has it (Linux), else 0."""
    return getattr(mmap, "MAP_POPULATE", 0)


def address_of(mapping: mmap.mmap) -> int:
    """The address ``mapping`` starts at (no export of its buffer is kept)."""
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor  # the mapping can close
    return address


def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def populate(
    address: int,
    size: int,
    *,
    threads: int | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Allocate and map every page of ``[address, address + size)`` (a shared mapping),
    ``STEP_BYTES`` at a time, by ``threads`` threads (default: one per CPU, at most
    :data:`MAX_THREADS`) each taking the next step. ``progress(bytes done)`` after each
    step (from any of them); ``stop`` set ends them between steps with ``ECANCELED``.
    Raises :class:`PopulateUnsupported` on a kernel without ``MADV_POPULATE_WRITE``, and
    ``OSError`` (``ENOMEM``, or ``EFAULT`` where a touch would raise SIGBUS: a file past
    its file system's room) when the pages cannot be had."""
    steps = -(-size // STEP_BYTES)
    count = max(1, min(threads or os.cpu_count() or 1, MAX_THREADS, steps))
    madvise = _madvise()
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    failures: list[OSError] = []

    def work() -> None:
        while True:
            with lock:
                if failures or state["next"] >= size:
                    return
                start = state["next"]
                state["next"] = start + STEP_BYTES
            if stop is not None and stop.is_set():
                failures.append(OSError(errno.ECANCELED, "the pool's allocation was stopped"))
                return
            length = min(STEP_BYTES, size - start)
            if madvise(address + start, length, MADV_POPULATE_WRITE) != 0:
                number = ctypes.get_errno()
                kind = PopulateUnsupported if number == errno.EINVAL else OSError
                failures.append(kind(number, os.strerror(number)))
                return
            with lock:
                state["done"] += length
                done = state["done"]
            if progress is not None:
                progress(done)

    helpers = [threading.Thread(target=work, name=f"populate-{i}") for i in range(count - 1)]
    for helper in helpers:
        helper.start()
    work()
    for helper in helpers:
        helper.join()
    if failures:
        raise failures[0]


class Prefault:
    """Populate ``mapping`` in a background thread, a step at a time; :meth:`stop` ends it
    between two steps and waits, so the range is never populated after it is unmapped."""

    def __init__(self, mapping: mmap.mmap, name: str) -> None:
        self.size = len(mapping)
        self.done = 0  # bytes populated so far
        self.error: str | None = None  # why it stopped early, if it did
        self._stop = threading.Event()
        self._address = address_of(mapping)
        self._thread = threading.Thread(target=self._run, name=f"prefault-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            populate(self._address, self.size, threads=1, stop=self._stop, progress=self._count)
        except OSError as exc:
            self.error = exc.strerror or str(exc)
            # An older kernel (EINVAL): pages then fault in on first touch, as before.
            log.debug("pool pages not populated ahead", error=self.error)

    def _count(self, done: int) -> None:
        self.done = done

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end; whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """End the thread (after its current step) and wait for it."""
        self._stop.set()
        self._thread.join()
