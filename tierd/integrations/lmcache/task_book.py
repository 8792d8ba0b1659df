"""The LMCache adapter's book of tasks: ids, results and the three event fds.

LMCache's controllers submit tasks and poll for their results after an event fd fires:
stores are popped all at once (``pop_completed_store_tasks``); lookups and loads are
asked by id and answered once. This module owns that state (thread-safe: two controller
threads and the adapter's workers use it) and knows nothing of LMCache's types: a lookup
or load result is a list of flags, turned into LMCache's ``Bitmap`` by the adapter.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from dataclasses import dataclass

__all__ = ["Book", "StoreOutcome"]


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """A finished store task: whether it succeeded and the bytes it wrote."""

    ok: bool
    bytes_written: int


class _Notifier:
    """One eventfd (non-blocking), signalled once per finished task."""

    __slots__ = ("_lock", "fd")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # a closed fd's number may be reused at once

    def signal(self) -> None:
        with self._lock, contextlib.suppress(OSError):  # full: it fires anyway
            if self.fd >= 0:  # closed: nobody waits any more
                os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Book:
    """Task ids, finished results, and the event fds that announce them."""

    def __init__(self) -> None:
        self.store_events = _Notifier()
        self.lookup_events = _Notifier()
        self.load_events = _Notifier()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores: dict[int, StoreOutcome] = {}
        self._lookups: dict[int, list[bool]] = {}
        self._loads: dict[int, list[bool]] = {}
        self.pending = 0  # tasks submitted and not finished yet

    def new_task(self) -> int:
        with self._lock:
            self.pending += 1
            return next(self._ids)

    def stored(self, task: int, outcome: StoreOutcome) -> None:
        with self._lock:
            self._stores[task] = outcome
            self.pending -= 1
        self.store_events.signal()

    def looked_up(self, task: int, found: list[bool]) -> None:
        with self._lock:
            self._lookups[task] = found
            self.pending -= 1
        self.lookup_events.signal()

    def loaded(self, task: int, done: list[bool]) -> None:
        with self._lock:
            self._loads[task] = done
            self.pending -= 1
        self.load_events.signal()

    def pop_stores(self) -> dict[int, StoreOutcome]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def take_lookup(self, task: int) -> list[bool] | None:
        with self._lock:
            return self._lookups.pop(task, None)

    def take_load(self, task: int) -> list[bool] | None:
        with self._lock:
            return self._loads.pop(task, None)

    def close(self) -> None:
        for notifier in (self.store_events, self.lookup_events, self.load_events):
            notifier.close()
