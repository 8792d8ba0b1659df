"""What-ifs repeat: ``replay --config``, ``replay --compare`` and ``simulate --config``
start cold in a private directory unless ``--warm DIR``; a daemon replay gets a fresh
namespace per run unless ``--namespace`` names one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierd.cli import main
from tierd.testing import daemon_config, running_daemon
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import write_trace

FIGURES = ("hits", "hits_by_medium", "misses", "stored_blocks", "loaded_blocks")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_trace(path, generate(GeneratorConfig(seed=5, conversations=40)))
    return path


def chain_file(tmp_path: Path, name: str, cpu_blocks: int) -> tuple[Path, Path]:
    """A config with a disk tier in its own directory; returns (file, disk directory)."""
    (tmp_path / name).mkdir()
    cfg = daemon_config(tmp_path / name, cpu_blocks=cpu_blocks, disk_blocks=2048)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"block_bytes": cfg["block_bytes"], "tiers": cfg["tiers"]}))
    return path, Path(cfg["tiers"][1]["directories"][0])


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    status = main([*argv, "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    result: dict[str, Any] = json.loads(out)
    return result


def figures(run: dict[str, Any]) -> dict[str, Any]:
    return {name: run[name] for name in FIGURES if name in run}


def test_the_same_compare_twice_gives_identical_figures(
    tmp_path: Path, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (small, small_disk), (large, large_disk) = (
        chain_file(tmp_path, "small", 16),
        chain_file(tmp_path, "large", 64),
    )
    argv = ["replay", str(trace_path), "--compare", str(small), str(large), "--max-rate"]
    first = run_json(argv, capsys)["runs"]
    second = run_json(argv, capsys)["runs"]

    assert [figures(r) for r in first] == [figures(r) for r in second]
    assert all(r["hits_by_medium"].get("DISK", 0) > 0 for r in first)  # the disk tier served
    assert list(small_disk.iterdir()) == list(large_disk.iterdir()) == []  # never touched


def test_the_same_chain_simulation_twice_gives_identical_figures(
    tmp_path: Path, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, disk = chain_file(tmp_path, "chain", 16)
    argv = ["simulate", str(trace_path), "--config", str(config)]
    first, second = run_json(argv, capsys), run_json(argv, capsys)

    assert figures(first) == figures(second)
    assert first["hits_by_medium"]["DISK"] > 0
    assert list(disk.iterdir()) == []


def test_warm_keeps_the_disk_tier_between_runs(
    tmp_path: Path, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = chain_file(tmp_path, "chain", 16)
    warm = tmp_path / "warm"
    argv = ["replay", str(trace_path), "--config", str(config), "--warm", str(warm)]
    first, second = run_json(argv, capsys), run_json(argv, capsys)
    cold = run_json(["replay", str(trace_path), "--config", str(config)], capsys)

    assert second["hits"] > first["hits"]  # the second run found the first one's blocks
    assert figures(cold) == figures(first)
    assert sorted(p.name for p in (warm / "chain").iterdir()) == ["disk-0"]


def test_warm_is_refused_for_a_daemon_replay(
    trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["replay", str(trace_path), "--warm", "/tmp/x"])
    assert status == 2
    assert "--warm applies to --config" in capsys.readouterr().err


async def test_a_daemon_replay_starts_in_a_fresh_namespace_unless_named(
    tmp_path: Path, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=2048)
    argv = ["replay", str(trace_path), "--socket", cfg["socket"]["path"], "--max-rate"]
    async with running_daemon(cfg):
        first = await asyncio.to_thread(run_json, argv, capsys)
        second = await asyncio.to_thread(run_json, argv, capsys)
        named = [*argv, "--namespace", "mine"]
        named_first = await asyncio.to_thread(run_json, named, capsys)
        named_second = await asyncio.to_thread(run_json, named, capsys)

    assert figures(first) == figures(second)
    assert first["namespace"] != second["namespace"]
    assert first["namespace"].startswith("replay-")
    assert figures(named_first) == figures(first)
    assert named_second["hits"] > named_first["hits"]  # a named namespace is reused
    assert named_second["namespace"] == "mine"
