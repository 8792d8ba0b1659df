"""Duel: it follows ARC where ARC hits more and LRU where LRU does, decided online.

The two workloads are the textbook cases: a hot set under a scan of blocks seen once (ARC
keeps the hot set, LRU loses it) and blocks each used twice at a gap a little under the
capacity (LRU hits every second use; ARC, with its protected list full of blocks seen
twice, misses some). The contract and state-machine suites cover the rest, as for every
registered policy.
"""

from __future__ import annotations

import random

import pytest

from tierd.keys import BlockKey, int_key
from tierd.policy import DuelPolicy, make_policy
from tierd.tier import Tier
from tierd.workload.simulate import replay

Requests = list[list[BlockKey]]


def hot_set_and_scan(capacity: int, requests: int, seed: int = 0) -> Requests:
    """Half the requests use one of ``capacity/2`` hot blocks, half a block never seen again."""
    rng = random.Random(seed)
    hot, fresh, out = capacity // 2, 10**9, []
    for _ in range(requests):
        if rng.random() < 0.5:
            out.append([int_key(rng.randrange(hot))])
        else:
            out.append([int_key(fresh)])
            fresh += 1
    return out


def used_twice(capacity: int, blocks: int, seed: int = 0) -> Requests:
    """Every block is used twice, 0.6-0.9 x ``capacity`` distinct blocks apart."""
    rng = random.Random(seed)
    events = []
    for i in range(blocks):
        events += [(float(i), i), (i + rng.uniform(0.3, 0.45) * capacity, i)]
    events.sort()
    return [[int_key(block)] for _, block in events]


def hits(policy: str, capacity: int, requests: Requests) -> int:
    return replay(Tier(capacity, policy, name="duel-test"), requests)


@pytest.mark.parametrize("capacity", [200, 4096])  # the shadows are sampled at 4096
def test_duel_keeps_the_hot_set_like_arc(capacity: int) -> None:
    requests = hot_set_and_scan(capacity, 20 * capacity)
    lru, arc, duel = (hits(p, capacity, requests) for p in ("lru", "arc", "duel"))
    assert arc > lru * 1.2  # the workload does separate them
    assert duel >= arc - 0.01 * len(requests)


@pytest.mark.parametrize("capacity", [200, 4096])
def test_duel_hits_every_second_use_like_lru(capacity: int) -> None:
    requests = used_twice(capacity, 20 * capacity)
    lru, arc, duel = (hits(p, capacity, requests) for p in ("lru", "arc", "duel"))
    assert lru == 20 * capacity  # every second use is a hit
    assert arc < lru
    assert duel >= lru - 0.002 * len(requests)


def test_duel_changes_mode_when_the_traffic_changes() -> None:
    capacity = 200
    tier = Tier(capacity, "duel", name="duel-test")
    policy = tier.policy
    assert isinstance(policy, DuelPolicy)
    assert not policy.arc_mode  # LRU until the shadows say otherwise
    modes = []
    for request in used_twice(capacity, 20 * capacity):
        replay(tier, [request])
        modes.append(policy.arc_mode)
    assert modes.count(False) > 0.9 * len(modes)
    replay(tier, hot_set_and_scan(capacity, 20 * capacity))
    assert policy.arc_mode
    lru_hits, arc_hits = policy.shadow_hits
    assert arc_hits > lru_hits


def test_duel_is_deterministic() -> None:
    """Sampling hashes the key (xxh3), not Python's salted hash: runs agree."""
    requests = hot_set_and_scan(4096, 40_000, seed=3)
    assert hits("duel", 4096, requests) == hits("duel", 4096, requests)


def test_duel_clear_forgets_the_shadows() -> None:
    policy = make_policy("duel", 200)
    assert isinstance(policy, DuelPolicy)
    tier = Tier(200, policy, name="duel-test")
    replay(tier, hot_set_and_scan(200, 4000))
    assert policy.arc_mode
    policy.clear()
    assert (len(policy), policy.arc_mode, policy.shadow_hits) == (0, False, (0.0, 0.0))
