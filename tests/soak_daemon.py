#!/usr/bin/env python3
"""The daemon side of the soak campaign: a fault-injecting disk layer, the daemon runner
and a client that dies holding a lease.

Run as a child process (``python tests/soak_daemon.py ...``):

``serve CONFIG.yaml FAULTS``
    Runs the daemon of ``CONFIG.yaml`` (uvloop, SIGTERM handled as ``tierd serve`` does)
    with its disk tier on a :class:`FaultFileIO` steered by the control file ``FAULTS``
    (see :class:`FaultControl`); prints ``ready PID`` on stdout once clients can connect
    and nothing else there. The disk store is built with the faulty layer by replacing
    ``tierd.stores.disk.store.FileIO`` (what ``DiskStore`` instantiates when no ``fileio`` is
    given) before the chain opens: the daemon itself is unchanged.
``hold SOCKET NAMESPACE store|load KEY_HEX...``
    Connects and either reserves the keys (``prepare_store``) and scribbles wrong bytes
    into the reserved pool slots, or stores the keys with their right bytes and pins them
    (``prepare_load``); then prints ``ready N`` (slots reserved or blocks pinned) and
    waits to be killed with its lease open. ``refused CODE`` and exit status 3 when the
    daemon refuses the lease.

Imported (by the soak kit, ``tests/soak_*.py``, and the tests): :func:`content`,
:class:`FaultPlan`, :class:`FaultControl`, :class:`FaultFileIO`.

The fault layer fails or slows only the block transfers of the slab (a ``pwritev`` or
``preadv`` of a header page plus the block's data, two buffers per block); the superblock,
the O_DIRECT probe and the header scan at recovery go through untouched, so a fault plan
never stops a daemon from starting. ``disk_full`` mode also fails the journal's and the
snapshot's ``write`` calls with ENOSPC, as a file system with no room left would.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import mmap
import os
import random
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# Runnable as a script from anywhere: the repository root holds the tierd package.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from tierd.stores.disk.io import FileIO

WRITE_MODES = ("eio", "enospc", "short")
COUNTERS = ("write_eio", "write_enospc", "write_short", "journal_enospc", "read_eio", "slow")


def content(key: bytes, size: int) -> bytes:
    """The bytes every soak client stores under ``key``: blake2b(key) repeated, with the
    index of each 64-byte chunk folded into its first word, so a block shifted or mixed
    with another block's bytes never passes for the right one."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    chunks = -(-size // 64)
    words = np.frombuffer(seed * chunks, dtype=np.uint64).reshape(chunks, 8).copy()
    words[:, 0] ^= np.arange(chunks, dtype=np.uint64)
    return words.tobytes()[:size]


# -- the fault plan and its control file -------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What the disk layer does to each block transfer (rates are per call, 0..1)."""

    write_rate: float = 0.0
    write_mode: str = "eio"  # eio | enospc | short (header only written: a torn block)
    journal_rate: float = 0.0  # journal and snapshot writes failing with ENOSPC
    read_rate: float = 0.0  # preadv failing with EIO
    slow_s: float = 0.0  # sleep before every block transfer (in the I/O thread)

    def __post_init__(self) -> None:
        if self.write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {self.write_mode!r}")

    @property
    def active(self) -> bool:
        return bool(self.write_rate or self.journal_rate or self.read_rate or self.slow_s)

    def describe(self) -> dict[str, float | str]:
        return {k: v for k, v in asdict(self).items() if v and v != "eio"}


# Layout of the control file: the plan, then one u64 per counter.
_PLAN = struct.Struct("<QdBddd")  # version, write_rate, write_mode, journal_rate, read_rate, slow
_PLAN_BYTES = 64
_COUNTER = struct.Struct("<Q")
_FILE_BYTES = _PLAN_BYTES + _COUNTER.size * len(COUNTERS)


class FaultControl:
    """A small shared file: the campaign writes the plan, the daemon reads it on every
    block transfer (a memory read, no system call) and counts the faults it injected.

    It is mapped ``MAP_SHARED``, so the counts of a daemon killed with SIGKILL survive
    it, and a restarted daemon goes on counting in the same file."""

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False) -> None:
        self.path = os.fspath(path)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, _FILE_BYTES)
            self._mm = mmap.mmap(fd, _FILE_BYTES, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._lock = threading.Lock()

    def set(self, plan: FaultPlan) -> None:
        version = _PLAN.unpack_from(self._mm, 0)[0] + 1
        mode = WRITE_MODES.index(plan.write_mode)
        raw = _PLAN.pack(
            version, plan.write_rate, mode, plan.journal_rate, plan.read_rate, plan.slow_s
        )
        self._mm[: len(raw)] = raw

    def plan(self) -> FaultPlan:
        while True:  # the writer is another process: read until two copies agree
            first = self._mm[: _PLAN.size]
            if first == self._mm[: _PLAN.size]:
                break
        _, write_rate, mode, journal_rate, read_rate, slow_s = _PLAN.unpack(first)
        return FaultPlan(write_rate, WRITE_MODES[mode], journal_rate, read_rate, slow_s)

    def count(self, name: str) -> None:
        offset = _PLAN_BYTES + _COUNTER.size * COUNTERS.index(name)
        with self._lock:
            (value,) = _COUNTER.unpack_from(self._mm, offset)
            _COUNTER.pack_into(self._mm, offset, value + 1)

    def counters(self) -> dict[str, int]:
        return {
            name: _COUNTER.unpack_from(self._mm, _PLAN_BYTES + _COUNTER.size * i)[0]
            for i, name in enumerate(COUNTERS)
        }

    def close(self) -> None:
        self._mm.close()


class FaultFileIO(FileIO):
    """:class:`FileIO` that fails or slows block transfers as the control file says.

    Thread-safe: the store calls it from its I/O threads; the sleep of a slow disk is a
    real ``time.sleep`` there, which is what a slow device does to those threads."""

    def __init__(self, control: FaultControl) -> None:
        self.control = control
        self._rng = random.Random(os.getpid())

    def _hit(self, rate: float) -> bool:
        return rate >= 1.0 or (rate > 0.0 and self._rng.random() < rate)

    def _slow(self, plan: FaultPlan) -> None:
        if plan.slow_s > 0:
            self.control.count("slow")
            time.sleep(plan.slow_s)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if len(buffers) < 2:  # not a block: the superblock or the O_DIRECT probe
            return super().pwritev(fd, buffers, offset)
        plan = self.control.plan()
        self._slow(plan)
        if self._hit(plan.write_rate):
            if plan.write_mode == "short":
                self.control.count("write_short")
                return os.pwritev(fd, buffers[:1], offset)  # the header, not the data
            code = errno.EIO if plan.write_mode == "eio" else errno.ENOSPC
            self.control.count(f"write_{plan.write_mode}")
            raise OSError(code, f"injected: {os.strerror(code)}")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if len(buffers) < 2:  # the superblock, the probe, the header scan of a recovery
            return super().preadv(fd, buffers, offset)
        plan = self.control.plan()
        self._slow(plan)
        if self._hit(plan.read_rate):
            self.control.count("read_eio")
            raise OSError(errno.EIO, "injected: read error")
        return super().preadv(fd, buffers, offset)

    def write(self, fd: int, data: bytes) -> int:
        if self._hit(self.control.plan().journal_rate):
            self.control.count("journal_enospc")
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return super().write(fd, data)


def install(control: FaultControl) -> None:
    """Make every disk store built from now on use a :class:`FaultFileIO` on ``control``."""
    import tierd.stores.disk.store as disk

    disk.FileIO = functools.partial(FaultFileIO, control)  # type: ignore[misc]


# -- child roles -------------------------------------------------------------------------


def serve(config_path: str, fault_path: str) -> int:
    import uvloop

    from tierd.config import DaemonConfig, load_config
    from tierd.daemon import Daemon, configure_logging

    install(FaultControl(fault_path))
    cfg = load_config(Path(config_path), DaemonConfig)
    configure_logging(cfg.logging)

    async def main() -> int:
        daemon = Daemon(cfg)
        task = asyncio.create_task(daemon.run())
        ready = asyncio.create_task(daemon.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            print(f"ready {os.getpid()}", flush=True)
        else:
            ready.cancel()
        return await task

    return uvloop.run(main())


async def hold(socket_path: str, namespace: str, mode: str, keys: list[bytes]) -> int:
    from tierd.client import Client, DaemonError

    client = await Client.connect(socket_path, namespace=namespace)
    try:
        if mode == "store":
            lease = await client.prepare_store(keys)
            for view in lease.views():
                view[:] = b"\xee" * len(view)  # wrong bytes: must never be served
            held = len(lease.to_write)
        else:
            size = client.block_bytes
            await client.store(keys, [content(k, size) for k in keys])
            held = (await client.prepare_load(keys)).count
    except DaemonError as exc:
        print(f"refused {exc.code}", flush=True)
        return 3
    print(f"ready {held}", flush=True)
    await asyncio.Event().wait()  # hold the lease until killed
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "serve":
        return serve(argv[1], argv[2])
    if len(argv) >= 5 and argv[0] == "hold" and argv[3] in ("store", "load"):
        keys = [bytes.fromhex(k) for k in argv[4:]]
        return asyncio.run(hold(argv[1], argv[2], argv[3], keys))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
