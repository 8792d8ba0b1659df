"""tierd as SGLang's HiCache storage backend (L3), for SGLang 0.5.23.

SGLang loads the class by module path (``docs/sglang.md`` has the flags to paste)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tierd",
        "module_path": "tierd.integrations.sglang", "class_name": "TierdHiCache",
        "interface_v1": 1, "socket": "/run/user/1000/tierd/tierd.sock"}'

SGLang calls a backend synchronously from its storage threads (prefetch and backup).
Every call runs on the calling thread's own blocking connection, down the data path
:mod:`tierd.integrations.core.route` picks (:mod:`tierd.integrations.sglang.page_jobs`), and waits
on the daemon at most a short deadline (``lookup_deadline_s`` for ``batch_exists``,
``job_deadline_s`` for the rest), then answers a miss or a failed set; after repeated
failures a breaker answers at once until the daemon is back (the
:class:`~tierd.integrations.core.link.DaemonLink` probes it). No call raises into SGLang (after
``close()`` too): a daemon that did not serve a call costs a miss, counted; an error of
the backend's own code (a bug) costs a miss too, counted and logged with its traceback
(:class:`~tierd.integrations.core.engine_log.Faults`), never a quiet one. A page is only
reported loaded when its bytes are the daemon's bytes for that key, and stored when the
daemon holds it. ``clear()`` deletes the namespace's blocks from the daemon. The backend
logs through the standard logging SGLang configures (:mod:`~tierd.integrations.core.engine_log`).

This module needs SGLang (``scripts/setup_sglang``); nothing else in tierd imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransferResult,
)

from tierd.config import default_socket_path
from tierd.errors import TierdError
from tierd.integrations.core.engine_calls import Unconfirmed
from tierd.integrations.core.engine_log import EngineLog, Faults
from tierd.integrations.core.link import BlockSizeMismatch, DaemonLink, LinkSettings
from tierd.integrations.core.one_flag import missing_daemon
from tierd.integrations.core.params import checked_params, size_advice, start_refusal
from tierd.integrations.sglang.page_jobs import PageJobs
from tierd.integrations.sglang.pages import (
    PageGeometry,
    UnsupportedPool,
    derive_namespace,
    ignored_allocator,
    page_facts,
    page_key,
    prefix_keys,
)
from tierd.integrations.sglang.storage_metrics import Counters, tensor_bytes

__all__ = ["SglangSettings", "TierdHiCache", "UnsupportedPool"]

# SGLang configures the standard logging, not structlog: the lines go where SGLang's do.
log = EngineLog("tierd.integrations.sglang")
T = TypeVar("T")

# Keys of the extra config that SGLang itself reads; they are not ours to check.
_SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size"}
    # SGLang's own, which it takes out before the backend sees the config (tolerated):
    | {"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token"}
    | {"hicache_storage_pass_prefix_keys"}
)


@dataclass(frozen=True, slots=True)
class SglangSettings:
    """The backend's keys of ``--hicache-storage-backend-extra-config``."""

    socket: str | None = None
    namespace: str | None = None  # adds to the derived digest, never replaces it
    lookup_deadline_s: float = 0.1
    job_deadline_s: float = 2.0
    # A clear deletes a whole namespace, in slices the daemon serves between other requests.
    clear_deadline_s: float = 30.0
    breaker_failures: int = 3
    connect_timeout_s: float = 5.0
    reconnect_max_s: float = 10.0
    server_uids: tuple[int, ...] = ()
    zero_copy: bool = True  # may hand the host pool's memfd to a daemon without a pool

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> SglangSettings:
        ours = checked_params(
            cls,
            {k: v for k, v in (extra or {}).items() if k not in _SGLANG_KEYS},
            owner="tierd's HiCache extra config",
            unknown_what="unknown keys in tierd's HiCache extra config",
            doc="docs/sglang.md",
            positive=(
                "lookup_deadline_s",
                "job_deadline_s",
                "clear_deadline_s",
                "connect_timeout_s",
            ),
        )
        return cls(**ours)


class TierdHiCache(HiCacheStorage):
    """A HiCache storage backend backed by a running ``tierd serve``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = SglangSettings.from_extra(storage_config.extra_config)
        self.socket_path = str(self.settings.socket or default_socket_path())
        self.is_writer = bool(storage_config.is_storage_writer)
        self.namespace: str | None = None
        self.counters = Counters()
        self.faults = Faults(log)
        self._jobs: PageJobs | None = None
        self._link: DaemonLink | None = None
        self._closed = False  # after close() every call answers a miss or a failure

    # -- start-up ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the pages' geometry, derive the namespace and connect; refuses (raises,
        so SGLang does not start) a pool or a daemon it cannot serve exactly."""
        super().register_mem_pool_host(mem_pool_host)
        if ignored_allocator(self.storage_config.extra_config, mem_pool_host):
            log.warning(
                'tierd HiCache: the extra config asks for "allocator": "shm", but SGLang '
                "allocated its host pool without a memfd (SGLang reads `allocator` only from "
                "an extra config given inline as JSON, not from an @file), so pages are "
                "copied through tierd's pool",
                fix="give --hicache-storage-backend-extra-config as inline JSON (docs/sglang.md)",
            )
        geometry = PageGeometry.of(mem_pool_host)
        facts = page_facts(self.storage_config, mem_pool_host, geometry, self.settings.namespace)
        self.namespace = derive_namespace(facts)
        s = self.settings
        link = DaemonLink(
            LinkSettings(
                self.socket_path,
                self.namespace,
                geometry.page_bytes,
                s.reconnect_max_s,
                s.server_uids,
                lookup_deadline_s=s.lookup_deadline_s,
                job_deadline_s=s.job_deadline_s,
                breaker_failures=s.breaker_failures,
            ),
            name="tierd-sglang",
            logger=log,  # SGLang shows its standard logging only
            map_pool=False,  # the link watches the daemon; calls map the pool themselves
        )
        fd = getattr(mem_pool_host, "fd", None) if s.zero_copy else None
        jobs = PageJobs(
            link,
            geometry,
            fd=fd,
            lookup_deadline_s=s.lookup_deadline_s,
            job_deadline_s=s.job_deadline_s,
        )
        self._connect(link, geometry)
        self._link, self._jobs = link, jobs
        log.info(
            "tierd HiCache backend ready",
            socket=self.socket_path,
            namespace=self.namespace,
            page_bytes=geometry.page_bytes,
            layout=geometry.layout,
            memfd_offered=jobs.zero_copy,  # used for stores when the daemon has no pool
            writer=self.is_writer,
            connected=link.connected,
        )

    def _connect(self, link: DaemonLink, geometry: PageGeometry) -> None:
        """First contact: a wrong block size or an untrusted daemon refuses the start;
        a daemon not up yet only warns (its pages miss until it is)."""
        try:
            link.call(link.client(), self.settings.connect_timeout_s)
        except BlockSizeMismatch as exc:
            link.close()
            raise ValueError(
                f"the tierd daemon at {self.socket_path} does not serve blocks of "
                f"{geometry.page_bytes} bytes, one page of SGLang's host pool ({geometry.layout},"
                f" {geometry.page_tokens} tokens, this rank) ({exc.reason}):"
                f" {size_advice(geometry.page_bytes)}"
            ) from exc
        except (TierdError, OSError) as exc:
            refusal = start_refusal(
                exc, self.socket_path, config="tierd HiCache extra config", engine="SGLang"
            )
            if refusal is not None:
                link.close()
                raise refusal from exc
            log.warning(missing_daemon(self.socket_path, exc))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        raise UnsupportedPool(
            f"tierd's HiCache backend serves one KV host pool; this model also has a "
            f"{host_pool_name!s} pool (a hybrid model: SSM, SWA or sparse state), which it "
            "does not store. Use SGLang's file or mooncake backend for hybrid models."
        )

    # -- the zero-copy interface (interface_v1) ----------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        jobs = self._jobs
        if jobs is None or not keys:
            return 0
        found = self._guarded(lambda: jobs.leading([page_key(k) for k in keys]), 0)
        self.counters.looked_up(len(keys), found)
        return found

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._move(False, keys, host_indices, prefix_keys(extra_info))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not self.is_writer:
            # MLA: every rank holds the same pages and the writer rank stores them.
            return [True] * len(keys)
        return self._move(True, keys, host_indices, prefix_keys(extra_info))

    def _move(
        self, store: bool, keys: list[str], host_indices: Any, prefix: list[str] | None = None
    ) -> list[bool]:
        jobs = self._jobs
        if jobs is None or not keys:
            return [False] * len(keys)
        return self._guarded(
            lambda: self._moved(jobs, store, keys, host_indices, prefix), [False] * len(keys)
        )

    def _moved(
        self,
        jobs: PageJobs,
        store: bool,
        keys: list[str],
        host_indices: Any,
        prefix: list[str] | None,
    ) -> list[bool]:
        started = time.perf_counter()
        raw = [page_key(k) for k in keys]
        pointers, _ = self.mem_pool_host.get_page_buffer_meta(host_indices)
        offsets = jobs.geometry.offsets(pointers, len(keys))
        # The way each takes is the route's (sglang_jobs): nothing of the daemon's lands
        # in SGLang's pages once this call has given up.
        done = jobs.store(raw, offsets) if store else jobs.load(raw, offsets)
        pages = done.index(False) if False in done else len(done)
        if pages > 1 or (pages and prefix):
            # A call's pages (after SGLang's prefix keys, when it passes them) are one
            # sequence, just used: the daemon is told so, head most recent, so it drops
            # the sequence's tail before its head.
            left = started + jobs.job_deadline_s - time.perf_counter()
            self._guarded(lambda: jobs.touch_sequence(prefix or [], raw[:pages], left), None)
        elapsed = time.perf_counter() - started
        self.counters.moved(store, pages, pages * jobs.geometry.page_bytes, elapsed)
        return done

    def _guarded(self, call: Callable[[], T], failed: T) -> T:
        """``call()``, or ``failed`` if it raised: nothing reaches SGLang. A daemon that
        did not serve the call (``TierdError``, ``OSError``) is a counted failure, logged
        at debug (the link logs a lost daemon); anything else is an error of this code
        (or of SGLang's own page checks): counted as an internal error and logged with
        its traceback (rate-limited), unless ``close()`` stopped the link or a
        connection under the call."""
        try:
            return call()
        except (TierdError, OSError) as exc:
            self.counters.failed()
            log.debug("tierd HiCache call failed", error=str(exc))
            return failed
        except Exception as exc:
            if self._closed:
                self.counters.failed()
                return failed
            self.counters.failed(internal=True)
            self.faults.report("tierd HiCache call failed in tierd's own code", exc)
            return failed

    # -- the generic interface --------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any | None:
        jobs = self._jobs
        if jobs is None or target_location is None:
            return None
        return self._guarded(lambda: self._get(jobs, key, target_location), None)

    def _get(self, jobs: PageJobs, key: str, target: Any) -> Any | None:
        if not target.is_contiguous():
            return None  # its bytes are not one run: nothing is written into it
        out = tensor_bytes(target)
        if out.nbytes != jobs.geometry.page_bytes:
            return None
        return target if jobs.get_block(page_key(key), out) else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any | None]:
        return self._guarded(lambda: self._batch_get(keys, target_locations), [None] * len(keys))

    def _batch_get(self, keys: list[str], target_locations: Any) -> list[Any | None]:
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            return [None] * len(keys)
        found: list[Any | None] = []
        for key, target in zip(keys, targets, strict=True):
            found.append(self.get(key, target))
            if found[-1] is None:  # SGLang uses the leading pages only
                found.extend([None] * (len(keys) - len(found)))
                break
        return found

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        jobs = self._jobs
        if jobs is None or value is None:
            return False
        if not self.is_writer:
            return True
        return self._guarded(lambda: self._set(jobs, key, value), False)

    def _set(self, jobs: PageJobs, key: str, value: Any) -> bool:
        data = tensor_bytes(value.contiguous())
        if data.nbytes != jobs.geometry.page_bytes:
            return False
        return jobs.put_block(page_key(key), data)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self._guarded(lambda: self._batch_set(keys, values), False)

    def _batch_set(self, keys: list[str], values: Any) -> bool:
        pages = list(values or [])
        if len(pages) != len(keys):
            return False
        return all(self.set(k, v) for k, v in zip(keys, pages, strict=True))

    # -- hybrid models (not served) ---------------------------------------------------

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> PoolTransferResult:
        return PoolTransferResult.empty()

    def batch_get_v2(
        self, transfers: Sequence[Any], extra_info: Any = None
    ) -> dict[str, list[bool]]:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(
        self, transfers: Sequence[Any], extra_info: Any = None
    ) -> dict[str, list[bool]]:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # -- the rest -----------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the previous call (SGLang logs them when
        ``--enable-cache-report``/storage metrics are on)."""
        return self.counters.take()

    def clear(self) -> bool:
        """SGLang's L3 flush (``POST /hicache/storage-backend/clear``): delete every
        block of this backend's namespace from the daemon's tiers, for every engine of
        the namespace (they share one cache). True only once the daemon has removed them
        all; else False, logged at WARNING with why: a delete the daemon was sent and did
        not answer in time may still complete (the line says so)."""
        return self._guarded(self._clear, False)

    def _clear(self) -> bool:
        jobs = self._jobs
        if jobs is None:
            state = "closed" if self._closed else "not started"
            log.warning("tierd HiCache not cleared", reason=f"the backend is {state}")
            return False
        try:
            removed, busy = jobs.clear(self.settings.clear_deadline_s)
        except Unconfirmed as exc:
            log.warning(
                "tierd HiCache clear unconfirmed: tierd was asked to delete the namespace's"
                " pages and did not answer in time; the delete may still complete",
                namespace=self.namespace,
                error=str(exc),
            )
            return False
        except (TierdError, OSError) as exc:
            log.warning("tierd HiCache not cleared", namespace=self.namespace, error=str(exc))
            return False
        except Exception:
            if not self._closed:
                raise
            log.warning("tierd HiCache not cleared", reason="the backend was closed meanwhile")
            return False
        if busy:
            log.warning(
                "tierd HiCache not cleared: pages being loaded stayed; clear again",
                namespace=self.namespace,
                removed=removed,
                in_use=busy,
            )
            return False
        log.info("tierd HiCache cleared", namespace=self.namespace, removed=removed)
        return True

    def close(self) -> None:
        """Disconnect; every later call answers a miss or a failure (idempotent)."""
        self._closed = True
        jobs, link = self._jobs, self._link
        self._jobs = self._link = None
        for part in (jobs, link):
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:  # SGLang's detach goes on, and the other part closes
                self.counters.failed(internal=True)
                self.faults.report("tierd HiCache close failed in tierd's own code", exc)
