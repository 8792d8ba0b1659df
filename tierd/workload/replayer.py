"""Replaying a trace against a live cache the way an inference engine drives it, checking
every byte that comes back.

Per request: ``lookup`` the keys; load the hit prefix in chunks and compare each block
with :func:`block_content` of its key; store the rest (the misses, and whatever a load
could not bring back) in chunks, with that same content. A block whose bytes differ is a
``wrong_bytes`` error (its key is kept); a load that brings back fewer blocks than the
lookup promised is a shortfall (counted in ``load_shortfalls``, not as an error: a
correct cache does that under contention, when the block was evicted meanwhile, or when
its checksum failed); a store the cache had no room for is a ``store_refused``.

The cache sits behind a :class:`ReplayBackend` (defined in
:mod:`tierd.workload.replay_figures`; see :mod:`tierd.workload.backends`: a daemon over
its socket, or an in-process chain). ``len(backends)`` workers take requests
in trace order; request *i* starts no earlier than ``start + (ts_i - ts_0) / speed``
(``speed=None``: as fast as the workers go), and requests start (send their lookup) in
trace order even when many run at once. ``ordered`` (the default): the workers call one
at a time in a fixed rotation (:mod:`tierd.workload.rotation`), and each store is followed,
in the same turn, by :meth:`ReplayBackend.settle`: the cache's background copies of what
it stored (``write_behind``, queued remote writes) end before the next call. So the same
trace from the same starting state always gives the same figures, however fast the disk
writes (a store the cache could not be seen to settle after is counted in
``unsettled_stores``). Else the calls overlap and nothing waits for the background copies
(more throughput; hit figures vary run to run).
Once ``stop()`` is true no request starts any more: the replay returns what it measured
so far, ``interrupted``. So it does when the cache goes away under it (the daemon stops,
the connection is lost, the chain is closed): ``cut_short`` says why, tiers as last sampled.

Throughput: ``store_gb_s``/``load_gb_s`` are the bytes moved over the replay's wall time;
``store_call_gb_s``/``load_call_gb_s`` the same bytes over the summed duration of the
calls that moved them (the rate one call sees). GB is 10**9 bytes.

Two modes, one engine. ``verify=True`` (``tierd replay``) stores each block's own content
and checks every byte loaded back, in chunks of at most :data:`MAX_CHUNK_BLOCKS`.
``verify=False`` (``tierd simulate --config``, :func:`replay_chain`) is about hit ratios:
every block is the same filler, loads are not compared, and chunks are the entry tier's
size, so nothing but the chain's own behaviour decides the figures.

(Not called ``replay``: that is the single-tier replay function the package exports.)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from tierd.control.clients.client import Unreachable
from tierd.errors import CapacityError, ResourceClosed, TierdError
from tierd.keys import BlockKey
from tierd.workload.replay_figures import (
    SAMPLE_CAP,
    Contents,
    Latencies,
    ReplayBackend,
    ReplayProgress,
    ReplaySummary,
    block_content,
    rate,
    slowest_medium,
)
from tierd.workload.rotation import InTurn, Turns
from tierd.workload.trace import Trace, TraceRequest

__all__ = [
    "ReplayBackend",
    "ReplayProgress",
    "ReplaySummary",
    "block_content",
    "replay",
]

MAX_CHUNK_BLOCKS = 64
WRONG_KEYS_KEPT = 100
STOP_CHECK = 0.2  # seconds: how often a paced wait checks whether to stop
LATE_S = 0.01  # seconds: a paced request that starts later than this after it was due is late
_FATAL = (ResourceClosed, Unreachable)  # the cache is gone: end the replay
_GOING = "shutting_down"  # the error code of a daemon that is stopping: gone too


class _Replay:
    """The state of one replay, shared by its workers (one event loop: no locks needed
    except the start gate, which keeps starts in trace order)."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        backends: Sequence[ReplayBackend],
        speed: float | None,
        sample_every: int,
        progress: Callable[[ReplayProgress], None] | None,
        stop: Callable[[], bool] | None = None,
        verify: bool = True,
        ordered: bool = True,
    ) -> None:
        first = backends[0]
        self.turns = Turns(len(backends)) if ordered else None
        self.stop = stop
        self.requests, self.backends, self.speed = requests, backends, speed
        self.block_bytes = first.block_bytes
        self.verify = verify
        if verify:
            self.chunk = max(1, min(MAX_CHUNK_BLOCKS, first.entry_capacity // 4))
        else:
            self.chunk = max(1, first.entry_capacity)
        self.filler = [bytes(self.block_bytes)] * self.chunk
        self.sample_every = sample_every
        self.progress = progress
        self.progress_every = max(1, len(requests) // 1000)
        self.gate = asyncio.Lock()
        self.cursor = self.done = self.lookups = self.accesses = self.hits = 0
        self.loaded = self.stored = self.shortfalls = 0
        self.unsettled = 0  # stores after which the cache was not seen at rest
        self.settle_s = 0.0  # seconds spent waiting for it
        self.late = 0  # paced requests that started more than LATE_S after they were due
        self.behind = 0.0  # the most any started after it was due (seconds)
        self.by_medium: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.wrong_keys: list[str] = []
        self.lookup_lat, self.store_lat = Latencies(), Latencies()
        self.load_lat: dict[str, Latencies] = {}
        self.timeline: list[dict[str, Any]] = []
        self.tiers: list[dict[str, Any]] = []  # as last sampled
        self.gone: str | None = None  # why the cache went away, if it did
        self.started = time.perf_counter()

    # -- workers -----------------------------------------------------------------------

    async def worker(self, backend: ReplayBackend, number: int) -> None:
        """Serve requests until none is left, the replay is stopped or the cache is gone."""
        if self.turns is not None:
            backend = InTurn(backend, self.turns, number)
        try:
            await self._work(backend)
        except TierdError as exc:
            if not isinstance(exc, _FATAL) and _code(exc) != _GOING:
                raise
            gone = "the daemon went away" if backend.kind == "daemon" else "the chain closed"
            self.gone = self.gone or f"{gone}: {exc}"
        finally:
            if self.turns is not None:
                self.turns.leave(number)

    async def _work(self, backend: ReplayBackend) -> None:
        while (index := await self._next()) is not None:
            keys = self.requests[index].keys
            if len(set(keys)) != len(keys):  # one block named twice is one block
                keys = tuple(dict.fromkeys(keys))
            if keys:
                await self._serve(backend, keys)
            self.done += 1
            if self.done % self.sample_every == 0 and self.done < len(self.requests):
                await self.sample(backend)
            if self.progress is not None and self.done % self.progress_every == 0:
                self.report_progress()

    async def _next(self) -> int | None:
        """The next request to start, once it is due. The gate is held while waiting, so
        requests start in order; the caller sends its lookup before it next suspends, so
        the lookups leave in order too."""
        async with self.gate:
            index = self.cursor
            if index >= len(self.requests) or self.stopped:
                return None
            self.cursor += 1
            if self.speed is not None:
                offset = self.requests[index].timestamp - self.requests[0].timestamp
                delay = self.started + offset / 1000 / self.speed - time.perf_counter()
                if delay > 0:
                    await self._pause(delay)
                elif -delay > LATE_S:  # the clients or the cache cannot keep this pace
                    self.late += 1
                    self.behind = max(self.behind, -delay)
            return None if self.stopped else index

    @property
    def stopped(self) -> bool:
        return self.gone is not None or (self.stop is not None and self.stop())

    async def _pause(self, delay: float) -> None:
        """Wait ``delay`` seconds (pacing, not synchronisation), or until stopped: the
        stop is checked at least every :data:`STOP_CHECK` seconds."""
        deadline = time.perf_counter() + delay
        # A flag, not an Event: it is set from a signal handler, outside the event loop.
        while (left := deadline - time.perf_counter()) > 0 and not self.stopped:  # noqa: ASYNC110
            await asyncio.sleep(min(left, STOP_CHECK))

    async def _serve(self, backend: ReplayBackend, keys: Sequence[BlockKey]) -> None:
        self.accesses += len(keys)
        began = time.perf_counter()
        try:
            count, media = await backend.lookup(keys)
        except _FATAL:
            raise
        except TierdError as exc:
            self._error("lookup", exc)
            count, media = 0, ()
        else:
            self.lookup_lat.add(time.perf_counter() - began)
            self.lookups += 1
        self.hits += count
        self.by_medium.update(media)
        loaded = await self._load(backend, keys, count, media) if count else 0
        try:
            await backend.touch(keys)  # the request's use of its keys, as an engine does
        except _FATAL:
            raise
        except TierdError as exc:
            self._error("touch", exc)
        if loaded < len(keys):
            await self._store(backend, keys[loaded:])

    async def _load(
        self, backend: ReplayBackend, keys: Sequence[BlockKey], count: int, media: Sequence[str]
    ) -> int:
        """Load and verify the hit prefix chunk by chunk; returns how many blocks came back."""
        for start in range(0, count, self.chunk):
            part = keys[start : min(count, start + self.chunk)]
            began = time.perf_counter()
            try:
                blocks = await backend.load(part)
            except _FATAL:
                raise
            except TierdError as exc:
                self._error("load", exc)
                blocks = []
            else:
                medium = slowest_medium(media[start : start + len(part)])
                if medium not in self.load_lat:
                    self.load_lat[medium] = Latencies(keep=SAMPLE_CAP)
                self.load_lat[medium].add(time.perf_counter() - began)
            self.loaded += len(blocks)
            if self.verify:
                self._verify(part, blocks)
            if len(blocks) < len(part):
                self.shortfalls += 1
                return start + len(blocks)
        return count

    def _error(self, call: str, exc: TierdError) -> None:
        """Count ``exc`` of ``call``; a daemon's ``shutting_down`` ends the replay."""
        if _code(exc) == _GOING:
            raise exc
        self.errors[f"{call}_{_code(exc)}"] += 1

    def _verify(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        size = self.block_bytes
        for key, block in zip(keys, blocks, strict=False):
            if block != block_content(key, size):
                self.errors["wrong_bytes"] += 1
                if len(self.wrong_keys) < WRONG_KEYS_KEPT:
                    self.wrong_keys.append(key.hex())

    async def _store(self, backend: ReplayBackend, keys: Sequence[BlockKey]) -> None:
        for start in range(0, len(keys), self.chunk):
            part = keys[start : start + self.chunk]
            began = time.perf_counter()
            try:
                # Not ``self.stored += await ...``: that reads the counter before the
                # await and loses what other workers added meanwhile.
                data = Contents(part, self.block_bytes) if self.verify else self.filler
                stored = await backend.store(part, data)
            except CapacityError:
                self.errors["store_refused"] += 1
            except _FATAL:
                raise
            except TierdError as exc:
                self._error("store", exc)
            else:
                self.store_lat.add(time.perf_counter() - began)
                self.stored += stored
            if self.turns is not None:  # ordered: the store's turn ends with this
                await self._settle(backend)

    async def _settle(self, backend: ReplayBackend) -> None:
        """Wait for the cache to finish what the store left running in the background."""
        began = time.perf_counter()
        try:
            settled = await backend.settle()
        except _FATAL:
            raise
        except TierdError as exc:
            self._error("settle", exc)
            settled = False
        self.settle_s += time.perf_counter() - began
        self.unsettled += not settled

    # -- observation -------------------------------------------------------------------

    async def sample(self, backend: ReplayBackend) -> list[dict[str, Any]]:
        """Record a timeline point; returns the tiers of the stats it read."""
        stats = await backend.stats()
        self.timeline.append(
            {
                "t": round(time.perf_counter() - self.started, 6),
                "requests": self.done,
                "accesses": self.accesses,
                "hits": dict(self.by_medium),
                "occupancy": {tier["name"]: tier["used"] for tier in stats["tiers"]},
            }
        )
        self.tiers = stats["tiers"]
        return self.tiers

    def report_progress(self) -> None:
        if self.progress is not None:
            seconds = time.perf_counter() - self.started
            self.progress(
                ReplayProgress(self.done, len(self.requests), self.hits, self.accesses, seconds)
            )

    def summary(self, seconds: float, tiers: list[dict[str, Any]]) -> ReplaySummary:
        media = dict.fromkeys([*(t["medium"] for t in tiers), *self.by_medium])
        hits_by = {m: self.by_medium.get(m, 0) for m in media}
        acc = self.accesses
        first = self.backends[0]
        return ReplaySummary(
            requests=self.done,
            planned_requests=len(self.requests),
            interrupted=self.done < len(self.requests),
            cut_short=self.gone,
            lookups=self.lookups,
            block_accesses=acc,
            hits=self.hits,
            misses=acc - self.hits,
            hit_ratio=rate(self.hits, acc),
            hits_by_medium=hits_by,
            hit_ratio_by_medium={m: rate(n, acc) for m, n in hits_by.items()},
            loaded_blocks=self.loaded,
            stored_blocks=self.stored,
            load_shortfalls=self.shortfalls,
            seconds=seconds,
            latency={
                "lookup": self.lookup_lat.summary(),
                "load": {m: lat.summary() for m, lat in self.load_lat.items()},
                "store": self.store_lat.summary(),
            },
            throughput=self._throughput(seconds),
            errors=dict(sorted(self.errors.items())),
            wrong_bytes=self.errors["wrong_bytes"],
            wrong_bytes_keys=list(self.wrong_keys),
            timeline=self.timeline,
            load_latency_samples={m: list(lat.sample) for m, lat in self.load_lat.items()},
            config={
                "clients": len(self.backends),
                "speed": "max" if self.speed is None else self.speed,
                "block_bytes": self.block_bytes,
                "chunk_blocks": self.chunk,
                "verify": self.verify,
                "ordered": self.turns is not None,
                "settled": self.turns is not None,  # each store's background copies awaited
                "backend": first.kind,
                "socket" if first.kind == "daemon" else "path": first.target,
            },
            tiers=tiers,
            late_requests=self.late,
            behind_s=round(self.behind, 6),
            unsettled_stores=self.unsettled,
            settle_s=round(self.settle_s, 6),
        )

    def _throughput(self, seconds: float) -> dict[str, float]:
        loaded_gb, stored_gb = (
            self.loaded * self.block_bytes / 1e9,
            self.stored * self.block_bytes / 1e9,
        )
        load_time = sum(lat.total for lat in self.load_lat.values())
        return {
            "store_gb_s": rate(stored_gb, seconds),
            "load_gb_s": rate(loaded_gb, seconds),
            "store_call_gb_s": rate(stored_gb, self.store_lat.total),
            "load_call_gb_s": rate(loaded_gb, load_time),
            "requests_per_s": rate(self.done, seconds),
            "accesses_per_s": rate(self.accesses, seconds),
        }


async def replay(
    trace: Trace | Sequence[TraceRequest],
    backends: Sequence[ReplayBackend],
    *,
    speed: float | None = 1.0,
    limit: int | None = None,
    sample_every: int | None = None,
    progress: Callable[[ReplayProgress], None] | None = None,
    stop: Callable[[], bool] | None = None,
    verify: bool = True,
    ordered: bool = True,
) -> ReplaySummary:
    """Replay ``trace`` (its first ``limit`` requests) with one worker per backend.

    ``speed``: how much faster than the trace's own clock (``None``: no pacing).
    ``sample_every``: requests between timeline points (default: 1/200 of the replay).
    ``stop``: once it returns true, no request starts any more; the summary says
    ``interrupted``. ``verify``, ``ordered``: the modes (see the module's docstring).
    """
    if not backends:
        raise ValueError("a replay needs at least one backend")
    if speed is not None and not speed > 0:
        raise ValueError(f"speed must be positive, got {speed}")
    requests = trace.requests if isinstance(trace, Trace) else tuple(trace)
    if limit is not None:
        requests = requests[: max(0, limit)]
    every = sample_every or max(1, len(requests) // 200)
    run = _Replay(requests, backends, speed, every, progress, stop, verify, ordered)
    await run.sample(backends[0])
    run.started = time.perf_counter()
    run.timeline[0]["t"] = 0.0
    try:
        async with asyncio.TaskGroup() as group:
            for number, backend in enumerate(backends):
                group.create_task(run.worker(backend, number))
    except BaseExceptionGroup as failure:
        raise failure.exceptions[0] from None
    seconds = time.perf_counter() - run.started
    tiers = run.tiers if run.gone else await run.sample(backends[0])
    run.report_progress()
    return run.summary(seconds, tiers)


def _code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return str(code) if code else type(exc).__name__
