"""Moving SGLang's host pages to and from the daemon, each call under a deadline.

Every call goes through the backend's :class:`~tierd.integrations.core.engine_calls.EngineCalls`:
on the calling SGLang thread's own blocking connection (SGLang's prefetch and backup
threads never wait on each other, nor on an event loop's thread), down the way
:mod:`tierd.integrations.core.route` picks for SGLang:

- **loads** copy out of the daemon's pool (leases, mapped into this process) on the
  caller's thread, inside the call. Nothing of the daemon's lands in SGLang's pages once
  the call has given up. (A ``region_load`` into SGLang's pool could not promise that: a
  daemon copy call that started before the deadline may end after it; 8 MiB pieces
  landed up to 61 ms late.)
- **stores** copy into the daemon's pool (leases) on the caller's thread, the same one
  copy. Only a daemon whose entry tier has no pool (not a CPU tier) is handed the host
  pool's memfd when SGLang allocated it so (``"allocator": "shm"``), registered once per
  connection; the daemon then reads the pages itself, and keeps nothing it read past the
  call's deadline (the job's ``expires``). A page of SGLang's generic calls is a copy of
  its own, not in the memfd: it goes through the connection's staging memfd instead.

Every method raises only :class:`~tierd.errors.TierdError` and ``OSError``; the backend
turns them into misses and failed sets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tierd.errors import TierdError
from tierd.integrations.core.data_paths import Blocks
from tierd.integrations.core.engine_calls import EngineCalls, memfd_of
from tierd.integrations.core.engine_log import EngineLog
from tierd.integrations.core.link import DaemonLink
from tierd.integrations.sglang.pages import FlatBlock, PageBlocks, PageGeometry, page_key

__all__ = ["PageJobs", "cpu_demand"]

log = EngineLog("tierd.integrations.sglang")
Offsets = npt.NDArray[np.uint64]
# A clear asks again while some blocks are in use (a load lease lives for one copy): at
# most this many times, pausing a little longer each time.
_CLEAR_TRIES = 5
_CLEAR_PAUSE_S = 0.05
_STAGING_BYTES = 64 << 20


class PageJobs:
    """Stores, loads and lookups of pages of one host pool, from SGLang's threads."""

    def __init__(
        self,
        link: DaemonLink,
        geometry: PageGeometry,
        *,
        fd: int | None,
        lookup_deadline_s: float,
        job_deadline_s: float,
    ) -> None:
        self.geometry = geometry
        self.memory = geometry.memory()
        self.lookup_deadline_s = lookup_deadline_s
        self.job_deadline_s = job_deadline_s
        # Staging is the way of a daemon without a pool: 64 MiB of pages a round.
        self.calls = EngineCalls(
            link,
            "sglang",
            staging_rows=_STAGING_BYTES // geometry.page_bytes,
            map_pool=True,
            memfd=memfd_of(fd),
        )

    @property
    def zero_copy(self) -> bool:
        """Whether stores hand the daemon the host pool's memfd."""
        return self.calls.zero_copy

    # -- lookups --------------------------------------------------------------------

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the daemon holds ready, waiting at most
        :meth:`lookup_deadline`."""
        return self.calls.leading(keys, self.lookup_deadline()) if keys else 0

    def lookup_deadline(self) -> float:
        """``lookup_deadline_s`` of the engine's own time: stretched by how many times
        over the node's CPUs are asked for now (:func:`cpu_demand`), up to
        ``job_deadline_s``. A lookup's round trip is almost all waiting for a CPU on a
        busy node (the daemon's work is a fraction of a millisecond; docs/sglang.md), and
        SGLang's own threads wait as long: on an idle node a stopped daemon costs the
        deadline itself."""
        base = self.lookup_deadline_s
        return min(base * cpu_demand(), max(base, self.job_deadline_s))

    def touch_sequence(
        self, prefix: Sequence[str], pages: Sequence[bytes], deadline_s: float
    ) -> None:
        """Mark SGLang's page sequence (the hashes ``prefix``, then the keys ``pages``;
        head first) used, without waiting for the answer: its head ends up the most
        recent at every level of the daemon that holds it, so the daemon drops the
        sequence's tail before its head (a kept tail whose head is gone is never
        served). The order only: a call is not a request, so no use is counted for
        admission rules (a prefix would count once per call). Sent only on this thread's
        open connection and within ``deadline_s`` (what is left of the call's own
        deadline): a hint never costs the call a connection or its time."""
        if deadline_s <= 0 or self.calls.channel.here() is None:
            return
        keys = [page_key(k) for k in prefix]
        keys += pages
        try:
            self.calls.touch(keys, min(deadline_s, self.lookup_deadline_s), uses=False)
        except (TierdError, OSError) as exc:  # a hint: its loss changes nothing for SGLang
            log.debug("tierd touch not sent", error=str(exc))

    # -- pages ------------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], offsets: Offsets) -> list[bool]:
        """Load the leading keys the daemon holds into their pages."""
        blocks = PageBlocks(self.memory, offsets, self.geometry.pieces)
        loaded = self._leading(keys, blocks)
        return [i < loaded for i in range(len(keys))]

    def store(self, keys: Sequence[bytes], offsets: Offsets) -> list[bool]:
        """Store the pages of ``keys``; per key whether the daemon holds it now."""
        blocks = PageBlocks(self.memory, offsets, self.geometry.pieces)
        return self.calls.store(keys, blocks, self.job_deadline_s)

    def _leading(self, keys: Sequence[bytes], blocks: Blocks) -> int:
        """How many leading blocks of ``keys`` were loaded into ``blocks``; a load that
        copied nothing for another reason than misses raises it (a failed call)."""
        outcome = self.calls.load(keys, blocks, self.job_deadline_s, leading=True, cut_off=True)
        if outcome.error is not None and not outcome.loaded:
            raise _Failed(outcome.error)
        return len(outcome.loaded)

    # -- whole blocks (SGLang's generic get/set) -------------------------------------

    def get_block(self, key: bytes, out: Any) -> bool:
        """Copy the block of ``key`` into ``out`` (a writable buffer of a block)."""
        target = FlatBlock(np.frombuffer(out, dtype=np.uint8))
        return self._leading([key], target) == 1

    def put_block(self, key: bytes, data: Any) -> bool:
        """Store ``data`` (a buffer of a block) under ``key``."""
        source = FlatBlock(np.frombuffer(data, dtype=np.uint8))
        return all(self.calls.store([key], source, self.job_deadline_s))

    # -- the whole namespace (SGLang's clear) ----------------------------------------

    def clear(self, deadline_s: float) -> tuple[int, int]:
        """Delete every block of the namespace from the daemon's tiers (the daemon's
        ``delete`` of ``all``, which a member may send for its own namespace), asking
        again while some are in use; ``(removed, still in use)``. Raises what the
        connection raises (:class:`~tierd.client.Unreachable` past ``deadline_s``)."""
        return self.calls.delete_all(deadline_s, tries=_CLEAR_TRIES, pause_s=_CLEAR_PAUSE_S)

    def close(self) -> None:
        """Close every thread's connection (the daemon drops their regions and leases)."""
        self.calls.close()


def cpu_demand(loadavg: str = "/proc/loadavg") -> float:
    """How many times over the CPUs this process may run on are asked for: the node's
    runnable tasks now or its load over the last minute, whichever is higher, over those
    CPUs; at least 1 (a CPU to spare, or no ``/proc``). The count is the node's, not
    a container's: a cpuset smaller than the node reads as busier than it is (a longer
    wait, within ``job_deadline_s``), a CPU quota not at all."""
    try:
        with open(loadavg, "rb") as f:
            fields = f.read().split()
        running = int(fields[3].split(b"/")[0])
        demand = max(float(fields[0]), running - 1)  # less the reader itself
    except (OSError, IndexError, ValueError):
        return 1.0
    return max(1.0, demand / len(os.sched_getaffinity(0)))


class _Failed(TierdError):
    """A load that copied nothing, and why."""
