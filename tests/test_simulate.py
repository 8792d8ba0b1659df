"""Replaying traces through a tier, and the ``tierd`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest

from tierd.cli import main
from tierd.errors import UnknownPolicy
from tierd.keys import BlockKey
from tierd.policy import policy_names
from tierd.tier import Tier
from tierd.workload import Trace, parse_capacity, read_trace, replay, simulate, write_trace
from tierd.workload.generate import GeneratorConfig, generate


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "generated.jsonl"
    write_trace(path, generate(GeneratorConfig(seed=1, conversations=400, documents=80)))
    return path


@pytest.fixture(scope="module")
def trace(trace_file: Path) -> Trace:
    return read_trace(trace_file)


def reference_lru(key_lists: Sequence[Sequence[BlockKey]], capacity: int) -> int:
    """Prefix hits of a plain ordered-dict LRU, written independently of tierd."""
    cache: OrderedDict[BlockKey, None] = OrderedDict()
    hits = 0
    for keys in key_lists:
        for key in keys:
            if key not in cache:
                break
            hits += 1
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
        if len(keys) > capacity:
            continue  # the request's blocks cannot all fit: the tier stores none of them
        for key in [key for key in keys if key not in cache]:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[key] = None
    return hits


# -- capacity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "blocks"),
    [
        (7, 7),
        ("7", 7),
        ("1%", 1827),
        ("5%", 9139),
        ("10%", 18279),
        ("25%", 45697),
        ("100%", 182790),
    ],
)
def test_parse_capacity(value: str | int, blocks: int) -> None:
    assert parse_capacity(value, 182_790) == blocks


def test_parse_capacity_is_at_least_one_block() -> None:
    assert parse_capacity("0.001%", 10) == 1


@pytest.mark.parametrize("value", ["0", "-3", 0, "x", "5 %%", "0%", "101%", "%"])
def test_parse_capacity_rejects(value: str | int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        parse_capacity(value, 1000)


# -- replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [1, 8, 100, 1000, 100_000])
def test_lru_matches_an_ordered_dict_reference(trace: Trace, capacity: int) -> None:
    result = simulate(trace, "lru", capacity)
    assert result.hits == reference_lru(trace.key_lists(), capacity)


@pytest.mark.parametrize("policy", policy_names())
def test_hit_ratio_grows_with_capacity(trace: Trace, policy: str) -> None:
    ratios = [simulate(trace, policy, f"{share}%").hit_ratio for share in (1, 5, 25, 100)]
    assert ratios == sorted(ratios)
    assert ratios[0] < ratios[-1]
    # With room for every block, only a block's first access misses.
    assert simulate(trace, policy, "100%").hits == trace.block_accesses - trace.unique_blocks


def test_result_fields(trace: Trace) -> None:
    result = simulate(trace, "lru", "5%")
    assert result.policy == "lru"
    assert result.capacity == parse_capacity("5%", trace.unique_blocks)
    assert result.requests == len(trace)
    assert result.block_accesses == trace.block_accesses
    assert result.unique_blocks == trace.unique_blocks
    assert result.hit_ratio == pytest.approx(result.hits / result.block_accesses)
    assert result.seconds > 0
    assert result.accesses_per_second == pytest.approx(result.block_accesses / result.seconds)
    assert result.to_dict()["hits"] == result.hits


def test_replay_leaves_a_consistent_tier(trace: Trace) -> None:
    tier = Tier(500, "lru")
    calls: list[tuple[int, int]] = []
    hits = replay(tier, trace.key_lists(), lambda done, total: calls.append((done, total)))
    assert hits == tier.hits
    assert tier.hits + tier.misses == trace.block_accesses
    stats = tier.stats()
    assert stats.used == 500
    assert stats.writing == 0
    assert stats.pinned == 0
    assert tier.take_events() == []  # replay drained them
    assert calls[-1] == (len(trace), len(trace))
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_unknown_policy(trace: Trace) -> None:
    with pytest.raises(UnknownPolicy, match="valid policies: arc, duel, lru"):
        simulate(trace, "nope", 10)


# -- the figures on the shared Mooncake trace -------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [(1827, 0.0523), (9139, 0.1957), (18279, 0.2787), (45697, 0.3535)],
)
def test_shared_trace_lru_hit_ratios(shared_trace: Path, capacity: int, expected: float) -> None:
    result = simulate(read_trace(shared_trace), "lru", capacity)
    assert result.hit_ratio == pytest.approx(expected, abs=0.002)


@pytest.mark.parametrize(
    ("capacity", "lru", "arc", "duel"),
    [
        (1827, 0.0523, 0.0751, 0.0758),
        (9139, 0.1957, 0.2119, 0.2120),
        (18279, 0.2787, 0.2864, 0.2836),
        (45697, 0.3535, 0.3358, 0.3535),
    ],
)
def test_shared_trace_duel_follows_the_better_of_lru_and_arc(
    shared_trace: Path, capacity: int, lru: float, arc: float, duel: float
) -> None:
    """ARC wins at small sizes, LRU at 25 %; duel is within 0.003 of the better one."""
    result = simulate(read_trace(shared_trace), "duel", capacity)
    assert result.hit_ratio == pytest.approx(duel, abs=0.0005)
    assert result.hit_ratio >= max(lru, arc) - 0.003


# -- the command line -------------------------------------------------------------------


def test_cli_simulate_text(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(trace_file), "--policy", "lru", "--capacity", "5%"]) == 0
    out, err = capsys.readouterr()
    expected = simulate(read_trace(trace_file), "lru", "5%")
    assert f"hit ratio       {expected.hit_ratio:.4f}" in out
    assert f"requests        {expected.requests:,}" in out
    assert f"block accesses  {expected.block_accesses:,}" in out
    assert "accesses/s" in out
    assert err == ""  # no progress bar: stderr is not a terminal


def test_cli_simulate_json(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(trace_file), "--policy", "arc", "--capacity", "50", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert out.count("\n") == 1
    assert data["policy"] == "arc"
    assert data["capacity"] == 50
    assert data["hits"] == simulate(read_trace(trace_file), "arc", 50).hits
    assert set(data) >= {"hit_ratio", "requests", "block_accesses", "accesses_per_second"}


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--policy", "nope"], 2, "unknown cache policy 'nope'; valid policies: arc, duel, lru"),
        (["--capacity", "lots"], 2, "capacity must be a block count or a percentage"),
    ],
)
def test_cli_simulate_usage_errors(
    trace_file: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    status: int,
    message: str,
) -> None:
    assert main(["simulate", str(trace_file), *args]) == status
    assert message in capsys.readouterr().err


def test_cli_missing_and_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    assert main(["simulate", str(missing)]) == 2
    assert f"trace file not found: {missing}" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["simulate", str(bad)]) == 1
    assert f"{bad}:1: missing field(s)" in capsys.readouterr().err


def test_cli_trace_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.jsonl"
    args = ["trace", "generate", "--out", str(out), "--seed", "5", "--conversations", "30"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    first = out.read_text()
    assert main(args) == 0
    assert out.read_text() == first
    assert len(read_trace(out)) >= 30


def test_cli_argparse_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["simulate"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        main(["no-such-command"])
    assert caught.value.code == 2


def test_python_dash_m(trace_file: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tierd", "simulate", str(trace_file), "--capacity", "9", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["capacity"] == 9
    done = subprocess.run(
        [sys.executable, "-m", "tierd", "simulate", str(trace_file), "--policy", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "valid policies" in done.stderr
