"""vLLM's workers copying straight between their KV cache and rows of tierd's pool.

:class:`TierdPoolWorker` is the worker side of
:class:`~tierd.integrations.vllm.pool_spec.TierdPoolSpec`: each rank maps the daemon's pool
(the scheduler's mapping when it runs in this process, else one of its own, from the
descriptor the daemon passes) and views each KV tensor's part of every row, as vLLM views
its own shared region: row ``r`` at ``r * stride``, rank ``k``'s part at
``k * cpu_page_size_per_worker`` (rank 0's alone when the layout is the same on every
rank), in it ``blocks_per_chunk`` pages of each KV tensor in turn.

- **On a GPU** the pool mapping is page-locked in this process (``cudaHostRegister``
  through vLLM's ``host_register``, in row-aligned pieces of at most 64 GiB, as vLLM pins
  its own region; unregistered before the mapping goes) and the copies are vLLM's own
  (``SingleDirectionOffloadingHandler``: its batched copies on its streams, an event per
  job to know when it is done).
- **On vLLM's CPU build** the copies are plain torch
  (:class:`~tierd.integrations.vllm.cpu_spec.RowCopies`), done when ``submit_*`` returns.

Every job names the pool its rows lie in
(:class:`~tierd.integrations.vllm.pool_manager.TierdRowsSpec`): a restarted daemon has a new
pool, which the worker maps when a job first names it; the old one stays mapped while
jobs may use it (its rows, pinned or reserved before the daemon went, are never reused
by anyone). A load whose pool this process cannot map (the daemon that pinned it gone
before this rank ever mapped it, and restarted since) fails loudly: vLLM has no way to
recompute a failed load, and copying nothing would serve whatever the engine's blocks
held.

Threads. vLLM calls a :class:`TierdPoolWorker` from one thread of its rank (its
offloading connector's worker side), which owns the pools mapped, their views and copy
handlers, and the results not collected yet, all unlocked; the copies run on vLLM's CUDA
streams (on the CPU build they are done when ``submit_*`` returns), and their ends are
read on that same thread (``get_finished``, ``wait``). Shared with other threads: the
scheduler's mappings when it runs in this process
(:func:`~tierd.integrations.core.pool_leases.mapped_pool`), under their
:class:`~tierd.integrations.core.channel.PoolUsers`' lock, and this rank's own
:class:`~tierd.control.clients.pool.PoolShare`, under its own. A pool's rows are shared
with the daemon, another process, only through leases: the daemon never gives a row to
another block while a job may use it.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from tierd.control.clients.pool import PoolMap, PoolShare
from tierd.errors import TierdError
from tierd.integrations.core.pool_leases import mapped_pool
from tierd.integrations.vllm.cpu_spec import RowCopies
from tierd.logs import get_logger

__all__ = ["TierdPoolWorker"]

log = get_logger("tierd.integrations.vllm")

MAX_REGISTER_BYTES = 64 << 30  # one cudaHostRegister call, at most (vLLM's own bound)
_KEEP_POOLS = 2  # pools mapped at once: the daemon's, and its predecessor's


class _PoolRows:
    """One pool mapped here, and the copies through its rows."""

    def __init__(self, pool: PoolMap, spec: Any, kv_caches: Any, cuda: bool) -> None:
        import torch

        if pool.block_bytes != spec.kv_bytes_per_chunk:
            raise TierdError(
                f"tierd's pool {pool.name} has rows of {pool.block_bytes} bytes; vLLM's"
                f" are {spec.kv_bytes_per_chunk}"
            )
        self.name = pool.name
        self._pool = pool
        self._base = pool.as_tensor()
        rank = 0 if spec.replicated_layout else int(spec.config.parallel.rank)
        offset = rank * spec.cpu_page_size_per_worker
        end = offset + spec.cpu_page_size_per_worker
        hosts = []
        for cache in kv_caches.tensors:
            width = cache.page_size_bytes * spec.blocks_per_chunk
            shape, strides = (pool.num_blocks, width), (pool.stride, 1)
            hosts.append(torch.as_strided(self._base, shape, strides, offset))
            offset += width
        if offset > end:
            raise TierdError(f"vLLM's KV tensors need {offset} bytes of a row, past {end}")
        self._pinned: list[int] = []
        self.results: list[Any] = []  # the CPU build's finished jobs
        if cuda:
            self._handlers = self._gpu_handlers(spec, kv_caches, hosts)
            self._copies = None
        else:
            self._handlers = {}
            self._copies = RowCopies(kv_caches, spec.blocks_per_chunk, hosts)

    def _gpu_handlers(self, spec: Any, kv_caches: Any, hosts: list[Any]) -> dict[str, Any]:
        """vLLM's own copy handlers over the pool's rows, page-locked here first."""
        import torch
        from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

        pinned = self._pin()
        engine = [
            cache.tensor.view(torch.int8).view(-1, cache.page_size_bytes)
            for cache in kv_caches.tensors
        ]

        def handler(gpu_to_cpu: bool) -> Any:
            return SingleDirectionOffloadingHandler(
                gpu_tensors=list(engine),  # the handler clears its lists at shutdown
                cpu_tensors=list(hosts),
                blocks_per_chunk=spec.blocks_per_chunk,
                layer_refs_per_group=kv_caches.group_data_refs,
                gpu_to_cpu=gpu_to_cpu,
                host_memory_is_pinned=pinned,
            )

        return {"store": handler(True), "load": handler(False), "expedited": handler(False)}

    def _pin(self) -> bool:
        """Page-lock the whole mapping in row-aligned pieces (all or none)."""
        from vllm.v1.kv_offload.cpu.host_register import host_register

        pool = self._pool
        total = pool.num_blocks * pool.stride
        piece = max(MAX_REGISTER_BYTES // pool.stride, 1) * pool.stride
        base = self._base.data_ptr()
        started = time.monotonic()
        for offset in range(0, total, piece):
            if not host_register(base + offset, min(piece, total - offset)):
                log.warning("cannot page-lock tierd's pool: copies run pageable", pool=pool.name)
                self._unpin()
                return False
            self._pinned.append(base + offset)
        log.info(
            "tierd's pool page-locked",
            pool=pool.name,
            bytes=total,
            seconds=round(time.monotonic() - started, 3),
        )
        return True

    def _unpin(self) -> None:
        if not self._pinned:
            return
        from vllm.v1.kv_offload.cpu.host_register import host_unregister

        for address in self._pinned:
            host_unregister(address)
        self._pinned.clear()

    def copy(self, job_id: int, engine_spec: Any, rows_spec: Any, kind: str) -> bool:
        """Start one job (``kind``: store, load or expedited load); the CPU build's is
        done when this returns."""
        if self._copies is None:
            handler = self._handlers[kind]
            if kind == "store":
                return bool(handler.transfer_async(job_id, engine_spec, rows_spec))
            return bool(handler.transfer_async(job_id, rows_spec, engine_spec))
        started = time.perf_counter()
        moved = self._copies.copy(engine_spec, rows_spec, store=kind == "store")
        took = time.perf_counter() - started
        self.results.append(TransferResult(job_id, True, moved, took))
        return True

    def finished(self) -> list[Any]:
        done, self.results = self.results, []
        for handler in self._handlers.values():
            done += handler.get_finished()
        return done

    def wait(self, job_ids: set[int]) -> None:
        for handler in self._handlers.values():
            handler.wait(job_ids)

    def close(self) -> None:
        """Drain the copies under way, then let go of the rows (unpinned first)."""
        for handler in self._handlers.values():
            handler.shutdown()
        self._handlers.clear()
        if self._copies is not None:
            self._copies.release()
        self._unpin()
        self._base = None


class TierdPoolWorker(OffloadingWorker):  # type: ignore[misc]
    """One rank's copies between vLLM's KV cache and rows of tierd's pool."""

    def __init__(self, spec: Any, kv_caches: Any) -> None:
        self._spec = spec
        self._kv_caches = kv_caches
        self._settings = spec.settings()
        self._cuda = any(cache.tensor.is_cuda for cache in kv_caches.tensors)
        self._share = PoolShare(keep=_KEEP_POOLS)  # pools this rank mapped itself
        self._pools: dict[str, _PoolRows] = {}  # oldest first
        self._results: list[Any] = []

    def _rows(self, name: str) -> _PoolRows | None:
        """The pool ``name``, mapped here (when it is the daemon's now); None if it
        cannot be (its daemon is gone and this rank never mapped it)."""
        rows = self._pools.get(name)
        if rows is not None:
            return rows
        pool = mapped_pool(name) or self._share.find(name) or self._connect(name)
        if pool is None:
            return None
        rows = _PoolRows(pool, self._spec, self._kv_caches, self._cuda)
        self._pools[name] = rows
        while len(self._pools) > _KEEP_POOLS:  # the oldest, drained first
            self._pools.pop(next(iter(self._pools))).close()
        return rows

    def _connect(self, name: str) -> PoolMap | None:
        """Map the daemon's pool through a connection of this rank's own (closed at
        once: the mapping stays); the pool if it is ``name``."""
        s = self._settings
        deadline = time.monotonic() + max(s.load_deadline_s, 1.0)
        try:
            client = s.blocking(deadline, map_pool=True, pools=self._share)
        except (TierdError, OSError) as exc:
            log.warning("tierd's pool cannot be mapped", pool=name, error=str(exc))
            return None
        client.close()  # the pool stays mapped: the share owns it
        return self._share.find(name)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        rows = self._rows(dst_spec.pool)
        if rows is None:  # its daemon is gone, its reservation with it: nothing to keep
            self._results.append(TransferResult(job_id, True, 0, 0.0))
            return True
        return rows.copy(job_id, src_spec, dst_spec, "store")

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        rows = self._rows(src_spec.pool)
        if rows is None:
            log.error(
                "tierd's pool of a pinned load cannot be mapped: its daemon restarted"
                " before this rank mapped it; the load fails",
                pool=src_spec.pool,
            )
            return False
        return rows.copy(job_id, dst_spec, src_spec, "expedited" if expedited else "load")

    def get_finished(self) -> list[Any]:
        done, self._results = self._results, []
        for rows in self._pools.values():
            done += rows.finished()
        return done

    def wait(self, job_ids: set[int]) -> None:
        for rows in self._pools.values():
            rows.wait(job_ids)

    def shutdown(self) -> None:
        for rows in self._pools.values():
            rows.close()
        self._pools.clear()
        self._share.close()
