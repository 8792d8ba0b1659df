"""``tierd simulate --curve``: the LRU hit ratio at every capacity in one pass, checked
against single-capacity ``simulate`` runs (exact equality), and its command line."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tierd.cli import main
from tierd.workload import Trace, parse_trace, read_trace, simulate, write_trace
from tierd.workload.curve import lru_curve
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import TraceRecord


def trace_of(requests: Sequence[Sequence[int]]) -> Trace:
    lines = [
        TraceRecord(i, 16 * len(ids), 1, tuple(ids)).to_json() for i, ids in enumerate(requests)
    ]
    return parse_trace(lines)


def simulated_hits(trace: Trace, capacities: Sequence[int]) -> list[int]:
    return [simulate(trace, "lru", capacity).hits for capacity in capacities]


SHAPES = {
    "conversations": GeneratorConfig(seed=3, conversations=40),
    "shared documents": GeneratorConfig(seed=5, conversations=30, documents=40, document_share=0.6),
    "flat popularity, long chats": GeneratorConfig(
        seed=7, conversations=25, zipf_exponent=0.6, mean_turns=8
    ),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_curve_equals_single_capacity_simulate(shape: str, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate(SHAPES[shape]))
    trace = read_trace(path)
    curve = lru_curve(trace)
    low, high = curve.min_capacity, trace.unique_blocks
    # every capacity near the bottom, where the curve moves most, then a stride to past the end
    capacities = [*range(low, low + 150), *range(low + 150, high + 3, 7)]
    assert [curve.hits_at(c) for c in capacities] == simulated_hits(trace, capacities)
    assert curve.hits_at(high) > curve.hits_at(low)  # the check covered a curve that moves
    assert curve.min_capacity == max(len(set(keys)) for keys in trace.key_lists())


def test_repeated_keys_and_hits_after_a_miss(tmp_path: Path) -> None:
    """Requests that repeat a key, and keys cached after a request's first miss (touched,
    not counted): every capacity of many small random traces."""
    compared = 0
    for seed in range(60):
        rng = random.Random(seed)
        requests = []
        for _ in range(rng.randint(5, 40)):
            ids = [rng.randint(0, 25) for _ in range(rng.randint(1, 7))]
            requests.append(sorted(ids) if rng.random() < 0.5 else ids)
        trace = trace_of(requests)
        curve = lru_curve(trace)
        capacities = list(range(curve.min_capacity, trace.unique_blocks + 2))
        assert [curve.hits_at(c) for c in capacities] == simulated_hits(trace, capacities)
        compared += sum(len(set(r)) != len(r) for r in requests)
    assert compared > 20  # the traces did repeat keys within requests


def test_repeated_key_counts_each_time_in_the_leading_run() -> None:
    trace = trace_of([[1, 2], [1, 1, 2, 1]])
    curve = lru_curve(trace)
    assert curve.min_capacity == 2
    assert curve.hits_at(2) == 4 == simulate(trace, "lru", 2).hits


def test_a_bigger_tier_can_hit_less() -> None:
    """tierd stores a request's misses after touching its hits, so where a block sits
    after a request depends on whether it was a hit there: LRU here has no inclusion
    property, and the curve follows the tier, not a stack-distance shortcut."""
    trace = trace_of([[4, 9, 1], [5, 2], [7], [3, 9, 1, 1], [0], [2], [1, 7], [9, 2, 6]])
    curve = lru_curve(trace)
    assert (curve.hits_at(3), curve.hits_at(4)) == (1, 0)
    assert simulated_hits(trace, [3, 4, 5, 9, 10]) == [curve.hits_at(c) for c in (3, 4, 5, 9, 10)]


def test_capacities_below_the_largest_request_are_refused() -> None:
    curve = lru_curve(trace_of([[1, 2, 3], [1, 2]]))
    with pytest.raises(ValueError, match="starts at 3 blocks"):
        curve.hits_at(2)
    assert curve.hits_at(10**6) == curve.hits_at(3) == 2


# -- the command line ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("curve") / "trace.jsonl"
    write_trace(path, generate(GeneratorConfig(seed=11, conversations=60)))
    return path


def write_config(path: Path, cpu: int, disk: int) -> Path:
    path.write_text(
        "block_bytes: 4096\ntiers:\n"
        f"  - {{name: cpu, kind: cpu, capacity: {cpu}}}\n"
        f"  - {{name: disk, kind: disk, capacity: '{disk} blocks', directories: [{path.parent}]}}\n"
    )
    return path


def test_cli_curve_json_and_tier_marks(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = read_trace(trace_file)
    config = write_config(tmp_path / "tiers.yaml", 150, 250)
    assert main(["simulate", str(trace_file), "--curve", "--json", "--config", str(config)]) == 0
    doc = json.loads(capsys.readouterr().out)
    shares = [p["share"] for p in doc["points"]]
    expected = [
        s for s in (1, 5, 10, 25, 50, 100) if trace.unique_blocks * s // 100 >= doc["min_capacity"]
    ]
    assert shares == expected and 100 in shares
    for point in doc["points"]:
        single = simulate(trace, "lru", f"{point['share']:g}%")
        assert (point["capacity"], point["hits"]) == (single.capacity, single.hits)
    cpu, disk = doc["tiers"]
    assert (cpu["name"], cpu["capacity"], cpu["cumulative_capacity"]) == ("cpu", 150, 150)
    assert (disk["name"], disk["capacity"], disk["cumulative_capacity"]) == ("disk", 250, 400)
    assert disk["hit_ratio"] == simulate(trace, "lru", 400).hit_ratio
    assert doc["plot"] is None


def test_cli_curve_table_and_png(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "plots" / "curve.png"
    config = write_config(tmp_path / "tiers.yaml", 100, 300)
    argv = ["simulate", str(trace_file), "--curve", "--out", str(png), "--config", str(config)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    ten = simulate(read_trace(trace_file), "lru", "10%")
    assert f"{ten.capacity:>12,}     10%  {ten.hit_ratio:.4f}" in out
    assert "tier cpu" in out and "tier disk" in out and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--out", "x.png"], "--out draws the curve: use it with --curve"),
        (["--curve", "--policy", "arc"], "--curve computes LRU's hit ratio only"),
        (["--curve", "--out", "curve.svg"], "--out writes a PNG"),
    ],
)
def test_cli_curve_usage_errors(
    trace_file: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(trace_file), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_curve_bad_config_and_unwritable_png(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{name: cpu, kind: cpu, capacity: -3}]\n")
    assert main(["simulate", str(trace_file), "--curve", "--config", str(bad)]) == 78
    assert "invalid configuration" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "curve.png"
    assert main(["simulate", str(trace_file), "--curve", "--out", str(target)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {target}" in err and err.count("\n") == 1
