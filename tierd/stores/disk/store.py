"""The disk store: fixed slots in preallocated slab files, one per directory (drive).

Global slot ``s`` lives in slab ``s % len(directories)`` at local slot
``s // len(directories)``, so consecutive slots stripe across drives. Every block is
written as one ``pwritev`` of a header page and its data, and read back checked against
the expected key, generation and checksum (:mod:`tierd.stores.disk.block_format`): a torn, stale
or corrupted block reads as failed, never as wrong bytes.

Each slab (:mod:`tierd.stores.disk.slab`) keeps its slot index in memory, with a journal
of every BEGIN, SET and DEL since the last snapshot of that index
(:mod:`tierd.stores.disk.journal`, :mod:`tierd.stores.disk.index`); a write's BEGIN
record is in the journal file before its block is written. Opening a slab
(:mod:`tierd.stores.disk.opening`) takes the snapshot a clean close wrote as it stands; after
a crash it replays the snapshot and journal and reads only the slots they leave open
(writes in flight); only without a usable snapshot and journal does it read every slot's
header. :meth:`DiskStore.index` then lists what survived, for the tier above to adopt.
Checkpoints are taken while serving, a slice per loop turn, and their snapshots written
on a thread of their own, never inside a write (:mod:`tierd.stores.disk.checkpoints`).

I/O runs on two thread pools, reads apart from writes, so loads never queue behind
write-back; a batch is cut into chunks per slab of up to ``blocks_per_task`` blocks (by
default :data:`READ_TASK_BLOCKS` for reads and :data:`WRITE_TASK_BYTES` of blocks for
writes: each written chunk costs two syncs under ``fsync: always``), one thread hop per
chunk, up to ``read_threads`` / ``write_threads`` chunks in flight
(:mod:`tierd.stores.disk.threads`). O_DIRECT is used where the file system accepts it
(probed once per slab at open); caller buffers that are page-aligned and a multiple of
4096 bytes long (CPU pool slots) are read into and written from directly, anything else
goes through a per-thread aligned staging buffer. Under buffered I/O no staging is needed.

Durability (``fsync``): ``"always"`` syncs the journal before a batch's data is written
and fdatasyncs the slab after it, before the write is acknowledged; ``"batch"`` syncs
data then journal at most ``fsync_interval`` seconds after a write; ``"none"`` leaves both
to the page cache. What a crash loses in each mode is :mod:`tierd.stores.disk.io`'s
docstring; checksums make the worst case a miss.

Threads. The event loop owns the bookkeeping: each slab's slot index (a write's
generation begun and committed, an invalidation, a read's look-up), the counters, the
operations in flight and the checkpoints' walks. The reader and writer threads run only
the blocking routines (:class:`~tierd.stores.disk.slab.Slab`'s ``*_chunk``, ``*_sync``
and ``flush_journal``) on the slots and buffers the loop handed them, and never touch an
index. Shared: each slab's journal, whose records the loop queues and a writer thread
writes, in order, under the journal's lock; its snapshots, written one at a time under
the journal's snapshot lock on the snapshot thread; a slab's journal error count and
read-only reason, set by the thread that met the error and read on the loop without a
lock (a figure and a flag); and the set of background journal flushes, added to on the
loop and discarded from by each flush's done callback (single set operations, atomic
under the GIL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

import numpy as np

from tierd.keys import BlockKey, Medium
from tierd.logs import get_logger
from tierd.stores.base import (
    BlockStore,
    Buffer,
    InFlight,
    StoreStats,
    background_priority,
    block_views,
    device_rows,
)
from tierd.stores.disk.block_format import BAD_BLOCK, OK
from tierd.stores.disk.checkpoints import Checkpoints
from tierd.stores.disk.io import FileIO, Fsync, PeriodicSync
from tierd.stores.disk.slab import Slab, SlabConfig
from tierd.stores.disk.threads import Chunking, run_chunks

_log = get_logger("tierd.disk")

__all__ = ["READ_TASK_BLOCKS", "WRITE_TASK_BYTES", "DiskStore"]

READ_TASK_BLOCKS = 8  # blocks one read chunk holds at most (unless blocks_per_task says)
# Bytes one write chunk may hold, or READ_TASK_BLOCKS blocks when that is more (unless
# blocks_per_task says): blocks of adjacent slots go in one pwritev, and under
# fsync always a chunk costs two syncs. In-process, 128 KiB blocks were written at
# 1.0 GB/s in chunks of 8 blocks and at 1.4-1.65 GB/s in chunks of 64.
WRITE_TASK_BYTES = 8 << 20


def _from_numpy(array: np.ndarray[Any, Any]) -> Any:
    import torch  # only reached with device rows in hand: torch is loaded

    return torch.from_numpy(array)


class DiskStore(BlockStore):
    """Block store over slab files; see the module docstring for the guarantees.

    Beyond :class:`BlockStore` it offers :meth:`index` (the blocks readable after open,
    so the tier above can be rebuilt on restart), :meth:`invalidate` and :meth:`sync`.
    """

    medium = Medium.DISK

    def __init__(
        self,
        *,
        num_blocks: int,
        block_bytes: int,
        directories: Sequence[str | Any],
        o_direct: bool | Literal["auto"] = "auto",
        read_threads: int = 4,
        write_threads: int = 2,
        blocks_per_task: int | None = None,
        fsync: Fsync | str = Fsync.ALWAYS,
        fsync_interval: float = 1.0,
        journal_limit_bytes: int = 16 << 20,
        fileio: FileIO | None = None,
    ) -> None:
        super().__init__(num_blocks=num_blocks, block_bytes=block_bytes)
        if not directories:
            raise ValueError("a disk store needs at least one directory")
        if o_direct not in ("auto", True, False):
            raise ValueError(f"o_direct must be 'auto', True or False, got {o_direct!r}")
        if fsync not in _MODES:
            raise ValueError(f"fsync must be 'always', 'batch' or 'none', got {fsync!r}")
        per_read, per_write = (
            READ_TASK_BLOCKS,
            max(READ_TASK_BLOCKS, WRITE_TASK_BYTES // block_bytes),
        )
        if blocks_per_task is not None:
            per_read = per_write = blocks_per_task
        if min(read_threads, write_threads, per_read) < 1:
            raise ValueError("thread counts and blocks_per_task must be positive")
        self.directories = [str(d) for d in directories]
        self._n = len(self.directories)
        self._reading = Chunking(read_threads, per_read)
        self._writing = Chunking(write_threads, per_write)
        self._fsync = _MODES[fsync]
        self._periodic: PeriodicSync | None = None
        if self._fsync is Fsync.BATCH:
            self._periodic = PeriodicSync(fsync_interval, self._sync_soon)
        self._journal_limit = journal_limit_bytes
        io = fileio or FileIO()
        self._slabs = [self._make_slab(i, d, o_direct, io) for i, d in enumerate(self.directories)]
        self._readers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None
        self._snapshots: ThreadPoolExecutor | None = None
        self._checkpoints: Checkpoints | None = None  # made with the pools, at open
        self._in_flight = InFlight()  # reads and writes in progress
        self._journal_flushes: set[Future[int]] = set()
        self._counts = dict.fromkeys(
            (
                "bytes_written",
                "bytes_read",
                "write_errors",
                "read_errors",
                "checksum_failures",
                "index_misses",
            ),
            0,
        )

    def _make_slab(self, i: int, directory: str, o_direct: bool | str, io: FileIO) -> Slab:
        cfg = SlabConfig(
            directory=directory,
            dir_index=i,
            num_dirs=self._n,
            local_slots=len(range(i, self.num_blocks, self._n)),
            block_bytes=self.block_bytes,
            o_direct=o_direct,
            sync=self._fsync is Fsync.ALWAYS,
        )
        return Slab(cfg, io)

    # -- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        self._readers = ThreadPoolExecutor(self._reading.threads, thread_name_prefix="tierd-disk-r")
        # Writes (demotions, flushes) and snapshots are bulk work: below the loop's priority.
        self._writers = ThreadPoolExecutor(
            self._writing.threads,
            thread_name_prefix="tierd-disk-w",
            initializer=background_priority,
        )
        self._snapshots = ThreadPoolExecutor(
            1, thread_name_prefix="tierd-disk-snap", initializer=background_priority
        )
        self._checkpoints = Checkpoints(
            self._slabs, self._journal_limit, self._flush_soon, self._snapshots
        )
        loop = asyncio.get_running_loop()
        opens = [loop.run_in_executor(self._readers, s.open_sync) for s in self._slabs]
        results = await asyncio.gather(*opens, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for slab in self._slabs:
                slab.close_fds()
            self._shutdown_pools()
            raise failures[0]

    async def _close(self) -> None:
        await self._in_flight.idle()  # the base class already refuses new reads and writes
        loop = asyncio.get_running_loop()
        try:
            if self._checkpoints is not None:  # the clean snapshot below supersedes its work
                await self._checkpoints.close()
            if self._periodic is not None:
                await self._periodic.close()
            for fut in list(self._journal_flushes):
                await asyncio.wrap_future(fut)
            for slab in self._slabs:
                slab.final_checkpoint()
            unsaved = await asyncio.gather(
                *(loop.run_in_executor(self._writers, s.close_sync) for s in self._slabs)
            )
            for what in filter(None, unsaved):
                _log.error(
                    "could not save the disk index; the next start rebuilds it from the"
                    " slab (every block written stays readable)",
                    unsaved=what,
                )
        finally:
            for slab in self._slabs:
                slab.close_fds()
            self._shutdown_pools()

    def _shutdown_pools(self) -> None:
        for pool in (self._readers, self._writers, self._snapshots):
            if pool is not None:
                pool.shutdown(wait=False)

    # -- index -------------------------------------------------------------------------

    def index(self) -> dict[int, BlockKey]:
        """Slot -> key of every block that is readable now (after open: what survived)."""
        n = self._n
        if n == 1:  # at C speed: a restart adopts millions of blocks
            return dict(self._slabs[0].entries.keys_of)  # type: ignore[arg-type]
        out: dict[int, bytes] = {}
        for d, slab in enumerate(self._slabs):
            out.update((local * n + d, key) for local, key in slab.entries.keys_of.items())
        return out  # type: ignore[return-value]  # BlockKey is bytes at run time

    def invalidate(self, slots: Sequence[int]) -> None:
        """Make ``slots`` unreadable now (also after a restart, once the journal holds it;
        the next write batch, :meth:`sync` or :meth:`close` writes it)."""
        self._check(slots, None)
        for slot in slots:
            self._slabs[slot % self._n].invalidate(slot // self._n)

    async def sync(self) -> None:
        """Finish the checkpoints under way, write the journal of every slab (unless
        ``fsync`` is ``"none"``, sync the slabs' data, then their journals) and the
        snapshots due (one waiting out its retry time stays due)."""
        self._check((), None)
        if self._checkpoints is not None:
            await self._checkpoints.finish_walks()
        if self._fsync is Fsync.NONE:
            await run_chunks(self._writers, [partial(_flush, s, False) for s in self._slabs])
        else:
            await run_chunks(self._writers, [partial(_sync, s) for s in self._slabs])
        if self._checkpoints is not None:
            await self._checkpoints.write_due()

    def _sync_soon(self) -> Future[object]:
        """Start a sync of every slab (``batch`` mode's periodic one) on a writer thread."""
        if self._writers is None:
            raise RuntimeError("the disk store's thread pools are gone")
        slabs = self._slabs
        return self._writers.submit(lambda: [s.sync_all() for s in slabs])

    # -- data --------------------------------------------------------------------------

    async def _write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        with self._in_flight.tracked():
            return await self._write_batch(slots, keys, data)

    async def _read(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]:
        with self._in_flight.tracked():
            return await self._read_batch(slots, keys, out)

    async def _write_batch(
        self, slots: Sequence[int], keys: Sequence[BlockKey], data: Sequence[Buffer] | Any
    ) -> list[bool]:
        bb = self.block_bytes
        rows = device_rows(data, len(slots), bb)
        if rows is not None:  # the disk only moves host memory: bounce device tensors
            data = [row.cpu() for row in rows]
        views = block_views(data, len(slots), bb, writable=False)
        n = self._n
        plan = [(self._slabs[s % n], s // n, k) for s, k in zip(slots, keys, strict=True)]
        gens = [slab.begin(local) for slab, local, _ in plan]
        jobs = [
            (slab, (local, bytes(k), g, v))
            for (slab, local, k), g, v in zip(plan, gens, views, strict=True)
        ]
        codes: list[int] | None = None
        try:
            codes = await self._writing.run(self._writers, jobs, write=True)
        finally:
            ok = [False] * len(plan) if codes is None else [c == OK for c in codes]
            for (slab, local, key), gen, good in zip(plan, gens, ok, strict=True):
                slab.commit(local, bytes(key), gen, good)
            self._after_write(ok)
        return ok

    def _after_write(self, ok: list[bool]) -> None:
        good = sum(ok)
        self._counts["bytes_written"] += good * self.block_bytes
        self._counts["write_errors"] += len(ok) - good
        # The SET records need not be durable before the caller goes on (a lost one only
        # means a checksum pass at recovery), so they are flushed in the background.
        if self._writers is None:
            return
        for slab in self._slabs:
            if slab.journal.dirty:
                self._flush_soon(slab)
        if self._checkpoints is not None:
            self._checkpoints.after_write()
        if self._periodic is not None:
            self._periodic.written()

    def _flush_soon(self, slab: Slab) -> Future[int]:
        if self._writers is None:
            raise RuntimeError("the disk store's thread pools are gone")
        fut = self._writers.submit(slab.flush_journal, self._fsync is Fsync.ALWAYS)
        self._journal_flushes.add(fut)
        fut.add_done_callback(self._journal_flushes.discard)
        return fut

    async def _read_batch(
        self, slots: Sequence[int], keys: Sequence[BlockKey], out: Sequence[Buffer] | Any
    ) -> list[bool]:
        bb = self.block_bytes
        rows = device_rows(out, len(slots), bb)
        host = np.empty((len(slots), bb), dtype=np.uint8) if rows is not None else out
        views = block_views(host, len(slots), bb, writable=True)
        results = [False] * len(slots)
        jobs: list[tuple[Slab, tuple[int, bytes, int, Any]]] = []
        where: list[int] = []
        for i, (slot, key) in enumerate(zip(slots, keys, strict=True)):
            slab, local = self._slabs[slot % self._n], slot // self._n
            entry = slab.entries.get(local)
            if entry is None or entry[0] != key:
                self._counts["index_misses"] += 1
                continue
            jobs.append((slab, (local, bytes(key), entry[1], views[i])))
            where.append(i)
        codes = await self._reading.run(self._readers, jobs, write=False) if jobs else []
        for i, code in zip(where, codes, strict=True):
            results[i] = code == OK
            if code == OK and rows is not None:
                rows[i].copy_(_from_numpy(host[i]))
        self._counts["bytes_read"] += sum(results) * bb
        self._counts["checksum_failures"] += codes.count(BAD_BLOCK)
        self._counts["read_errors"] += sum(1 for c in codes if c > 0)
        return results

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        c = self._counts
        slabs = self._slabs
        return StoreStats(
            medium=self.medium,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            bytes_written=c["bytes_written"],
            bytes_read=c["bytes_read"],
            write_errors=c["write_errors"],
            read_errors=c["read_errors"],
            details={
                "o_direct": all(s.o_direct for s in slabs),
                "reason": "; ".join(sorted({s.reason for s in slabs})),
                "files": [s.path for s in slabs],
                "slabs": [s.details() for s in slabs],
                "checksum_failures": c["checksum_failures"],
                "index_misses": c["index_misses"],
                "journal_errors": sum(s.journal_errors for s in slabs),
                "snapshot_failures": self._checkpoints.failures if self._checkpoints else 0,
                "fsync": str(self._fsync),
                "periodic_syncs": self._periodic.syncs if self._periodic else 0,
                "slot_bytes": slabs[0].slot_size,
                "recovery": [s.recovery for s in slabs],
                "recovery_details": [s.recovery_stats for s in slabs],
                "blocks": sum(len(s.entries) for s in slabs),
                "dropped_blocks": sum(s.dropped for s in slabs),
            },
        )


def _flush(slab: Slab, sync: bool) -> list[int]:
    return [slab.flush_journal(sync)]


def _sync(slab: Slab) -> list[int]:
    return [slab.sync_all()]


# "never" is the name "none" had before ``always`` and ``batch`` were told apart.
_MODES: dict[str, Fsync] = {**{m.value: m for m in Fsync}, "never": Fsync.NONE}
