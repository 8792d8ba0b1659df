"""The figures every bench reports, in one place: :class:`Figure` (one figure's samples,
their median and spread min-max), :class:`Figures` (named figures filled sample by
sample), :func:`median_of`, :func:`ratio`, and the one side-by-side runner
(:func:`side_by_side_async`) that interleaves a candidate with its
baselines after a warm-up, so that drift on a shared machine hits them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field


def median_of(samples: Iterable[float]) -> float:
    """The median of ``samples``; no samples is an error, not a zero."""
    values = list(samples)
    if not values:
        raise ValueError("a median of no samples")
    return statistics.median(values)


def ratio(candidate: float, baseline: float) -> float:
    """``candidate / baseline``, 0.0 where the baseline is zero (nothing to compare to)."""
    return candidate / baseline if baseline else 0.0


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure's samples (often each run's median), as a report writes them."""

    runs: Sequence[float]

    @property
    def median(self) -> float:
        return median_of(self.runs)

    def spread(self, scale: float = 1.0, fmt: str = ".3f") -> str:
        """``min-max`` of the samples, scaled and formatted."""
        return f"{format(min(self.runs) * scale, fmt)}-{format(max(self.runs) * scale, fmt)}"

    def text(self, scale: float = 1.0, digits: int = 3) -> str:
        """``median (min-max)``, scaled, with ``digits`` decimals."""
        fmt = f".{digits}f"
        return f"{format(self.median * scale, fmt)} ({self.spread(scale, fmt)})"


@dataclass
class Figures:
    """Named figures filled one sample at a time (a run adds one sample to each)."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def figure(self, name: str) -> Figure:
        return Figure(self.values[name])

    def median(self, name: str) -> float:
        return self.figure(name).median

    def spread(self, name: str, scale: float, fmt: str) -> str:
        return self.figure(name).spread(scale, fmt)


def _order(count: int, rep: int) -> list[int]:
    """The order of the ``count`` contenders in repetition ``rep``: rotated each time."""
    return [(k + rep) % count for k in range(count)]


async def side_by_side_async(
    reps: int, *fns: Callable[[], Awaitable[object]], warmups: int = 1
) -> list[Figure]:
    """Seconds per call of each of ``fns`` (the candidate first, then its baselines) over
    ``reps`` repetitions after ``warmups`` untimed calls each, awaited one at a time; the
    calls interleave and rotate their order every repetition."""
    for fn in fns:
        for _ in range(warmups):
            await fn()
    seconds: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        for i in _order(len(fns), rep):
            start = time.perf_counter()
            await fns[i]()
            seconds[i].append(time.perf_counter() - start)
    return [Figure(s) for s in seconds]
