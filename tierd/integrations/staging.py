"""Store jobs as one region request each, through a private staging region.

The daemon moves region bytes itself (``Client.region_store``), so a store is one small
request and the engine's thread only waits on the socket. The region is not vLLM's own
CPU tier but a memfd of this module's (:func:`staging_memory`), and the rows move from
vLLM's tier into it with one numpy copy per job (``np.take``). Why not register vLLM's
file itself: a job the engine gave up on (a daemon stopped past the deadline, then
resumed) would still be read by the daemon later, out of rows vLLM has handed to other
blocks by then, and the daemon would file another block's bytes under the key. A staging
region belongs to one connection: when a job times out the link drops the connection,
and the next connection gets a fresh memfd, so a late copy only ever touches memory that
nobody writes again. Loads go the same way on the scheduler's own connection
(:mod:`tierd.integrations.direct`).

A job larger than the staging region moves in rounds. ``None`` from
:meth:`StagedCopies.store` means the daemon has no regions (an older daemon, or a
refusal): the caller falls back to leases.
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

__all__ = ["NO_REGIONS", "StagedCopies", "Staging", "staging_memory"]

log = get_logger("tierd.integrations.staging")
Rows = npt.NDArray[np.uint8]
NO_REGIONS = frozenset({"unknown_op", "bad_region", "not_allowed"})


def staging_memory(rows: int, row_bytes: int) -> tuple[int, Rows]:
    """A memfd of ``rows`` rows of ``row_bytes``, mapped here with every page faulted in
    (not in the first job): its descriptor (the caller closes it once the daemon has it;
    the mapping keeps the memory) and the rows."""
    size = rows * row_bytes
    fd = os.memfd_create("tierd-vllm-staging", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        raise
    array = np.frombuffer(mapping, dtype=np.uint8).reshape(rows, row_bytes)
    array[:] = 0
    return fd, array


@dataclass(slots=True)
class Staging:
    """A memfd of ``rows`` rows, mapped here and registered on one connection."""

    client: Client
    region: int
    array: Rows  # (rows, row_bytes)
    offsets: npt.NDArray[np.uint64]  # byte offset of each row
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def rows(self) -> int:
        return len(self.array)

    @classmethod
    async def register(cls, client: Client, rows: int, row_bytes: int) -> Staging:
        fd, array = staging_memory(rows, row_bytes)
        try:
            region = await client.register_region(fd, array.nbytes)
        finally:
            os.close(fd)  # the mapping and the daemon's copy keep the memory
        return cls(client, region, array, row_offsets(rows, row_bytes))


def row_offsets(rows: int, row_bytes: int) -> npt.NDArray[np.uint64]:
    """The byte offset of each of ``rows`` rows."""
    return np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)


class StagedCopies:
    """Store jobs from vLLM's rows to the daemon, one region request per round."""

    def __init__(self, rows: Rows, staging_bytes: int) -> None:
        self._rows = rows
        # No job moves more rows than vLLM's tier has: staging never needs more.
        self._per_round = max(1, min(len(rows), staging_bytes // rows.shape[1]))
        self._staging: Staging | None = None
        self._unsupported = False
        self._registering = asyncio.Lock()  # binds to the link's loop on first use

    def release(self) -> None:
        """Let go of vLLM's rows (at shutdown, once no job runs): an array over them
        keeps vLLM's mapping exported, and vLLM could not close it."""
        self._rows = np.empty((0, self._rows.shape[1]), dtype=self._rows.dtype)

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
                self._staging = await Staging.register(client, self._per_round, self._rows.shape[1])
            except DaemonError as exc:
                if exc.code not in NO_REGIONS:
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
        async with staging.lock:
            for first in range(0, len(keys), staging.rows):
                chunk = ids[first : first + staging.rows]
                np.take(self._rows, chunk, axis=0, out=staging.array[: len(chunk)])
                done = await client.region_store(
                    staging.region, keys[first : first + len(chunk)], staging.offsets[: len(chunk)]
                )
                held = held and all(done)
        return held
