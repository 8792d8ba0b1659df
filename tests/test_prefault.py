"""A mapped pool's page tables are filled ahead of use (``tierd/prefault.py``): in the
background for a client's mapping, at start for the daemon's.

What is checked is the process's own page tables: the resident size (``Rss`` in
``/proc/self/smaps``) of the mapping, which counts only pages this process has mapped,
not pages the file holds.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest
from loop_daemon_kit import connect, serve

from tierd.prefault import Prefault

MIB = 1 << 20
pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps"
)


def resident_bytes(mapping: mmap.mmap) -> int:
    """How much of ``mapping`` this process has in its page tables."""
    anchor = ctypes.c_char.from_buffer(mapping)
    start = ctypes.addressof(anchor)
    del anchor
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low = int(head.split("-")[0], 16)
            found = low == start
        elif found and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def finished(prefault: Prefault) -> None:
    """Wait for ``prefault``; skip where the kernel has no MADV_POPULATE_WRITE (< 5.14)."""
    assert prefault.wait(30.0)
    if prefault.error == os.strerror(errno.EINVAL):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert prefault.error is None


def allocated_memfd(size: int) -> int:
    fd = os.memfd_create("prefault-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # the pages exist, as the daemon's pool's do
    return fd


def test_a_mapping_is_populated_in_the_background_and_an_untouched_one_is_not() -> None:
    size = 24 * MIB
    fd = allocated_memfd(size)
    try:
        plain = mmap.mmap(fd, size, mmap.MAP_SHARED)
        filled = mmap.mmap(fd, size, mmap.MAP_SHARED)
        prefault = Prefault(filled, "test")
        finished(prefault)
        assert prefault.done == size
        assert resident_bytes(filled) == size
        assert resident_bytes(plain) < MIB  # the same pages, never touched here
        plain.close()
        filled.close()  # the thread's view of the buffer is gone: the mapping closes
    finally:
        os.close(fd)


def test_stop_ends_it_between_steps_and_the_mapping_then_closes() -> None:
    size = 256 * MIB
    fd = allocated_memfd(size)
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        prefault = Prefault(mapping, "test")
        prefault.stop()
        assert prefault.wait(0.0) and prefault.done <= size
        mapping.close()
    finally:
        os.close(fd)


async def test_a_clients_pool_mapping_is_populated_without_a_lease(tmp_path: Path) -> None:
    async with serve(tmp_path, cpu_blocks=256, disk_blocks=16) as daemon:
        client = await connect(daemon)
        try:
            pool = client.require_pool()
            finished(pool.prefault)
            assert resident_bytes(pool._mm) == pool.prefault.size > 0
        finally:
            await client.close()


def file_bytes(fd: int) -> int:
    """How much of the file behind ``fd`` is allocated (its blocks, as ``du`` counts)."""
    return os.fstat(fd).st_blocks * 512


def test_populate_allocates_and_maps_every_page_with_several_threads() -> None:
    """The daemon's pool at start: a memfd never allocated, populated by four threads in
    64 MiB steps; afterwards every page of the file exists and is mapped here, and the
    progress reached the size from the threads' steps."""
    from tierd.prefault import STEP_BYTES, PopulateUnsupported, address_of, populate

    size = 4 * STEP_BYTES + 3 * MIB  # a last step shorter than the others
    fd = os.memfd_create("populate-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        assert file_bytes(fd) == 0
        seen: list[int] = []
        try:
            populate(address_of(mapping), size, threads=4, progress=seen.append)
        except PopulateUnsupported:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
        assert file_bytes(fd) >= size and resident_bytes(mapping) == size
        assert max(seen) == size and len(seen) == 5
        mapping.close()
    finally:
        os.close(fd)


def test_populate_stops_between_steps_and_says_why() -> None:
    import threading

    from tierd.prefault import STEP_BYTES, address_of, populate

    size = 8 * STEP_BYTES
    fd = os.memfd_create("populate-stop", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        stop = threading.Event()
        stop.set()
        with pytest.raises(OSError, match=r"stopped|Invalid argument") as stopped:
            populate(address_of(mapping), size, threads=2, stop=stop)
        assert stopped.value.errno in (errno.ECANCELED, errno.EINVAL)
        assert file_bytes(fd) < size
        mapping.close()
    finally:
        os.close(fd)
