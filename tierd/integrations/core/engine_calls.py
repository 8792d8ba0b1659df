"""An engine's calls to the daemon: one transport, one data path each, chosen in one place.

:class:`EngineCalls` is what vLLM's tier and SGLang's backend call. Each call runs on
the calling thread's own connection (:class:`~tierd.integrations.core.channel.EngineChannel`:
a deadline, a breaker, one retry on a connection found lost) and a load or a store goes
down the way :func:`tierd.integrations.core.route.way` picks for the engine
(:mod:`tierd.integrations.core.data_paths` does the moving). A daemon that refuses regions is
remembered: later calls route around them, and the call that found out is routed again
at once. The daemon's link (:class:`~tierd.integrations.core.link.DaemonLink`) carries no
engine call: it watches the daemon (the breaker's probe, its log lines) and carries the
events an integration subscribes to.

A store answers, per key, only what the daemon said it holds: a key it gave no slot (held
already, or another writer's, which may still abort) is looked up after the lease, and a
lease it stored fewer blocks of than it reserved leaves its keys to that lookup too
(:func:`leased_store`). The engine's memfd is handed over only for blocks that lie in it
(:class:`RegionBlocks`); others (SGLang's generic calls) go through the staging memfd.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from tierd.control.clients.blocking_client import BlockingClient
from tierd.control.clients.handshake import DaemonError, DaemonSilent
from tierd.control.clients.regions import job_keys
from tierd.errors import ProtocolError, TierdError
from tierd.integrations.core.channel import EngineChannel, ThreadConnection
from tierd.integrations.core.data_paths import (
    NO_REGIONS,
    Blocks,
    LoadOutcome,
    copied_load,
    engine_region_store,
    inline_store,
    staged_load,
    staged_store,
)
from tierd.integrations.core.link import DaemonLink
from tierd.integrations.core.route import Engine, Way, way

__all__ = [
    "CopyCutOff",
    "DeadlineBlocks",
    "EngineCalls",
    "EngineMemfd",
    "RegionBlocks",
    "Unconfirmed",
    "leased_store",
]

T = TypeVar("T")
_REGION_WAYS = frozenset({Way.STAGED, Way.ENGINE_REGION})


@runtime_checkable
class RegionBlocks(Blocks, Protocol):
    """Blocks that lie in the engine's memfd: piece ``j`` of block ``i`` at
    ``offsets[i, j]``, ``pieces[j]`` bytes."""

    offsets: npt.NDArray[np.uint64]
    pieces: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineMemfd:
    """The engine's own memory as a file the daemon may read (SGLang's ``shm`` pool)."""

    fd: int
    size: int


class EngineCalls:
    """Lookups, touches, loads, stores and deletes of one engine, from any of its threads."""

    def __init__(
        self,
        link: DaemonLink,
        engine: Engine,
        *,
        staging_rows: int,
        map_pool: bool,
        memfd: EngineMemfd | None = None,
        regions: bool = True,
    ) -> None:
        self.link = link
        self.engine: Engine = engine
        self.channel = EngineChannel(link, map_pool=map_pool)
        self.staging_rows = max(1, staging_rows)
        self.memfd = memfd
        self.regions = regions  # False once the daemon refused a region
        self.memfd_refused = False

    @property
    def zero_copy(self) -> bool:
        """Whether stores read the engine's memfd (not refused)."""
        return self.memfd is not None and self.regions and not self.memfd_refused

    # -- lookups and hints ------------------------------------------------------------

    def present(self, keys: Sequence[bytes], deadline_s: float) -> list[bool]:
        return self.channel.call(deadline_s, lambda c, d: c.client.lookup_each(keys, d))

    def leading(self, keys: Sequence[bytes], deadline_s: float) -> int:
        return self.channel.call(deadline_s, lambda c, d: c.client.lookup(keys, d))

    def touch(self, keys: Sequence[bytes], deadline_s: float, *, uses: bool = True) -> None:
        """Mark ``keys`` used (``keys[0]`` the most recent); sent, not waited for."""
        self.channel.call(
            deadline_s, lambda c, d: c.client.touch(keys, d, uses=uses), answered=False
        )

    def request(self, op: str, deadline_s: float, **fields: Any) -> dict[str, Any]:
        return self.channel.call(deadline_s, lambda c, d: c.client.request(op, d, **fields))

    # -- moving blocks ----------------------------------------------------------------

    def load(
        self,
        keys: Sequence[bytes],
        blocks: Blocks,
        deadline_s: float,
        *,
        leading: bool = False,
        cut_off: bool = False,
    ) -> LoadOutcome:
        """Copy the daemon's blocks of ``keys`` into ``blocks``; never raises: what was
        copied, and why the rest was not (``None``: misses only). ``cut_off``: no block
        is copied once the deadline has passed (:class:`DeadlineBlocks`), so the call
        ends at most one block's copy after it; the blocks not copied by then are not
        loaded (their lease goes with the connection)."""
        loaded: list[int] = []

        def body(conn: ThreadConnection, deadline: float) -> str | None:
            loaded.clear()  # a second attempt (a connection found lost) starts afresh
            target = DeadlineBlocks(blocks, deadline) if cut_off else blocks

            def run(chosen: Way) -> None:
                self._load(chosen, conn, keys, target, deadline, loaded, leading)

            try:
                self._routed(conn, "load", run, loaded, in_memfd=False)
            except CopyCutOff as exc:
                # The daemon answered; the copy ran out of time on the engine's side. The
                # connection (a lease it may still hold) is closed: nothing late is read.
                conn.client.close()
                return str(exc)
            return None

        try:
            cut = self.channel.call(deadline_s, body)
        except (TierdError, OSError) as exc:
            return LoadOutcome(tuple(loaded), str(exc))
        return LoadOutcome(tuple(loaded), cut)

    def store(self, keys: Sequence[bytes], blocks: Blocks, deadline_s: float) -> list[bool]:
        """Store ``blocks`` under ``keys``; per key, whether the daemon holds it now.
        Raises what the daemon or the connection raised."""

        # Only blocks that lie in the engine's memfd can be read out of it by the daemon.
        in_memfd = isinstance(blocks, RegionBlocks)

        def body(conn: ThreadConnection, deadline: float) -> list[bool]:
            def run(chosen: Way) -> list[bool]:
                return self._store(chosen, conn, keys, blocks, deadline)

            return self._routed(conn, "store", run, [], in_memfd=in_memfd)

        return self.channel.call(deadline_s, body)

    def _routed(
        self,
        conn: ThreadConnection,
        op: Any,
        run: Callable[[Way], T],
        moved: list[Any],
        *,
        in_memfd: bool,
    ) -> T:
        """``run(way)`` down the way the route picks (the engine region only for blocks
        ``in_memfd``). A way the daemon refused (regions it does not have, the engine's
        memfd it will not take) is routed around from now on, and this call routed again
        at once if nothing moved yet."""
        for attempt in range(2):
            chosen = way(
                self.engine,
                op,
                regions=self.regions,
                engine_region=self.zero_copy and in_memfd,
                pool=conn.client.pool is not None,
            )
            try:
                return run(chosen)
            except DaemonError as exc:
                if exc.code not in NO_REGIONS or chosen not in _REGION_WAYS:
                    raise
                self._refused(Way.STAGED, exc)
                error = exc
            except _Refused as refused:
                error = refused.error
            if attempt or moved or conn.client.closed:
                raise error
        raise AssertionError("unreachable: the loop returns or raises")

    def _refused(self, chosen: Way, exc: DaemonError) -> None:
        if chosen is Way.ENGINE_REGION:
            self.memfd_refused = True
            self.link.log.warning(
                "tierd refused the engine's memfd; its blocks are copied through the pool",
                error=str(exc),
            )
        else:
            self.regions = False
            self.channel.map_pool = True  # leases on the connections made from now on
            self.link.log.warning(
                "tierd daemon has no engine regions; copying through its pool", error=str(exc)
            )

    def _load(
        self,
        chosen: Way,
        conn: ThreadConnection,
        keys: Sequence[bytes],
        blocks: Blocks,
        deadline: float,
        loaded: list[int],
        leading: bool,
    ) -> None:
        if chosen is Way.STAGED:
            staged_load(
                conn, keys, blocks, deadline, loaded, rows=self.staging_rows, leading=leading
            )
        else:
            lease = chosen is Way.LEASE
            copied_load(conn, keys, blocks, deadline, loaded, leading=leading, lease=lease)

    def _store(
        self,
        chosen: Way,
        conn: ThreadConnection,
        keys: Sequence[bytes],
        blocks: Blocks,
        deadline: float,
    ) -> list[bool]:
        if chosen is Way.ENGINE_REGION:
            region = self._engine_region(conn, deadline)
            paged: Any = blocks  # RegionBlocks: the route offers this way for them only
            return engine_region_store(conn, region, keys, paged.offsets, paged.pieces, deadline)
        if chosen is Way.STAGED:
            return staged_store(conn, keys, blocks, deadline, rows=self.staging_rows)
        if chosen is Way.LEASE:
            return leased_store(conn, keys, blocks, deadline)
        return inline_store(conn, keys, blocks, deadline)

    def _engine_region(self, conn: ThreadConnection, deadline: float) -> int:
        """This connection's id of the engine's memfd (registered on first use)."""
        region = conn.held.get("engine")
        if isinstance(region, int):
            return region
        memfd = self.memfd
        if memfd is None:
            raise TierdError("the engine's memory has no file descriptor to hand over")
        try:
            region = conn.client.register_region(memfd.fd, memfd.size, deadline)
        except DaemonError as exc:  # refused, not lost: copy from now on
            self._refused(Way.ENGINE_REGION, exc)
            raise _Refused(exc) from exc
        conn.held["engine"] = region
        return region

    # -- the whole namespace ----------------------------------------------------------

    def delete_all(self, deadline_s: float, *, tries: int, pause_s: float) -> tuple[int, int]:
        """Delete every block of the namespace, asking again while some are in use (a
        lease lives for one copy): ``(removed, still in use)``. A delete sent and not
        answered within the deadline raises :class:`Unconfirmed`: the daemon may still
        carry it out (a stopped daemon does once it resumes)."""

        def body(conn: ThreadConnection, deadline: float) -> tuple[int, int]:
            removed = busy = 0
            for attempt in range(tries):
                if attempt:
                    time.sleep(min(pause_s * attempt, max(0.0, deadline - time.monotonic())))
                try:
                    done = conn.client.request("delete", deadline, all=True)
                except DaemonSilent as exc:
                    raise Unconfirmed(f"the delete was sent, not answered: {exc}") from exc
                removed += int(done["removed"])
                busy = int(done["busy"])
                if not busy:
                    break
            return removed, busy

        return self.channel.call(deadline_s, body)

    def close(self) -> None:
        self.channel.close()


class CopyCutOff(TierdError):
    """A load's deadline passed before its next block was copied into the engine."""


@dataclass(frozen=True, slots=True)
class DeadlineBlocks:
    """``blocks`` (:class:`~tierd.integrations.core.data_paths.Blocks`) that take no block in once
    ``deadline`` (a ``time.monotonic()`` second) has passed: each copy in starts only
    before it, so a load ends at most one block's copy after its deadline, and a block
    is either copied whole or not at all (:class:`CopyCutOff`)."""

    blocks: Blocks
    deadline: float

    def _in_time(self) -> None:
        if time.monotonic() >= self.deadline:
            raise CopyCutOff("the load's deadline passed before its next block was copied")

    def fill(self, positions: Any, source: Any) -> None:
        # One block at a time: a batch (a staging round) is cut off between blocks too;
        # the positions of a batch count as loaded only once all of it is copied.
        for i in range(len(positions)):
            self._in_time()
            self.blocks.fill(positions[i : i + 1], source[i : i + 1])

    def gather(self, positions: Any, out: Any) -> None:
        self.blocks.gather(positions, out)

    def fill_one(self, position: int, block: memoryview) -> None:
        self._in_time()
        self.blocks.fill_one(position, block)

    def gather_one(self, position: int, out: memoryview) -> None:
        self.blocks.gather_one(position, out)


class Unconfirmed(DaemonSilent):
    """The daemon was sent a request and did not answer it within the deadline: it may
    still carry it out (a stopped daemon, once it resumes)."""


def leased_store(
    conn: ThreadConnection, keys: Sequence[bytes], blocks: Blocks, deadline: float
) -> list[bool]:
    """Store ``blocks`` under ``keys`` through pool slots, a lease at a time; per key,
    whether the daemon holds it now. A key given a slot counts once ``complete_store``
    says every block of its lease was stored; the others (given no slot: held already,
    or being written by another writer, which may still abort; or in a lease stored
    short) are looked up once, after the last lease (``lookup_each``: ready or not)."""
    client = conn.client
    client.require_pool()  # refused at once without a mapped pool
    done = [False] * len(keys)
    unsure: list[int] = []
    start = 0
    while start < len(keys):
        batch = list(keys[start : start + job_keys(client.info, len(keys) - start)])
        reply = client.request("prepare_store", deadline, keys=batch)
        slots, lease = list(reply["slots"]), reply.get("lease")
        if len(slots) != len(batch):
            raise ProtocolError(f"prepare_store gave {len(slots)} slots for {len(batch)} keys")
        if lease is not None and _written(client, blocks, start, slots, int(lease), deadline):
            for i, slot in enumerate(slots):
                done[start + i] = slot is not None
        unsure += [start + i for i in range(len(batch)) if not done[start + i]]
        start += len(batch)
    if unsure:
        held = client.lookup_each([keys[i] for i in unsure], deadline)
        for i, ready in zip(unsure, held, strict=True):
            done[i] = ready
    return done


def _written(
    client: BlockingClient,
    blocks: Blocks,
    first: int,
    slots: list[int | None],
    lease: int,
    deadline: float,
) -> bool:
    """Copy the blocks of a store lease (block ``first + i`` into slot ``slots[i]``) and
    commit it; whether the daemon stored every block it reserved (its ``stored``)."""
    pool = client.require_pool()
    taken = [(first + i, int(slot)) for i, slot in enumerate(slots) if slot is not None]
    try:
        for position, slot in taken:
            blocks.gather_one(position, pool.view(slot))
    except BaseException:
        _abort(client, deadline, lease)
        raise
    reply = client.request("complete_store", deadline, lease=lease, ok=True)
    return int(reply["stored"]) == len(taken)


def _abort(client: BlockingClient, deadline: float, lease: int) -> None:
    """Give a store lease back without waiting; if that fails the connection is closed,
    and the daemon ends every lease of a closed connection."""
    if not client.closed:
        with contextlib.suppress(TierdError, OSError):
            client.post("abort_store", deadline, lease=lease)


class _Refused(Exception):
    """The daemon refused the engine's memfd (``error``): route the call again."""

    def __init__(self, error: DaemonError) -> None:
        super().__init__(str(error))
        self.error = error


def memfd_of(fd: int | None) -> EngineMemfd | None:
    """The engine's memfd and its size, or None without one."""
    return None if fd is None else EngineMemfd(fd, os.fstat(fd).st_size)
