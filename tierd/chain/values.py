"""Values of the chain: levels, admission rules, lookup results and chain counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd.keys import Medium
from tierd.policy.admission import Admission
from tierd.stores import BlockStore
from tierd.tier import Tier

__all__ = ["Admission", "ChainStats", "Level", "LookupResult"]


@dataclass(slots=True)
class Level:
    """One level of the chain: bookkeeping, bytes, and how blocks move down from it."""

    tier: Tier
    store: BlockStore
    write_through: bool = False
    admission: Admission = field(default_factory=Admission)
    demotions: int = 0  # blocks copied down from this level on eviction
    promotions: int = 0  # blocks copied up into this level
    dropped: int = 0  # dirty blocks lost at eviction (no level below, refused, or failed)
    refused: int = 0  # demotions into this level refused by admission or capacity
    io_errors: int = 0  # blocks whose copy into or out of this level failed

    @property
    def medium(self) -> Medium:
        return self.tier.medium


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``count`` leading keys are ready somewhere; ``levels[i]`` is the highest level that
    holds key *i*; ``in_flight`` says the first key not ready is being written (retry)."""

    count: int
    levels: tuple[int, ...]
    media: tuple[Medium, ...]
    in_flight: bool


@dataclass(frozen=True, slots=True)
class ChainStats:
    lookups: int
    hit_blocks: int
    miss_blocks: int
    hits_by_medium: dict[str, int]
    hits_by_level: tuple[int, ...]  # block hits served by each level (its highest holder)
    events_published: int
    events_dropped: int
