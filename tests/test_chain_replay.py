"""Trace replay through a whole chain (the replay engine in its hit-ratio mode, what
``tierd simulate --config`` runs): hits per medium, and what a disk tier adds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tierd
from tierd.workload.backends import replay_chain
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.replay_figures import ReplaySummary
from tierd.workload.simulate import simulate
from tierd.workload.trace import Trace, read_trace, write_trace

BLOCK = 4096


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_trace(path, generate(GeneratorConfig(seed=7, conversations=150)))
    return read_trace(path)


def config(tmp_path: Path, cpu_blocks: int, disk_blocks: int | None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "cpu", "kind": "cpu", "capacity": cpu_blocks}]
    if disk_blocks is not None:
        (tmp_path / "disk").mkdir(exist_ok=True)
        tiers.append(
            {
                "name": "disk",
                "kind": "disk",
                "capacity": disk_blocks,
                "directories": [str(tmp_path / "disk")],
            }
        )
    return {"block_bytes": BLOCK, "tiers": tiers}


async def replay_cpu_only(tmp_path: Path, trace: Trace, capacity: int) -> ReplaySummary:
    """``trace`` replayed through a chain of one CPU tier of ``capacity`` blocks."""
    async with tierd.open(config(tmp_path, capacity, None)) as chain:
        return await replay_chain(chain, trace)


async def test_cpu_only_chain_matches_the_single_tier_simulation(
    tmp_path: Path, trace: Trace
) -> None:
    capacity = max(8, trace.unique_blocks // 10)
    result = await replay_cpu_only(tmp_path, trace, capacity)
    reference = simulate(trace, "lru", capacity)
    assert result.block_accesses == reference.block_accesses
    assert result.hits == reference.hits
    assert result.hits_by_medium == {"CPU": result.hits}


async def test_a_disk_tier_below_adds_hits_and_reports_them_per_medium(
    tmp_path: Path, trace: Trace
) -> None:
    capacity = max(8, trace.unique_blocks // 20)
    alone = await replay_cpu_only(tmp_path, trace, capacity)
    async with tierd.open(config(tmp_path, capacity, trace.unique_blocks)) as chain:
        both = await replay_chain(chain, trace)
        chain.check_invariants(idle=True)
    assert both.hit_ratio >= alone.hit_ratio
    assert both.hits_by_medium["DISK"] > 0
    assert both.hits == both.hits_by_medium["CPU"] + both.hits_by_medium["DISK"]
    assert both.hit_ratio_by_medium["DISK"] == pytest.approx(
        both.hits_by_medium["DISK"] / both.block_accesses
    )
