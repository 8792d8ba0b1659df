"""An engine's calls to the daemon: one transport, one data path each, chosen in one place.

:class:`EngineCalls` is what vLLM's tier and SGLang's backend call. Each call runs on
the calling thread's own connection (:class:`~tierd.integrations.channel.EngineChannel`:
a deadline, a breaker, one retry on a connection found lost) and a load or a store goes
down the way :func:`tierd.integrations.route.way` picks for the engine
(:mod:`tierd.integrations.moves` does the moving). A daemon that refuses regions is
remembered: later calls route around them, and the call that found out is routed again
at once. The daemon's link (:class:`~tierd.integrations.link.DaemonLink`) carries no
engine call: it watches the daemon (the breaker's probe, its log lines) and carries the
events an integration subscribes to.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from tierd.control.handshake import DaemonError
from tierd.errors import TierdError
from tierd.integrations.channel import Connection, EngineChannel
from tierd.integrations.link import DaemonLink
from tierd.integrations.moves import (
    Blocks,
    LoadOutcome,
    copied_load,
    engine_region_store,
    inline_store,
    lease_store,
    staged_load,
    staged_store,
)
from tierd.integrations.route import Engine, Way, way
from tierd.integrations.staging import NO_REGIONS

__all__ = ["EngineCalls", "EngineMemfd", "RegionBlocks"]

T = TypeVar("T")
_REGION_WAYS = frozenset({Way.STAGED, Way.ENGINE_REGION})


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
        self, keys: Sequence[bytes], blocks: Blocks, deadline_s: float, *, leading: bool = False
    ) -> LoadOutcome:
        """Copy the daemon's blocks of ``keys`` into ``blocks``; never raises: what was
        copied, and why the rest was not (``None``: misses only)."""
        loaded: list[int] = []

        def body(conn: Connection, deadline: float) -> None:
            loaded.clear()  # a second attempt (a connection found lost) starts afresh
            self._routed(conn, "load", lambda w: self._load(w, conn, keys, blocks, deadline,
                                                             loaded, leading), loaded)  # fmt: skip

        try:
            self.channel.call(deadline_s, body)
        except (TierdError, OSError) as exc:
            return LoadOutcome(tuple(loaded), str(exc))
        return LoadOutcome(tuple(loaded))

    def store(self, keys: Sequence[bytes], blocks: Blocks, deadline_s: float) -> list[bool]:
        """Store ``blocks`` under ``keys``; per key, whether the daemon holds it now.
        Raises what the daemon or the connection raised."""

        def body(conn: Connection, deadline: float) -> list[bool]:
            return self._routed(conn, "store", lambda w: self._store(w, conn, keys, blocks,
                                                                      deadline), [])  # fmt: skip

        return self.channel.call(deadline_s, body)

    def _routed(self, conn: Connection, op: Any, run: Callable[[Way], T], moved: list[Any]) -> T:
        """``run(way)`` down the way the route picks. A way the daemon refused (regions
        it does not have, the engine's memfd it will not take) is routed around from
        now on, and this call routed again at once if nothing moved yet."""
        for attempt in range(2):
            chosen = way(
                self.engine,
                op,
                regions=self.regions,
                engine_region=self.zero_copy,
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
        conn: Connection,
        keys: Sequence[bytes],
        blocks: Blocks,
        deadline: float,
        loaded: list[int],
        leading: bool,
    ) -> None:
        if chosen is Way.STAGED:
            staged_load(conn, keys, blocks, deadline, loaded, rows=self.staging_rows,
                        leading=leading)  # fmt: skip
        else:
            lease = chosen is Way.LEASE
            copied_load(conn, keys, blocks, deadline, loaded, leading=leading, lease=lease)

    def _store(
        self, chosen: Way, conn: Connection, keys: Sequence[bytes], blocks: Blocks, deadline: float
    ) -> list[bool]:
        if chosen is Way.ENGINE_REGION:
            region = self._engine_region(conn, deadline)
            paged: Any = blocks  # RegionBlocks: the route offers this way for them only
            return engine_region_store(conn, region, keys, paged.offsets, paged.pieces, deadline)
        if chosen is Way.STAGED:
            return staged_store(conn, keys, blocks, deadline, rows=self.staging_rows)
        if chosen is Way.LEASE:
            return lease_store(conn, keys, blocks, deadline)
        return inline_store(conn, keys, blocks, deadline)

    def _engine_region(self, conn: Connection, deadline: float) -> int:
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
        lease lives for one copy): ``(removed, still in use)``."""

        def body(conn: Connection, deadline: float) -> tuple[int, int]:
            removed = busy = 0
            for attempt in range(tries):
                if attempt:
                    time.sleep(min(pause_s * attempt, max(0.0, deadline - time.monotonic())))
                done = conn.client.request("delete", deadline, all=True)
                removed += int(done["removed"])
                busy = int(done["busy"])
                if not busy:
                    break
            return removed, busy

        return self.channel.call(deadline_s, body)

    def close(self) -> None:
        self.channel.close()


class _Refused(Exception):
    """The daemon refused the engine's memfd (``error``): route the call again."""

    def __init__(self, error: DaemonError) -> None:
        super().__init__(str(error))
        self.error = error


def memfd_of(fd: int | None) -> EngineMemfd | None:
    """The engine's memfd and its size, or None without one."""
    return None if fd is None else EngineMemfd(fd, os.fstat(fd).st_size)
