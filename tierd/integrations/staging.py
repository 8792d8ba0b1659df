"""Store and load jobs as one region request each, through a private staging region.

The daemon moves region bytes itself (``Client.region_store`` / ``region_load``), so a job
is one small request and the engine's thread only waits on the socket. The region is not
vLLM's own CPU tier but a memfd of this module's (:class:`Staging`), and the rows move
between vLLM's tier and it with one numpy copy per job (``np.take`` / a fancy assignment:
a memcpy that releases the GIL). Why not register vLLM's file itself: a job the engine gave
up on (a daemon stopped past the deadline, then resumed) would still be copied by the
daemon later, into or out of rows vLLM has handed to other blocks by then: a store would
file another block's bytes under the key, a load would overwrite a live row. A staging
region belongs to one connection: when a job times out the link drops the connection, and
the next connection gets a fresh memfd, so a late copy only ever touches memory that
nobody reads again.

Each connection's staging has two halves, for loads and for stores, so a promotion (which
a request waits for) never queues behind a cascade. A job larger than a half moves in
rounds. ``None`` from :meth:`StagedCopies.store` / :meth:`StagedCopies.load` means the
daemon has no regions (an older daemon, or a refusal): the caller falls back to leases.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tierd.client import Client, DaemonError
from tierd.logs import get_logger

__all__ = ["Staging", "StagedCopies"]

log = get_logger("tierd.integrations.staging")
Rows = npt.NDArray[np.uint8]
_NO_REGIONS = frozenset({"unknown_op", "bad_region", "not_allowed"})


@dataclass(slots=True)
class Staging:
    """A memfd of ``2 * rows`` rows, mapped here and registered on one connection."""

    client: Client
    region: int
    rows: int
    array: Rows  # (2 * rows, row_bytes): loads use the first half, stores the second
    offsets: npt.NDArray[np.uint64]  # byte offset of each row
    locks: tuple[asyncio.Lock, asyncio.Lock] = field(
        default_factory=lambda: (asyncio.Lock(), asyncio.Lock())
    )

    @classmethod
    async def register(cls, client: Client, rows: int, row_bytes: int) -> Staging:
        size = 2 * rows * row_bytes
        fd = os.memfd_create("tierd-vllm-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            array = np.frombuffer(mapping, dtype=np.uint8).reshape(2 * rows, row_bytes)
            array[:] = 0  # fault every page in now, not in the first job
            region = await client.register_region(fd, size)
        finally:
            os.close(fd)  # the mapping and the daemon's copy keep the memory
        offsets = np.arange(2 * rows, dtype=np.uint64) * np.uint64(row_bytes)
        return cls(client, region, rows, array, offsets)


class StagedCopies:
    """Jobs between vLLM's rows and the daemon, one region request per round."""

    def __init__(self, rows: Rows, staging_bytes: int) -> None:
        self._rows = rows
        # No job moves more rows than vLLM's tier has: a half never needs more.
        self._per_half = max(1, min(len(rows), staging_bytes // (2 * rows.shape[1])))
        self._staging: Staging | None = None
        self._unsupported = False
        self._registering = asyncio.Lock()  # binds to the link's loop on first use

    async def _for(self, client: Client) -> Staging | None:
        """This connection's staging, registered on first use (a new connection gets a
        new memfd); None when the daemon has no regions."""
        staging = self._staging
        if staging is not None and staging.client is client:
            return staging
        if self._unsupported:
            return None
        async with self._registering:
            if self._staging is not None and self._staging.client is client:
                return self._staging
            try:
                self._staging = await Staging.register(client, self._per_half, self._rows.shape[1])
            except DaemonError as exc:
                if exc.code not in _NO_REGIONS:
                    raise
                self._unsupported = True
                log.warning(
                    "tierd daemon has no engine regions; copying through leases",
                    error=str(exc),
                )
                return None
            return self._staging

    async def store(
        self, client: Client, keys: Sequence[bytes], row_ids: Sequence[int]
    ) -> bool | None:
        """Store ``rows[row_ids[i]]`` under ``keys[i]``; whether the daemon holds every
        key now (None: no regions, use leases)."""
        staging = await self._for(client)
        if staging is None:
            return None
        ids = np.asarray(row_ids, dtype=np.intp)
        held = True
        async with staging.locks[1]:
            area = staging.array[staging.rows :]
            for first in range(0, len(keys), staging.rows):
                chunk = ids[first : first + staging.rows]
                np.take(self._rows, chunk, axis=0, out=area[: len(chunk)])
                offsets = staging.offsets[staging.rows : staging.rows + len(chunk)]
                done = await client.region_store(
                    staging.region, keys[first : first + len(chunk)], offsets
                )
                held = held and all(done)
        return held

    async def load(
        self, client: Client, keys: Sequence[bytes], row_ids: Sequence[int]
    ) -> list[int] | None:
        """Copy the daemon's blocks of ``keys`` into ``rows[row_ids[i]]``; the indices
        that loaded (None: no regions, use leases)."""
        staging = await self._for(client)
        if staging is None:
            return None
        ids = np.asarray(row_ids, dtype=np.intp)
        loaded: list[int] = []
        async with staging.locks[0]:
            area = staging.array[: staging.rows]
            for first in range(0, len(keys), staging.rows):
                count = min(staging.rows, len(keys) - first)
                done = await client.region_load(
                    staging.region, keys[first : first + count], staging.offsets[:count]
                )
                got = np.flatnonzero(np.asarray(done, dtype=bool))
                self._rows[ids[first + got]] = area[got]
                loaded.extend((first + got).tolist())
        return loaded
