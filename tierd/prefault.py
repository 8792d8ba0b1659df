"""Page tables filled ahead of use, for a shared pool mapped into a process.

A shared mapping starts with no page-table entries: the first touch of each 4 KiB page
in each process is a fault, even when the pages exist (the daemon allocates its pool at
start). Copies into fresh pool slots paid that on the copying thread: under SGLang, a
64-page store (1 MiB pages) through leases into never-touched slots moved 0.16x of a
memcpy, 0.73x into slots touched before (``scripts/bench sglang``). So a client's
mapping of the pool is populated in the background once mapped (``MADV_POPULATE_WRITE``,
Linux 5.14, in 64 MiB steps: the thread waits in the kernel without the GIL), and the
daemon maps its own pool with ``MAP_POPULATE``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from tierd.logs import get_logger

__all__ = ["Prefault", "populate_flags"]

log = get_logger("tierd.prefault")
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, since Linux 5.14
STEP_BYTES = 64 << 20


def populate_flags() -> int:
    """``MAP_POPULATE`` where the platform has it (Linux), else 0."""
    return getattr(mmap, "MAP_POPULATE", 0)


class Prefault:
    """Populate ``mapping`` in a background thread, a step at a time; :meth:`stop` ends it
    between two steps and waits, so the range is never populated after it is unmapped."""

    def __init__(self, mapping: mmap.mmap, name: str) -> None:
        self.size = len(mapping)
        self.done = 0  # bytes populated so far
        self.error: str | None = None  # why it stopped early, if it did
        self._stop = threading.Event()
        anchor = ctypes.c_char.from_buffer(mapping)
        self._address = ctypes.addressof(anchor)
        del anchor  # drops its export of the mapping's buffer: the mapping can close
        self._thread = threading.Thread(target=self._run, name=f"prefault-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        while self.done < self.size and not self._stop.is_set():
            step = min(STEP_BYTES, self.size - self.done)
            if madvise(self._address + self.done, step, MADV_POPULATE_WRITE) != 0:
                self.error = os.strerror(ctypes.get_errno())
                # An older kernel (EINVAL): pages then fault in on first touch, as before.
                log.debug("pool pages not populated ahead", error=self.error)
                return
            self.done += step

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end; whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """End the thread (after its current step) and wait for it."""
        self._stop.set()
        self._thread.join()
