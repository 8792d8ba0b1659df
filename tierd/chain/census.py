"""Ready blocks per level by key prefix, kept up to date from the chain's own events.

A daemon asks how many blocks each namespace (the first bytes of a key) holds in each
tier. Counting that by a pass over every index costs time that grows with the blocks
held (about 0.2 s per million, on the event loop, whenever any member asks). A
:class:`PrefixCensus` instead adds up the events the chain publishes anyway: a
``STORED`` batch adds its keys' prefixes, a ``REMOVED`` batch takes them away, at C speed
per batch (one ``Counter`` of the keys' prefixes). Reading it costs the number of
prefixes, not the number of blocks.

Blocks that enter a tier without an event (adopted after a restart: they were announced
before it) are noticed by a cheap check on every read, the number of blocks counted
against the tier's number of ready blocks, and that level alone is counted again, once
its adoption has ended: while a restart still adopts kept blocks in the background (in
slices, at a bounded rate), a recount on every read would be a pass over the index per
request again, so until then the adopted blocks are missing from the figures (the
tier's ``adopting`` figure says how many are still to come).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from operator import itemgetter

from tierd.events import EventKind, TierEvent
from tierd.tier import Tier

__all__ = ["PrefixCensus"]


class PrefixCensus:
    """Ready blocks of each tier by the first ``length`` bytes of their keys."""

    def __init__(self, length: int, tiers: Sequence[Tier]) -> None:
        if length <= 0:
            raise ValueError(f"a prefix is at least one byte, got {length}")
        self.length = length
        self._cut = itemgetter(slice(0, length))
        self._tiers = list(tiers)
        self._counts: list[Counter[bytes]] = [Counter() for _ in self._tiers]
        self._totals = [0] * len(self._tiers)
        self.recounts = 0  # whole-index passes made (one per level at the start)
        for index in range(len(self._tiers)):
            self._recount(index)

    def seen(self, index: int, events: Iterable[TierEvent]) -> None:
        """Add the events level ``index`` just published."""
        counts = self._counts[index]
        for event in events:
            delta = Counter(map(self._cut, event.keys))
            if event.kind is EventKind.STORED:
                counts.update(delta)
                self._totals[index] += len(event.keys)
                continue
            for prefix, gone in delta.items():
                left = counts.get(prefix, 0) - gone
                if left > 0:
                    counts[prefix] = left
                else:
                    counts.pop(prefix, None)
            self._totals[index] -= len(event.keys)

    def counts(self, index: int) -> Counter[bytes]:
        """Ready blocks of level ``index`` by prefix (a copy: O(prefixes))."""
        self._check(index)
        return Counter(self._counts[index])

    def held(self, index: int, prefix: bytes) -> int:
        """Ready blocks of level ``index`` whose keys start with ``prefix`` (of the
        census's length)."""
        self._check(index)
        return self._counts[index].get(prefix, 0)

    def _check(self, index: int) -> None:
        tier = self._tiers[index]
        if tier.adopting:
            return  # adoption still runs: counting again on every read would cost a pass
        if self._totals[index] != len(tier) - tier.stats().writing:
            self._recount(index)  # blocks came in without an event: adopted at a restart

    def _recount(self, index: int) -> None:
        tier = self._tiers[index]
        if tier.stats().writing:  # blocks being written are not ready: their event adds them
            counts = Counter(map(self._cut, tier.ready_keys()))
        else:
            counts = tier.count_prefixes(self.length)  # at C speed
        self._counts[index] = counts
        self._totals[index] = counts.total()
        self.recounts += 1
