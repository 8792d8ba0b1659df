"""tierd as an L2 adapter of LMCache's multi-process server (LMCache 0.5.6 and 0.5.7).

LMCache loads it by module path (``docs/lmcache.md`` has the JSON to paste)::

    --l2-adapter '{"type": "plugin", "module_path": "tierd.integrations.lmcache",
        "class_name": "TierdL2Adapter", "adapter_params": {"socket": "/run/tierd.sock"}}'

LMCache's two controller threads submit tasks and return at once; the adapter runs each
task on one of its worker threads and announces it on the event fd of its kind. Every
task finishes within ``deadline_s`` of its submission (then as a failed store, or misses)
whatever the daemon does: dead, stopped (SIGSTOP) or restarted; while a daemon is away a
breaker answers at once. No call raises into LMCache's threads, and no task is left
unfinished (``close()`` fails what is still queued).

Objects must be the daemon's ``block_bytes``: another size fails its task with a log line
naming the value to set. A lookup-and-lock pins the blocks it finds in the daemon's pool
until LMCache unlocks them; a load copies from those pins (or pins afresh) into LMCache's
memory objects on the worker, before the task is reported. ``delete`` deletes through the
daemon; ``get_usage`` reports the bytes the daemon holds in this adapter's namespaces
(``tierd`` owns eviction, so the capacity is 0: LMCache does not evict for it).

This module needs LMCache (``scripts/setup_lmcache``); nothing else in tierd imports it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from tierd.config import default_socket_path
from tierd.integrations.core.params import checked_params
from tierd.integrations.lmcache.task_book import Book, StoreOutcome
from tierd.integrations.lmcache.tasks import Tasks

try:  # LMCache 0.5.7 tags every adapter's medium; 0.5.6 has no such types
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags
except ImportError:  # pragma: no cover - depends on the installed LMCache
    MemoryTags = None

__all__ = ["LmcacheSettings", "TierdL2Adapter", "TierdL2AdapterConfig"]


@dataclass(frozen=True, slots=True)
class LmcacheSettings:
    """The adapter's ``adapter_params``."""

    socket: str | None = None
    namespace: str = ""  # a tag the bytes also depend on (serde, chunk size, KV dtype)
    block_bytes: int | None = None  # the object size LMCache will use; checked at start
    deadline_s: float = 2.0
    breaker_failures: int = 3
    reconnect_max_s: float = 5.0
    server_uids: tuple[int, ...] = ()
    workers: int = 2
    max_namespaces: int = 16

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> LmcacheSettings:
        given = checked_params(
            cls,
            dict(params or {}),
            owner="tierd's L2 adapter",
            unknown_what="unknown adapter_params of tierd's L2 adapter",
            doc="docs/lmcache.md",
            positive=("deadline_s", "reconnect_max_s"),
        )
        for name in ("workers", "max_namespaces", "block_bytes"):
            if given.get(name) is not None and int(given[name]) < 1:
                raise ValueError(f"tierd's L2 adapter: {name} must be >= 1")
        return cls(**given)


class TierdL2AdapterConfig(L2AdapterConfigBase):
    """LMCache's config object for the adapter (found as ``<class_name>Config``)."""

    def __init__(self, settings: LmcacheSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierdL2AdapterConfig:
        return cls(LmcacheSettings.from_params(d))

    @classmethod
    def help(cls) -> str:
        return (
            "tierd L2 adapter (adapter_params): socket (the daemon's control socket; "
            "default: tierd's default path), namespace (a tag the bytes depend on, e.g. "
            "serde or chunk size), block_bytes (LMCache's object size, checked against the "
            "daemon's at start), deadline_s (per task, default 2.0), breaker_failures, "
            "reconnect_max_s, server_uids, workers, max_namespaces. See docs/lmcache.md."
        )


class TierdL2Adapter(L2AdapterInterface):
    """An L2 adapter backed by a running ``tierd serve``."""

    def __init__(
        self, config: TierdL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None
    ) -> None:
        super().__init__(max_capacity_bytes=0)
        if isinstance(config, dict):
            config = TierdL2AdapterConfig.from_dict(config)
        self.settings = config.settings
        self.socket_path = str(self.settings.socket or default_socket_path())
        self._book = Book()
        self._tasks = Tasks(self.settings, self.socket_path)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.settings.workers, thread_name_prefix="tierd-lmcache"
        )
        self._closed = False
        self._submit_lock = threading.Lock()
        self._tasks.start()

    # -- event fds ------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._book.store_events.fd

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._book.lookup_events.fd

    def get_load_event_fd(self) -> int:
        return self._book.load_events.fd

    # -- tasks ----------------------------------------------------------------------------

    def _submit(self, work: Callable[[float], Any], finish: Callable[[Any], None]) -> None:
        """Run ``work(expires)`` on a worker, then ``finish(result)``; ``finish(None)``
        (a failed task) when the adapter is closed or ``work`` failed."""
        expires = time.monotonic() + self.settings.deadline_s

        def run() -> None:
            finish(self._tasks.guarded(lambda: work(expires)))

        with self._submit_lock:
            if not self._closed:
                try:
                    self._pool.submit(run)
                    return
                except RuntimeError:  # the pool was shut down meanwhile
                    pass
        finish(None)

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = self._book.new_task()

        def finish(written: int | None) -> None:
            if written is not None:  # listeners hear before LMCache can pop the result
                self._tasks.guarded(lambda: self._stored_keys(keys, objects))
            self._book.stored(task, StoreOutcome(written is not None, written or 0))

        self._submit(lambda at: self._tasks.store(keys, objects, at), finish)
        return task

    def _stored_keys(self, keys: list[Any], objects: list[Any]) -> None:
        self._notify_keys_stored(list(keys), [int(obj.get_size()) for obj in objects])

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        return {
            task: L2StoreResult(outcome.ok, outcome.bytes_written)
            for task, outcome in self._book.pop_stores().items()
        }

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        task = self._book.new_task()

        def finish(found: list[bool] | None) -> None:
            self._book.looked_up(task, found or [False] * len(keys))

        self._submit(lambda at: self._tasks.lock(keys, at), finish)
        return task

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return _bitmap(self._book.take_lookup(task_id))

    def submit_unlock(self, keys: list[Any]) -> None:
        self._tasks.guarded(lambda: self._tasks.unlock(keys))

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = self._book.new_task()

        def finish(done: list[bool] | None) -> None:
            done = done or [False] * len(keys)
            self._book.loaded(task, done)
            hits = [key for key, ok in zip(keys, done, strict=True) if ok]
            if hits:
                self._notify_keys_accessed(hits)

        self._submit(lambda at: self._tasks.load(keys, objects, at), finish)
        return task

    def query_load_result(self, task_id: int) -> Any:
        return _bitmap(self._book.take_load(task_id))

    # -- the rest -------------------------------------------------------------------------

    def submit_touch(self, keys: list[Any]) -> None:
        """LMCache 0.5.7: ``keys`` were used; the daemon is told (never blocks)."""
        self._tasks.guarded(lambda: self._tasks.touch(keys))
        parent = getattr(super(), "submit_touch", None)
        if parent is not None:
            parent(keys)

    def get_memory_tags(self) -> Any:
        """LMCache 0.5.7: the blocks live in this host's memory (spilling to its disks)."""
        if MemoryTags is None:
            raise NotImplementedError("memory tags need LMCache 0.5.7")
        return MemoryTags(MemorySegment.DRAM, MemoryResidency.LOCAL)

    def delete(self, keys: list[Any]) -> None:
        self._tasks.guarded(lambda: self._tasks.delete(keys))
        self._notify_keys_deleted(list(keys), [0] * len(keys))

    def get_usage(self) -> AdapterUsage:
        """The bytes the daemon holds in this adapter's namespaces (as of its last answer,
        asked at most once a second), per cache salt; capacity 0: tierd evicts."""
        by_salt = self._tasks.guarded(self._tasks.usage) or {}
        return AdapterUsage(
            total_bytes_used=sum(by_salt.values()),
            total_capacity_bytes=0,
            bytes_by_cache_salt=MappingProxyType({k: v for k, v in by_salt.items() if v}),
        )

    def report_status(self) -> dict[str, Any]:
        status = self._tasks.status()
        status["pending_tasks"] = self._book.pending
        status["closed"] = self._closed
        status["is_healthy"] = bool(status["is_healthy"]) and not self._closed
        return status

    def close(self) -> None:
        """Finish every task (queued ones fail at once), close the connections and the
        event fds (idempotent)."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        self._tasks.closing()
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._tasks.close()
        self._book.close()


def _bitmap(flags: list[bool] | None) -> Any:
    if flags is None:
        return None
    bitmap = Bitmap(len(flags))
    bitmap.batched_set([i for i, flag in enumerate(flags) if flag])
    return bitmap
