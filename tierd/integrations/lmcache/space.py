"""One namespace of the LMCache adapter: its daemon connection and the work on it.

A :class:`Space` owns a :class:`~tierd.integrations.core.link.DaemonLink` (its connection) and
moves bytes through leases on the daemon's pool, mapped into this process: a store reserves
slots, copies LMCache's bytes in and commits; a lookup-and-lock pins the blocks it finds as
:class:`Pin` s, which a load copies from and an unlock releases. Copies run on the calling
worker thread before the task is reported: nothing lands in LMCache's memory later.

A pin belongs to one connection: when the link loses it, the daemon released the lease with
it (a load pins afresh, an unlock sends nothing, a copy during the loss fails its key); a
reservation too (its commit then fails, sent to no connection). Each method waits at most
until ``expires`` (a ``time.monotonic()`` instant), not for the link to let a silent
connection go, and raises only :class:`~tierd.errors.TierdError` and ``OSError``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tierd.client import Client, DaemonError, LoadLease, PoolMap, StoreLease, Unreachable
from tierd.integrations.core.engine_log import EngineLog
from tierd.integrations.core.link import DaemonLink, LinkSettings, NotSent, TooLate, log_unanswered

__all__ = ["LeaseShare", "Pin", "Space", "SpaceSettings"]

T = TypeVar("T")
log = EngineLog("tierd.integrations.lmcache")
_RUN_MAX = 1024  # keys per lease (the daemon's max_keys_per_request may be lower)


@dataclass(frozen=True, slots=True)
class SpaceSettings:
    socket_path: str
    namespace: str
    block_bytes: int
    deadline_s: float
    breaker_failures: int
    reconnect_max_s: float
    server_uids: tuple[int, ...]
    workers: int = 2  # the adapter's threads: each may hold a store or load lease


class LeaseShare:
    """One load lease, shared by the pins of its keys; released when the last is unlocked."""

    __slots__ = ("connection", "lease", "left", "pool")

    def __init__(self, lease: LoadLease, pool: PoolMap, connection: int) -> None:
        self.lease, self.pool, self.connection = lease, pool, connection
        self.left = lease.count  # the pins, and the loads copying from them, still held


@dataclass(frozen=True, slots=True)
class Pin:
    """One locked key: the ``index``-th block of ``hold``'s lease."""

    hold: LeaseShare
    index: int


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy one block between two buffers of the same size."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _runs(
    keys: Sequence[bytes], wanted: Sequence[bool], most: int = _RUN_MAX
) -> list[tuple[int, list[bytes]]]:
    """(first index, keys) of the runs of wanted keys: at most ``most``, none repeated."""
    runs: list[tuple[int, list[bytes]]] = []
    current: list[bytes] = []
    seen: set[bytes] = set()
    for i, (key, want) in enumerate(zip(keys, wanted, strict=True)):
        if want and current and key not in seen and len(current) < most:
            current.append(key)
            seen.add(key)
            continue
        current, seen = [], set()
        if want:
            current.append(key)
            seen.add(key)
            runs.append((i, current))
    return runs


class Space:
    """The daemon connection of one namespace."""

    def __init__(self, settings: SpaceSettings) -> None:
        self.settings = settings
        self.link = DaemonLink(
            LinkSettings(
                settings.socket_path,
                settings.namespace,
                settings.block_bytes,
                settings.reconnect_max_s,
                settings.server_uids,
                lookup_deadline_s=settings.deadline_s,
                job_deadline_s=settings.deadline_s,
                breaker_failures=settings.breaker_failures,
            ),
            name="tierd-lmcache",
            logger=log,
        )
        self._lock = threading.Lock()
        self._unreleased: list[LeaseShare] = []  # releases that could not be sent yet
        self.used_bytes = 0  # the namespace's bytes in the daemon, at the last report
        self._usage_asked = 0.0
        self.lease_bound = self.request_bound = 0  # from the daemon's hello (0: none)
        self.pinned = 0  # blocks locks hold pinned on the current connection
        self.link.on_connect.append(self._learn)

    def _learn(self, client: Client) -> None:
        """A new connection: the daemon's bounds (the pins of the one before went with it)."""
        self.lease_bound = int(client.info.get("max_lease_blocks") or 0)
        self.request_bound = int(client.info.get("max_keys_per_request") or 0)
        with self._lock:
            self.pinned = 0

    def chunk(self) -> int:
        """Keys per lease: a share of what one connection may hold (the locks, each
        worker's store or load and one spare), at most the keys of one request."""
        share = self.lease_bound // (self.settings.workers + 2) if self.lease_bound else _RUN_MAX
        return max(1, min(_RUN_MAX, share, self.request_bound or _RUN_MAX))

    # -- stores -------------------------------------------------------------------------

    def store(self, keys: Sequence[bytes], sources: Sequence[Any], expires: float) -> int:
        """Store the blocks; returns the bytes written (a block the daemon held: none)."""
        first: dict[bytes, Any] = {}
        for key, source in zip(keys, sources, strict=True):
            first.setdefault(key, source)
        written = start = 0
        while start < len(first):
            done, size = self._store_chunk(list(first)[start:], first, expires)
            written, start = written + size, start + done
        return written

    def _store_chunk(
        self, keys: list[bytes], sources: dict[bytes, Any], expires: float
    ) -> tuple[int, int]:
        """Store a leading chunk of ``keys``: (keys done, bytes written)."""

        async def reserve(client: Client) -> tuple[int, StoreLease]:
            return self.link.connects, await client.prepare_store(keys[: self.chunk()])

        connection, lease = self.link.ask(reserve, expires)
        if lease.finished:
            return len(lease.keys), 0
        try:
            for view, i in zip(lease.views(), lease.to_write, strict=True):
                with view:
                    copy_bytes(view, sources[lease.keys[i]])
        except BaseException:
            self._send_on(connection, lease.abort)
            raise
        try:
            stored = self.link.ask(self._on_connection(connection, lease.commit), expires)
        except TooLate:  # the deadline passed during the copy: not committed, aborted
            self._send_on(connection, lease.abort)
            raise
        return len(lease.keys), stored * self.settings.block_bytes

    def _on_connection(
        self, connection: int, request: Callable[[], Awaitable[T]]
    ) -> Callable[[Client], Awaitable[T]]:
        """``request()`` of a lease of ``connection``, as an op of the link: sent only
        while that is the link's connection. A lease of a lost one went with it; its
        request fails unsent, so the link neither drops the connection it has now (the
        request would fail there) nor sends it again on a fresh one."""
        if not self._on_link(connection):
            raise Unreachable("the lease's connection was lost: the daemon ended the lease")

        async def on_link(client: Client) -> T:
            if not self._on_link(connection):
                raise NotSent("the lease's connection was lost: the daemon ended the lease")
            return await request()

        return on_link

    def _on_link(self, connection: int) -> bool:
        return self.link.connected and self.link.connects == connection

    # -- lookup and lock ----------------------------------------------------------------

    def lock(self, keys: Sequence[bytes], expires: float) -> tuple[list[bool], list[Pin | None]]:
        """Which keys the daemon holds ready, and pins for those the connection may hold."""
        with self._lock:  # releases that could not be sent before
            holds, self._unreleased = self._unreleased, []
        for hold in holds:
            self._release(hold)

        found = self.link.ask(lambda client: client.lookup_each(keys), expires)
        pins: list[Pin | None] = [None] * len(keys)
        runs = self._budget(_runs(keys, found, self.chunk()))
        if not runs:
            return found, pins

        async def pin(client: Client) -> tuple[int, PoolMap, list[Any]]:
            connection = self.link.connects
            asked = [client.prepare_load(run) for _, run in runs]
            leases = await asyncio.gather(*asked, return_exceptions=True)
            return connection, client.require_pool(), list(leases)

        try:
            connection, pool, leases = self.link.ask(pin, expires)
        except BaseException:
            self._give_back(sum(len(run) for _, run in runs))
            raise
        self._take(runs, leases, lambda lease: LeaseShare(lease, pool, connection), pins)
        return found, pins

    def _take(
        self,
        runs: list[tuple[int, list[bytes]]],
        leases: list[Any],
        hold_of: Callable[[LoadLease], LeaseShare],
        pins: list[Pin | None],
    ) -> None:
        """``pins`` from the leases granted for ``runs``; what was not goes back to the budget."""
        unused = 0
        for (first, run), lease in zip(runs, leases, strict=True):
            if isinstance(lease, BaseException):
                unused += len(run)
                if isinstance(lease, DaemonError):
                    continue  # refused (the lease bounds, say): its load pins afresh
                raise lease
            hold = hold_of(lease)
            if lease.keys != run[: lease.count]:
                unused += len(run)
                hold.left = 0
                self._release(hold)  # not what was asked: nothing is guessed
                continue
            unused += len(run) - lease.count
            for i in range(lease.count):
                pins[first + i] = Pin(hold, i)
        self._give_back(unused)

    def _give_back(self, blocks: int) -> None:
        with self._lock:
            self.pinned = max(0, self.pinned - blocks)

    def _budget(self, runs: list[tuple[int, list[bytes]]]) -> list[tuple[int, list[bytes]]]:
        """The leading runs (the last one cut) that locks may pin: they hold at most one
        chunk of what the connection may (the rest is for loads and stores); the blocks are
        counted as pinned from here on (a refused run gives its share back)."""
        kept: list[tuple[int, list[bytes]]] = []
        with self._lock:
            room = self.chunk() - self.pinned
            for first, run in runs:
                if room <= 0:
                    break
                kept.append((first, run[:room]))
                room -= len(kept[-1][1])
            self.pinned += sum(len(run) for _, run in kept)
        return kept

    def hold(self, pins: Sequence[Pin]) -> None:
        """Keep each pin's lease for a copy from it (an :meth:`unpin` of it lets it go)."""
        with self._lock:
            for pin in pins:
                pin.hold.left += 1

    def unpin(self, pins: Sequence[Pin]) -> None:
        """Unlock: each pin's lease is released when its last key is (never blocks)."""
        done: list[LeaseShare] = []
        with self._lock:
            for pin in pins:
                pin.hold.left -= 1
                if pin.hold.left == 0:
                    done.append(pin.hold)
                    if pin.hold.connection == self.link.connects:
                        self.pinned -= len(pin.hold.lease.keys)
        for hold in done:
            self._release(hold)

    def _valid(self, hold: LeaseShare) -> bool:
        return self._on_link(hold.connection)

    def _release(self, hold: LeaseShare) -> None:
        if not self._valid(hold):
            return  # the daemon released it with the connection
        future = self._send_on(hold.connection, hold.lease.release)

        def retry_later(done: Any) -> None:
            if done.cancelled() or done.exception() is not None:
                with self._lock:
                    self._unreleased.append(hold)

        future.add_done_callback(retry_later)

    # -- loads --------------------------------------------------------------------------

    def load(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Any],
        pins: Sequence[Pin | None],
        expires: float,
    ) -> list[bool]:
        """Copy each key's block into its target: from its pin while that is valid, else
        from a fresh lease; per key whether its bytes are the daemon's."""
        done = [False] * len(keys)
        rest = [True] * len(keys)
        for i, pin in enumerate(pins):
            if pin is not None and self._valid(pin.hold):
                rest[i] = False
                done[i] = self._copy_pinned(pin, targets[i])
        for first, run in _runs(keys, rest, len(keys) or 1):
            self._load_run(first, run, targets, done, expires)
        return done

    def _copy_pinned(self, pin: Pin, target: Any) -> bool:
        hold = pin.hold
        with hold.pool.view(hold.lease.slots[pin.index]) as view:
            copy_bytes(target, view)
        return self._valid(hold)  # dropped meanwhile: the slot may have been reused

    def _load_run(
        self, first: int, run: list[bytes], targets: Sequence[Any], done: list[bool], at: float
    ) -> None:
        start = 0
        while start < len(run):
            keys = run[start:]

            async def pin(client: Client, keys: list[bytes] = keys) -> tuple[int, LeaseShare]:
                asked = keys[: self.chunk()]
                lease = await client.prepare_load(asked)
                return len(asked), LeaseShare(lease, client.require_pool(), self.link.connects)

            asked, hold = self.link.ask(pin, at)
            count = hold.lease.count
            try:
                if hold.lease.keys != keys[:count]:
                    return
                base = first + start
                for i in range(count):
                    done[base + i] = self._copy_pinned(Pin(hold, i), targets[base + i])
            finally:
                hold.left = 0
                self._release(hold)
            start += count + (count < asked)  # past the key that missed

    # -- the rest -------------------------------------------------------------------------

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark the blocks used, ``keys[0]`` the most recent (never blocks)."""
        self._fire(lambda client: client.touch(keys))

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete the blocks from the daemon's tiers (never blocks; a failure is logged)."""
        self._fire(lambda client: client.delete(keys))

    def _fire(self, op: Callable[[Client], Awaitable[Any]]) -> None:
        self.link.start(op, self.settings.deadline_s).add_done_callback(log_unanswered)

    def refresh_usage(self) -> None:
        """Have :attr:`used_bytes` take the namespace's bytes (asked at most once a second)."""
        now = time.monotonic()
        if now - self._usage_asked < 1.0:
            return
        self._usage_asked = now
        name = self.settings.namespace

        async def ask(client: Client) -> None:
            rows = (await client.namespaces()).values()
            mine = [r for group in rows for r in group if r.get("namespace") == name]
            self.used_bytes = sum(int(r.get("bytes", 0)) for r in mine)

        self._fire(ask)

    def _send_on(self, connection: int, op: Callable[[], Awaitable[Any]]) -> Future[Any]:
        """Send ``op()`` (a request of a lease) if its connection is still the link's (a
        lease of a lost one went with it; no failure of the new connection to count)."""

        async def on_link(client: Client) -> Any:
            if self.link.connects != connection or not self.link.connected:
                return None
            return await op()

        future = self.link.start(on_link, self.settings.deadline_s)
        future.add_done_callback(log_unanswered)
        return future

    def close(self) -> None:
        self.link.close()
