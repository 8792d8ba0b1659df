#!/usr/bin/env python
"""The policy search behind ``duel``: candidate policies side by side on the shared trace
and on synthetic traces of several shapes, at 1 / 5 / 10 / 25 % of each trace's unique
blocks, every one replayed through a real :class:`~tierd.tier.Tier`.

The registered policies (``lru``, ``arc``, ``duel``) run from the registry. The other
candidates live here, written against the same :class:`~tierd.policy.CachePolicy` seam,
because they lost: each is described in its docstring with what it tried. Writes a
markdown table (``--out``): each cell is the hit ratio and its difference to LRU, and the
last column is the candidate's worst difference to LRU on the synthetic traces (the
issue's bar: never more than 0.005 below LRU).

    .venv/bin/python scripts/policy_search.py [--out docs/bench/policy_search.md]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from itertools import chain, filterfalse, islice
from pathlib import Path

from tierd.keys import BlockKey
from tierd.policy import CachePolicy, make_policy
from tierd.policy.lru import LRUPolicy
from tierd.workload import parse_capacity, read_trace, simulate
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import Trace, parse_trace

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
SHARES = ("1%", "5%", "10%", "25%")
SYNTHETIC = {
    "syn-a (defaults)": GeneratorConfig(seed=1),
    "syn-b (documents)": GeneratorConfig(
        seed=2, zipf_exponent=0.8, documents=1000, document_share=0.9
    ),
    "syn-c (long chats)": GeneratorConfig(seed=3, mean_turns=6.0, document_share=0.2),
    "syn-d (many prompts)": GeneratorConfig(
        seed=4, conversations=3000, system_prompts=16, zipf_exponent=1.4
    ),
}


class SegmentedLRU(LRUPolicy):
    """SLRU: a probation LRU for blocks seen once and a protected LRU (30 % of the tier,
    a fraction picked by hand) for blocks used again; protected overflow goes back to
    probation. Evicts from probation first."""

    name = "slru-30"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._limit = int(capacity * 0.3)
        self._protected: OrderedDict[BlockKey, None] = OrderedDict()
        self._held_protected: set[BlockKey] = set()

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or key in self._protected

    def __len__(self) -> int:
        return super().__len__() + len(self._protected)

    def remove(self, key: BlockKey) -> bool:
        self._held_protected.discard(key)
        if key in self._protected:
            del self._protected[key]
            return True
        return super().remove(key)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        probation, protected = self._order, self._protected
        for key in reversed(keys):
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                del probation[key]
                protected[key] = None
        while len(protected) > self._limit:
            probation[protected.popitem(last=False)[0]] = None

    def hold(self, key: BlockKey) -> None:
        if key in self._protected:
            del self._protected[key]
            self._held[key] = None
            self._held_protected.add(key)
        else:
            super().hold(key)

    def release(self, key: BlockKey) -> None:
        if key in self._held_protected:
            self._held_protected.discard(key)
            del self._held[key]
            self._protected[key] = None
        else:
            super().release(key)

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        both = chain(self._order, self._protected)
        victims = list(islice(filterfalse(protected.__contains__, both), n))
        if len(victims) < n:
            return None
        for key in victims:
            if key in self._order:
                del self._order[key]
            else:
                del self._protected[key]
        return victims

    def clear(self) -> None:
        super().clear()
        self._protected.clear()
        self._held_protected.clear()


class TailFirstLRU(LRUPolicy):
    """LRU that stores the last block of each stored run at the cold end. In the shared
    trace a request's last block is partial and almost never used again (0.8 % against
    25 % for the others); in the synthetic traces it is reused, and this loses there."""

    name = "lru-tail-first"

    def insert(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            super().insert(keys[:-1])
            self._order[keys[-1]] = None
            self._order.move_to_end(keys[-1], last=False)


class HitDensity(LRUPolicy):
    """After LHD (Beckmann et al., NSDI'18): blocks are classed by use count (1, 2, 3-4,
    5+) and grouped by class and epoch of last use; online histograms of hit and eviction
    ages per class give each (class, age) an expected hits per block-time, and the group
    with the lowest density is evicted first (tail blocks first within a group). The
    learned densities come out nearly flat in age on this trace, so it ends close to
    LRU."""

    name = "hit-density"
    CLASSES = 4
    BUCKETS = 8 * 64

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._epoch = max(1, capacity // 16)
        self._clock = 0
        self._meta: dict[BlockKey, tuple[int, int]] = {}  # key -> (uses, last use)
        self._groups: list[dict[int, dict[BlockKey, None]]] = [{} for _ in range(4)]
        self._hit_ages = [[0.0] * self.BUCKETS for _ in range(4)]
        self._evict_ages = [[0.0] * self.BUCKETS for _ in range(4)]
        self._density: list[list[float]] | None = None
        self._events = 0

    @staticmethod
    def _class(uses: int) -> int:
        return 0 if uses <= 1 else 1 if uses == 2 else 2 if uses <= 4 else 3

    @staticmethod
    def _bucket(age: int) -> int:
        if age < 16:
            return age
        shift = age.bit_length() - 4
        return shift * 8 + (age >> shift)

    @staticmethod
    def _age_of(bucket: int) -> float:
        if bucket < 16:
            return float(bucket)
        shift = bucket // 8 - 1
        return ((bucket - shift * 8) << shift) + ((1 << shift) - 1) / 2

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def _group(self, key: BlockKey, uses: int, last: int) -> dict[BlockKey, None]:
        return self._groups[self._class(uses)].setdefault(last // self._epoch, {})

    def _ungroup(self, key: BlockKey, uses: int, last: int) -> None:
        groups = self._groups[self._class(uses)]
        group = groups[last // self._epoch]
        del group[key]
        if not group:
            del groups[last // self._epoch]

    def insert(self, keys: Sequence[BlockKey]) -> None:
        for key in reversed(keys):  # tail first within its group
            self._meta[key] = (1, self._clock)
            self._group(key, 1, self._clock)[key] = None
        self._clock += len(keys)

    def remove(self, key: BlockKey) -> bool:
        meta = self._meta.pop(key, None)
        if meta is None:
            return False
        if key in self._held:
            del self._held[key]
        else:
            self._ungroup(key, *meta)
        return True

    def touch(self, keys: Sequence[BlockKey]) -> None:
        clock = self._clock
        for key in reversed(keys):
            meta = self._meta.get(key)
            if meta is None:
                continue
            uses, last = meta
            self._hit_ages[self._class(uses)][self._bucket(clock - last)] += 1
            self._events += 1
            self._meta[key] = (uses + 1, clock)
            if key not in self._held:
                self._ungroup(key, uses, last)
                self._group(key, uses + 1, clock)[key] = None
        self._clock = clock + len(keys)
        if self._events >= max(1024, self.capacity):
            self._learn()

    def hold(self, key: BlockKey) -> None:
        meta = self._meta.get(key)
        if meta is not None and key not in self._held:
            self._ungroup(key, *meta)
            self._held[key] = None

    def release(self, key: BlockKey) -> None:
        if key in self._held:
            del self._held[key]
            uses = self._meta[key][0]
            self._meta[key] = (uses, self._clock)
            self._group(key, uses, self._clock)[key] = None

    def _learn(self) -> None:
        self._events = 0
        self._density = []
        for hits, evictions in zip(self._hit_ages, self._evict_ages, strict=True):
            density = [0.0] * self.BUCKETS
            hits_after = events_after = age_sum = 0.0
            for bucket in range(self.BUCKETS - 1, -1, -1):
                hits_after += hits[bucket]
                events = hits[bucket] + evictions[bucket]
                events_after += events
                age = self._age_of(bucket)
                age_sum += events * age
                lifetime = age_sum - events_after * age
                density[bucket] = hits_after / lifetime if lifetime > 0 else 0.0
                hits[bucket] *= 0.9
                evictions[bucket] *= 0.9
            self._density.append(density)

    def evict(self, n: int, protected: Collection[BlockKey] = ()) -> list[BlockKey] | None:
        if n <= 0:
            return []
        if n > len(self._meta) - len(self._held):
            return None
        victims: list[BlockKey] = []
        spent: set[tuple[int, int]] = set()
        while len(victims) < n:
            best: tuple[float, int, int] | None = None
            for cls, groups in enumerate(self._groups):
                for epoch in groups:
                    if (cls, epoch) in spent:
                        continue
                    age = max(0, self._clock - epoch * self._epoch - self._epoch // 2)
                    value = -age if self._density is None else self._density[cls][self._bucket(age)]
                    if best is None or value < best[0]:
                        best = (value, cls, epoch)
            if best is None:
                return None
            _, cls, epoch = best
            spent.add((cls, epoch))
            group = self._groups[cls][epoch]
            fresh = [key for key in group if key not in protected and key not in victims]
            victims += fresh[: n - len(victims)]
        for key in victims:
            uses, last = self._meta.pop(key)
            self._evict_ages[self._class(uses)][self._bucket(self._clock - last)] += 1
            self._events += 1
            self._ungroup(key, uses, last)
        return victims

    def clear(self) -> None:
        self.__init__(self.capacity)  # type: ignore[misc]


CANDIDATES: dict[str, Callable[[int], CachePolicy]] = {
    "lru": lambda capacity: make_policy("lru", capacity),
    "arc": lambda capacity: make_policy("arc", capacity),
    "duel": lambda capacity: make_policy("duel", capacity),
    "slru-30": SegmentedLRU,
    "lru-tail-first": TailFirstLRU,
    "hit-density": HitDensity,
}


def synthetic(name: str, config: GeneratorConfig) -> Trace:
    return parse_trace((record.to_json() for record in generate(config)), source=name)


def traces(shared: Path) -> dict[str, Trace]:
    out = {}
    if shared.is_file():
        out["shared conversation trace"] = read_trace(shared)
    for name, config in SYNTHETIC.items():
        out[name] = synthetic(name, config)
    return out


def run(candidates: Sequence[str], shared: Path) -> str:
    loaded = traces(shared)
    ratios: dict[tuple[str, str, str], float] = {}
    seconds: dict[str, float] = {}
    for candidate in candidates:
        started = time.perf_counter()
        for trace_name, trace in loaded.items():
            for share in SHARES:
                capacity = parse_capacity(share, trace.unique_blocks)
                policy = CANDIDATES[candidate](capacity)
                ratios[candidate, trace_name, share] = simulate(trace, policy, capacity).hit_ratio
        seconds[candidate] = time.perf_counter() - started
        print(f"{candidate}: {seconds[candidate]:.0f} s", flush=True)
    lines = [
        "| policy | trace | " + " | ".join(SHARES) + " |",
        "|---|---|" + "---:|" * len(SHARES),
    ]
    worst: dict[str, float] = {}
    for candidate in candidates:
        for trace_name in loaded:
            cells = []
            for share in SHARES:
                ratio = ratios[candidate, trace_name, share]
                diff = ratio - ratios["lru", trace_name, share]
                if trace_name in SYNTHETIC:
                    worst[candidate] = min(worst.get(candidate, 0.0), diff)
                cells.append(f"{ratio:.4f}" if candidate == "lru" else f"{ratio:.4f} ({diff:+.4f})")
            lines.append(f"| {candidate} | {trace_name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| policy | worst difference to LRU on the synthetic traces | replay time, all runs |",
        "|---|---:|---:|",
    ]
    lines += [f"| {c} | {worst[c]:+.4f} | {seconds[c]:.0f} s |" for c in candidates]
    sizes = ", ".join(f"{name}: {t.unique_blocks:,} unique blocks" for name, t in loaded.items())
    lines += ["", f"Traces: {sizes}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, default=SHARED_TRACE)
    parser.add_argument("--policies", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    if "lru" not in args.policies:
        args.policies.insert(0, "lru")
    text = run(args.policies, args.trace)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
