"""What tierd's HiCache backend reports to SGLang, and byte views of SGLang's tensors.

:class:`Counters` collects, per call, the pages and bandwidth SGLang's
``StorageMetrics`` carries (``prefetch_pgs``, ``backup_pgs`` and their GB/s), handed over
and reset by ``get_stats()`` as SGLang's own backends do, plus running totals for logs
and tests. Bandwidth counts only calls that moved pages. A failed call is counted in
``failed_calls``; one that failed in the backend's own code (a bug, not the daemon) in
``internal_errors`` too.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.observability.metrics_collector import StorageMetrics

__all__ = ["Counters", "tensor_bytes"]


class Counters:
    """Per-call figures since the last :meth:`take`, and totals (thread-safe: SGLang's
    prefetch and backup threads call the backend at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics = StorageMetrics()
        self.totals = {
            "lookups": 0,
            "looked_up_pages": 0,
            "hit_pages": 0,
            "loaded_pages": 0,
            "stored_pages": 0,
            "failed_calls": 0,
            "internal_errors": 0,
        }

    def looked_up(self, pages: int, hits: int) -> None:
        with self._lock:
            self.totals["lookups"] += 1
            self.totals["looked_up_pages"] += pages
            self.totals["hit_pages"] += hits

    def moved(self, store: bool, pages: int, nbytes: int, elapsed_s: float) -> None:
        with self._lock:
            self.totals["stored_pages" if store else "loaded_pages"] += pages
            if not pages:
                return
            rate = nbytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
            if store:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(rate)
            else:
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(rate)

    def failed(self, *, internal: bool = False) -> None:
        with self._lock:
            self.totals["failed_calls"] += 1
            self.totals["internal_errors"] += internal

    def take(self) -> StorageMetrics:
        with self._lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics


def tensor_bytes(tensor: Any) -> npt.NDArray[np.uint8]:
    """The bytes of a contiguous CPU tensor, shared (no copy, no torch import)."""
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if not nbytes:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(tensor.data_ptr())))
