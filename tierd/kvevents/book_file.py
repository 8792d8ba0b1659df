"""A tenant's block descriptions across restarts: :class:`BookFile`.

The file (``kv-descriptors.log`` beside the tenant's first disk tier's slab: only that
tier outlives the daemon) is a stream of msgpack records, one per change of the book:
``[key, fields, count, hashes, group_idx]`` for a description, ``[key]`` for one dropped.
Appends go through one writer thread (the loop gathers them and hands them over
:data:`HAND_S` after the first, or at :data:`HAND_BYTES`: one write and one wake-up of
the thread for many, not one each; not longer, so that a description a router was sent
is on file a moment later, and a restart, even after SIGKILL, announces its block again);
a start reads the file
in a thread, keeps the last record of each key, and the writer writes the survivors to a
fresh file (then renamed over the old one). While running, when the file has grown past four times
the live descriptions plus 8 MiB, it is rewritten the same way behind the appends: the
thread starts a fresh file, the loop hands it the live descriptions a part a turn (some
16,000: a full book's taken at once would hold the loop), and the thread renames it over
the old one after the last part. Appends meanwhile go to the fresh file, between the
parts: each part is the book as it is when taken, and each change after the rewrite
began has its record after it, so the last record of each key is still its last word.

Nothing is fsynced: a description lost in a crash (the daemon's: those of its last
:data:`HAND_S`; the machine's: what the kernel had not written yet) only means its block
is not announced (a router then does not credit the node for it), never a wrong
announcement; a record cut short at the end of the file is ignored.

Threads. The loop owns the appends gathered, their hand-over timer and a rewrite's parts
not handed over yet (the book's rows are read a part at a time on the loop, never by the
writer). The writer thread owns the file and its temporary. They share the writer's queue
(a ``queue.SimpleQueue``, locked by itself), which carries appends, a rewrite's parts
(lists the loop no longer touches) and its bounds, in order; and two fields written
without a lock: ``size`` (the loop adds each record, the writer sets the file's size at a
rewrite's end: an estimate of when to rewrite, no more) and ``failed`` (set by the writer,
read by anyone).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from tierd.keys import BlockKey
from tierd.kvevents.book import Entry, entry_of, record_of
from tierd.logs import get_logger

__all__ = ["FILE_NAME", "BookFile", "read_book"]

FILE_NAME = "kv-descriptors.log"
HAND_S = 0.05  # appends gathered on the loop for the writer at most this long,
HAND_BYTES = 1 << 20  # or up to these bytes
_SLACK = 8 << 20
_BEGIN, _END = object(), object()  # a rewrite's bounds in the writer's queue
_Rows = list[tuple[BlockKey, bytes]]
log = get_logger("tierd.kvevents")


def _entry(record: Any) -> Entry | None:
    """The entry of a description's record (``[key, fields, pairs, hashes, group_idx]``),
    None when its items are not what :func:`tierd.kvevents.wire.describe` makes (events
    are made from them as they are)."""
    _, fields, pairs, hashes, group = record
    if (
        type(fields) is not bytes
        or type(hashes) is not bytes
        or type(pairs) is not int
        or not 0 < pairs < 128
        or (group is not None and type(group) is not int)
    ):
        return None
    return entry_of(record[1:])


def read_book(path: Path) -> dict[BlockKey, Entry]:
    """The descriptions the file holds (the last record of each key wins)."""
    out: dict[BlockKey, Entry] = {}
    try:
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=64 << 20)
            for record in unpacker:
                if not isinstance(record, list) or not record or not isinstance(record[0], bytes):
                    break  # not ours: stop at the first bad record
                key = BlockKey(record[0])
                if len(record) == 1:
                    out.pop(key, None)
                elif len(record) == 5 and (entry := _entry(record)) is not None:
                    out[key] = entry
                else:
                    break
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        log.warning("descriptions file read in part", path=str(path), reason=str(exc))
    return out


class BookFile:
    """Appends a book's changes to its file, in a thread of its own."""

    def __init__(self, path: Path, parts: Callable[[], Iterator[_Rows]]) -> None:
        self.path = path
        self._parts = parts  # the book's rows in parts (DescriptorBook.row_parts), on the loop
        self._pending: Iterator[_Rows] | None = None  # a rewrite's parts not handed over yet
        self.size = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._records: list[bytes] = []  # appends not handed to the writer yet
        self._records_bytes = 0
        self._hand: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # why writing stopped, if it did

    def start(self) -> None:
        """Write the live entries as the whole file (a rewrite, its parts handed over at
        once), then take appends."""
        self._begin_rewrite()
        self.settle()
        self._thread = threading.Thread(target=self._run, name="tierd-kv-book", daemon=True)
        self._thread.start()

    def changed(self, records: list[bytes], live_bytes: int) -> None:
        """On the loop: queue the records of some changes (the book's ``on_records``), and
        a rewrite when the file has grown enough."""
        size = sum(map(len, records))
        self.size += size
        self._records += records
        self._records_bytes += size
        if self._records_bytes >= HAND_BYTES:
            self._hand_records()
        elif self._hand is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (the book used in-process): at once
                self._hand_records()
            else:
                self._hand = loop.call_later(HAND_S, self._hand_records)
        if self.size > 4 * live_bytes + _SLACK and self._pending is None:
            self._begin_rewrite()
            try:
                asyncio.get_running_loop().call_soon(self._part_a_turn)
            except RuntimeError:  # no loop (the book used in-process): all at once
                self.settle()

    def settle(self) -> None:
        """On the loop: hand over the appends gathered and the parts of a rewrite under
        way at once (to close)."""
        self._hand_records()
        while self._pending is not None:
            self._hand_part()

    def close(self) -> None:
        """From any thread (after :meth:`settle` on the loop): write what is queued, stop."""
        if self._thread is not None:
            self._queue_records()  # (the loop's timer, if any, finds none left)
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _hand_records(self) -> None:
        """On the loop: the appends gathered, to the writer as one."""
        if self._hand is not None:
            self._hand.cancel()
            self._hand = None
        self._queue_records()

    def _queue_records(self) -> None:
        if self._records:
            records, self._records, self._records_bytes = self._records, [], 0
            self._queue.put(b"".join(records))

    def _put(self, item: Any) -> None:
        self._hand_records()
        self._queue.put(item)

    def _begin_rewrite(self) -> None:
        self.size = 0  # counted again by the rewrite
        self._put(_BEGIN)
        self._pending = iter(self._parts())

    def _part_a_turn(self) -> None:
        self._hand_part()
        if self._pending is not None:
            asyncio.get_running_loop().call_soon(self._part_a_turn)

    def _hand_part(self) -> None:
        """The rewrite's next part to the writer (after the last, its end)."""
        if self._pending is None:
            return
        part = next(self._pending, None)
        if part is None:
            self._pending = None
            self._put(_END)
        else:
            self._put(part)

    def _run(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        f = open(self.path, "ab")  # noqa: SIM115  (reopened by each rewrite)
        try:
            while (item := self._queue.get()) is not None:
                if self.failed is not None:
                    continue
                try:
                    if item is _BEGIN:
                        f.close()
                        f = open(tmp, "wb")  # noqa: SIM115
                    elif item is _END:
                        f.flush()
                        os.replace(tmp, self.path)  # f writes on, now as the file
                        self.size = f.tell()
                    elif isinstance(item, list):
                        _write_rows(f, item)
                    else:
                        f.write(item)
                    if self._queue.empty():
                        f.flush()
                except OSError as exc:
                    self._failed(exc)
        finally:
            f.close()

    def _failed(self, exc: OSError) -> None:
        self.failed = str(exc)
        log.warning("descriptions not kept", path=str(self.path), reason=str(exc))


def _write_rows(f: BinaryIO, rows: _Rows) -> None:
    f.write(b"".join([record_of(key, row) for key, row in rows]))
