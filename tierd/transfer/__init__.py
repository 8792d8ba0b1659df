"""Copies of blocks between two stores, routed by (source medium, destination medium).

:class:`TransferEngine` owns three things: the route table (which handler moves bytes from
one medium to another), a byte budget per route (how many bytes may be in flight on it),
and a pinned staging area for the routes that need one (GPU <-> DISK). It never touches a
tier: the caller prepares slots, awaits :meth:`TransferEngine.copy`, and completes.

A handler moves a block with one store operation where the other store offers zero-copy
slot views (``disk.read`` into CPU views, ``gpu.write`` from CPU views: no staging copy),
else with two through staging. Guarantees:

- per-block success: a block counts as copied only when its read from the source and its
  write to the destination both succeeded;
- a batch larger than its route's budget is split into chunks; in-flight bytes per route
  never exceed the budget (a single block larger than the budget runs alone);
- cancelling the awaiting task waits for the store operation already started to finish
  (so no byte lands in a slot after the caller released it), starts no further one,
  returns the budget, then re-raises :class:`asyncio.CancelledError`.

Modules: :mod:`~tierd.transfer.engine` (the engine, its route table and handlers),
:mod:`~tierd.transfer.budget` (byte budgets and per-route counters),
:mod:`~tierd.transfer.staging` (staging areas and the zero-copy buffers of a batch).
"""

from tierd.transfer.budget import ByteBudget, Route, RouteStats
from tierd.transfer.engine import TransferEngine
from tierd.transfer.staging import StagingFactory

__all__ = ["ByteBudget", "Route", "RouteStats", "StagingFactory", "TransferEngine"]
