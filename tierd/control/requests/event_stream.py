"""One connection's event subscription: batches from its tenant's chain (or, for an
operator without a namespace, from every tenant's), pushed to the client.

Each chain's event bus gives the subscription a bounded queue of batches; a pump per
chain waits while the client's socket is full (``writable`` cleared), so a client that
does not read loses batches, counted in each push's ``dropped``, and never grows the
daemon. A namespaced connection sees only its namespace's keys, without the prefix; a
connection without one sees raw keys, and across tenants each event names its tenant.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tierd.events import Subscription, TierEvent

if TYPE_CHECKING:
    from tierd.chain import TierChain

__all__ = ["EventStream"]


class EventStream:
    """The pumps of one connection's subscription; ``close`` stops them all."""

    def __init__(
        self,
        chains: Sequence[tuple[str, TierChain]],
        *,
        prefix: bytes,
        queue_batches: int,
        writable: asyncio.Event,
        send: Callable[[dict[str, Any]], None],
        is_closed: Callable[[], bool],
    ) -> None:
        self._prefix = prefix
        self._writable = writable
        self._send = send
        self._is_closed = is_closed
        self._named = len(chains) > 1  # events name their tenant when several can come
        self._subscriptions: list[Subscription] = []
        self._pumps: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        for name, chain in chains:
            subscription = chain.bus.subscribe(queue_batches)
            self._subscriptions.append(subscription)
            self._pumps.append(loop.create_task(self._pump(name, subscription)))

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        # Closed here, not only in the pump's ``finally``: a pump cancelled before its
        # first step (subscribe and unsubscribe in one read) never runs that block.
        for subscription in self._subscriptions:
            subscription.close()
        self._pumps, self._subscriptions = [], []

    async def _pump(self, tenant: str, subscription: Subscription) -> None:
        try:
            async for batch in subscription:
                await self._writable.wait()
                events = [e for e in (self._fields(tenant, ev) for ev in batch) if e is not None]
                if events and not self._is_closed():
                    push = {"push": "events", "events": events, "dropped": subscription.dropped}
                    self._send(push)
        finally:
            subscription.close()

    def _fields(self, tenant: str, event: TierEvent) -> dict[str, Any] | None:
        prefix = self._prefix
        if prefix:
            size = len(prefix)
            keys = [k[size:] for k in event.keys if k[:size] == prefix]
            if not keys:
                return None
        else:
            keys = list(event.keys)
        fields = {
            "kind": str(event.kind),
            "medium": str(event.medium),
            "tier": event.tier,
            "keys": keys,
        }
        if self._named:
            fields["tenant"] = tenant
        return fields
