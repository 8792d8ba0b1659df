"""A seeded synthetic trace generator writing the Mooncake format.

The shape follows what makes real chat traffic cacheable:

- every conversation starts with one of a few shared system prompts;
- its first turn may quote a document drawn with Zipf popularity (a few documents are
  quoted often), placed right after the system prompt so that conversations quoting the
  same document under the same system prompt share those blocks;
- each later turn extends the previous turn's blocks (the history) with new ones (the
  answer and the next user message), after a think time;
- conversations arrive as a Poisson process; the requests are written in time order.

Block ids are prefix-chained like the real trace's: a block's id is determined by its
parent's id and its content, and ids are numbered in order of first appearance. The
same config (seed included) always yields the same trace.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from tierd.workload.trace import TraceRecord

__all__ = ["GeneratorConfig", "generate"]

BLOCK_TOKENS = 512
_Content = tuple[Any, ...]  # what a block holds, symbolically: ("sys", 2, 0), ("doc", 7, 3) ...


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    """Knobs of the generator; ranges are inclusive ``(low, high)`` block counts."""

    seed: int = 0
    conversations: int = 1000
    system_prompts: int = 4
    system_prompt_blocks: tuple[int, int] = (2, 8)
    documents: int = 300
    document_blocks: tuple[int, int] = (4, 24)
    document_share: float = 0.6  # of first turns that quote a document
    zipf_exponent: float = 1.1
    mean_turns: float = 3.0
    max_turns: int = 12
    turn_blocks: tuple[int, int] = (1, 4)
    output_tokens: tuple[int, int] = (16, 1024)
    arrivals_per_second: float = 4.0
    think_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.conversations < 0 or self.system_prompts < 1 or self.documents < 1:
            raise ValueError("need conversations >= 0, system_prompts >= 1, documents >= 1")
        if not 0.0 <= self.document_share <= 1.0:
            raise ValueError(f"document_share must be in [0, 1], got {self.document_share}")
        if self.mean_turns < 1.0 or self.max_turns < 1:
            raise ValueError("mean_turns and max_turns must be at least 1")
        for name in ("system_prompt_blocks", "document_blocks", "turn_blocks", "output_tokens"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name} must be a range 0 < low <= high, got {(low, high)}")
        if self.arrivals_per_second <= 0 or self.think_seconds < 0:
            raise ValueError("arrivals_per_second must be > 0 and think_seconds >= 0")


def generate(config: GeneratorConfig) -> list[TraceRecord]:
    """The synthetic trace for ``config``, in time order."""
    rng = random.Random(config.seed)
    catalog = _Catalog.draw(rng, config)
    turns: list[tuple[int, int, int, list[_Content]]] = []  # (ms, conv, turn, contents)
    start = 0.0
    for conv in range(config.conversations):
        start += rng.expovariate(config.arrivals_per_second)
        turns.extend(_conversation(rng, config, catalog, conv, start))
    turns.sort(key=lambda turn: turn[:3])
    ids = _BlockIds()
    records = []
    for ms, _, _, contents in turns:
        hash_ids = ids.chain(contents)
        input_length = (len(hash_ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        output_length = rng.randint(*config.output_tokens)
        records.append(TraceRecord(ms, input_length, output_length, hash_ids))
    return records


@dataclass(frozen=True, slots=True)
class _Catalog:
    """The shared items: each system prompt's and document's length, documents' popularity."""

    system_blocks: tuple[int, ...]
    document_blocks: tuple[int, ...]
    popularity: tuple[float, ...]  # cumulative Zipf weights, most popular document first

    @classmethod
    def draw(cls, rng: random.Random, config: GeneratorConfig) -> _Catalog:
        weights = (1.0 / rank**config.zipf_exponent for rank in range(1, config.documents + 1))
        return cls(
            tuple(rng.randint(*config.system_prompt_blocks) for _ in range(config.system_prompts)),
            tuple(rng.randint(*config.document_blocks) for _ in range(config.documents)),
            tuple(itertools.accumulate(weights)),
        )


def _conversation(
    rng: random.Random, config: GeneratorConfig, catalog: _Catalog, conv: int, start: float
) -> list[tuple[int, int, int, list[_Content]]]:
    system = rng.randrange(config.system_prompts)
    contents: list[_Content] = [("sys", system, i) for i in range(catalog.system_blocks[system])]
    if rng.random() < config.document_share:
        doc = rng.choices(range(config.documents), cum_weights=catalog.popularity)[0]
        contents += [("doc", doc, i) for i in range(catalog.document_blocks[doc])]
    # Geometric number of turns with the configured mean, capped.
    count = 1
    while count < config.max_turns and rng.random() > 1.0 / config.mean_turns:
        count += 1
    turns = []
    at = start
    for turn in range(count):
        new = rng.randint(*config.turn_blocks)
        contents = contents + [("turn", conv, turn, i) for i in range(new)]
        turns.append((int(at * 1000), conv, turn, contents))
        at += rng.expovariate(1.0 / config.think_seconds) if config.think_seconds else 0.0
    return turns


class _BlockIds:
    """Prefix-chained ids: (parent id, content) -> id, numbered by first appearance."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, _Content], int] = {}

    def chain(self, contents: list[_Content]) -> tuple[int, ...]:
        ids = self._ids
        parent = -1
        out = []
        for content in contents:
            node = (parent, content)
            block = ids.get(node)
            if block is None:
                block = ids[node] = len(ids)
            out.append(block)
            parent = block
        return tuple(out)
