"""Trace files: parsing good and bad lines, writing, and the synthetic generator."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tierd.errors import TierdError, TraceError
from tierd.keys import int_key
from tierd.workload import TraceRecord, parse_trace, read_trace, write_trace
from tierd.workload.generate import GeneratorConfig, generate


def line(timestamp: int = 0, ids: list[int] | None = None, **extra: object) -> str:
    record = {"timestamp": timestamp, "input_length": 1000, "output_length": 10}
    record["hash_ids"] = [0, 1] if ids is None else ids  # type: ignore[assignment]
    record.update(extra)  # type: ignore[arg-type]
    return json.dumps(record)


# -- parsing ----------------------------------------------------------------------------


def test_parse_good_lines_interns_keys_and_counts_blocks() -> None:
    trace = parse_trace([line(0, [0, 1, 2]), "", line(5, [0, 1, 3]), "  \n"], source="t")
    assert len(trace) == 2
    assert trace.unique_blocks == 4
    assert trace.block_accesses == 6
    first, second = trace.requests
    assert first.timestamp == 0
    assert second.timestamp == 5
    assert first.input_length == 1000
    assert first.output_length == 10
    assert first.keys == (int_key(0), int_key(1), int_key(2))
    # One bytes object per distinct id, shared by every request that names it.
    assert first.keys[0] is second.keys[0]
    assert first.keys[1] is second.keys[1]
    assert trace.key_lists() == [first.keys, second.keys]


def test_empty_hash_ids_is_a_request_without_blocks() -> None:
    trace = parse_trace([line(ids=[])])
    assert trace.requests[0].keys == ()
    assert trace.block_accesses == 0


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"timestamp": 0, "hash_ids": []}', "missing field(s): input_length, output_length"),
        (line(timestamp=-1), "timestamp must be a non-negative integer"),
        (line(input_length="7"), "input_length must be a non-negative integer"),
        (line(output_length=True), "output_length must be a non-negative integer"),
        (line(timestamp=1.5), "timestamp must be a non-negative integer"),
        (line(ids=[0, "1"]), "hash_ids must be a list of integers"),
        (line(ids=[-1]), "hash_ids must be a list of integers"),
        (line(ids=[2**64]), "hash_ids must be a list of integers"),
        (line(hash_ids=7), "hash_ids must be a list of integers"),
    ],
)
def test_bad_line_names_file_and_line(bad: str, expected: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace([line(), "", bad], source="x.jsonl")
    assert caught.value.path == "x.jsonl"
    assert caught.value.line == 3
    assert str(caught.value).startswith("x.jsonl:3: ")
    assert expected in str(caught.value)
    assert isinstance(caught.value, TierdError)


def test_a_trace_without_requests_is_an_error() -> None:
    with pytest.raises(TraceError, match="no request"):
        parse_trace(["", "\n"], source="empty")


def test_read_trace_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TraceError, match="no such trace file") as caught:
        read_trace(missing)
    assert caught.value.path == str(missing)
    assert caught.value.line is None


def test_read_trace_bad_line_in_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n" + line() + "\noops\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:3: not valid JSON"):
        read_trace(path)


def test_read_trace_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceError, match="UTF-8"):
        read_trace(path)


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    records = [TraceRecord(0, 600, 5, (0, 1)), TraceRecord(7, 100, 3, (0, 2))]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, records) == 2
    trace = read_trace(path)
    assert [(r.timestamp, r.input_length, r.output_length) for r in trace] == [
        (0, 600, 5),
        (7, 100, 3),
    ]
    assert [r.keys for r in trace] == [(int_key(0), int_key(1)), (int_key(0), int_key(2))]
    buffer = io.StringIO()
    write_trace(buffer, records)
    assert buffer.getvalue() == path.read_text()


def test_shared_trace_figures(shared_trace: Path) -> None:
    trace = read_trace(shared_trace)
    assert len(trace) == 12_031
    assert trace.unique_blocks == 182_790
    assert trace.block_accesses == 288_500


# -- the generator ----------------------------------------------------------------------

SMALL = GeneratorConfig(seed=7, conversations=200, documents=50)


def test_generator_is_deterministic_for_a_seed() -> None:
    assert generate(SMALL) == generate(SMALL)
    other = generate(GeneratorConfig(seed=8, conversations=200, documents=50))
    assert other != generate(SMALL)


def test_generator_shape() -> None:
    records = generate(SMALL)
    assert len(records) >= SMALL.conversations  # at least one turn each
    stamps = [r.timestamp for r in records]
    assert stamps == sorted(stamps)
    for record in records:
        blocks = len(record.hash_ids)
        assert blocks >= 1
        # len(hash_ids) == ceil(input_length / 512), like the Mooncake trace.
        assert -(-record.input_length // 512) == blocks
        low, high = SMALL.output_tokens
        assert low <= record.output_length <= high
    # Ids are numbered by first appearance.
    seen: list[int] = []
    for record in records:
        seen.extend(i for i in record.hash_ids if i not in seen)
    assert seen == list(range(len(seen)))


def test_generator_ids_are_prefix_chained() -> None:
    parent: dict[int, int] = {}
    for record in generate(SMALL):
        previous = -1
        for block in record.hash_ids:
            # A block id always follows the same parent: sharing an id shares the prefix.
            assert parent.setdefault(block, previous) == previous
            previous = block


def test_generator_turns_extend_earlier_turns_and_share_system_prompts() -> None:
    records = generate(SMALL)
    by_prefix = {r.hash_ids for r in records}
    extended = sum(
        any(r.hash_ids[:k] in by_prefix for k in range(1, len(r.hash_ids))) for r in records
    )
    assert extended > len(records) // 3  # later turns extend an earlier turn
    heads = {r.hash_ids[0] for r in records}
    assert len(heads) <= SMALL.system_prompts


def test_generated_trace_parses(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    records = generate(SMALL)
    write_trace(path, records)
    trace = read_trace(path)
    assert len(trace) == len(records)
    assert trace.unique_blocks == len({i for r in records for i in r.hash_ids})


@pytest.mark.parametrize(
    "bad",
    [
        {"conversations": -1},
        {"document_share": 1.5},
        {"mean_turns": 0.5},
        {"turn_blocks": (3, 2)},
        {"arrivals_per_second": 0.0},
    ],
)
def test_generator_rejects_bad_config(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        GeneratorConfig(**bad)  # type: ignore[arg-type]
