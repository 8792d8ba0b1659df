"""Admission rules beyond ``reuse>=N``: ``sample<=P`` (whole requests drawn by a hash),
``comeback>=P`` (kinds of blocks that came back, learned online) and ``A|B``; their
parsing, the bookkeeping they read, and their effect through a chain on hand-made traces
where the outcome is exact."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from xxhash import xxh3_64_intdigest

import tierd
from tests.admission_kit import chain_yaml, write_trace
from tierd.cli import main
from tierd.config import ChainConfig, load_config
from tierd.errors import ConfigError
from tierd.keys import BlockKey, int_key
from tierd.policy.admission import Admission, Comeback, KeyUses
from tierd.workload.backends import replay_chain

# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rule", "canonical"),
    [
        ("always", Admission(), "always"),
        ("reuse>=2", Admission(min_reuse=2), "reuse>=2"),
        ("sample<=0.25", Admission(sample=0.25), "sample<=0.25"),
        ("comeback>=0.3", Admission(comeback=0.3), "comeback>=0.3"),
        ("reuse>=2 | sample<=0.5", Admission(min_reuse=2, sample=0.5), "reuse>=2|sample<=0.5"),
        ("comeback>=1|reuse>=3", Admission(min_reuse=3, comeback=1.0), "reuse>=3|comeback>=1"),
    ],
)
def test_rules_parse_and_print(text: str, rule: Admission, canonical: str) -> None:
    assert Admission.parse(text) == rule
    assert str(rule) == canonical
    assert Admission.parse(str(rule)) == rule
    assert rule.counts_uses is not rule.always


@pytest.mark.parametrize(
    "text",
    [
        "",
        "never",
        "reuse>=0",
        "sample<=0",
        "sample<=1.5",
        "sample<=nan",
        "sample<=inf",
        "sample>=0.5",
        "comeback>=-0.1",
        "comeback<=0.5",
        "reuse>=2|reuse>=3",
        "always|reuse>=2",
        "reuse>=2|",
    ],
)
def test_bad_rules_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="admission rule"):
        Admission.parse(text)


def test_a_config_takes_a_combined_rule(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "block_bytes": 4096,
        "tiers": [
            {"name": "cpu", "kind": "memory", "capacity": 2},
            {"name": "disk", "kind": "memory", "capacity": 8, "admission": "reuse>=2|sample<=0.5"},
        ],
    }
    assert load_config(config, ChainConfig).tiers[1].admission == "reuse>=2|sample<=0.5"
    config["tiers"][1]["admission"] = "sample<=2"
    with pytest.raises(ConfigError, match="sample<=2"):
        load_config(config, ChainConfig)


# -- what the rules know of keys ---------------------------------------------------------

A, B, C, D = (int_key(i) for i in (1, 2, 3, 4))


def test_a_request_draws_once_for_its_new_keys() -> None:
    uses = KeyUses(100, draws=True)
    uses.count([A, B])
    uses.count([A, B, C, D])  # A and B were drawn by the first request
    assert uses.draw(A) == uses.draw(B) == xxh3_64_intdigest(A)
    assert uses.draw(C) == uses.draw(D) == xxh3_64_intdigest(C)
    assert [uses.uses(k) for k in (A, B, C, D)] == [2, 2, 1, 1]
    assert uses.draw(int_key(9)) == xxh3_64_intdigest(int_key(9))  # never touched: its own


def test_a_key_ended_the_request_that_used_it_last() -> None:
    uses = KeyUses(100, ends=True)
    uses.count([A, B, C])
    assert (uses.ended(B), uses.ended(C)) == (False, True)
    uses.count([A, B])  # B ends this one; C still ended the last request that used it
    assert (uses.ended(B), uses.ended(C)) == (True, True)
    uses.count([B, D])
    assert (uses.ended(B), uses.ended(D)) == (False, True)


def test_forgotten_keys_lose_everything() -> None:
    uses = KeyUses(2, draws=True, ends=True)
    for key in (A, B, C):
        uses.count([key])
    assert uses.uses(A) == 0 and not uses.ended(A)
    assert uses.draws is not None and A not in uses.draws
    assert (uses.uses(C), uses.ended(C)) == (1, True)


def test_reuse_or_sample_admits_what_either_admits() -> None:
    uses = KeyUses(100, draws=True)
    uses.count([A, B])
    share = xxh3_64_intdigest(A) / 2**64  # where the request of A and B drew
    below, above = share / 2, min(1.0, share * 1.01)
    out = Admission(min_reuse=2, sample=below)
    assert not out.admits(A, uses) and not out.admits(B, uses)  # one use, not drawn
    assert Admission(min_reuse=2, sample=above).admits(B, uses)  # drawn with A
    uses.count([A])
    assert out.admits(A, uses) and not out.admits(B, uses)  # A came back


# -- comeback: the shadow ----------------------------------------------------------------

ONE_USE = Comeback.kind(1, False)


def candidates(shadow: Comeback, keys: Sequence[BlockKey], uses: int = 1) -> list[bool]:
    """Offer each key as a candidate, telling the shadow about each admission."""
    verdicts = []
    for key in keys:
        verdict = shadow.admits(key, uses, False)
        if verdict:
            shadow.admitted()
        verdicts.append(verdict)
    return verdicts


def test_a_kind_that_never_comes_back_is_refused() -> None:
    shadow = Comeback(0.5, horizon=2)  # judged after 1 candidate scored
    # Nothing known: A and B are admitted. C's arrival is 2 admissions after A's: A's time
    # is up, it did not come back, and the kind is refused from then on.
    assert candidates(shadow, [A, B, C, D]) == [True, True, False, False]
    assert shadow.rate(ONE_USE) == 0.0
    assert shadow.rate(Comeback.kind(1, True)) is None  # other kinds: still unknown


def test_a_kind_that_comes_back_is_admitted() -> None:
    shadow = Comeback(0.5, horizon=2)
    assert candidates(shadow, [A, B]) == [True, True]
    shadow.touched([A])  # A came back while an admitted copy would still be held
    assert candidates(shadow, [C, D]) == [True, True]
    assert shadow.rate(ONE_USE) == 0.5  # A's time was up at C's offer (back), B's at D's


def test_refused_candidates_are_still_watched() -> None:
    shadow = Comeback(0.5, horizon=2)
    assert candidates(shadow, [A, B, C]) == [True, True, False]
    # No admissions: the clock stands still, C stays in the shadow and comes back; when
    # it is a candidate again its return is scored (1 back of 2), and the kind passes.
    shadow.touched([C])
    assert candidates(shadow, [C]) == [True]
    assert shadow.rate(ONE_USE) == 0.5


def test_a_kind_passes_through_a_kind_with_fewer_uses() -> None:
    shadow = Comeback(0.5, horizon=100)
    for uses, ended, back, gone in [(1, False, 30, 10), (3, False, 4, 36), (1, True, 0, 40)]:
        kind = Comeback.kind(uses, ended)
        shadow.back[kind], shadow.gone[kind] = back, gone
    assert shadow.passes(Comeback.kind(3, False))  # its prefix kind (1 use) comes back
    assert shadow.passes(Comeback.kind(2, False))  # unknown
    shadow.back[Comeback.kind(2, True)] = 0
    shadow.gone[Comeback.kind(2, True)] = 40
    assert not shadow.passes(Comeback.kind(2, True))  # its place: nothing with fewer uses
    assert Comeback.kind(9, True) == Comeback.kind(4, True)  # 4 or more is one kind


def test_scores_are_halved_past_the_horizon() -> None:
    shadow = Comeback(0.5, horizon=4)
    shadow.back[ONE_USE], shadow.gone[ONE_USE] = 1, 3
    shadow._score(ONE_USE << 1 | 1)  # a fifth score: more than the horizon
    assert (shadow.back[ONE_USE], shadow.gone[ONE_USE]) == (1.0, 1.5)


def test_the_shadow_is_bounded_by_its_memory() -> None:
    shadow = Comeback(0.5, horizon=4, memory=6)
    keys = [int_key(i) for i in range(20)]
    shadow.back[ONE_USE] = 100  # the kind passes: every candidate is admitted
    assert all(candidates(shadow, keys[:6]))
    assert len(shadow.shadow) == 4  # the clock ticks with each admission
    refusing = Comeback(0.5, horizon=4, memory=6)
    refusing.gone[ONE_USE] = 100  # refused: the clock stands still, memory bounds it
    assert not any(candidates(refusing, keys))
    assert len(refusing.shadow) == 6


# -- through a chain ---------------------------------------------------------------------


Simulate = Callable[[Sequence[Sequence[int]], str], tuple[int, int]]


@pytest.fixture
def simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Simulate:
    """``tierd simulate --json`` of requests through a 1-block CPU tier over a 2-block
    disk tier under an admission rule: the disk tier's stores and its hits."""

    def run(requests: Sequence[Sequence[int]], admission: str) -> tuple[int, int]:
        config = chain_yaml(tmp_path, admission, cpu=1, disk=2)
        trace = write_trace(tmp_path / "trace.jsonl", requests)
        assert main(["simulate", str(trace), "--config", str(config), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        disk_tier = next(t for t in result["tiers"] if t["name"] == "disk")
        return disk_tier["stores"], result["hits_by_medium"].get("DISK", 0)

    return run


# One block per request, never used again: each request demotes the one before it.
SINGLES = [[n] for n in range(1, 7)]
# Each block comes back in the request after the next: a disk hit every time. Under
# ``always`` a promotion out of the full 2-block disk tier (the last level) swaps: the
# block moves up and the CPU tier's victim takes its slot, so the block is demoted again
# when the CPU tier evicts it (13 stores for 7 hits; docs/architecture.md, "Promotion
# copies, and duplicates go first"). Under another rule the promoted copy stays (a block
# demoted again could be refused): only new blocks are demoted (8 stores).
RETURNS = [[1], [2], [1]] + [r for n in range(3, 9) for r in ([n], [n - 1])]


@pytest.mark.parametrize(
    ("requests", "admission", "stores", "disk_hits"),
    [
        (SINGLES, "always", 5, 0),
        # Blocks 1 and 2 go down while nothing is known; when 3 is demoted, block 1's
        # time is up (2 admissions since) and it never came back: 3, 4, 5 are refused.
        (SINGLES, "comeback>=0.5", 2, 0),
        (RETURNS, "always", 13, 7),
        (RETURNS, "comeback>=0.5", 8, 7),  # they all come back: admitted like always
        # Each block is demoted before its second use and admitted after it, too late.
        (RETURNS, "reuse>=2", 6, 0),
    ],
)
def test_comeback_through_simulate(
    simulate: Simulate, requests: list[list[int]], admission: str, stores: int, disk_hits: int
) -> None:
    assert simulate(requests, admission) == (stores, disk_hits)


async def test_sample_keeps_or_drops_whole_requests(tmp_path: Path) -> None:
    """Eight requests under one shared head block (a system prompt), three new blocks
    each; the CPU tier holds one request, so each request demotes the one before."""
    requests = [[0, 1, 2, 3]] + [[0, 10 * r + 1, 10 * r + 2, 10 * r + 3] for r in range(1, 8)]
    demoted = requests[:-1]
    draws = sorted(
        xxh3_64_intdigest(int_key(ids[0] if r == 0 else ids[1])) for r, ids in enumerate(demoted)
    )
    share = (draws[2] + draws[3]) / 2 / 2**64  # exactly three requests are drawn
    config = {
        "block_bytes": 4096,
        "tiers": [
            {"name": "cpu", "kind": "memory", "capacity": 4},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": 64,
                "directories": [str(tmp_path)],
                "admission": f"sample<={share!r}",
            },
        ],
    }
    async with tierd.open(config) as chain:
        await replay_chain(chain, [tuple(int_key(i) for i in ids) for ids in requests])
        disk = chain.levels[1].tier
        kept = [ids[1:] for ids in demoted if all(int_key(i) in disk for i in ids[1:])]
        dropped = [ids[1:] for ids in demoted if not any(int_key(i) in disk for i in ids[1:])]
        assert len(kept) == 3 and len(dropped) == 4  # whole requests, in or out
        assert chain.levels[1].refused == 4 * 3
