"""Moving SGLang's host pages to and from the daemon, each call under a deadline.

Two paths:

- **memfd hand-off, for stores** (SGLang's host pool allocated with ``"allocator":
  "shm"``): the pool's file descriptor is registered with the daemon once per connection
  (``Client.register_region``); a store is then one request of keys and byte offsets
  (``region_store``) and the daemon reads the pages with positional syscalls. A read
  still under way when the call gives up is harmless to SGLang, and the daemon keeps
  nothing it read past the job's ``expires``.
- **leases, for every load** (and for stores with any other allocator): the daemon's
  pool slots are mapped into this process; a load pins slots (``prepare_load``) and a
  store reserves them (``prepare_store``), and the page bytes are copied between those
  slots and SGLang's host pool on the **caller's thread**, after the daemon's part has
  answered and before the call returns.

So nothing writes into SGLang's host pool but SGLang's own thread, inside the call:
once a deadline has expired, no byte of ours lands in pages SGLang may reuse at once.
(A ``region_load`` into SGLang's pool could not promise that: a daemon copy call that
started before the deadline may end after it, 8 MiB pieces landed up to 61 ms late.) Everything that
waits on the daemon goes through :meth:`DaemonLink.ask` (a deadline, a breaker).

Every method raises only :class:`~tierd.errors.TierdError` and ``OSError``; the backend
turns them into misses and failed sets.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tierd.client import Client, DaemonError, LoadLease, StoreLease
from tierd.errors import TierdError
from tierd.integrations.link import DaemonLink
from tierd.integrations.sglang_log import SglangLog
from tierd.integrations.sglang_pages import PageGeometry, gather_page, page_key, scatter_page

__all__ = ["PageJobs"]

log = SglangLog("tierd.integrations.sglang")
Offsets = npt.NDArray[np.uint64]
# A clear asks again while some blocks are in use (a load lease lives for one copy): at
# most this many times, pausing a little longer each time.
_CLEAR_TRIES = 5
_CLEAR_PAUSE_S = 0.05


class PageJobs:
    """Stores, loads and lookups of pages of one host pool through one link."""

    def __init__(
        self,
        link: DaemonLink,
        geometry: PageGeometry,
        *,
        fd: int | None,
        lookup_deadline_s: float,
        job_deadline_s: float,
    ) -> None:
        self.link = link
        self.geometry = geometry
        self.memory = geometry.memory()
        self.lookup_deadline_s = lookup_deadline_s
        self.job_deadline_s = job_deadline_s
        self._fd = fd
        self._region_size = os.fstat(fd).st_size if fd is not None else 0
        self._region: tuple[Client, int] | None = None
        self.zero_copy = fd is not None
        self.lease_bound = 0  # the daemon's max_lease_blocks, from its hello (0: unknown)

    def learn(self, info: dict[str, Any]) -> None:
        """Take the bounds of the daemon's hello (called once connected)."""
        self.lease_bound = int(info.get("max_lease_blocks") or 0)

    # -- lookups --------------------------------------------------------------------

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the daemon holds ready."""
        if not keys:
            return 0

        async def op(client: Client) -> int:
            return int((await client.lookup(keys)).count)

        return self.link.ask(op, self.lookup_deadline_s)

    def touch_sequence(self, prefix: Sequence[str], pages: Sequence[bytes]) -> None:
        """Mark SGLang's page sequence (the hashes ``prefix``, then the keys ``pages``;
        head first) used, without waiting for the answer: its head ends up the most
        recent at every level of the daemon that holds it, so the daemon drops the
        sequence's tail before its head (a kept tail whose head is gone is never
        served). One conversion per prefix hash."""
        keys = [page_key(k) for k in prefix]
        keys += pages

        async def touch(client: Client) -> None:
            # The order only: a call is not a request, so no use is counted for admission
            # rules (a prefix would count once per call).
            await client.touch(keys, uses=False)

        self.link.start(touch, self.lookup_deadline_s).add_done_callback(_ignore_outcome)

    # -- the memfd hand-off -----------------------------------------------------------

    async def _region_of(self, client: Client) -> int:
        """This connection's id of the host pool's region (registered on first use: a
        region dies with the connection that registered it)."""
        if self._region is not None and self._region[0] is client:
            return self._region[1]
        if self._fd is None:
            raise TierdError("the host pool has no file descriptor to hand over")
        try:
            region = await client.register_region(self._fd, self._region_size)
        except DaemonError as exc:  # refused, not lost: copy through leases from now on
            self.zero_copy = False
            log.warning(
                "tierd refused SGLang's host pool memfd; pages are copied through its pool",
                error=str(exc),
            )
            raise
        self._region = (client, region)
        return region

    def region_store(self, keys: Sequence[bytes], offsets: Offsets) -> list[bool]:
        """``region_store`` of ``keys`` at ``offsets``. There is no region load: a load
        into SGLang's own pages must not be written by the daemon (see the module's
        docstring)."""
        pieces = list(self.geometry.pieces)
        # SGLang may reuse these pages once the call gives up: the daemon starts no copy
        # past then, and keeps nothing it read after it.
        expires = time.monotonic() + self.job_deadline_s

        async def op(client: Client) -> list[bool]:
            region = await self._region_of(client)
            return await client.region_store(region, keys, offsets, pieces, expires)

        return self.link.ask(op, self.job_deadline_s)

    # -- leases -----------------------------------------------------------------------

    def _chunk(self, total: int) -> int:
        """Keys per lease: half of what one connection may hold (a store and a load of
        the same link may both hold leases)."""
        return max(1, min(total, self.lease_bound // 2 or total))

    def lease_load(self, keys: Sequence[bytes], offsets: Offsets) -> list[bool]:
        """Load the leading keys the daemon holds into their pages, chunk by chunk."""
        done = [False] * len(keys)
        start = 0
        while start < len(keys):
            chunk = list(keys[start : start + self._chunk(len(keys) - start)])
            count = self._load_chunk(chunk, offsets[start : start + len(chunk)])
            done[start : start + count] = [True] * count
            if count < len(chunk):
                break  # SGLang uses the leading pages only
            start += count
        return done

    def _load_chunk(self, keys: list[bytes], offsets: Offsets) -> int:
        async def pin(client: Client) -> LoadLease:
            return await client.prepare_load(keys)

        lease = self.link.ask(pin, self.job_deadline_s)
        try:
            if lease.keys != keys[: lease.count]:  # a repeated key: nothing is guessed
                return 0
            for i, view in enumerate(lease.views()):
                scatter_page(self.memory, offsets[i], self.geometry.pieces, view)
            return lease.count
        finally:
            self._release(lease)

    def _release(self, lease: LoadLease) -> None:
        """Unpin without waiting (a lost release is undone when the connection ends)."""

        async def release(client: Client) -> None:
            await lease.release()

        future = self.link.start(release, self.job_deadline_s)
        future.add_done_callback(_ignore_outcome)

    def lease_store(self, keys: Sequence[bytes], offsets: Offsets) -> list[bool]:
        """Store the pages of ``keys``, chunk by chunk; per key whether the daemon holds
        it now (a failed chunk fails its keys and every later one)."""
        done = [False] * len(keys)
        start = 0
        while start < len(keys):
            chunk = list(keys[start : start + self._chunk(len(keys) - start)])
            self._store_chunk(chunk, offsets[start : start + len(chunk)])
            done[start : start + len(chunk)] = [True] * len(chunk)
            start += len(chunk)
        return done

    def _store_chunk(self, keys: list[bytes], offsets: Offsets) -> None:
        def fill(lease: StoreLease) -> None:
            for view, i in zip(lease.views(), lease.to_write, strict=True):
                gather_page(self.memory, offsets[i], self.geometry.pieces, view)

        self._store(keys, fill)

    def _store(self, keys: list[bytes], fill: Callable[[StoreLease], None]) -> None:
        """Reserve ``keys``, let ``fill`` write the views the daemon wants (none when it
        holds every key already) and commit; a fill that raises aborts the lease."""

        async def reserve(client: Client) -> StoreLease:
            return await client.prepare_store(keys)

        lease = self.link.ask(reserve, self.job_deadline_s)
        if lease.finished:
            return  # the daemon holds (or is being given) every key already
        try:
            fill(lease)
        except BaseException:
            self._abort(lease)
            raise

        async def commit(client: Client) -> int:
            return await lease.commit()

        self.link.ask(commit, self.job_deadline_s)

    def _abort(self, lease: StoreLease) -> None:
        async def abort(client: Client) -> None:
            await lease.abort()

        self.link.start(abort, self.job_deadline_s).add_done_callback(_ignore_outcome)

    # -- whole blocks (SGLang's generic get/set) -------------------------------------

    def get_block(self, key: bytes, out: Any) -> bool:
        """Copy the block of ``key`` into ``out`` (a writable buffer of a block)."""

        async def pin(client: Client) -> LoadLease:
            return await client.prepare_load([key])

        lease = self.link.ask(pin, self.job_deadline_s)
        try:
            if lease.count != 1:
                return False
            np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(lease.views()[0], np.uint8)
            return True
        finally:
            self._release(lease)

    def put_block(self, key: bytes, data: Any) -> bool:
        """Store ``data`` (a buffer of a block) under ``key``."""

        def fill(lease: StoreLease) -> None:
            lease.views()[0][:] = data

        self._store([key], fill)
        return True

    # -- the whole namespace (SGLang's clear) ----------------------------------------

    def clear(self, deadline_s: float) -> tuple[int, int]:
        """Delete every block of the link's namespace from the daemon's tiers (the
        daemon's ``delete`` of ``all``, which a member may send for its own namespace),
        asking again while some are in use; ``(removed, still in use)``. Raises what
        the link raises (:class:`~tierd.client.Unreachable` past ``deadline_s``)."""

        async def delete(client: Client) -> tuple[int, int]:
            removed = busy = 0
            for attempt in range(_CLEAR_TRIES):
                if attempt:
                    await asyncio.sleep(_CLEAR_PAUSE_S * attempt)
                done = await client.delete(everything=True)
                removed += int(done["removed"])
                busy = int(done["busy"])
                if not busy:
                    break
            return removed, busy

        return self.link.call(self.link.run(delete), deadline_s)

    def close(self) -> None:
        """Forget the region (the daemon drops it with the connection)."""
        self._region = None


def _ignore_outcome(future: Any) -> None:
    """A fire-and-forget release, abort or touch: its failure changes nothing for SGLang
    (the daemon releases a lost connection's leases itself; a touch is a hint), so it is
    only logged."""
    if not future.cancelled() and future.exception() is not None:
        log.debug("tierd request not answered in time", error=str(future.exception()))
