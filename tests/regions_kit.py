"""Shared-memory regions in tests: a memfd of the client's own, a deterministic pattern, stores
and reads through a region, its rows, the descriptors a process holds, and disk reads held
at a gate."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import tierd.control.engine_regions.byte_moves as region_copy
from tierd.client import Client, DaemonError
from tierd.daemon import Daemon
from tierd.stores.disk.store import DiskStore

BLOCK = 4096
NS = "model-a"


def pattern(tag: bytes, size: int) -> bytes:
    """Bytes derived from ``tag`` alone, so any mix-up shows."""
    return (tag * (size // len(tag) + 1))[:size]


async def connect(daemon: Daemon, namespace: str | None = NS) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=namespace)


# Each memfd's mapping here (address, size), made before it is registered: once the
# daemon has sealed it for loads, its owner writes it through mappings made before
# (write() is refused). Mapped with libc's mmap: Python's keeps a duplicate descriptor,
# and the tests count the descriptors of a memfd.
_OWN: dict[int, tuple[int, int]] = {}


_LIBC = region_copy._libc()  # mmap and munmap with their types declared


@contextmanager
def memfd(size: int, name: str = "engine-kv") -> Iterator[int]:
    """An engine's memory: a sealable memfd of ``size`` bytes, mapped here, every page
    allocated (the engine pays for its memory; the daemon writes only where pages
    exist)."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        address = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        _OWN[fd] = (int(address), size)
        touch(fd, size)
        yield fd
    finally:
        own = _OWN.pop(fd, None)
        if own is not None:
            _LIBC.munmap(ctypes.c_void_p(own[0]), own[1])
        os.close(fd)


def put(fd: int, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset`` of an engine's memory, as the engine does: through
    its mapping (a memfd of :func:`memfd`), else with ``pwrite``."""
    own = _OWN.get(fd)
    if own is None:
        os.pwrite(fd, data, offset)
        return
    address, size = own
    assert offset >= 0 and offset + len(data) <= size
    ctypes.memmove(address + offset, bytes(data), len(data))


def touch(fd: int, size: int) -> None:
    """Write zeros over the file: its pages exist (fallocated pages are holes still)."""
    zeros = bytes(min(size, 1 << 20))
    for at in range(0, size, len(zeros)):
        put(fd, zeros[: size - at], at)


def rows(*indices: int, size: int = BLOCK) -> np.ndarray:
    """One piece per key: key i's block at row ``indices[i]``."""
    return np.array([[i * size] for i in indices], dtype=np.uint64)


def read(fd: int, offset: int, size: int = BLOCK) -> bytes:
    return os.pread(fd, size, offset)


def open_descriptors(name: str) -> int:
    """How many of this process's descriptors name the memfd ``name``."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == f"/memfd:{name} (deleted)":
                count += 1
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor)
    return count


async def refused(call: Any, code: str = "bad_request") -> str:
    with pytest.raises(DaemonError) as info:
        await call
    assert info.value.code == code, info.value
    return str(info.value)


def held_disk_reads(
    monkeypatch: pytest.MonkeyPatch, suffix: bytes
) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold every disk-tier read of a batch with a key ending in ``suffix`` until the
    second event is set; the first is set when one starts."""
    reading, gate = asyncio.Event(), asyncio.Event()
    real = DiskStore._read

    async def held(store: DiskStore, slots: Any, keys: Any, out: Any) -> list[bool]:
        if any(key.endswith(suffix) for key in keys):
            reading.set()
            await gate.wait()
        return await real(store, slots, keys, out)

    monkeypatch.setattr(DiskStore, "_read", held)
    return reading, gate
