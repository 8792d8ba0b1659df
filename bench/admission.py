#!/usr/bin/env python
"""Admission to the disk tier: disk hits against disk writes, rule by rule (issue 16).

A CPU tier of 5 % of a trace's unique blocks over a disk tier of 25 %, both LRU, with
the disk tier's ``admission`` rule varied: ``always``, ``reuse>=N``, ``sample<=P`` and
``comeback>=P`` (see :mod:`tierd.policy.admission`), on the shared conversation trace and
on two synthetic traces from :mod:`tierd.workload.generate` (so that nothing is read off
one trace). Each point replays the trace through a real :class:`~tierd.chain.TierChain`,
as ``tierd simulate TRACE --config FILE`` does, over in-memory stores whose tiers are
marked CPU and DISK: the counts are those of ``simulate --config`` (hits do not depend
on where the bytes sit), in seconds rather than minutes. ``--real`` uses a CPU pool and
a disk slab in a temporary directory instead, through :func:`tierd.library.open_chain`.

The trace is replayed in two halves on the same chain, so the table also gives the
second half alone: the steady state, once the disk tier is full and a learning rule has
learned (on the shared trace the disk tier fills in the first quarter).

Two rows are not rules, and live here only: ``offline bound`` admits exactly the blocks
that the trace uses again later (it knows the future: the most any rule could save), and
``second eviction`` admits a block when the tier above demotes it for the second time
within the last disk-tier's size of refusals (a ghost of refused keys). Deterministic:
one run per point. Writes a markdown table (``--out``) and a PNG (``--png``).

    scripts/bench admission [--out docs/bench/admission.md]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import platform
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fragment import default_out, write_fragment
from tierd.chain import Admission, Level, TierChain
from tierd.chain.remote import RemoteSide
from tierd.keys import BlockKey, Medium
from tierd.library import open_chain
from tierd.stores.memory import MemoryStore
from tierd.tier import Tier
from tierd.transfer import TransferEngine
from tierd.workload import read_trace
from tierd.workload.backends import replay_chain
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.replay_figures import ReplaySummary
from tierd.workload.trace import Trace, parse_trace

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
CPU_SHARE, DISK_SHARE = 0.05, 0.25
BLOCK_BYTES = 4096
SYNTHETIC = {  # two of scripts/policy_search.py's shapes
    "syn-a (defaults)": GeneratorConfig(seed=1),
    "syn-c (long chats)": GeneratorConfig(seed=3, mean_turns=6.0, document_share=0.2),
}
RULES = [
    "always",
    "reuse>=2",
    "reuse>=3",
    "sample<=0.5",
    "reuse>=2|sample<=0.25",
    "reuse>=2|sample<=0.5",
    "reuse>=2|sample<=0.75",
    "comeback>=0.1",
    "comeback>=0.2",
    "comeback>=0.3",
    "comeback>=0.4",
    "comeback>=0.6",
    "comeback>=0.8",
]
SECOND_EVICTION = "second eviction"
OFFLINE_BOUND = "offline bound"
PROTOTYPES = [SECOND_EVICTION, OFFLINE_BOUND]


# -- prototypes: admission decided by a subclass (not rules a config can name) ------------


class SecondEviction(TierChain):
    """Admit a block on its second demotion into the last level: the first one is refused
    and remembered in a ghost of as many keys as that level holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost_size = self.levels[-1].tier.num_blocks

    def _admits(self, side: Level | RemoteSide, key: BlockKey) -> bool:
        ghost = self._ghost
        if key in ghost:
            del ghost[key]
            return True
        ghost[key] = None
        while len(ghost) > self._ghost_size:
            ghost.popitem(last=False)
        return False


class OfflineBound(TierChain):
    """Admit exactly the blocks that a later request uses (read off the whole trace)."""

    def __init__(self, *args: Any, future: dict[BlockKey, list[int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._future = future  # key -> the requests that use it, in order
        self._clock = 0  # requests touched so far

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self._clock += 1
        super().touch(keys)

    def _admits(self, side: Level | RemoteSide, key: BlockKey) -> bool:
        uses = self._future.get(key, [])
        return bisect.bisect_left(uses, self._clock) < len(uses)


# -- runs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Point:
    rule: str
    accesses: int
    hits: int
    disk_hits: int
    disk_stores: int
    late_accesses: int  # the second half alone
    late_disk_hits: int
    late_disk_stores: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    keys: list[tuple[BlockKey, ...]]
    unique: int
    cpu: int
    disk: int


def workload(name: str, trace: Trace) -> Workload:
    keys = trace.key_lists()
    unique = len({key for request in keys for key in request})
    cpu = max(1, int(unique * CPU_SHARE))
    return Workload(name, keys, unique, cpu, max(1, int(unique * DISK_SHARE)))


def future_uses(keys: Sequence[Sequence[BlockKey]]) -> dict[BlockKey, list[int]]:
    future: dict[BlockKey, list[int]] = {}
    for index, request in enumerate(keys):
        for key in dict.fromkeys(request):
            future.setdefault(key, []).append(index)
    return future


@asynccontextmanager
async def memory_chain(work: Workload, rule: str) -> AsyncIterator[TierChain]:
    """CPU over DISK on in-memory stores; prototypes by their subclass."""
    async with AsyncExitStack() as stack:
        stores = [
            await stack.enter_async_context(MemoryStore(num_blocks=n, block_bytes=BLOCK_BYTES))
            for n in (work.cpu, work.disk)
        ]
        engine = await stack.enter_async_context(TransferEngine(budget_bytes=64 << 20))
        admission = Admission() if rule in PROTOTYPES else Admission.parse(rule)
        levels = [
            Level(Tier(work.cpu, "lru", name="cpu", medium=Medium.CPU), stores[0]),
            Level(
                Tier(work.disk, "lru", name="disk", medium=Medium.DISK), stores[1], False, admission
            ),
        ]
        if rule == SECOND_EVICTION:
            yield SecondEviction(levels, engine)
        elif rule == OFFLINE_BOUND:
            yield OfflineBound(levels, engine, future=future_uses(work.keys))
        else:
            yield TierChain(levels, engine)


@asynccontextmanager
async def real_chain(work: Workload, rule: str) -> AsyncIterator[TierChain]:
    """A CPU pool over a disk slab in a temporary directory, as ``simulate --config``."""
    with tempfile.TemporaryDirectory(prefix="tierd-admission-") as directory:
        config = {
            "block_bytes": BLOCK_BYTES,
            "tiers": [
                {"name": "cpu", "kind": "cpu", "capacity": work.cpu},
                {
                    "name": "disk",
                    "kind": "disk",
                    "capacity": work.disk,
                    "directories": [directory],
                    "admission": rule,
                },
            ],
        }
        async with open_chain(config) as chain:
            yield chain


def run_point(work: Workload, rule: str, *, real: bool) -> Point:
    opener = real_chain if real and rule not in PROTOTYPES else memory_chain

    async def run() -> tuple[ReplaySummary, ReplaySummary, int]:
        half = len(work.keys) // 2
        async with opener(work, rule) as chain:
            early = await replay_chain(chain, work.keys[:half])
            stores = disk_stores(early)
            late = await replay_chain(chain, work.keys[half:])
        return early, late, stores

    started = time.perf_counter()
    early, late, early_stores = asyncio.run(run())
    seconds = time.perf_counter() - started
    stores = disk_stores(late)
    early_disk, late_disk = early.hits_by_medium["DISK"], late.hits_by_medium["DISK"]
    return Point(
        rule,
        early.block_accesses + late.block_accesses,
        early.hits + late.hits,
        early_disk + late_disk,
        stores,
        late.block_accesses,
        late_disk,
        stores - early_stores,
        seconds,
    )


def disk_stores(result: ReplaySummary) -> int:
    return int(next(t["stores"] for t in result.tiers if t["name"] == "disk"))


# -- report ------------------------------------------------------------------------------


def table(work: Workload, points: Sequence[Point]) -> list[str]:
    base = next(p for p in points if p.rule == "always")
    lines = [
        f"### {work.name}: {work.unique:,} unique blocks, {len(work.keys):,} requests, "
        f"{base.accesses:,} block accesses; CPU tier {work.cpu:,} blocks, "
        f"disk tier {work.disk:,}",
        "",
        "| disk admission | hit ratio | from disk | disk stores | disk hits per disk store "
        "| stores / always's | 2nd half: from disk | 2nd half: disk stores "
        "| 2nd half: stores / always's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        name = p.rule if p.rule in PROTOTYPES else "`{}`".format(p.rule.replace("|", "\\|"))
        lines.append(
            f"| {name} | {p.hits / p.accesses:.4f} | {p.disk_hits / p.accesses:.4f} "
            f"| {p.disk_stores:,} | {p.disk_hits / max(p.disk_stores, 1):.2f} "
            f"| {p.disk_stores / max(base.disk_stores, 1):.3f} "
            f"| {p.late_disk_hits / p.late_accesses:.4f} | {p.late_disk_stores:,} "
            f"| {p.late_disk_stores / max(base.late_disk_stores, 1):.3f} |"
        )
    return lines


def write_png(results: Sequence[tuple[Workload, list[Point]]], path: Path) -> Path:
    """Disk hits against disk stores, both as shares of ``always``'s, one column per
    trace; the whole trace above, its second half below; each rule family one series."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families: list[tuple[str, Callable[[str], bool], str]] = [
        ("reuse>=N", lambda r: r == "always" or (r.startswith("reuse>=") and "|" not in r), "o-"),
        ("reuse>=2|sample<=P", lambda r: r in ("always", "reuse>=2") or "|sample" in r, "s--"),
        ("comeback>=P", lambda r: r == "always" or r.startswith("comeback"), "^-"),
        ("sample<=0.5", lambda r: r.startswith("sample"), "v"),
        (SECOND_EVICTION, lambda r: r == SECOND_EVICTION, "D"),
        (OFFLINE_BOUND, lambda r: r == OFFLINE_BOUND, "*"),
    ]
    halves: list[tuple[str, Callable[[Point], tuple[int, int]]]] = [
        ("whole trace", lambda p: (p.disk_stores, p.disk_hits)),
        ("second half", lambda p: (p.late_disk_stores, p.late_disk_hits)),
    ]
    fig = Figure(figsize=(5.2 * len(results), 9.5), layout="constrained")
    grid = fig.subplots(len(halves), len(results), squeeze=False)
    for row, (half, pick) in enumerate(halves):
        for ax, (work, points) in zip(grid[row], results, strict=True):
            base_stores, base_hits = pick(next(p for p in points if p.rule == "always"))
            top = 1.0
            for index, (label, member, style) in enumerate(families):
                chosen = sorted(pick(p) for p in points if member(p.rule))
                xs = [stores / base_stores for stores, _ in chosen]
                ys = [hits / base_hits for _, hits in chosen]
                top = max([top, *ys])
                ax.plot(xs, ys, style, color=f"C{index}", label=label, markersize=6)
            ax.axvline(0.5, color="grey", linestyle=":", linewidth=1)
            ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
            ax.plot([0.5], [1.0], "x", color="black", markersize=10)
            ax.annotate("target", (0.5, 1.0), textcoords="offset points", xytext=(5, 5))
            ax.set_xlim(0, 1.05)
            ax.set_ylim(0, top * 1.08)
            ax.set_xlabel("disk stores / always's")
            ax.set_ylabel("disk hits / always's")
            ax.set_title(f"{work.name}: {half}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Admission to the disk tier: disk hits against disk writes")
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=100)
    return path


def machine() -> str:
    """The CPU model, its core count and the load average when the run started."""
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=SHARED_TRACE)
    parser.add_argument("--out", type=Path, default=default_out("admission"))
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "bench" / "admission.png")
    parser.add_argument("--rules", nargs="+", default=RULES, help="rules to run (and always)")
    parser.add_argument("--no-synthetic", action="store_true", help="the shared trace only")
    parser.add_argument("--real", action="store_true", help="a CPU pool and a disk slab")
    args = parser.parse_args(argv)

    host = machine()
    started = time.perf_counter()
    works = [workload("shared conversation trace", read_trace(args.trace))]
    if not args.no_synthetic:
        for name, config in SYNTHETIC.items():
            records = generate(config)
            works.append(workload(name, parse_trace(r.to_json() for r in records)))
    rules = list(dict.fromkeys(["always", *args.rules, *PROTOTYPES]))
    results: list[tuple[Workload, list[Point]]] = []
    for work in works:
        points = []
        for rule in rules:
            point = run_point(work, rule, real=args.real)
            points.append(point)
            print(
                f"{work.name:<28} {rule:<24} from disk {point.disk_hits / point.accesses:.4f}"
                f"  disk stores {point.disk_stores:>8,}  ({point.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        results.append((work, points))
    elapsed = time.perf_counter() - started

    stores = "a CPU pool and a disk slab" if args.real else "in-memory stores marked CPU and DISK"
    lines = [
        "## Admission to the disk tier: disk hits against disk writes (scripts/bench admission)",
        "",
        f"Machine: {host}, Python {platform.python_version()}. CPU tier 5 % of "
        "each trace's unique blocks over a disk tier of 25 %, both LRU, "
        f"{BLOCK_BYTES // 1024} KiB blocks, {stores}; a real `TierChain` replays each "
        "trace as `tierd simulate --config` does. Deterministic: one run per point; "
        f"all {sum(len(p) for _, p in results)} runs took {elapsed:.0f} s. *From disk*: "
        "block hits served by the disk tier over all block accesses; *disk stores*: blocks "
        "written into the disk tier. *2nd half*: the second half of the trace alone, "
        "replayed on the same chain (the disk tier full, a learning rule warmed up).",
        "",
    ]
    for work, points in results:
        lines += [*table(work, points), ""]
    write_fragment("\n".join(lines), args.out)
    try:
        print(f"wrote {write_png(results, args.png)}", file=sys.stderr)
    except ImportError:
        print("matplotlib is missing: no PNG", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
