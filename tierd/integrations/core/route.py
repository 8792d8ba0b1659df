"""Which way each engine call takes: the one place that decides.

Every engine call goes over one transport, the calling thread's blocking connection
(:class:`~tierd.integrations.core.channel.EngineChannel`), and down one data path
(:mod:`tierd.integrations.core.data_paths`), the first of the engine's preferences that its
connection offers (:data:`PREFERENCES`, :func:`way`):

====================  ==========================================  =========================
call                  ways, first choice first                    why the first
====================  ==========================================  =========================
vLLM load             staged, lease, inline                       one round trip, the rows
                                                                  copied in bulk; vLLM maps
                                                                  no pool
vLLM store            staged, lease, inline                       vLLM's rows are reused
                                                                  once a job ends: the
                                                                  daemon reads a copy
SGLang load           lease, staged, inline                       one copy, on SGLang's own
                                                                  thread
SGLang store          lease, engine region, staged, inline        one copy, on SGLang's own
                                                                  thread (numpy, the GIL let
                                                                  go), its own CPU's; engine
                                                                  region where the daemon
                                                                  has no pool: the daemon
                                                                  reads the host pool's
                                                                  memfd (``"allocator":
                                                                  "shm"``)
====================  ==========================================  =========================

SGLang's stores went the engine-region way first until the paired bench showed the
daemon's reads of the memfd at 0.43x of a memcpy of the same pages against 0.88x for
the lease copy (``scripts/bench sglang``, docs/BENCHMARKS.md); the lease copy also
spends the tenant's own thread, not the daemon's copy threads that every tenant shares.

A way is offered when the connection has what it needs: the daemon's regions (staged,
engine region: not refused yet), the engine's memfd (engine region), the daemon's pool
mapped (lease); inline always. A load never reads into the engine's own memfd: a copy
under way at the deadline could land in pages the engine has reused, so loads copy on
the caller's thread. While the breaker is open no call is sent
(:meth:`~tierd.integrations.core.channel.EngineChannel.call`).
"""

from __future__ import annotations

import enum
from typing import Literal

__all__ = ["PREFERENCES", "Way", "way"]

Engine = Literal["vllm", "sglang"]
Op = Literal["load", "store"]


class Way(enum.Enum):
    STAGED = "staged"  # region requests through the connection's own memfd
    ENGINE_REGION = "engine_region"  # the daemon reads the engine's memfd (stores)
    LEASE = "lease"  # the daemon's pool mapped here, the caller's thread copies
    INLINE = "inline"  # the bytes in the messages


PREFERENCES: dict[tuple[Engine, Op], tuple[Way, ...]] = {
    ("vllm", "load"): (Way.STAGED, Way.LEASE, Way.INLINE),
    ("vllm", "store"): (Way.STAGED, Way.LEASE, Way.INLINE),
    ("sglang", "load"): (Way.LEASE, Way.STAGED, Way.INLINE),
    ("sglang", "store"): (Way.LEASE, Way.ENGINE_REGION, Way.STAGED, Way.INLINE),
}


def way(engine: Engine, op: Op, *, regions: bool, engine_region: bool, pool: bool) -> Way:
    """The way ``engine``'s ``op`` takes on a connection that offers ``regions`` (the
    daemon has not refused them), the engine's own memfd (``engine_region``) and the
    daemon's pool mapped (``pool``)."""
    offered = {
        Way.STAGED: regions,
        Way.ENGINE_REGION: regions and engine_region and op == "store",
        Way.LEASE: pool,
        Way.INLINE: True,
    }
    return next(w for w in PREFERENCES[(engine, op)] if offered[w])
