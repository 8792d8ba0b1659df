"""Tier bookkeeping: slots, states, pins, eviction, events and stats."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

from tierd.errors import (
    BlockBusy,
    BlockMissing,
    BlockNotPinned,
    BlockNotReady,
    BlockStateError,
    UnknownPolicy,
)
from tierd.events import EventKind, TierEvent
from tierd.keys import BlockKey, Medium, int_key
from tierd.policy import CachePolicy, LRUPolicy, policy_names
from tierd.tier import StorePlan, Tier, one_slot_per_key

NAME = "cpu0"
MEDIUM = Medium.CPU

a, b, c, d, e, f, g = (int_key(i) for i in range(1, 8))
UNIVERSE = [int_key(i) for i in range(1, 20)]

MakeTier = Callable[..., Tier]
Refusal = TypeVar("Refusal", bound=BlockStateError)


@pytest.fixture(params=[None, 4], ids=["one-dict", "in-parts"])
def make_tier(request: pytest.FixtureRequest) -> MakeTier:
    """Tiers as small ones are (one dict each), and as big ones are: the index in parts,
    and an LRU order in generations over parts."""
    parts: int | None = request.param

    def make(capacity: int, policy: str = "lru") -> Tier:
        chosen: str | CachePolicy = policy
        if parts and policy == "lru":
            chosen = LRUPolicy(capacity, part_keys=1, one_dict=0)
        return Tier(capacity, chosen, name=NAME, medium=MEDIUM, parts=parts)

    return make


def store(tier: Tier, keys: Sequence[BlockKey]) -> StorePlan:
    plan = tier.prepare_store(keys)
    assert plan is not None
    tier.complete_store(keys)
    return plan


def stored(*keys: BlockKey) -> TierEvent:
    return TierEvent(EventKind.STORED, keys, MEDIUM, NAME)


def removed(*keys: BlockKey) -> TierEvent:
    return TierEvent(EventKind.REMOVED, keys, MEDIUM, NAME)


def snapshot(tier: Tier) -> tuple[Any, ...]:
    """Everything observable about the tier without side effects (no lookup, no events)."""
    return (
        tier.stats(),
        len(tier),
        tier.free,
        sorted(tier.ready_keys()),
        {k: tier.slot_of(k) for k in UNIVERSE},
        {k for k in UNIVERSE if tier.is_writing(k)},
        {k for k in UNIVERSE if tier.is_pinned(k)},
    )


def assert_refused(
    tier: Tier, error: type[Refusal], call: Callable[[], object], key: BlockKey
) -> Refusal:
    """``call`` raises ``error`` naming ``key``, and the tier is as it was, with no events
    (those before the call are taken first)."""
    tier.take_events()
    before = snapshot(tier)
    with pytest.raises(error) as info:
        call()
    assert info.value.key == key
    assert snapshot(tier) == before
    assert tier.take_events() == []
    return info.value


# -- construction --------------------------------------------------------------------


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        Tier(0)


def test_unknown_policy_name() -> None:
    with pytest.raises(UnknownPolicy, match="lru"):
        Tier(4, "no-such-policy")


def test_accepts_a_policy_instance() -> None:
    policy = LRUPolicy(2)
    tier = Tier(2, policy)
    assert tier.policy is policy
    store(tier, [a, b])
    assert len(policy) == 2


@pytest.mark.parametrize("policy", policy_names())
def test_policy_by_name(make_tier: MakeTier, policy: str) -> None:
    tier = make_tier(3, policy)
    assert tier.stats().policy == policy
    assert tier.policy.name == policy


# -- the issue's example -------------------------------------------------------------


def test_issue_example(make_tier: MakeTier) -> None:
    tier = make_tier(3, "lru")
    plan = tier.prepare_store([a, b])
    assert plan is not None and plan.slots == (0, 1)
    tier.complete_store([a, b])
    tier.touch([a])
    plan = tier.prepare_store([b, c, d])
    assert plan is not None
    assert plan.keys == (c, d)
    assert plan.slots == (2, 0)
    assert plan.evicted == (a,)
    assert plan.evicted_slots == (0,)


# -- prepare_store -------------------------------------------------------------------


def test_new_blocks_are_writing_until_complete_store(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    plan = tier.prepare_store([a, b])
    assert plan == StorePlan((a, b), (0, 1))
    assert tier.is_writing(a) and tier.is_writing(b)
    assert a not in tier and len(tier) == 2
    assert tier.slot_of(a) == 0 and tier.slot_of(b) == 1
    assert tier.lookup([a]) == 0
    tier.complete_store([a, b])
    assert a in tier and b in tier and not tier.is_writing(a)
    assert tier.lookup([a, b]) == 2


def test_present_keys_are_skipped(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a])
    assert tier.prepare_store([b]) is not None  # b being written
    tier.take_events()
    plan = tier.prepare_store([a, b, c])
    assert plan is not None
    assert plan.keys == (c,) and plan.slots == (2,)
    assert plan.evicted == ()
    assert tier.slot_of(a) == 0 and tier.slot_of(b) == 1
    assert tier.is_writing(b) and not tier.is_writing(a)


def test_nothing_to_store_gives_an_empty_plan(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    store(tier, [a, b])
    tier.take_events()
    before = snapshot(tier)
    for keys in ([], [a], [b, a, b]):
        plan = tier.prepare_store(keys)
        assert plan is not None and plan.keys == () and plan.slots == () and plan.evicted == ()
    assert snapshot(tier) == before
    assert tier.take_events() == []


def test_a_key_given_twice_counts_once(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a])
    tier.take_events()
    plan = tier.prepare_store([b, c, b, c])  # two new keys, two free slots: no eviction
    assert plan is not None
    assert plan.keys == (b, c) and plan.slots == (1, 2) and plan.evicted == ()
    assert tier.stats().used == 3
    tier.complete_store([b, b, c])
    assert tier.take_events() == [stored(b, c)]
    assert tier.stats().stores == 3


def test_duplicates_do_not_inflate_eviction(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b, c])
    plan = tier.prepare_store([d, d, d])
    assert plan is not None and plan.keys == (d,) and plan.evicted == (a,)
    assert tier.stats().evictions == 1


def test_victims_are_ready_unpinned_and_not_among_keys(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b, c])  # LRU order: a b c
    tier.prepare_load([a])  # a pinned
    assert tier.prepare_store([d]) is not None  # d writing, tier full
    # a pinned, d writing, b among the keys: only c may go.
    plan = tier.prepare_store([b, e])
    assert plan is not None
    assert plan.keys == (e,) and plan.evicted == (c,) and plan.evicted_slots == (2,)
    assert plan.slots == (2,)
    assert tier.is_pinned(a) and a in tier
    assert tier.is_writing(d) and b in tier
    # Nothing evictable is left: b is among the keys, everything else busy.
    assert tier.prepare_store([b, f]) is None


def test_more_new_keys_than_capacity_is_refused(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    assert tier.prepare_store([a, b, c]) is None
    assert len(tier) == 0 and tier.take_events() == []
    store(tier, [a, b])
    tier.take_events()
    before = snapshot(tier)
    assert tier.prepare_store([c, d, e]) is None
    assert snapshot(tier) == before


def test_slots_never_used_first_then_last_freed_first(make_tier: MakeTier) -> None:
    tier = make_tier(6)
    assert store(tier, [a, b, c]).slots == (0, 1, 2)
    tier.discard([b])
    tier.discard([a])  # freed stack: 1, 0
    assert tier.prepare_store([d, e, f]).slots == (3, 4, 5)  # type: ignore[union-attr]
    assert tier.prepare_store([g]).slots == (0,)  # type: ignore[union-attr]
    h = int_key(8)
    assert tier.prepare_store([h]).slots == (1,)  # type: ignore[union-attr]


def test_slots_freed_in_one_call_are_reused_last_first(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b, c, d])  # slots 0 1 2 3
    assert tier.discard([c, a]) == [c, a]  # freed 2 then 0
    plan = tier.prepare_store([e, f])
    assert plan is not None and plan.slots == (0, 2) and plan.evicted == ()


def test_mixes_fresh_and_freed_slots_in_order(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b])  # 0 1
    tier.discard([a, b])  # freed 0 then 1
    plan = tier.prepare_store([c, d, e, f])
    assert plan is not None and plan.slots == (2, 3, 1, 0)


def test_evicted_slots_are_reused_last_evicted_first(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b, c])
    tier.touch([a, b, c])  # tail to head: LRU order c b a
    plan = tier.prepare_store([d, e])
    assert plan is not None
    assert plan.evicted == (c, b) and plan.evicted_slots == (2, 1)
    assert plan.slots == (1, 2)
    assert tier.slot_of(d) == 1 and tier.slot_of(e) == 2
    assert tier.slot_of(c) is None and tier.slot_of(b) is None


def test_refused_prepare_store_changes_nothing(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b, c])
    tier.prepare_load([a])
    assert tier.prepare_store([d]) is not None
    tier.lookup([a, b, e])
    tier.take_events()
    before = snapshot(tier)
    # Needs three victims; only b and c are evictable.
    assert tier.prepare_store([e, f, g]) is None
    assert snapshot(tier) == before
    assert tier.take_events() == []
    # The policy order is untouched too: the next eviction takes b (least recent) first.
    plan = tier.prepare_store([e])
    assert plan is not None and plan.evicted == (b,)


def test_removed_event_at_prepare_store_in_eviction_order(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b, c])
    assert tier.take_events() == [stored(a, b, c)]
    tier.touch([a])  # LRU order: b c a
    plan = tier.prepare_store([d, e])
    assert plan is not None and plan.evicted == (b, c)
    events = tier.take_events()
    assert events == [removed(b, c)]
    assert events[0].medium is Medium.CPU and events[0].tier == NAME
    tier.complete_store([d, e])
    assert tier.take_events() == [stored(d, e)]
    assert tier.take_events() == []


def test_no_removed_event_without_eviction(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    tier.prepare_store([a, b])
    assert tier.take_events() == []


# -- complete_store ------------------------------------------------------------------


def test_stored_event_only_for_blocks_that_became_ready(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    tier.prepare_store([a, b, c])
    tier.complete_store([b])
    assert tier.take_events() == [stored(b)]
    tier.complete_store([a, b, c])
    assert tier.take_events() == [stored(a, c)]
    tier.complete_store([c, a])
    assert tier.take_events() == []
    assert tier.stats().stores == 3


@pytest.mark.parametrize("policy", policy_names())
def test_complete_store_leaves_ready_blocks_alone(make_tier: MakeTier, policy: str) -> None:
    tier = make_tier(3, policy)
    store(tier, [a, b])
    tier.prepare_load([b])
    tier.prepare_store([c])
    tier.complete_store([b, a, c])  # a and b are ready already: not stored again
    assert tier.stats().stores == 3
    assert tier.is_pinned(b) and len(tier.policy) == 3
    # b is still pinned, so a is the only possible victim.
    plan = tier.prepare_store([d])
    assert plan is not None and plan.evicted == (a,)
    plan = tier.prepare_store([e])
    assert plan is not None and plan.evicted == (c,)
    assert tier.prepare_store([f]) is None  # b pinned, d and e being written
    assert b in tier


def test_complete_store_does_not_refresh_ready_blocks(make_tier: MakeTier) -> None:
    tier = make_tier(3, "lru")
    store(tier, [a, b])
    tier.prepare_store([c])
    tier.complete_store([a, c])  # a was ready: its recency is unchanged
    plan = tier.prepare_store([d])
    assert plan is not None and plan.evicted == (a,)


def test_failed_store_drops_writing_blocks_and_frees_their_slots(make_tier: MakeTier) -> None:
    tier = make_tier(5)
    store(tier, [a])  # slot 0
    tier.prepare_store([b, c, d])  # slots 1 2 3
    tier.complete_store([c])
    tier.take_events()
    tier.complete_store([a, b, c, d], success=False)
    assert tier.take_events() == []
    assert a in tier and c in tier  # ready blocks are left alone
    assert tier.slot_of(a) == 0 and tier.slot_of(c) == 2
    for key in (b, d):
        assert tier.slot_of(key) is None and not tier.is_writing(key)
    stats = tier.stats()
    assert stats.used == 2 and stats.writing == 0 and stats.stores == 2
    assert tier.lookup([b]) == 0
    # Freed b (1) then d (3): a fresh slot first, then the last freed first.
    plan = tier.prepare_store([e, f, g])
    assert plan is not None and plan.slots == (4, 3, 1) and plan.evicted == ()


def test_failed_store_does_not_undo_evictions(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    store(tier, [a, b])
    plan = tier.prepare_store([c])
    assert plan is not None and plan.evicted == (a,)
    tier.complete_store([c], success=False)
    assert a not in tier and tier.slot_of(a) is None
    assert tier.stats().evictions == 1 and tier.stats().used == 1
    assert tier.take_events() == [stored(a, b), removed(a)]


def test_failed_store_is_not_in_the_policy(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    tier.prepare_store([a, b])
    tier.complete_store([a, b], success=False)
    assert len(tier.policy) == 0
    store(tier, [c, d])
    plan = tier.prepare_store([e])
    assert plan is not None and plan.evicted == (c,)


def test_complete_store_of_an_unknown_key_changes_nothing(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a])
    tier.prepare_store([b])
    tier.take_events()
    before = snapshot(tier)
    for success in (True, False):
        with pytest.raises(BlockMissing) as info:
            tier.complete_store([b, e], success=success)
        assert info.value.key == e and info.value.tier == NAME and info.value.medium == "CPU"
        assert snapshot(tier) == before
        assert tier.take_events() == []
    assert tier.is_writing(b)


# -- loads ---------------------------------------------------------------------------


def test_prepare_load_pins_and_returns_slots(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b, c])
    assert tier.prepare_load([c, a, c]) == [2, 0, 2]
    assert tier.is_pinned(a) and tier.is_pinned(c) and not tier.is_pinned(b)
    assert tier.stats().pinned == 2


def test_pins_are_counted(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    store(tier, [a, b])
    tier.prepare_load([a])
    tier.prepare_load([a])
    tier.complete_load([a])
    assert tier.is_pinned(a)
    assert tier.prepare_store([c, d]) is None  # a still pinned
    tier.complete_load([a])
    assert not tier.is_pinned(a)
    plan = tier.prepare_store([c, d])
    assert plan is not None and set(plan.evicted) == {a, b}
    with pytest.raises(BlockNotPinned):
        tier.complete_load([a])


def test_prepare_load_of_a_missing_key(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a])
    missing = assert_refused(tier, BlockMissing, lambda: tier.prepare_load([a, e]), e)
    assert missing.tier == NAME and missing.medium == "CPU"
    with pytest.raises(BlockNotPinned):
        tier.complete_load([a])  # the failed call pinned nothing


def test_prepare_load_of_a_writing_key(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a])
    tier.prepare_store([b])
    assert_refused(tier, BlockNotReady, lambda: tier.prepare_load([a, b]), b)
    assert not tier.is_pinned(a)


def test_complete_load_of_an_unpinned_key(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b])
    tier.prepare_load([a])
    assert_refused(tier, BlockNotPinned, lambda: tier.complete_load([a, b]), b)
    before = snapshot(tier)
    with pytest.raises(BlockNotPinned):
        tier.complete_load([a, a])  # pinned once, released twice
    assert snapshot(tier) == before
    with pytest.raises(BlockNotPinned):
        tier.complete_load([e])  # not even present
    assert snapshot(tier) == before
    assert tier.take_events() == []
    tier.complete_load([a])
    assert not tier.is_pinned(a)


def test_pinned_blocks_are_never_evicted(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b, c])
    tier.prepare_load([a, b])
    plan = tier.prepare_store([d])
    assert plan is not None and plan.evicted == (c,)
    tier.complete_store([d])
    tier.prepare_load([d])
    assert tier.prepare_store([e]) is None
    assert a in tier and b in tier and d in tier
    tier.complete_load([b])
    plan = tier.prepare_store([e])
    assert plan is not None and plan.evicted == (b,)


def test_unpinned_block_is_most_recent(make_tier: MakeTier) -> None:
    tier = make_tier(3)
    store(tier, [a, b, c])
    tier.prepare_load([a])
    tier.complete_load([a])  # LRU order: b c a
    plan = tier.prepare_store([d, e])
    assert plan is not None and plan.evicted == (b, c)


# -- lookup and touch ----------------------------------------------------------------


def test_lookup_counts_only_leading_ready_keys(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b, d])
    tier.prepare_store([c])  # writing
    assert tier.lookup([a, b, c, d]) == 2
    assert tier.lookup([a, e, b]) == 1
    assert tier.lookup([e, a, b]) == 0
    assert tier.lookup([d, b, a]) == 3
    assert tier.lookup([]) == 0
    stats = tier.stats()
    assert (stats.hits, stats.misses) == (2 + 1 + 0 + 3, 2 + 2 + 3 + 0)


def test_lookup_without_writing_blocks(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b])
    assert tier.lookup([a, b, c, a]) == 2
    assert (tier.stats().hits, tier.stats().misses) == (2, 2)


def test_lookup_does_not_touch(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    store(tier, [a, b])
    assert tier.lookup([a]) == 1
    plan = tier.prepare_store([c])
    assert plan is not None and plan.evicted == (a,)


def test_touch_keeps_a_prefix_head_longest(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b, c, d])
    tier.touch([d, c, b, a])  # tail to head: d ends most recent
    tier.touch([e])  # unknown: ignored
    tier.prepare_store([f])  # writing: touching it is harmless
    tier.touch([f, a])
    plan = tier.prepare_store([g])
    assert plan is not None and plan.evicted == (b,)


# -- discard and clear ---------------------------------------------------------------


def test_discard(make_tier: MakeTier) -> None:
    tier = make_tier(4)
    store(tier, [a, b, c])
    tier.take_events()
    assert tier.discard([c, e, a, c]) == [c, a]
    assert tier.take_events() == [removed(c, a)]
    assert c not in tier and a not in tier and b in tier
    assert tier.slot_of(a) is None and len(tier) == 1
    assert len(tier.policy) == 1
    assert tier.discard([e]) == []
    assert tier.take_events() == []
    assert tier.stats().evictions == 0  # a discard is not an eviction


@pytest.mark.parametrize("busy", ["pinned", "writing"])
def test_discard_of_a_busy_block_removes_nothing(make_tier: MakeTier, busy: str) -> None:
    tier = make_tier(4)
    store(tier, [a, b])
    if busy == "pinned":
        tier.prepare_load([b])
        key = b
    else:
        tier.prepare_store([c])
        key = c
    assert_refused(tier, BlockBusy, lambda: tier.discard([a, key]), key)


def test_clear_removes_idle_blocks_only(make_tier: MakeTier) -> None:
    tier = make_tier(5)
    store(tier, [a, b, c])
    tier.prepare_load([b])
    tier.prepare_store([d])
    tier.take_events()
    assert sorted(tier.clear()) == sorted([a, c])
    assert tier.take_events() in ([removed(a, c)], [removed(c, a)])
    assert b in tier and tier.is_pinned(b) and tier.is_writing(d)
    assert tier.stats().used == 2
    tier.complete_load([b])
    tier.complete_store([d])
    assert sorted(tier.clear()) == sorted([b, d])
    assert len(tier) == 0 and len(tier.policy) == 0
    assert tier.clear() == []
    # Every slot is free again.
    plan = tier.prepare_store([a, b, c, d, e])
    assert plan is not None and sorted(plan.slots) == [0, 1, 2, 3, 4]


# -- stats ---------------------------------------------------------------------------


def test_stats(make_tier: MakeTier) -> None:
    tier = make_tier(3, "lru")
    stats = tier.stats()
    assert (stats.name, stats.medium, stats.policy, stats.capacity) == (NAME, MEDIUM, "lru", 3)
    assert (stats.used, stats.hits, stats.misses, stats.stores) == (0, 0, 0, 0)
    assert (stats.evictions, stats.pinned, stats.writing) == (0, 0, 0)
    store(tier, [a, b])
    tier.prepare_store([c])
    tier.prepare_load([a, a, b])
    tier.lookup([a, b, c])
    stats = tier.stats()
    assert (stats.used, stats.stores, stats.pinned, stats.writing) == (3, 2, 2, 1)
    assert (stats.hits, stats.misses) == (2, 1)
    tier.complete_load([a, a, b])
    tier.complete_store([c])
    tier.prepare_store([d, e])
    stats = tier.stats()
    assert (stats.used, stats.stores, stats.evictions) == (3, 3, 2)
    assert (stats.pinned, stats.writing) == (0, 2)
    assert tier.free == 0 and len(tier) == 3


def test_restore_adopts_blocks_and_reuses_free_slots_lowest_first() -> None:
    from tierd.keys import int_key

    tier = Tier(4, "lru")
    a, b, c = int_key(1), int_key(2), int_key(3)
    tier.restore([(a, 2), (b, 0)])
    assert tier.lookup([a, b]) == 2
    assert tier.take_events() == []
    plan = tier.prepare_store([c])
    assert plan is not None and plan.slots == (1,)
    with pytest.raises(ValueError, match="not empty"):
        tier.restore([(a, 3)])
    with pytest.raises(ValueError, match="repeat"):
        Tier(4).restore([(a, 1), (b, 1)])


def test_reserved_slots_are_never_allocated_until_adopted() -> None:
    tier = Tier(8, "lru", medium=Medium.DISK)
    kept = [(int_key(i), slot) for i, slot in enumerate((1, 3, 4, 6))]
    forgotten: list[int] = []
    tier.reserve(kept, forgotten.extend)
    assert (tier.adopting, tier.free, tier.stats().adopting) == (4, 4, 4)
    assert tier.lookup([kept[0][0]]) == 0  # not adopted yet: a miss
    new = [int_key(100 + i) for i in range(3)] + [kept[2][0]]  # one stored again
    plan = tier.prepare_store(new)
    assert plan is not None and set(plan.slots) == {0, 2, 5, 7}
    tier.complete_store(new)
    plan = tier.prepare_store([int_key(200)])  # full: a new block is evicted, no kept one
    assert plan is not None and plan.slots == plan.evicted_slots == (0,)
    tier.complete_store([int_key(200)])
    listed = [key for part in tier.key_parts() for key in part]  # kept ones too
    assert (listed.count(kept[1][0]), listed.count(kept[2][0])) == (1, 2)
    assert tier.discard([kept[1][0]]) == [kept[1][0]]  # before it was adopted: gone for good
    assert forgotten == [3] and tier.adopting == 3
    assert tier.adopt(8) == 2  # the copy stored again since the restart is kept
    assert sorted(forgotten) == [3, 4]
    assert tier.adopting == 0 and tier.free == 2
    assert tier.lookup([kept[0][0]]) == 1 and kept[1][0] not in tier
    assert (tier.slot_of(kept[0][0]), tier.slot_of(kept[2][0])) == (1, 7)
    plan = tier.prepare_store([int_key(300), int_key(301)])
    assert plan is not None and set(plan.slots) == {3, 4} and not plan.evicted
    assert tier.adopt(1) == 0


def test_clear_drops_kept_blocks_and_older_copies_are_forgotten_at_once() -> None:
    tier = Tier(8, "lru", medium=Medium.DISK)
    a, b = int_key(1), int_key(2)
    forgotten: list[int] = []
    tier.reserve([(a, 0), (b, 5), (a, 2)], forgotten.extend)  # a twice: slot 0 is kept
    assert (forgotten, tier.adopting, tier.free) == ([2], 2, 6)
    assert sorted(tier.clear()) == [a, b]
    assert sorted(forgotten) == [0, 2, 5] and tier.adopting == 0 and tier.free == 8
    assert tier.take_events() == []  # nothing announced them since the restart


def test_a_key_given_twice_keeps_its_lowest_slot_reserved_or_restored() -> None:
    # One rule for both ways a restart brings blocks back (restore_tier uses the same
    # function): the lowest slot, whatever the order the store listed them in.
    a, b = int_key(1), int_key(2)
    for given in ([(a, 0), (b, 5), (a, 2)], [(a, 2), (b, 5), (a, 0)]):
        forgotten: list[int] = []
        tier = Tier(8, "lru", medium=Medium.DISK)
        tier.reserve(given, forgotten.extend)
        assert forgotten == [2]
        assert tier.adopt(8) == 2 and (tier.slot_of(a), tier.slot_of(b)) == (0, 5)
        assert one_slot_per_key(given) == ({a: 0, b: 5}, [2])


class _CountedOrder(list[tuple[BlockKey, int]]):
    """An adoption order that counts the positions read from it (and can be weakly
    referenced, to see that the tier lets go of it)."""

    visited = 0

    def __getitem__(self, index: Any) -> Any:
        self.visited += 1
        return super().__getitem__(index)


def test_adopt_visits_at_most_count_positions_after_a_delete() -> None:
    # A delete drops most kept blocks from the front of the order: one adopt(n) still
    # visits at most n positions (it walked every dropped one in one call before).
    kept = _CountedOrder((int_key(i), i) for i in range(1000))
    tier = Tier(1000, "lru", medium=Medium.DISK)
    tier.reserve(kept, list)
    tier.discard([key for key, _ in kept[:990]])
    kept.visited = 0
    calls = []
    while tier.adopting and len(calls) < 2000:
        before = kept.visited
        calls.append(tier.adopt(4))
        assert kept.visited - before <= 4
    assert sum(calls) == 10 and len(calls) == 250 and tier.adopting == 0


def test_adoption_is_paced_by_the_blocks_it_takes_not_by_those_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    import tierd.library

    kept = [(int_key(i), i) for i in range(1000)]
    tier = Tier(1000, "lru", medium=Medium.DISK)
    tier.reserve(kept, list)
    tier.discard([key for key, _ in kept[:990]])
    paused: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        paused.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(tierd.library.asyncio, "sleep", sleep)
    asyncio.run(tierd.library.adopt_kept(tier, 100))
    assert tier.adopting == 0 and len(tier) == 10
    assert sum(paused) == pytest.approx(10 / 100)  # 10 blocks at 100 a second


def test_a_clear_lets_go_of_the_adoption_order() -> None:
    import gc
    import weakref

    kept = _CountedOrder((int_key(i), i) for i in range(100))
    tier = Tier(100, "lru", medium=Medium.DISK)
    tier.reserve(kept, list)
    tier.adopt(10)
    gone = weakref.ref(kept)
    del kept
    tier.clear()
    gc.collect()
    assert gone() is None and tier.adopting == 0
    assert tier.adopt(1) == 0


def test_reserve_refuses_bad_slots() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Tier(4).reserve([(int_key(1), 4)], list)
    with pytest.raises(ValueError, match="repeat"):
        Tier(4).reserve([(int_key(1), 1), (int_key(2), 1)], list)
    tier = Tier(4)
    tier.restore([(int_key(1), 0)])
    with pytest.raises(ValueError, match="not empty"):
        tier.reserve([(int_key(2), 2)], list)


# -- a withdrawn write's slots (quarantine) -------------------------------------------


def test_a_quarantined_write_frees_its_keys_but_never_gives_its_slots_to_a_store(
    make_tier: MakeTier,
) -> None:
    """A write withdrawn under a client that may still write its slots: its keys can be
    stored again (elsewhere), and no store gets its slots, even one that must evict for
    room, until they are released; then they are given out as freed slots."""
    tier = make_tier(4)
    store(tier, [a, b])  # slots 0 1
    plan = tier.prepare_store([c, d])
    assert plan is not None and plan.slots == (2, 3)
    tier.take_events()
    assert tier.quarantine([c, d, e]) == [2, 3]  # e: not being written, skipped
    assert tier.take_events() == []  # nothing was stored, nothing announced
    assert tier.stats().quarantined == 2 and tier.free == 0
    assert not tier.is_writing(c) and tier.slot_of(c) is None
    again = tier.prepare_store([c])  # the key itself is free: into an evicted slot
    assert again is not None and again.slots[0] in (0, 1) and again.evicted
    assert tier.prepare_store([e, f]) is None  # one ready block left: no room for two
    tier.complete_store([c])
    tier.release_quarantine([2, 3])
    assert tier.stats().quarantined == 0 and tier.free == 2
    plan = tier.prepare_store([e, f])
    assert plan is not None and sorted(plan.slots) == [2, 3] and plan.evicted == ()


def test_releasing_more_slots_than_quarantined_is_refused(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    assert tier.prepare_store([a]) is not None
    assert tier.quarantine([a]) == [0]
    with pytest.raises(ValueError, match="quarantined"):
        tier.release_quarantine([0, 1])
    assert tier.stats().quarantined == 1
