"""Mooncake-format request traces: reading them into memory, and writing them.

A trace is JSON lines, one request per line::

    {"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>,
     "hash_ids": [<int>, ...]}

``hash_ids`` are prefix-chained block ids: two requests that share an id share the whole
prefix up to and including that block. In memory each id becomes the block key
:func:`tierd.keys.int_key` gives it, and every occurrence of one id shares a single
``bytes`` object, so a trace costs one key per distinct block, not one per access.

A line may name its ``namespace`` (hex, as ``tierd record`` writes the namespace's id):
its keys are then that id's bytes followed by the block's key, so the same id in two
namespaces (two models sent the same prompt) is two blocks, never one shared.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tierd.errors import TraceError
from tierd.keys import BlockKey, int_key

__all__ = [
    "Trace",
    "TraceRecord",
    "TraceRequest",
    "parse_trace",
    "read_trace",
    "write_trace",
]

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_MAX_ID = 2**64  # ids become 8-byte keys
_MAX_NAMESPACE = 16  # bytes of a namespace id (hex in the file)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a loaded trace; ``keys`` are its blocks' keys, head first."""

    timestamp: int
    input_length: int
    output_length: int
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request as written to a trace file (block ids, not keys)."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: its requests in file order, and how many distinct blocks they name."""

    requests: tuple[TraceRequest, ...]
    unique_blocks: int
    block_accesses: int
    source: str = "<memory>"

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def first(self, count: int) -> Trace:
        """The trace of its first ``count`` requests (itself when it has no more)."""
        if count >= len(self.requests):
            return self
        requests = self.requests[:count]
        keys = [key for request in requests for key in request.keys]
        return Trace(requests, len(set(keys)), len(keys), self.source)

    def key_lists(self) -> list[tuple[BlockKey, ...]]:
        """Each request's keys, in order: what a replay loop iterates over."""
        return [request.keys for request in self.requests]


class _Interner(dict[int, BlockKey]):
    """Block id -> key (after one namespace's id), creating each key once."""

    def __init__(self, namespace: bytes = b"") -> None:
        super().__init__()
        self.namespace = namespace

    def __missing__(self, block_id: int) -> BlockKey:
        key = self[block_id] = BlockKey(self.namespace + int_key(block_id))
        return key


def read_trace(path: str | Path) -> Trace:
    """Load the trace at ``path``; :class:`TraceError` names the file (and line) if it is
    missing, a directory or not a regular file, cannot be read, a line is not UTF-8 or is
    malformed, or it holds no request."""
    source = str(path)
    if Path(path).is_dir():
        raise TraceError("is a directory, not a trace file", path=source)
    if Path(path).exists() and not Path(path).is_file():
        raise TraceError("not a regular file (a trace is a JSONL file)", path=source)
    try:
        with open(path, "rb") as handle:
            return parse_trace(_decoded(handle, source), source=source)
    except FileNotFoundError:
        raise TraceError("no such trace file", path=source) from None
    except OSError as exc:
        raise TraceError(f"cannot read the trace: {exc.strerror}", path=source) from None


def _decoded(lines: Iterable[bytes], source: str) -> Iterator[str]:
    """Each line as text; one that is not UTF-8 is a :class:`TraceError` naming it."""
    for number, line in enumerate(lines, start=1):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(
                f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=source, line=number
            ) from None


def parse_trace(lines: Iterable[str], *, source: str = "<memory>") -> Trace:
    """Parse trace lines (blank lines are skipped); errors name ``source`` and the line."""
    interners: dict[bytes, _Interner] = {}
    requests: list[TraceRequest] = []
    accesses = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        timestamp, input_length, output_length, ids, space = _parse_line(line, source, number)
        interner = interners.get(space)
        if interner is None:
            interner = interners[space] = _Interner(space)
        keys = tuple(map(interner.__getitem__, ids))
        accesses += len(keys)
        requests.append(TraceRequest(timestamp, input_length, output_length, keys))
    if not requests:
        raise TraceError("the trace holds no request", path=source)
    unique = sum(len(interner) for interner in interners.values())
    return Trace(tuple(requests), unique, accesses, source)


def _parse_line(line: str, source: str, number: int) -> tuple[int, int, int, list[int], bytes]:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"not valid JSON ({exc.msg})", path=source, line=number) from None
    if not isinstance(record, dict):
        raise TraceError("a request must be a JSON object", path=source, line=number)
    missing = [name for name in FIELDS if name not in record]
    if missing:
        raise TraceError(f"missing field(s): {', '.join(missing)}", path=source, line=number)
    numbers = [record[name] for name in FIELDS[:3]]
    for name, value in zip(FIELDS, numbers, strict=False):
        if type(value) is not int or value < 0:
            raise TraceError(
                f"{name} must be a non-negative integer, got {value!r}", path=source, line=number
            )
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < _MAX_ID for i in ids):
        raise TraceError(
            "hash_ids must be a list of integers from 0 to 2**64 - 1", path=source, line=number
        )
    return numbers[0], numbers[1], numbers[2], ids, _namespace(record, source, number)


def _namespace(record: dict[str, Any], source: str, number: int) -> bytes:
    """The bytes of a line's ``namespace`` id (none: empty)."""
    text = record.get("namespace")
    if text is None:
        return b""
    try:
        space = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        space = b""
    if not 0 < len(space) <= _MAX_NAMESPACE:
        raise TraceError(
            f"namespace must be a namespace id in hex (1 to {_MAX_NAMESPACE} bytes, as "
            f"tierd record writes it), got {text!r}",
            path=source,
            line=number,
        )
    return space


def write_trace(target: str | Path | TextIO, records: Iterable[TraceRecord]) -> int:
    """Write ``records`` as JSON lines to a path or an open text file; returns the count."""
    if isinstance(target, str | Path):
        with open(target, "w", encoding="utf-8") as handle:
            return write_trace(handle, records)
    count = 0
    for record in records:
        target.write(record.to_json())
        target.write("\n")
        count += 1
    return count
