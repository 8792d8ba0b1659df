"""What the chain's admission rules know of recent uses, and their answers.

:class:`Admissions` owns the counts of recently used keys (:class:`KeyUses`) and the
``comeback`` shadows, one per level (or remote side) whose rule asks for one. Moves ask
it whether a level below admits a candidate; touches count uses into it. New rules
(a reload) keep what was counted when they need no more of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.chain.levels import ChainLevels
from tierd.chain.remote import RemoteSide
from tierd.chain.values import Admission, Level
from tierd.keys import BlockKey
from tierd.policy.admission import Comeback, KeyUses

__all__ = ["Admissions"]


class Admissions:
    """Admission answers for the levels of ``levels`` and its remote side."""

    def __init__(self, levels: ChainLevels, reuse_memory: int = 1 << 20) -> None:
        self._levels = levels
        self._reuse_memory = reuse_memory
        rules = self._rules()
        self._uses = KeyUses(  # what admission rules know of each recently used key
            reuse_memory,
            draws=any(rule.sample for rule in rules),
            ends=any(rule.comeback for rule in rules),
        )
        self._comebacks: dict[int, Comeback] = {}  # id(level or remote side) -> its shadow
        self.tracks_uses = any(rule.counts_uses for rule in rules)

    def _rules(self) -> list[Admission]:
        remote = self._levels.remote
        return [level.admission for level in self._levels.levels] + (
            [remote.admission] if remote is not None else []
        )

    def set_rules(self, rules: Sequence[Admission], remote: Admission | None = None) -> None:
        """New admission rules, one per level (and the remote level's): what the old rules
        counted of recent uses is kept only if the new ones need no more of it."""
        levels, side = self._levels.levels, self._levels.remote
        if len(rules) != len(levels):
            raise ValueError(f"{len(rules)} admission rules for {len(levels)} levels")
        for level, rule in zip(levels, rules, strict=True):
            level.admission = rule
        if side is not None and remote is not None:
            side.admission = remote
        every = self._rules()
        draws = any(rule.sample for rule in every)
        ends = any(rule.comeback for rule in every)
        uses = self._uses
        if (draws and uses.draws is None) or (ends and uses.ends is None):
            self._uses = KeyUses(self._reuse_memory, draws=draws, ends=ends)
        self._comebacks.clear()  # rebuilt on the next candidate, at the new thresholds
        self.tracks_uses = any(rule.counts_uses for rule in every)

    def admits(self, side: Level | RemoteSide, key: BlockKey) -> bool:
        """Whether the level (or remote side) ``side`` admits ``key``, a candidate now;
        call once per candidate (a ``comeback`` rule records each one)."""
        rule = side.admission
        shadow = None
        if rule.comeback:  # the shadow spans the level's size (the remote: the reuse memory)
            shadow = self._comebacks.get(id(side))
            if shadow is None or shadow.threshold != rule.comeback:
                horizon = side.tier.num_blocks if isinstance(side, Level) else self._reuse_memory
                shadow = self._comebacks[id(side)] = Comeback(
                    rule.comeback, horizon, self._reuse_memory
                )
        return rule.admits(key, self._uses, shadow)

    def count_uses(self, keys: Sequence[BlockKey]) -> None:
        """Count one use per distinct key for admission rules, and tell ``comeback``
        shadows which of their candidates came back (callers check :attr:`tracks_uses`
        first)."""
        self._uses.count(keys)
        for shadow in self._comebacks.values():
            shadow.touched(keys)
