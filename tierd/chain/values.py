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
    copies_dropped: int = 0  # copies of blocks held above dropped for a demotion (chain.copies)
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
    ``dirty`` (held there and not in the tier below) with the failed writes behind them;
    with a remote level, the blocks sent to it (``remote_sent``) and, per remote level,
    those that did not land there, by cause (``remote_missed``: ``timeouts``, ``errors``,
    ``busy``, ``refused``, ...; ``tierd.remote.level.MISSED_CAUSES``)."""

    copied: int
    dirty: dict[str, int] = field(default_factory=dict)  # tier name -> blocks still dirty
    write_errors: dict[str, int] = field(default_factory=dict)  # tier name -> failed writes
    remote_sent: int = 0
    remote_missed: dict[str, dict[str, int]] = field(default_factory=dict)  # level -> causes
    remote_unread: int = 0  # blocks of the last tier that could not be read to be sent

    @property
    def left_dirty(self) -> int:
        return sum(self.dirty.values())

    @property
    def not_landed(self) -> int:
        """Blocks sent to the remote level that did not land on every level of it."""
        worst = max((sum(c.values()) for c in self.remote_missed.values()), default=0)
        return worst + self.remote_unread

    @property
    def failed(self) -> bool:
        """Whether the flush left blocks behind: dirty, or not landed on the remote level."""
        return bool(self.dirty) or self.not_landed > 0

    def plus(self, other: FlushResult) -> FlushResult:
        """Both flushes in one result (several chains of the same tiers)."""

        def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {name: a.get(name, 0) + b.get(name, 0) for name in {**a, **b}}

        levels = {**self.remote_missed, **other.remote_missed}
        missed = {
            name: add(self.remote_missed.get(name, {}), other.remote_missed.get(name, {}))
            for name in levels
        }
        return FlushResult(
            self.copied + other.copied,
            add(self.dirty, other.dirty),
            add(self.write_errors, other.write_errors),
            self.remote_sent + other.remote_sent,
            missed,
            self.remote_unread + other.remote_unread,
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

    @property
    def remote_reason(self) -> str:
        """Which blocks sent to the remote level did not land, per level and why, in one
        line ("" when all did)."""
        if not self.not_landed:
            return ""
        parts = []
        for level, causes in self.remote_missed.items():
            count = sum(causes.values())
            if count:
                why = ", ".join(f"{n} {cause}" for cause, n in causes.items() if n)
                parts.append(f"{count} of {self.remote_sent} not written to {level} ({why})")
        if self.remote_unread:
            parts.append(f"{self.remote_unread} unreadable in the last tier, not sent")
        return "; ".join(parts)
