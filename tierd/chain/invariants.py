"""The chain's invariants, checked on demand by tests, state machines and the soak.

Kept apart from :mod:`tierd.chain.core`: nothing on the data path calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.chain.values import Level

__all__ = ["check_levels"]


def check_levels(levels: Sequence[Level], *, idle: bool, pending: int) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``levels``. With
    ``idle`` there must be no pins, no writes in flight and no ``pending`` futures."""
    for level in levels:
        tier = level.tier
        slots = [tier.slot_of(k) for k in tier.ready_keys()]
        stats = tier.stats()
        _require(stats.used <= tier.num_blocks, f"{tier.name} over capacity")
        _require(len(set(slots)) == len(slots), f"{tier.name}: a slot has two keys")
        _require(
            all(s is not None and 0 <= s < tier.num_blocks for s in slots),
            f"{tier.name}: slot out of range",
        )
        _require(len(tier.policy) == len(slots), f"{tier.name}: policy and index disagree")
        if idle:
            _require(stats.pinned == 0, f"{tier.name}: {stats.pinned} blocks still pinned")
            _require(stats.writing == 0, f"{tier.name}: {stats.writing} blocks in flight")
            _require(stats.quarantined == 0, f"{tier.name}: {stats.quarantined} slots quarantined")
    if idle:
        _require(not pending, f"{pending} writes still pending")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
