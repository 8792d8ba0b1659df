"""What a replay drives (:class:`ReplayBackend`), what it measures and hands back
(:class:`ReplaySummary`, :class:`ReplayProgress`), the block contents it stores
(:func:`block_content`), and its latency records; the replay itself is
:mod:`tierd.workload.replayer`."""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, overload

__all__ = [
    "SAMPLE_CAP",
    "Contents",
    "Latencies",
    "ReplayBackend",
    "ReplayProgress",
    "ReplaySummary",
    "block_content",
    "rate",
    "slowest_medium",
]

SAMPLE_CAP = 20_000  # load latency samples kept per medium (reservoir)
_SEED = 0x7EE1D


def block_content(key: bytes, block_bytes: int) -> bytes:
    """The bytes the replay stores under ``key``: its 64-byte BLAKE2b digest, repeated."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (block_bytes // 64 + 1))[:block_bytes]


class ReplayBackend(Protocol):
    """A cache the replay drives; one per worker.

    ``lookup``: how many leading keys are cached, and the medium of each. ``load``: copies
    of the leading blocks it could load. ``store``: store blocks (``data`` co-indexed with
    ``keys``), returning how many were new; :class:`CapacityError` when there is no room.
    ``stats``: the daemon's stats structure (:func:`tierd.control.figures.stats.collect_stats`).
    ``settle``: wait until what the stores so far left running in the background (copies
    behind them, ``write_behind``; queued remote writes) is done; whether the cache was
    seen at rest (``False``: it cannot tell, or the wait passed its bound).
    Other errors are counted by their ``code`` (or class name); a lost connection
    (``Unreachable``) or a closed resource ends the replay."""

    @property
    def kind(self) -> str: ...  # "daemon" or "chain"

    @property
    def target(self) -> str: ...  # the socket path or the config path

    @property
    def block_bytes(self) -> int: ...

    @property
    def entry_capacity(self) -> int: ...  # blocks in the tier that stores enter

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]]: ...

    async def touch(self, keys: Sequence[bytes]) -> None: ...  # one use per request

    async def load(self, keys: Sequence[bytes]) -> list[bytes]: ...

    async def store(self, keys: Sequence[bytes], data: Sequence[bytes]) -> int: ...

    async def stats(self) -> dict[str, Any]: ...

    async def settle(self) -> bool: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    done: int
    total: int
    hits: int
    accesses: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """What one replay measured; :meth:`to_dict` is the JSON (``summary.json``) form.

    Counts are blocks unless named otherwise; ratios are of ``block_accesses``; times are
    seconds. ``latency``: ``lookup`` and ``store`` -> {p50, p90, p99, mean, count}, and
    ``load`` -> medium -> the same (the slowest medium a loaded chunk came from: a chunk
    with one block promoted from disk counts as a DISK load).
    ``errors``: kind -> occurrences (``wrong_bytes`` counts blocks, the others calls).
    ``timeline``: {t, requests, accesses, hits: {medium: cumulative}, occupancy: {tier:
    used}}, from before the first request to after the last. ``tiers``: the final stats'
    tiers. ``load_latency_samples``: medium -> up to 20,000 durations (a reservoir).
    ``requests`` is how many were replayed, of ``planned_requests``; fewer when the replay
    was ``interrupted``; ``cut_short`` says why when the cache went away under the replay
    (the daemon stopped, the connection was lost), else it is None. ``load_shortfalls``:
    loads that brought back fewer blocks than their lookup promised (normal under
    contention; those blocks are stored again)."""

    requests: int
    planned_requests: int
    interrupted: bool
    lookups: int
    block_accesses: int
    hits: int
    misses: int
    hit_ratio: float
    hits_by_medium: dict[str, int]
    hit_ratio_by_medium: dict[str, float]
    loaded_blocks: int
    stored_blocks: int
    load_shortfalls: int
    seconds: float
    latency: dict[str, Any]
    throughput: dict[str, float]
    errors: dict[str, int]
    wrong_bytes: int
    wrong_bytes_keys: list[str]
    timeline: list[dict[str, Any]]
    load_latency_samples: dict[str, list[float]]
    config: dict[str, Any]
    tiers: list[dict[str, Any]]
    # With --speed: requests that started more than 10 ms after the trace clock said
    # (the clients or the cache could not keep the pace), and the most any was late.
    late_requests: int = 0
    behind_s: float = 0.0
    cut_short: str | None = None
    # Ordered replays (``config["settled"]``): stores after which the cache could not be
    # seen at rest (so the figures may vary), and the seconds spent waiting for it.
    unsettled_stores: int = 0
    settle_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Contents(Sequence[bytes]):
    """Block contents of ``keys``, made only for the rows a store actually writes."""

    def __init__(self, keys: Sequence[bytes], block_bytes: int) -> None:
        self._keys = keys
        self._size = block_bytes

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [block_content(k, self._size) for k in self._keys[index]]
        return block_content(self._keys[index], self._size)


class Latencies:
    """Every duration of one kind of call (seconds), and optionally a fixed-size sample."""

    def __init__(self, keep: int = 0) -> None:
        self.values = array("d")
        self.total = 0.0
        self.sample: list[float] = []
        self._keep = keep
        self._rng = random.Random(_SEED)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)
        self.total += seconds
        if len(self.sample) < self._keep:
            self.sample.append(seconds)
        elif self._keep:
            slot = self._rng.randrange(len(self.values))
            if slot < self._keep:
                self.sample[slot] = seconds

    def summary(self) -> dict[str, float | int]:
        ordered = sorted(self.values)
        count = len(ordered)

        def rank(q: float) -> float:
            return ordered[max(0, math.ceil(q * count) - 1)] if count else 0.0

        mean = self.total / count if count else 0.0
        return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "mean": mean, "count": count}


def rate(amount: float, per: float) -> float:
    return amount / per if per > 0 else 0.0


_SPEED_ORDER = {"GPU": 0, "MEMORY": 1, "CPU": 2, "DISK": 3}


def slowest_medium(media: Sequence[str]) -> str:
    """The slowest of the media a chunk is served from (fastest first: GPU, MEMORY, CPU,
    DISK), which decides how long its load takes."""
    return max(media, key=lambda m: _SPEED_ORDER.get(m, len(_SPEED_ORDER)))
