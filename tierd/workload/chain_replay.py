"""Trace replay through a whole tier chain: which medium served each hit.

Per request, the way an engine uses the cache: ``lookup`` the keys; ``load`` the hits into
the entry level (promoting them from below) and release them; ``touch`` the keys; store the
misses at the entry level. Block contents are not checked here (every block carries the
same filler bytes): this is about hit ratios per medium, not data.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tierd.chain import TierChain
from tierd.errors import BlockMissing, CapacityError
from tierd.keys import BlockKey
from tierd.workload.simulate import Progress, Stop

__all__ = ["ChainReplayResult", "replay_chain"]

_CHUNK = 256


@dataclass(frozen=True, slots=True)
class ChainReplayResult:
    """Hits per medium (``hits_by_medium``) and overall, for one replay."""

    requests: int
    block_accesses: int
    hits: int
    hit_ratio: float
    hits_by_medium: dict[str, int]
    hit_ratio_by_medium: dict[str, float]
    store_refusals: int
    seconds: float
    accesses_per_second: float
    tiers: list[dict[str, Any]]
    planned_requests: int = 0  # ``requests`` falls short of it when ``interrupted``
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def replay_chain(
    chain: TierChain,
    key_lists: Sequence[Sequence[BlockKey]],
    progress: Progress | None = None,
    stop: Stop | None = None,
) -> ChainReplayResult:
    """Replay requests through ``chain`` and count hits per medium (until ``stop()``)."""
    filler = bytes(chain.block_bytes)
    room = chain.levels[chain.entry].tier.num_blocks
    by_medium: dict[str, int] = {str(level.medium): 0 for level in chain.levels}
    hits = accesses = refusals = 0
    started = time.perf_counter()
    done = 0
    for index, keys in enumerate(key_lists):
        if stop is not None and index % _CHUNK == 0 and stop():
            break
        done = index + 1
        found = chain.lookup(keys)
        accesses += len(keys)
        hits += found.count
        for medium in found.media:
            by_medium[str(medium)] += 1
        if found.count:
            await _load(chain, keys[: min(found.count, room)])
        chain.touch(keys)
        for start in range(found.count, len(keys), room):
            part = keys[start : start + room]
            try:
                await chain.store(part, [filler] * len(part))
            except CapacityError:
                refusals += 1
        if progress is not None and (index + 1) % _CHUNK == 0:
            progress(index + 1, len(key_lists))
    seconds = time.perf_counter() - started
    if progress is not None:
        progress(done, len(key_lists))
    return ChainReplayResult(
        requests=done,
        block_accesses=accesses,
        hits=hits,
        hit_ratio=hits / accesses if accesses else 0.0,
        hits_by_medium=by_medium,
        hit_ratio_by_medium={m: n / accesses if accesses else 0.0 for m, n in by_medium.items()},
        store_refusals=refusals,
        seconds=seconds,
        accesses_per_second=accesses / seconds if seconds > 0 else 0.0,
        tiers=[asdict(level.tier.stats()) for level in chain.levels],
        planned_requests=len(key_lists),
        interrupted=done < len(key_lists),
    )


async def _load(chain: TierChain, keys: Sequence[BlockKey]) -> None:
    try:
        handle = await chain.load(keys)
    except BlockMissing:
        return  # evicted or unreadable since the lookup: a miss, not an error
    handle.release()
