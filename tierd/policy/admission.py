"""Admission rules: which demoted blocks a lower level accepts.

A rule is a plain value (:class:`Admission`) with no dependency on stores or torch, so the
config layer can validate rules without loading the data path. What the rules remember
lives beside it and belongs to the chain: :class:`KeyUses` (per key: how many requests
used it, and what the rules below need to know about those requests) and
:class:`Comeback` (per level, for ``comeback>=P``: a shadow of the level's recent
candidates and how often each kind of candidate came back).

The rules, as written in a config (``admission:``):

``always``
    Every demoted block (the default).
``reuse>=N``
    Blocks used by at least ``N`` requests. A use is a touch (one per request, as engines
    touch the keys a request reuses); lookups are queries and count nothing.
``sample<=P``
    The blocks of a share ``P`` (``0 < P <= 1``) of the requests. A request's new blocks
    (the keys its touch uses for the first time) are in or out together: a hash of the
    first of them decides for all. Sampling each block on its own would be useless: a
    lookup stops at the first miss, so a block is worth something only if its whole
    prefix is cached too. Alone it admits about ``P`` of the blocks; its use is
    ``reuse>=N|sample<=P``, which admits the blocks that came back and, of the ones used
    by one request only, those of a share ``P`` of the requests: a dial between
    ``reuse>=N`` (``P`` near 0) and ``always`` (``P = 1``) for a budget of writes.
``comeback>=P``
    Blocks of a kind that lately came back at least a share ``P`` of the time: a minimum
    of hits per write, learned online. Every candidate, admitted or not (so the rule's
    own refusals hide nothing from it), enters a shadow of the level; it *came back* if a
    touch uses it while it is there. It is scored when it leaves: once the level has
    admitted as many blocks as it holds since the candidate entered (an admitted block
    would by then have been pushed out of an LRU level, unless a hit kept it), or when it
    is a candidate again. So the fewer blocks a level admits, the longer they would stay
    and the longer a candidate has to come back. A kind is the number of requests that
    used the block (0, 1, 2, 3, 4 or more) and whether it was the last block of the
    request that used it last. A kind with too little evidence is admitted; otherwise a
    block is admitted if its kind, or a kind with fewer uses and the same place in its
    request, came back often enough: a block's prefix was used at least as often as the
    block, so admitting a kind admits the prefixes it needs. A kind's scores are halved
    once it has been scored more than the level's size times, so they follow a change in
    the traffic. Nothing is set from a trace: the horizon is the level's size (for a
    remote level, whose size tierd does not know, the chain's reuse memory), and the rest
    is learned. Cost: the shadow (at most the chain's reuse memory of keys, 1 Mi by
    default) and a look-up per key touched.
``A|B``
    What any of the rules ``A``, ``B`` (of different families above) admits.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from tierd.keys import BlockKey

__all__ = ["Admission", "Comeback", "KeyUses"]

_DRAWS = 1 << 64  # a draw is a 64-bit hash
_USE_KINDS = 5  # uses 0, 1, 2, 3, 4 or more
MIN_EVIDENCE = 32
"""A kind is judged once this many of its candidates were scored (at most half the level's
size, so a small level judges too)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """Which demoted blocks a level accepts: what any of the set conditions admits, or every
    block when none is set (``always``). ``min_reuse``: ``reuse>=N``; ``sample``:
    ``sample<=P``; ``comeback``: ``comeback>=P`` (see the module's docstring)."""

    min_reuse: int = 0
    sample: float = 0.0
    comeback: float = 0.0

    @property
    def always(self) -> bool:
        return not (self.min_reuse or self.sample or self.comeback)

    @property
    def counts_uses(self) -> bool:
        """Whether the chain must count touches for this rule (every rule but ``always``)."""
        return not self.always

    @classmethod
    def parse(cls, rule: str) -> Admission:
        """``"always"``, or ``"reuse>=N"``, ``"sample<=P"``, ``"comeback>=P"`` joined by
        ``|`` (at most one of each)."""
        text = rule.replace(" ", "")
        if text == "always":
            return cls()
        found: dict[str, float] = {}
        for term in text.split("|"):
            name, value = _term(term, rule)
            if name in found:
                raise ValueError(f"admission rule {rule!r} names {name!r} twice")
            found[name] = value
        return cls(int(found.get("reuse", 0)), found.get("sample", 0.0), found.get("comeback", 0.0))

    def __str__(self) -> str:
        terms = []
        if self.min_reuse:
            terms.append(f"reuse>={self.min_reuse}")
        if self.sample:
            terms.append(f"sample<={self.sample:g}")
        if self.comeback:
            terms.append(f"comeback>={self.comeback:g}")
        return "|".join(terms) or "always"

    def admits(self, key: BlockKey, uses: KeyUses, shadow: Comeback | None = None) -> bool:
        """Whether ``key``, demoted now, is admitted. ``shadow`` is the level's
        :class:`Comeback` (required with ``comeback``): it records every candidate, so
        call this once per candidate."""
        if self.always:
            return True
        count = uses.uses(key)
        admitted = False
        if self.comeback:
            if shadow is None:
                raise ValueError("a comeback rule needs its level's shadow")
            admitted = shadow.admits(key, count, uses.ended(key))
        admitted = (
            admitted
            or (bool(self.min_reuse) and count >= self.min_reuse)
            or (bool(self.sample) and uses.draw(key) < self.sample * _DRAWS)
        )
        if admitted and shadow is not None:
            shadow.admitted()
        return admitted


def _term(term: str, rule: str) -> tuple[str, float]:
    """One term of a rule: ``("reuse", N)``, ``("sample", P)`` or ``("comeback", P)``."""
    bad = ValueError(
        f"admission rule {rule!r} is not 'always', or terms 'reuse>=N' (N >= 1),"
        " 'sample<=P', 'comeback>=P' (0 < P <= 1) joined by '|'"
    )
    if term.startswith("reuse>="):
        try:
            n = int(term.removeprefix("reuse>="))
        except ValueError:
            raise bad from None
        if n < 1:
            raise bad
        return "reuse", n
    for name, op in (("sample", "<="), ("comeback", ">=")):
        if term.startswith(name + op):
            try:
                p = float(term.removeprefix(name + op))
            except ValueError:
                raise bad from None
            if not (math.isfinite(p) and 0.0 < p <= 1.0):
                raise bad
            return name, p
    raise bad


class KeyUses:
    """What the rules know of a key, for the ``memory`` keys used most recently: how many
    requests used it; with ``draws``, its request's draw (``sample``); with ``ends``,
    whether it was the last key of the request that used it last (``comeback``)."""

    __slots__ = ("counts", "draws", "ends", "memory")

    def __init__(self, memory: int, *, draws: bool = False, ends: bool = False) -> None:
        self.memory = memory
        self.counts: OrderedDict[BlockKey, int] = OrderedDict()
        self.draws: dict[BlockKey, int] | None = {} if draws else None
        self.ends: set[BlockKey] | None = set() if ends else None

    def count(self, keys: Sequence[BlockKey]) -> None:
        """One request's touch: one use per distinct key."""
        counts, draws = self.counts, self.draws
        distinct = dict.fromkeys(keys)
        if draws is None:
            for key in distinct:
                counts[key] = counts.get(key, 0) + 1
                counts.move_to_end(key)
        else:
            draw = -1  # the request's draw: a hash of its first new key
            for key in distinct:
                n = counts.get(key, 0)
                counts[key] = n + 1
                counts.move_to_end(key)
                if n == 0:
                    if draw < 0:
                        draw = xxh3_64_intdigest(key)
                    draws[key] = draw
        ends = self.ends
        if ends is not None and keys:
            ends.difference_update(distinct)
            ends.add(keys[-1])
        while len(counts) > self.memory:
            old, _ = counts.popitem(last=False)
            if draws is not None:
                draws.pop(old, None)
            if ends is not None:
                ends.discard(old)

    def uses(self, key: BlockKey) -> int:
        return self.counts.get(key, 0)

    def draw(self, key: BlockKey) -> int:
        """The draw of the request that first used ``key`` (a key no touch used, or one
        forgotten, draws on its own)."""
        draws = self.draws
        if draws is not None and (draw := draws.get(key)) is not None:
            return draw
        return xxh3_64_intdigest(key)

    def ended(self, key: BlockKey) -> bool:
        return self.ends is not None and key in self.ends


class Comeback:
    """One level's shadow for ``comeback>=threshold``: the candidates since the last
    ``horizon`` admissions (at most ``memory`` of them, ``horizon`` by default) and, per
    kind, how many came back and how many did not (see the module's docstring). Tell it
    each candidate (:meth:`admits`), each admission (:meth:`admitted`) and each touch
    (:meth:`touched`)."""

    __slots__ = (
        "admissions",
        "back",
        "evidence",
        "gone",
        "horizon",
        "memory",
        "shadow",
        "threshold",
    )

    def __init__(self, threshold: float, horizon: int, memory: int | None = None) -> None:
        self.threshold = threshold
        self.horizon = max(1, horizon)
        self.memory = max(self.horizon, memory or self.horizon)
        self.evidence = max(1, min(MIN_EVIDENCE, self.horizon // 2))
        self.admissions = 0
        # key -> admissions before it << 5 | kind << 1 | came back
        # (kind: min(uses, 4) * 2 + last in its request)
        self.shadow: OrderedDict[BlockKey, int] = OrderedDict()
        self.back = [0.0] * (2 * _USE_KINDS)
        self.gone = [0.0] * (2 * _USE_KINDS)

    def touched(self, keys: Sequence[BlockKey]) -> None:
        """A request used ``keys``: the candidates among them came back."""
        shadow = self.shadow
        for key in keys:
            entry = shadow.get(key)
            if entry is not None and not entry & 1:
                shadow[key] = entry | 1  # an update keeps its place in the order

    @staticmethod
    def kind(uses: int, ended: bool) -> int:
        """The kind of a block used by ``uses`` requests, the last of the latest if
        ``ended``: an index into :attr:`back` and :attr:`gone`."""
        return min(uses, _USE_KINDS - 1) * 2 + ended

    def admits(self, key: BlockKey, uses: int, ended: bool) -> bool:
        """Record ``key`` as a candidate now; whether its kind is admitted."""
        kind = self.kind(uses, ended)
        shadow = self.shadow
        old = shadow.pop(key, None)
        if old is not None:
            self._score(old)
        shadow[key] = self.admissions << 5 | kind << 1
        oldest = self.admissions - self.horizon  # entered before: its time is up
        while shadow and (len(shadow) > self.memory or next(iter(shadow.values())) >> 5 <= oldest):
            self._score(shadow.popitem(last=False)[1])
        return self.passes(kind)

    def admitted(self) -> None:
        """The level admitted a candidate: the shadow's clock ticks."""
        self.admissions += 1

    def rate(self, kind: int) -> float | None:
        """How often candidates of ``kind`` came back, or ``None`` without enough
        evidence."""
        seen = self.back[kind] + self.gone[kind]
        return self.back[kind] / seen if seen >= self.evidence else None

    def passes(self, kind: int) -> bool:
        """Whether candidates of ``kind`` are admitted now."""
        if self.rate(kind) is None:
            return True  # nothing known yet: admit, and learn
        for fewer in range(kind & 1, kind + 1, 2):  # same place, uses up to the kind's
            rate = self.rate(fewer)
            if rate is not None and rate >= self.threshold:
                return True
        return False

    def _score(self, entry: int) -> None:
        kind = entry >> 1 & 15
        if entry & 1:
            self.back[kind] += 1
        else:
            self.gone[kind] += 1
        if self.back[kind] + self.gone[kind] > self.horizon:
            self.back[kind] /= 2
            self.gone[kind] /= 2
