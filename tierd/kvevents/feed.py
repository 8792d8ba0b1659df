"""From the tiers' events to the routers' wire: :class:`EventFeed`.

The feed follows each published tenant's chain (a bounded listener of its event bus,
handed each turn's batches in one call: a feed that falls behind loses batches, counted,
and never slows the chain), keeps the tenant's
:class:`~tierd.kvevents.book.DescriptorBook` up to date with where each described block
is, and turns each tier event into ``BlockStored`` / ``BlockRemoved`` events of the
engines' own format, the tier's medium named as the engines name it (``media``). A block
that was never described is not announced (a store without tokens is a placeholder
routers drop); it is counted in ``undescribed``.

Each tenant has a stream of its own (:class:`Stream`: its
:class:`~tierd.kvevents.publisher.Publisher`, its sockets): a tenant's descriptions credit
only its own stream, and who may read it is the operator's choice for that tenant. Events
are gathered into one batch, offered to the tenant's publisher at the end of the loop's
turn, or ``batch_s`` after the stream's last batch when that is later (so no event waits
longer than ``batch_s``, and a busy stream sends a batch per ``batch_s``, not one per
turn), or at once at ``max_batch_events``: a sequence number each, a gap when the
publisher's queue is full. A block's events are made from its description's row by the
level's :class:`~tierd.kvevents.wire.Framer`, the book's maps walked once per tier event
(a store of 16 blocks is one), never decoding a description. Every start
is a new incarnation: the first batch is ``AllBlocksCleared``, numbered past every batch of
the incarnations before (a batch's number starts from the microseconds since the epoch at
start: a consumer that stayed connected sees a gap forward, never a step back), and once
the chains have adopted the blocks their disk tiers kept, the descriptions read
back from disk are announced for the blocks held again, and dropped for the others.

Those batches go out before a subscriber that stayed connected across the restart is back
(ZMQ reconnects it a moment later): so whenever subscribers join, or come back, the stream
publishes a snapshot, ``AllBlocksCleared`` and every block the chain holds, rate-bounded.
A router then ends up with exactly what the node holds, whatever it missed (SMG's relay,
which ends its stream on a gap it cannot replay, subscribes again and gets one too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierd.events import EventKind, Listener, TierEvent
from tierd.keys import BlockKey
from tierd.kvevents import wire
from tierd.kvevents.book import DescriptorBook, Entry
from tierd.kvevents.book_file import BookFile
from tierd.logs import get_logger
from tierd.maps import TAG_BITS
from tierd.turns import INDEX_KEYS, next_turn

if TYPE_CHECKING:
    from tierd.chain import TierChain
    from tierd.kvevents.publisher import Publisher

__all__ = ["EventFeed", "FeedSettings", "KvTenant", "Stream"]

log = get_logger("tierd.kvevents")
ADOPTION_POLL_S = 0.5
SNAPSHOT_GATHER_S = 0.2  # the subscriptions of one wave of (re)connections, one snapshot
SNAPSHOT_GAP_S = 1.0  # between two snapshots at least,
SNAPSHOT_SHARE = 0.05  # and long enough that snapshots take this share of the time at most


@dataclass(frozen=True, slots=True)
class FeedSettings:
    media: dict[str, str]  # tierd's medium -> the engines' name for it
    locality: str | None = "LOCAL"
    batch_s: float = 0.005  # the config's default (tierd.config.kv_events)
    max_batch_events: int = 1024
    queue_batches: int = 4096  # of the chain's bus, per tenant


@dataclass(slots=True)
class Stream:
    """One tenant's stream: its publisher, the events gathered for its next batch, and
    ``subscribed``, set (from the publisher's thread) when a subscriber joined."""

    publisher: Publisher
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)
    out: list[bytes] = field(default_factory=list)
    flush: asyncio.Handle | None = None
    sent_at: float = float("-inf")  # the loop's time of the last batch offered
    announced: int = 0
    snapshots: int = 0


@dataclass(slots=True)
class KvTenant:
    """One published tenant: its chain, its book (and the book's file, if kept), its
    stream."""

    name: str
    chain: TierChain
    book: DescriptorBook
    stream: Stream
    file: BookFile | None = None
    restored: list[BlockKey] = field(default_factory=list)
    bits: dict[str, int] = field(default_factory=dict)  # tier name -> its bit
    media: dict[int, str] = field(default_factory=dict)  # bit -> medium on the wire
    framers: dict[int, wire.Framer] = field(default_factory=dict)  # bit -> its events
    last: int = 0  # bits of the levels a block leaves the node from
    sweeper: asyncio.TimerHandle | None = None  # the next look at the book's pending

    def add_level(self, tier: str, bit: int, medium: str, locality: str | None) -> None:
        """The level of ``tier`` is ``bit``; its events name ``medium``."""
        if bit >> TAG_BITS:  # (a book keeps a block's levels in a tag of that many bits)
            raise ValueError(f"more than {TAG_BITS} levels in a chain publishing KV events")
        self.bits[tier] = bit
        self.media[bit] = medium
        self.framers[bit] = wire.Framer(medium, locality=locality)

    def bit_of(self, event: TierEvent, settings: FeedSettings) -> int:
        bit = self.bits.get(event.tier)
        if bit is None:  # a remote level: its own bit, and the bottom of the node's reach
            bit = 1 << len(self.bits)
            self.add_level(event.tier, bit, settings.media[str(event.medium)], settings.locality)
            self.last |= bit
        return bit

    def top_medium(self, mask: int) -> str:
        return self.media[mask & -mask]


class EventFeed:
    """Publishes the tenants' block events (see the module's docstring)."""

    def __init__(self, tenants: Sequence[KvTenant], settings: FeedSettings) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.settings = settings
        self.incarnation = secrets.token_hex(8)
        self.undescribed = 0
        self.tier_events_failed = 0  # not published: their taking failed (logged)
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[Listener] = []
        for tenant in tenants:
            self._map_levels(tenant)

    def _map_levels(self, tenant: KvTenant) -> None:
        levels, s = tenant.chain.levels, self.settings
        for i, level in enumerate(levels):
            tenant.add_level(level.tier.name, 1 << i, s.media[str(level.medium)], s.locality)
        if tenant.chain.remote is None:
            tenant.last = 1 << (len(levels) - 1)

    # -- running ------------------------------------------------------------------------

    def start(self) -> None:
        """On the loop: the new incarnation's first batch, then follow every chain."""
        loop = asyncio.get_running_loop()
        for tenant in self.tenants.values():
            tenant.stream.publisher.offer([wire.cleared()])
            self._listeners.append(
                tenant.chain.bus.listen(
                    functools.partial(self._follow, tenant), self.settings.queue_batches
                )
            )
            self._tasks.append(loop.create_task(self._snapshots(tenant)))
            if tenant.restored:
                self._tasks.append(loop.create_task(self._settle_restored(tenant)))
        log.info("kv events on", incarnation=self.incarnation, tenants=list(self.tenants))

    async def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        for tenant in self.tenants.values():
            if tenant.sweeper is not None:
                tenant.sweeper.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for tenant in self.tenants.values():
            self._send(tenant.stream)
            if tenant.file is not None:
                tenant.file.settle()  # a rewrite's parts left, at once: the book is still
                await asyncio.to_thread(tenant.file.close)

    def _follow(self, tenant: KvTenant, batches: list[list[TierEvent]]) -> None:
        """What the chain published in one turn; then a sweep, unless the one planned
        comes before anything these changes can make due. (A batch that fails is logged
        and the others are taken: the feed goes on.)"""
        for batch in batches:
            try:
                self._take(tenant, batch)
            except Exception:
                self.tier_events_failed += len(batch)
                log.exception("kv events: tier events not published", tenant=tenant.name)
        timer = tenant.sweeper
        if timer is None or (
            timer.when() - asyncio.get_running_loop().time() > tenant.book.soonest_s
        ):
            self._sweep(tenant)

    def _sweep(self, tenant: KvTenant) -> None:
        """Drop what is due, and look again when the next pending description is."""
        book = tenant.book
        book.sweep()
        due = book.next_due()
        if due is None:
            return
        timer = tenant.sweeper
        if timer is not None and timer.when() - asyncio.get_running_loop().time() <= (
            due - book.clock()
        ):
            return  # an earlier look is planned already
        if timer is not None:
            timer.cancel()
        delay = max(0.0, due - book.clock()) + 0.01
        tenant.sweeper = asyncio.get_running_loop().call_later(delay, self._swept, tenant)

    def _swept(self, tenant: KvTenant) -> None:
        tenant.sweeper = None
        self._sweep(tenant)

    def _take(self, tenant: KvTenant, events: list[TierEvent]) -> None:
        book, out, bits = tenant.book, tenant.stream.out, tenant.bits
        for event in events:
            bit = bits.get(event.tier) or tenant.bit_of(event, self.settings)
            framer = tenant.framers[bit]
            if event.kind is EventKind.STORED:
                rows = book.stored_rows(event.keys, bit)
                self.undescribed += rows.count(None)
                out += map(framer.stored, filter(None, rows))
            else:
                rows = book.removed_rows(event.keys, bit, last=bool(bit & tenant.last))
                out += map(framer.removed, filter(None, rows))
        self._sent_soon(tenant.stream)

    def described(
        self, tenant: KvTenant, keys: Sequence[BlockKey], entries: Sequence[Entry]
    ) -> None:
        """Descriptions came for ``keys``: keep them, and announce each block where the
        chain holds it already (it was stored before it was described)."""
        tenant.book.put_all(keys, entries)
        self._announce_held(tenant, keys)
        self._sent_soon(tenant.stream)

    @staticmethod
    def _announce_held(tenant: KvTenant, keys: Sequence[BlockKey]) -> None:
        """A ``BlockStored`` for each level holding each of ``keys`` that the book has
        not counted there yet (each key's, top level first)."""
        book, out = tenant.book, tenant.stream.out
        for i, level in enumerate(tenant.chain.levels):
            held = level.tier.ready(keys)
            if held:
                bit = 1 << i
                stored = tenant.framers[bit].stored
                for key in held:
                    if (row := book.mark(key, bit)) is not None:
                        out.append(stored(row))

    async def _settle_restored(self, tenant: KvTenant) -> None:
        """Once every level has adopted its kept blocks: announce the restored
        descriptions of blocks held again, drop the others."""
        levels = tenant.chain.levels
        # Adoption is the chain's background task and signals nothing: a look every half
        # second costs nothing next to it.
        while any(level.tier.adopting for level in levels):  # noqa: ASYNC110
            await asyncio.sleep(ADOPTION_POLL_S)
        keys, tenant.restored = tenant.restored, []
        for start in range(0, len(keys), INDEX_KEYS):  # the loop's turn between slices
            book = tenant.book
            kept = [key for key in keys[start : start + INDEX_KEYS] if key in book]
            self._announce_held(tenant, kept)
            for key in kept:
                if book.mask_of(key) == 0:
                    book.drop(key)
            self._sent_soon(tenant.stream)
            await next_turn()
        log.info(
            "kv events: restored descriptions settled", tenant=tenant.name, kept=len(tenant.book)
        )

    async def _snapshots(self, tenant: KvTenant) -> None:
        """A snapshot of what the tenant's chain holds each time subscribers joined (see
        :meth:`_snapshot`), at most one a second and 5 % of the time."""
        stream = tenant.stream
        while True:
            await stream.subscribed.wait()
            await asyncio.sleep(SNAPSHOT_GATHER_S)
            stream.subscribed.clear()
            began = time.monotonic()
            await self._snapshot(tenant)
            took = time.monotonic() - began
            await asyncio.sleep(max(SNAPSHOT_GAP_S, took / SNAPSHOT_SHARE - took))

    async def _snapshot(self, tenant: KvTenant) -> None:
        """``AllBlocksCleared``, then a ``BlockStored`` on each medium holding it for every
        described block the chain holds, a part of the book a turn. A subscriber that
        joins (or comes back, after a restart of either side) ends up with what the node
        holds, whatever it missed; one that was following gets it again. A block that
        changes meanwhile is announced live as well, in order."""
        stream, framers = tenant.stream, tenant.framers
        self._send(stream)  # what was gathered before goes first
        stream.out.append(wire.cleared())
        for part in tenant.book.held_parts():
            for row, mask in part:
                while mask:
                    bit = mask & -mask
                    mask ^= bit
                    stream.out.append(framers[bit].stored(row))
            self._sent_soon(stream)
            await next_turn()
        self._send(stream)
        stream.snapshots += 1

    def _sent_soon(self, stream: Stream) -> None:
        """Plan the offer of what ``stream`` gathered: at the end of this turn, or
        ``batch_s`` after its last batch if that is later; at once when it is full."""
        if len(stream.out) >= self.settings.max_batch_events:
            self._send(stream)
        elif stream.out and stream.flush is None:
            loop = asyncio.get_running_loop()
            wait = stream.sent_at + self.settings.batch_s - loop.time()
            if wait > 0:
                stream.flush = loop.call_later(wait, self._send, stream)
            else:
                stream.flush = loop.call_soon(self._send, stream)

    def _send(self, stream: Stream) -> None:
        if stream.flush is not None:
            stream.flush.cancel()
            stream.flush = None
        out, limit = stream.out, self.settings.max_batch_events
        if not out:
            return
        stream.out = []
        for start in range(0, len(out), limit):
            chunk = out[start : start + limit] if len(out) > limit else out
            stream.announced += len(chunk)
            stream.publisher.offer(chunk)
        with contextlib.suppress(RuntimeError):  # (no loop: closing)
            stream.sent_at = asyncio.get_running_loop().time()

    # -- figures ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The totals of every stream, ``streams`` (each tenant's addresses and figures),
        and, with one stream, its addresses and next sequence number at the top as well."""
        books = [t.book for t in self.tenants.values()]
        streams = {
            name: {
                "endpoint": t.stream.publisher.endpoint,
                "replay_endpoint": t.stream.publisher.replay_endpoint,
                "events": t.stream.announced,
                "snapshots": t.stream.snapshots,
                **t.stream.publisher.stats(),
            }
            for name, t in self.tenants.items()
        }
        totals: dict[str, Any] = {}
        for figures in streams.values():
            for key, value in figures.items():
                if isinstance(value, int) and key != "sequence":
                    totals[key] = totals.get(key, 0) + value
        if len(streams) == 1:
            (only,) = streams.values()
            for key in ("endpoint", "replay_endpoint", "sequence"):
                totals[key] = only[key]
        return {
            "incarnation": self.incarnation,
            **totals,
            "streams": streams,
            "undescribed": self.undescribed,
            "tier_events_failed": self.tier_events_failed,
            "bus_dropped": sum(s.dropped for s in self._listeners),
            "described": sum(len(b) for b in books),
            "descriptor_bytes": sum(b.bytes_used for b in books),
            "descriptors_evicted": sum(b.evicted for b in books),
        }
