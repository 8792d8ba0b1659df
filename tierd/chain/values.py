"""Values of the chain: levels, admission rules, lookup results and chain counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd.keys import Medium
from tierd.policy.admission import Admission
from tierd.stores import BlockStore
from tierd.tier import Tier

__all__ = ["Admission", "ChainStats", "Deleted", "FlushResult", "Level", "LookupResult"]


@dataclass(slots=True)
class Level:
    """One level of the chain: bookkeeping, bytes, and how blocks move down from it."""

    tier: Tier
    store: BlockStore
    write_through: bool = False
    admission: Admission = field(default_factory=Admission)
    write_behind: bool = False  # stored blocks copied down in the background (chain.behind)
    demotions: int = 0  # blocks copied down from this level on eviction
    written_behind: int = 0  # blocks copied down from this level behind stores
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


@dataclass(frozen=True, slots=True)
class Deleted:
    """What a delete did: keys ``removed`` (from every level that held them), and keys
    kept whole because a level was writing or reading them (``busy``: ask again)."""

    removed: int
    busy: int


@dataclass(frozen=True, slots=True)
class FlushResult:
    """What a flush did: blocks ``copied`` down, and per tier the blocks that are still
    ``dirty`` (held there and not in the tier below) with the failed writes behind them."""

    copied: int
    dirty: dict[str, int] = field(default_factory=dict)  # tier name -> blocks still dirty
    write_errors: dict[str, int] = field(default_factory=dict)  # tier name -> failed writes

    @property
    def left_dirty(self) -> int:
        return sum(self.dirty.values())

    def plus(self, other: FlushResult) -> FlushResult:
        """Both flushes in one result (several chains of the same tiers)."""

        def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {name: a.get(name, 0) + b.get(name, 0) for name in {**a, **b}}

        return FlushResult(
            self.copied + other.copied,
            add(self.dirty, other.dirty),
            add(self.write_errors, other.write_errors),
        )

    @property
    def reason(self) -> str:
        """Why blocks stayed dirty, in one line ("" when none did)."""
        if not self.dirty:
            return ""
        parts = [f"{n} failed writes into tier {name}" for name, n in self.write_errors.items()]
        if not parts or self.left_dirty > sum(self.write_errors.values()):
            below = ", ".join(self.dirty)
            parts.append(
                f"no room below tier {below}: the tier below is full of pinned or in-flight"
                " blocks, or smaller than what it must hold"
            )
        return "; ".join(parts)
