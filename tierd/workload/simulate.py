"""Replaying a trace through a real :class:`~tierd.tier.Tier` to measure its hit ratio.

Each request goes through the tier exactly as a prefix-caching engine drives it::

    n = tier.lookup(keys)             # leading blocks already cached: the hits
    tier.touch(keys)                  # tail to head, so the prefix's head stays the freshest
    plan = tier.prepare_store(keys)   # room for the missing blocks (may evict)
    if plan is not None:
        tier.complete_store(plan.keys)
    tier.take_events()

The block hit ratio is ``sum(n) / sum(len(keys))``. No bytes move: this measures the
policy and the tier's bookkeeping, which is also what the throughput figure times.
A ``stop`` callable, checked every few hundred requests, ends a replay early; the result
then covers the requests replayed and says ``interrupted``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tierd.keys import BlockKey
from tierd.policy import CachePolicy
from tierd.tier import Tier
from tierd.workload.trace import Trace

__all__ = ["SimulationResult", "parse_capacity", "replay", "simulate"]

Progress = Callable[[int, int], None]
"""Called as ``progress(requests_done, requests_total)`` every few hundred requests."""

Stop = Callable[[], bool]
"""Asked every few hundred requests whether to end the replay there."""

_CHUNK = 512


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What one replay measured: ``requests`` of ``planned_requests`` (fewer when it was
    ``interrupted``), and the block accesses and hits of those."""

    policy: str
    capacity: int
    requests: int
    planned_requests: int
    interrupted: bool
    block_accesses: int
    hits: int
    unique_blocks: int
    hit_ratio: float
    seconds: float
    accesses_per_second: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_capacity(value: str | int, unique_blocks: int) -> int:
    """A capacity in blocks: an int, a block count (``"9139"``) or a share of the
    trace's unique blocks (``"5%"``, rounded down, at least one block)."""
    if isinstance(value, int):
        blocks = value
    else:
        text = value.strip()
        try:
            if text.endswith("%"):
                share = float(text[:-1])
                if not 0 < share <= 100:
                    raise ValueError(text)
                blocks = max(1, int(unique_blocks * share / 100))
            else:
                blocks = int(text)
        except ValueError:
            raise ValueError(
                f"capacity must be a block count or a percentage like '5%', got {value!r}"
            ) from None
    if blocks <= 0:
        raise ValueError(f"capacity must be at least one block, got {value!r}")
    return blocks


def replay(
    tier: Tier,
    key_lists: Sequence[Sequence[BlockKey]],
    progress: Progress | None = None,
) -> int:
    """Replay requests through ``tier``; returns the number of block hits."""
    return _replay(tier, key_lists, progress, None)[0]


def _replay(
    tier: Tier,
    key_lists: Sequence[Sequence[BlockKey]],
    progress: Progress | None,
    stop: Stop | None,
) -> tuple[int, int]:
    """Block hits, and how many requests were replayed (fewer once ``stop()`` is true)."""
    lookup, touch, prepare, complete, take = (
        tier.lookup,
        tier.touch,
        tier.prepare_store,
        tier.complete_store,
        tier.take_events,
    )
    total = len(key_lists)
    hits = 0
    done = 0
    for start in range(0, total, _CHUNK):
        if stop is not None and stop():
            break
        for keys in key_lists[start : start + _CHUNK]:
            hits += lookup(keys)
            touch(keys)
            plan = prepare(keys)
            if plan is not None:
                complete(plan.keys)
            take()
        done = min(start + _CHUNK, total)
        if progress is not None:
            progress(done, total)
    return hits, done


def simulate(
    trace: Trace,
    policy: str | CachePolicy,
    capacity: str | int,
    *,
    progress: Progress | None = None,
    stop: Stop | None = None,
) -> SimulationResult:
    """Replay ``trace`` through a fresh tier of ``capacity`` blocks under ``policy``.

    Raises :class:`~tierd.errors.UnknownPolicy` for a policy name not registered and
    ``ValueError`` for a bad capacity."""
    blocks = parse_capacity(capacity, trace.unique_blocks)
    tier = Tier(blocks, policy, name="simulate")
    key_lists = trace.key_lists()
    started = time.perf_counter()
    hits, done = _replay(tier, key_lists, progress, stop)
    seconds = time.perf_counter() - started
    whole = done == len(key_lists)
    accesses = trace.block_accesses if whole else sum(map(len, key_lists[:done]))
    return SimulationResult(
        policy=tier.policy.name,
        capacity=blocks,
        requests=done,
        planned_requests=len(key_lists),
        interrupted=done < len(key_lists),
        block_accesses=accesses,
        hits=hits,
        unique_blocks=trace.unique_blocks,
        hit_ratio=hits / accesses if accesses else 0.0,
        seconds=seconds,
        accesses_per_second=accesses / seconds if seconds > 0 else float("inf"),
    )
