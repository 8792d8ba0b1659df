"""A connection's private staging memory: what the daemon copies into, for an engine.

The staged way (:mod:`tierd.integrations.moves`) moves an engine's blocks through a memfd
of the connection's own, not through the engine's memory: a job the engine gave up on (a
daemon stopped past the deadline, then resumed) may still be copied by the daemon later,
and it must land where nobody reads or writes again. A staging memfd belongs to one
connection; when a call times out the connection is dropped, and the next connection
gets a fresh memfd.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import numpy.typing as npt

__all__ = ["NO_REGIONS", "row_offsets", "staging_memory"]

Rows = npt.NDArray[np.uint8]
# What a daemon without engine regions answers a registration with.
NO_REGIONS = frozenset({"unknown_op", "bad_region", "not_allowed"})


def staging_memory(rows: int, row_bytes: int) -> tuple[int, Rows]:
    """A memfd of ``rows`` rows of ``row_bytes``, mapped here with every page faulted in
    (not in the first job): its descriptor (the caller closes it once the daemon has it;
    the mapping keeps the memory) and the rows."""
    size = rows * row_bytes
    # Sealable: the daemon seals a region it loads into (its pages cannot go meanwhile).
    fd = os.memfd_create("tierd-engine-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        raise
    array = np.frombuffer(mapping, dtype=np.uint8).reshape(rows, row_bytes)
    array[:] = 0
    return fd, array


def row_offsets(rows: int, row_bytes: int) -> npt.NDArray[np.uint64]:
    """The byte offset of each of ``rows`` rows."""
    return np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)
