"""One slab file of the disk store (one per directory, i.e. per drive) and its slot index.

A :class:`Slab` owns the file descriptors and their lock, the in-memory slot index with
its journal, the blocking per-chunk I/O routines that the store runs on its thread pools
(each block's own write and checked read, alone or in a run of adjacent slots, are
:mod:`tierd.stores.disk.block_format`'s), and the order of opening and closing. Everything here
but the ``*_chunk``, ``*_sync`` and ``flush_journal`` methods runs on the event loop's
thread and never blocks. What opening finds out (the superblock, the O_DIRECT probe, the
index recovered after a crash) is :mod:`tierd.stores.disk.opening`.

Slab layout: a 4096-byte superblock (magic ``TIERDSLB``, geometry, slab uuid, xxh3), then
``local_slots`` slots of ``slot_size`` bytes: one 4096-byte header page (see
:mod:`tierd.stores.disk.block_format`) followed by the block's bytes, padded to 4096.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tierd.errors import SlabInUse, StoreIOError
from tierd.logs import get_logger
from tierd.stores.disk import block_format as di
from tierd.stores.disk import index as ix
from tierd.stores.disk import journal as dj
from tierd.stores.disk.block_format import (
    BAD_BLOCK,
    OK,
    ReadJob,
    WriteJob,
    read_block,
    read_run,
    runs_with,
    staging,
    write_block,
    write_run,
)
from tierd.stores.disk.index import Checkpoint, IndexWalk
from tierd.stores.disk.io import ALIGN, FileIO, aligned_buffer, round_up
from tierd.stores.disk.opening import (
    Resume,
    check_block,
    format_slab,
    probe_direct,
    read_superblock,
    recover_index,
    remove_files,
    scan_headers,
    write_superblock,
)

__all__ = ["BAD_BLOCK", "OK", "SLAB_FILE", "Slab", "SlabConfig", "slab_file_bytes"]

SLAB_FILE = "tierd-slab.bin"  # the slab's name in its directory
_LOCKED = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})
_log = get_logger("tierd.disk")
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
_WARN_EVERY_S = 5.0  # at most one journal warning per slab this often
_Run = Callable[..., list[int]]  # read_run or write_run


@dataclass(frozen=True, slots=True)
class SlabConfig:
    directory: str
    dir_index: int
    num_dirs: int
    local_slots: int
    block_bytes: int
    o_direct: bool | str  # "auto", True or False
    sync: bool  # fsync the journal and fdatasync the slab per write batch ("always")


def slab_file_bytes(local_slots: int, block_bytes: int) -> int:
    """The size of a slab file holding ``local_slots`` blocks of ``block_bytes``."""
    return ALIGN + local_slots * (ALIGN + round_up(block_bytes))


class Slab:
    """One slab file and the index of the slots it holds (local slot numbers)."""

    def __init__(self, cfg: SlabConfig, io: FileIO) -> None:
        self.cfg = cfg
        self.io = io
        self.path = os.path.join(cfg.directory, SLAB_FILE)
        self.data_io = round_up(cfg.block_bytes)  # bytes moved per block under O_DIRECT
        self.slot_size = ALIGN + self.data_io
        self.file_bytes = slab_file_bytes(cfg.local_slots, cfg.block_bytes)
        self.entries = ix.SlotIndex()  # never tracked by the garbage collector
        self.pending: dict[int, int] = {}  # local slot -> generation of the write in flight
        self.next_gen = 1
        self.epoch = 0
        self.uuid = b""
        self.o_direct = False
        self.reason = ""
        self.recovery = "new"
        self.dropped = 0
        self.recovery_stats: dict[str, Any] = {}
        self.journal_errors = 0
        self.read_only = ""  # why the slab takes no writes (no room for its journal)
        self._warned = self._retried = -_WARN_EVERY_S
        self.journal = dj.Journal(io, cfg.directory)
        self._lock_fd = -1  # buffered descriptor; holds the flock
        self._fd = -1  # descriptor for block I/O (O_DIRECT when the probe passed)
        self._formatted = False  # this open truncated the slab to format it
        self.resized_from = 0  # the slots of the slab this open resized, if it did
        self.walk: IndexWalk | None = None  # a checkpoint being taken, slice by slice

    # -- loop-thread bookkeeping -------------------------------------------------------

    def offset(self, local: int) -> int:
        return ALIGN + local * self.slot_size

    def begin(self, local: int) -> int:
        """Make ``local`` unreadable and reserve a generation for a write to it."""
        gen = self.next_gen
        self.next_gen += 1
        self.entries.pop(local, None)
        self.pending[local] = gen
        self.journal.append(di.Op.BEGIN, local, gen)
        if self.walk is not None:
            self.walk.touch(local)
        return gen

    def commit(self, local: int, key: bytes, gen: int, ok: bool) -> None:
        """Finish a write: readable under ``key`` if it succeeded and was not invalidated
        meanwhile; otherwise journal the slot as dead."""
        current = self.pending.get(local)
        if current == gen:
            del self.pending[local]
        if ok and current == gen:
            self.entries[local] = (key, gen)
            self.journal.append(di.Op.SET, local, gen, key)
        else:
            self.journal.append(di.Op.DEL, local, gen)
        if self.walk is not None:
            self.walk.touch(local)

    def invalidate(self, local: int) -> None:
        entry = self.entries.pop(local, None)
        gen = max(entry[1] if entry else 0, self.pending.pop(local, 0))
        if gen:
            self.journal.append(di.Op.DEL, local, gen)
        if self.walk is not None:
            self.walk.touch(local)

    def walk_step(self) -> bool:
        """Take the next slice of the checkpoint under way; once it is whole, queue the
        journal's rotation for it and return True."""
        if self.walk is None or not self.walk.step(self.entries):
            return False
        self.epoch += 1
        self.journal.rotate(self.walk.finish(self.epoch, self.next_gen, self.entries, self.pending))
        self.walk = None
        return True

    def checkpoint_now(self, *, clean: bool = False) -> None:
        """Queue a checkpoint of the whole index at once, superseding one under way (at
        open and close: the flush that reaches it writes it in line)."""
        self.walk = None
        self.epoch += 1
        cp = Checkpoint.of(self.epoch, self.next_gen, self.entries, self.pending, clean=clean)
        self.journal.checkpoint(cp)

    # -- I/O-thread routines -----------------------------------------------------------

    def flush_journal(self, sync: bool) -> int:
        """Write the queued journal records; an errno on failure (logged at a bounded
        rate and counted: the headers stay the truth, so a lost record costs recovery
        time, never bytes). A read-only slab first retries its opening journal."""
        try:
            if self.read_only:
                self._retry_journal()
            self.journal.flush(sync)
        except OSError as exc:
            self.journal_errors += 1
            self._warn("journal write failed: writes to this slab fail until it succeeds", exc)
            return exc.errno or errno.EIO
        return OK

    def sync_all(self) -> int:
        """Sync the slab's data, then write and sync its journal (``batch`` mode's
        periodic sync: a SET record durable means its block is). An errno on failure,
        logged as :meth:`flush_journal` does."""
        try:
            if self._fd >= 0:
                self.io.fdatasync(self._fd)
            self.journal.flush(sync=False)
            self.journal.sync()
        except OSError as exc:
            self.journal_errors += 1
            self._warn("sync failed: blocks written since the last sync are not durable", exc)
            return exc.errno or errno.EIO
        return OK

    def _warn(self, message: str, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            _log.warning(
                message, path=self.journal.path, error=str(exc), failures=self.journal_errors
            )

    def _retry_journal(self) -> None:
        if time.monotonic() - self._retried < _WARN_EVERY_S:
            raise OSError(errno.ENOSPC, f"read-only since start: {self.read_only}")
        self._retried = time.monotonic()
        self.journal.flush(sync=True)
        self.read_only = ""
        _log.info("disk index written: the slab takes writes again", path=self.path)

    def write_chunk(self, jobs: list[WriteJob]) -> list[int]:
        # BEGIN records must be on disk before the slots they announce are overwritten.
        failed = self.flush_journal(self.cfg.sync)
        if failed:
            return [failed] * len(jobs)
        codes = self._by_runs(jobs, write_block, write_run)
        if self.cfg.sync and OK in codes:
            try:
                self.io.fdatasync(self._fd)
            except OSError as exc:
                return [exc.errno or errno.EIO] * len(jobs)
        return codes

    def read_chunk(self, jobs: list[ReadJob]) -> list[int]:
        """Per job, its code (blocks of adjacent slots read together)."""
        return self._by_runs(jobs, read_block, read_run)

    def _by_runs(self, jobs: list[Any], one: Callable[..., int], run: _Run) -> list[int]:
        """Per job, its code: a run of adjacent slots (:func:`runs_with`) moved by ``run``
        in one system call, a lone block by ``one``."""
        fd, size, direct = self._fd, self.data_io, self.o_direct
        codes: list[int] = []
        for start, end in runs_with(jobs, size, direct):
            at = self.offset(jobs[start][0])
            if end - start == 1:
                codes.append(one(self.io, fd, at, jobs[start], size, direct))
            else:
                codes += run(self.io, fd, at, jobs[start:end], size, direct)
        return codes

    # -- open / close (I/O thread) -----------------------------------------------------

    def open_sync(self) -> None:
        """Open or create the slab, probe O_DIRECT, load or rebuild the index.

        :class:`SlabInUse` when another process holds the slab. When the slab cannot be
        preallocated (ENOSPC, EFBIG) it holds no block any more: the file, and the
        journal and snapshot this open created, are removed rather than left behind."""
        created = [p for p in self._own_files() if not os.path.exists(p)]
        self._formatted = False
        try:
            self._lock_fd = self.io.open(self.path, os.O_RDWR | os.O_CREAT)
            di.private(self._lock_fd)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _LOCKED:
                    raise SlabInUse(self.path, exc.errno) from exc
                raise
            fresh = self._prepare_file()
            self._fd = self._probe_direct()
            self.journal.uuid = self.uuid
            resume = self._load_index() if not fresh else None
            if not self._resume_journal(resume):
                self.checkpoint_now()
                self._start_journal()
        except OSError as exc:
            self.close_fds()
            if isinstance(exc, SlabInUse):
                raise
            formatted = self._formatted  # the old blocks are gone: nothing worth keeping
            remove_files([*created, self.path] if formatted else created)
            if isinstance(exc, StoreIOError):
                raise
            path = exc.filename if isinstance(exc.filename, str) else self.path
            if exc.errno in (errno.ENOSPC, errno.EFBIG) and formatted:
                message = (
                    f"cannot preallocate {self.file_bytes:,} bytes for the disk slab"
                    f" ({os.strerror(exc.errno)}; the partial slab was removed)"
                )
                raise StoreIOError(message, path=path, errno=exc.errno) from exc
            raise StoreIOError("cannot open disk slab", path=path, errno=exc.errno) from exc

    def _resume_journal(self, resume: Resume | None) -> bool:
        """Go on with the journal recovery found (no snapshot written at open); whether
        it could (else the caller writes a new snapshot and journal)."""
        if resume is None:
            return False
        try:
            self.journal.resume(self.epoch, *resume)
        except OSError as exc:
            _log.info("cannot go on with the disk journal; writing a new index", error=str(exc))
            return False
        return True

    def _start_journal(self) -> None:
        """Write the opening snapshot and journal. Without room for them (a full file
        system) the slab still serves its blocks, read-only: a write needs its journal
        record on disk first. Writes retry the journal, and resume once there is room."""
        try:
            self.journal.flush(sync=True)
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            self.read_only = os.strerror(exc.errno)
            _log.warning(
                "no room for the disk index: serving this slab's blocks read-only until"
                " space is freed",
                path=self.path,
                error=self.read_only,
                blocks=len(self.entries),
            )

    def _own_files(self) -> list[str]:
        return [self.path, self.journal.path, self.journal.snapshot_path]

    def final_checkpoint(self) -> None:
        """Queue the snapshot that :meth:`close_sync` writes (on the loop's thread, so the
        index cannot change while it is copied). It is the one marked clean."""
        self.checkpoint_now(clean=True)

    def close_sync(self) -> str | None:
        """Persist the index (slab fsync, then the clean snapshot), drop the journal, close
        files. Returns what could not be saved (the next start then rebuilds the index
        from the slab, losing nothing that was written), or None."""
        try:
            if self._fd >= 0:
                self.io.fsync(self._fd)
            self.journal.flush(sync=True)
            self.journal.close(remove=True)
        except OSError as exc:
            return f"the index of {self.path} ({exc.strerror or exc})"
        finally:
            self.close_fds()
        return None

    def close_fds(self) -> None:
        for fd in {self._fd, self._lock_fd} - {-1}:
            self.io.close(fd)
        self.journal.close(remove=False)
        self._fd = self._lock_fd = -1

    def _geometry(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.block_bytes, self.slot_size, c.local_slots, c.dir_index, c.num_dirs)

    def _prepare_file(self) -> bool:
        """Reuse the slab when its superblock records this geometry, resized when only
        its number of slots differs; else format it. Returns whether the slab is freshly
        formatted (nothing to recover)."""
        page = aligned_buffer(ALIGN)
        found = read_superblock(self.io, self._lock_fd, page, self._geometry(), self.path)
        if found is None:
            self.uuid = uuidlib.uuid4().bytes
            self._formatted = True
            geometry = self._geometry()
            format_slab(self.io, self._lock_fd, page, self.file_bytes, geometry, self.uuid)
            return True
        self.uuid = found.uuid
        if found.slots != self.cfg.local_slots:
            self._resize(page, found.slots)
        return False

    def _resize(self, page: memoryview, slots: int) -> None:
        """Grow or shrink a slab formatted for ``slots`` to this config's slots. The new
        superblock is written first: the blocks of slots that are gone are then dropped
        from the index by :meth:`_load_index` (on this open, or on the next one after a
        crash), and the slots kept are where they were."""
        self.resized_from = slots
        if self.cfg.local_slots > slots:
            self.io.allocate(self._lock_fd, self.file_bytes)
        write_superblock(self.io, self._lock_fd, page, self._geometry(), self.uuid)
        if self.cfg.local_slots < slots:
            self.io.truncate(self._lock_fd, self.file_bytes)

    def _probe_direct(self) -> int:
        """A descriptor for block I/O: O_DIRECT if asked for (or "auto") and an aligned
        read and rewrite of the superblock through it succeeds."""
        probe = probe_direct(self.io, self.path, self.cfg.o_direct, self._lock_fd)
        self.o_direct, self.reason = probe.o_direct, probe.reason
        if probe.error is not None:
            raise StoreIOError(self.reason, path=self.path, errno=probe.error.errno) from (
                probe.error
            )
        return probe.fd

    def _load_index(self) -> Resume | None:
        c = self.cfg
        scan = partial(scan_headers, self.io, self._fd, c.local_slots, self.offset, c.block_bytes)
        t0 = time.monotonic()
        found = recover_index(self.journal, self.uuid, self.epoch, scan, self._check, self.path)
        self.entries, self.next_gen, self.epoch = found.entries, found.next_gen, found.epoch
        self.recovery, self.dropped = found.recovery, found.dropped
        self.recovery_stats = {
            "seconds": round(time.monotonic() - t0, 3),
            "verified": found.verified,
            "scanned": found.scanned,
        }
        gone = [local for local in self.entries if local >= c.local_slots]
        for local in gone:  # a shrunk slab (this open's, or one a crash interrupted)
            del self.entries[local]
        self.dropped += len(gone)
        if self.resized_from or gone:
            _log.warning(
                "disk slab resized: the blocks of the slots kept stay"
                if self.resized_from
                else "disk slab shrunk before a crash: the blocks of the slots gone dropped",
                path=self.path,
                slots_before=self.resized_from or None,
                slots=c.local_slots,
                kept=len(self.entries),
                dropped=len(gone),
            )
            return None  # a new snapshot, without the slots gone
        return found.resume

    def _check(self, local: int, gen: int | None) -> bytes | None:
        """:func:`~tierd.stores.disk.opening.check_block` on this slab's ``local``."""
        page = staging(ALIGN + self.data_io)
        return check_block(
            self.io, self._fd, page, self.offset(local), local, gen, self.cfg.block_bytes
        )

    def details(self) -> dict[str, Any]:
        details = {"path": self.path, "o_direct": self.o_direct, "reason": self.reason}
        if self.read_only:
            details["read_only"] = self.read_only
        return details
