"""A tenant's block descriptions across restarts: :class:`BookFile`.

The file (``kv-descriptors.log`` beside the tenant's first disk tier's slab: only that
tier outlives the daemon) is a stream of msgpack records, one per change of the book:
``[key, fields, count, hashes, group_idx]`` for a description, ``[key]`` for one dropped.
Appends go through one writer thread (the loop only queues them); a start reads the file
in a thread, keeps the last record of each key, and writes the survivors to a fresh file
(then renamed over the old one). While running, when the file has grown past four times
the live descriptions plus 8 MiB, the same rewrite is queued behind the appends: the
list of live entries is taken on the loop (a copy of references, O(entries)), the
encoding and writing are the thread's.

Nothing is fsynced: a description lost in a crash only means its block is not announced
(a router then does not credit the node for it), never a wrong announcement; a record
cut short at the end of the file is ignored.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgpack

from tierd.keys import BlockKey
from tierd.kvevents.book import Entry, entry_of, record_of, row_of
from tierd.logs import get_logger

__all__ = ["FILE_NAME", "BookFile", "read_book"]

FILE_NAME = "kv-descriptors.log"
_SLACK = 8 << 20
log = get_logger("tierd.kvevents")


def _record(key: BlockKey, entry: Entry | None) -> bytes:
    return bytes(msgpack.packb([key])) if entry is None else record_of(key, row_of(entry))


def _entry(record: Any) -> Entry:
    return entry_of(record[1:])  # [key, fields, pairs, hashes, group_idx]


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
                elif len(record) == 5:
                    out[key] = _entry(record)
                else:
                    break
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        log.warning("descriptions file read in part", path=str(path), reason=str(exc))
    return out


class BookFile:
    """Appends a book's changes to its file, in a thread of its own."""

    def __init__(self, path: Path, live: Callable[[], Iterable[tuple[BlockKey, bytes]]]) -> None:
        self.path = path
        self._live = live  # the book's rows (DescriptorBook.rows), read on the loop
        self.size = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # why writing stopped, if it did

    def start(self) -> None:
        """Write the live entries as the whole file, then take appends."""
        self._rewrite(list(self._live()))
        self._thread = threading.Thread(target=self._run, name="tierd-kv-book", daemon=True)
        self._thread.start()

    def changed(self, key: BlockKey, entry: Entry | None, live_bytes: int) -> None:
        """On the loop: queue one change (and a rewrite when the file has grown enough)."""
        record = _record(key, entry)
        self.size += len(record)
        self._queue.put(record)
        if self.size > 4 * live_bytes + _SLACK:
            self.size = 0  # counted again by the rewrite
            self._queue.put(("rewrite", list(self._live())))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(open(self.path, "ab"))
            while (item := self._queue.get()) is not None:
                if isinstance(item, tuple):
                    f.close()
                    self._rewrite(item[1])
                    f = stack.enter_context(open(self.path, "ab"))
                    continue
                if self.failed is None:
                    try:
                        f.write(item)
                    except OSError as exc:
                        self.failed = str(exc)
                        log.warning("descriptions not kept", path=str(self.path), reason=str(exc))
                if self._queue.empty():
                    f.flush()

    def _rewrite(self, live: list[tuple[BlockKey, bytes]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                for key, row in live:
                    f.write(record_of(key, row))
                self.size = f.tell()
            os.replace(tmp, self.path)
        except OSError as exc:
            self.failed = str(exc)
            log.warning("descriptions not kept", path=str(self.path), reason=str(exc))
