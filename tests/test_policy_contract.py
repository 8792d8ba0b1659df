"""The cache-policy contract, run over every registered policy, plus LRU and ARC specifics.

The contract tests are parametrised over ``policy_names()``, so a newly registered policy is
covered without touching this file. ARC is checked against Megiddo & Modha (FAST'03).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierd.errors import UnknownPolicy
from tierd.keys import BlockKey, int_key
from tierd.policy import ARCPolicy, CachePolicy, LRUPolicy, make_policy, policy_names

CAPACITY = 8


def keys(*ids: int) -> list[BlockKey]:
    return [int_key(i) for i in ids]


def tracked(policy: CachePolicy, universe: list[BlockKey]) -> set[BlockKey]:
    return {key for key in universe if key in policy}


@pytest.fixture(params=policy_names())
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new(name: str) -> Callable[[], CachePolicy]:
    return lambda: make_policy(name, CAPACITY)


@pytest.fixture
def policy(new: Callable[[], CachePolicy]) -> CachePolicy:
    return new()


# -- registry ------------------------------------------------------------------------


def test_registry_knows_lru_and_arc() -> None:
    assert {"lru", "arc"} <= set(policy_names())
    assert policy_names() == sorted(policy_names())


def test_make_policy_builds_the_named_policy(name: str) -> None:
    policy = make_policy(name, 5)
    assert policy.name == name
    assert policy.capacity == 5
    assert len(policy) == 0


def test_unknown_policy_lists_the_valid_names() -> None:
    with pytest.raises(UnknownPolicy) as info:
        make_policy("no-such-policy", 4)
    message = str(info.value)
    assert "no-such-policy" in message
    for valid in policy_names():
        assert valid in message
    assert info.value.valid == policy_names()
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(name: str, capacity: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        make_policy(name, capacity)


# -- insert / contains / len / remove -------------------------------------------------


def test_insert_contains_len(policy: CachePolicy) -> None:
    a, b, c, d = keys(1, 2, 3, 4)
    policy.insert([a, b, c])
    assert len(policy) == 3
    assert a in policy and b in policy and c in policy
    assert d not in policy
    assert policy.get(a) and not policy.get(d)


def test_remove(policy: CachePolicy) -> None:
    a, b, c = keys(1, 2, 3)
    policy.insert([a, b])
    assert policy.remove(a) is True
    assert a not in policy and b in policy
    assert len(policy) == 1
    assert policy.remove(a) is False
    assert policy.remove(c) is False
    assert len(policy) == 1
    # A removed key is never chosen as a victim.
    assert policy.evict(1) == [b]
    assert policy.evict(1) is None


def test_remove_a_held_key(policy: CachePolicy) -> None:
    a, b = keys(1, 2)
    policy.insert([a, b])
    policy.hold(a)
    assert policy.remove(a) is True
    assert a not in policy and len(policy) == 1
    policy.release(a)  # releasing a forgotten key must not bring it back
    assert a not in policy and len(policy) == 1
    assert policy.evict(1) == [b]


def test_insert_order_is_recency_order(policy: CachePolicy) -> None:
    ks = keys(1, 2, 3, 4)
    policy.insert(ks)
    assert policy.evict(1) == [ks[0]]
    assert policy.evict(2) is not None
    assert tracked(policy, ks) == {ks[3]}


# -- touch ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (4, 3, 2, 1, 0), (2, 0, 4, 1, 3)])
def test_touch_first_key_ends_most_recent(policy: CachePolicy, order: tuple[int, ...]) -> None:
    ks = keys(0, 1, 2, 3, 4)
    policy.insert(ks)
    touched = [ks[i] for i in order]
    policy.touch(touched)
    victims = policy.evict(len(ks) - 1)
    assert victims is not None
    assert tracked(policy, ks) == {touched[0]}
    assert touched[0] not in victims


def test_touch_ignores_unknown_keys(policy: CachePolicy) -> None:
    a, b, c, x, y = keys(1, 2, 3, 90, 91)
    policy.insert([a, b, c])
    policy.touch([x, a, y])
    assert x not in policy and y not in policy
    assert len(policy) == 3
    victims = policy.evict(2)
    assert victims is not None and a not in victims
    assert tracked(policy, [a, b, c, x, y]) == {a}
    assert policy.evict(1) == [a]
    assert policy.evict(1) is None


def test_touch_of_nothing_changes_nothing(new: Callable[[], CachePolicy]) -> None:
    ks = keys(1, 2, 3)
    touched, plain = new(), new()
    for p in (touched, plain):
        p.insert(ks)
    touched.touch([])
    touched.touch(keys(50, 51))
    assert touched.evict(3) == plain.evict(3)


# -- hold / release ------------------------------------------------------------------


def test_hold_makes_a_key_unevictable_until_release(policy: CachePolicy) -> None:
    a, b, c = keys(1, 2, 3)
    policy.insert([a, b, c])
    policy.hold(a)
    assert a in policy and len(policy) == 3
    assert policy.evict(3) is None
    victims = policy.evict(2)
    assert victims is not None and sorted(victims) == sorted([b, c])
    assert a in policy
    assert policy.evict(1) is None
    policy.release(a)
    assert policy.evict(1) == [a]
    assert len(policy) == 0


def test_held_key_survives_touch(policy: CachePolicy) -> None:
    a, b = keys(1, 2)
    policy.insert([a, b])
    policy.hold(a)
    policy.touch([b, a])
    assert policy.evict(2) is None
    assert policy.evict(1) == [b]
    assert policy.evict(1) is None
    assert a in policy


def test_release_makes_the_key_most_recent(policy: CachePolicy) -> None:
    a, b, c = keys(1, 2, 3)
    policy.insert([a, b, c])
    policy.hold(a)
    policy.release(a)
    victims = policy.evict(2)
    assert victims is not None and a not in victims
    assert tracked(policy, [a, b, c]) == {a}


def test_hold_and_release_of_unknown_keys_are_ignored(policy: CachePolicy) -> None:
    a, x = keys(1, 99)
    policy.insert([a])
    policy.hold(x)
    policy.release(x)
    policy.release(a)  # not held: stays as it is
    assert x not in policy and len(policy) == 1
    assert policy.evict(1) == [a]


# -- evict ---------------------------------------------------------------------------


def test_evict_zero_is_empty(policy: CachePolicy) -> None:
    assert policy.evict(0) == []
    policy.insert(keys(1, 2))
    assert policy.evict(0) == []
    assert policy.evict(0, {int_key(1)}) == []
    assert len(policy) == 2


def test_evict_returns_exactly_n_and_removes_them(policy: CachePolicy) -> None:
    ks = keys(*range(6))
    policy.insert(ks)
    victims = policy.evict(4)
    assert victims is not None
    assert len(victims) == 4 and len(set(victims)) == 4
    assert set(victims) <= set(ks)
    assert len(policy) == 2
    for key in victims:
        assert key not in policy
    assert tracked(policy, ks) == set(ks) - set(victims)


def test_evict_skips_held_and_protected(policy: CachePolicy) -> None:
    ks = keys(*range(6))
    policy.insert(ks)
    policy.hold(ks[0])
    policy.hold(ks[3])
    protected = {ks[1], ks[4], int_key(77)}
    victims = policy.evict(2, protected)
    assert victims is not None and sorted(victims) == sorted([ks[2], ks[5]])
    assert tracked(policy, ks) == {ks[0], ks[1], ks[3], ks[4]}


@pytest.mark.parametrize("protected_type", [set, frozenset, tuple, list])
def test_evict_accepts_any_collection_as_protected(
    policy: CachePolicy, protected_type: type
) -> None:
    a, b, c = keys(1, 2, 3)
    policy.insert([a, b, c])
    victims = policy.evict(2, protected_type([a]))
    assert victims is not None and sorted(victims) == sorted([b, c])
    assert policy.evict(1, protected_type([a])) is None
    assert a in policy


def _refusal_cases() -> list[tuple[str, int, set[int], set[int]]]:
    # (label, n, held ids, protected ids) over keys 0..5
    return [
        ("more than tracked", 7, set(), set()),
        ("more than evictable (held)", 5, {0, 4}, set()),
        ("more than evictable (protected)", 4, set(), {1, 2, 3}),
        ("held and protected together", 3, {0, 1}, {2, 5}),
        ("everything held", 1, {0, 1, 2, 3, 4, 5}, set()),
        ("everything protected", 1, set(), {0, 1, 2, 3, 4, 5}),
    ]


@pytest.mark.parametrize(
    ("n", "held", "protected"),
    [case[1:] for case in _refusal_cases()],
    ids=[case[0] for case in _refusal_cases()],
)
def test_refused_evict_changes_nothing(
    new: Callable[[], CachePolicy], n: int, held: set[int], protected: set[int]
) -> None:
    ks = keys(*range(6))

    def build() -> CachePolicy:
        p = new()
        p.insert(ks)
        p.touch([ks[2], ks[5]])  # put some history in (ARC: T2 as well as T1)
        for i in held:
            p.hold(ks[i])
        return p

    refused, twin = build(), build()
    assert refused.evict(n, {ks[i] for i in protected}) is None
    assert len(refused) == 6
    assert tracked(refused, ks) == set(ks)
    # The refused call left no trace: from here on both behave the same.
    for i in held:
        refused.release(ks[i])
        twin.release(ks[i])
    assert refused.evict(6) == twin.evict(6)


def test_evict_on_empty(policy: CachePolicy) -> None:
    assert policy.evict(1) is None
    assert len(policy) == 0


_ids = st.integers(0, 11)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(_ids, max_size=4)),
        st.tuples(st.just("remove"), _ids),
        st.tuples(st.just("touch"), st.lists(_ids, max_size=4)),
        st.tuples(st.just("hold"), _ids),
        st.tuples(st.just("release"), _ids),
        st.tuples(st.just("evict"), st.tuples(st.integers(0, 5), st.sets(_ids, max_size=4))),
    ),
    max_size=40,
)


@pytest.mark.parametrize("policy_name", policy_names())
@given(ops=_ops)
def test_random_operations_keep_the_contract(policy_name: str, ops: list[tuple[str, Any]]) -> None:
    """Against a model of tracked and held keys: evict returns n allowed keys whenever n
    are evictable, and None (with nothing changed) only when they are not."""
    policy = make_policy(policy_name, 6)
    universe = keys(*range(12))
    tracked_keys: set[BlockKey] = set()
    held: set[BlockKey] = set()
    for op, arg in ops:
        if op == "insert":
            new = [k for k in dict.fromkeys(int_key(i) for i in arg) if k not in tracked_keys]
            policy.insert(new)
            tracked_keys.update(new)
        elif op == "remove":
            key = int_key(arg)
            assert policy.remove(key) == (key in tracked_keys)
            tracked_keys.discard(key)
            held.discard(key)
        elif op == "touch":
            policy.touch([int_key(i) for i in arg])
        elif op == "hold" and int_key(arg) in tracked_keys - held:
            policy.hold(int_key(arg))
            held.add(int_key(arg))
        elif op == "release" and int_key(arg) in held:
            policy.release(int_key(arg))
            held.discard(int_key(arg))
        elif op == "evict":
            n, protected_ids = arg
            protected = {int_key(i) for i in protected_ids}
            allowed = tracked_keys - held - protected
            victims = policy.evict(n, protected)
            if n > len(allowed):
                assert victims is None
            else:
                assert victims is not None and len(victims) == n
                assert len(set(victims)) == n and set(victims) <= allowed
                tracked_keys.difference_update(victims)
        assert len(policy) == len(tracked_keys)
        assert tracked(policy, universe) == tracked_keys


# -- clear ---------------------------------------------------------------------------


def test_clear_forgets_everything(policy: CachePolicy) -> None:
    ks = keys(*range(5))
    policy.insert(ks)
    policy.hold(ks[0])
    policy.touch([ks[1]])
    assert policy.evict(1) is not None
    policy.clear()
    assert len(policy) == 0
    assert tracked(policy, ks) == set()
    assert policy.evict(1) is None
    assert policy.evict(0) == []
    # Usable again after clear.
    policy.insert([ks[0]])
    assert policy.evict(1) == [ks[0]]


# -- LRU -----------------------------------------------------------------------------


def test_lru_exact_eviction_order() -> None:
    a, b, c, d, e = keys(1, 2, 3, 4, 5)
    lru = LRUPolicy(8)
    lru.insert([a, b, c, d, e])  # order, least recent first: a b c d e
    lru.touch([b, d])  # d, then b: a c e d b
    lru.hold(c)
    lru.release(c)  # a e d b c
    lru.touch([a, x := int_key(99)])  # e d b c a
    assert x not in lru
    assert lru.evict(2, {e}) == [d, b]  # e protected, skipped but not moved
    assert lru.evict(3) == [e, c, a]
    assert lru.evict(1) is None


def test_lru_touch_walks_tail_to_head() -> None:
    ks = keys(0, 1, 2, 3)
    lru = LRUPolicy(4)
    lru.insert(ks)
    lru.touch(ks)
    assert lru.evict(4) == list(reversed(ks))


def test_lru_held_key_keeps_no_place_until_release() -> None:
    a, b, c = keys(1, 2, 3)
    lru = LRUPolicy(4)
    lru.insert([a, b, c])
    lru.hold(b)
    lru.touch([b])  # held: ignored for ordering, release decides
    lru.touch([a])
    lru.release(b)  # c a b
    assert lru.evict(3) == [c, a, b]


# -- ARC -----------------------------------------------------------------------------


def arc_with_p(capacity: int, p_steps: int) -> ARCPolicy:
    """An ARC policy whose target ``p`` was raised ``p_steps`` times by B1 hits (each +1),
    left empty of resident keys."""
    arc = ARCPolicy(capacity)
    for i in range(p_steps):
        key = int_key(1000 + i)
        arc.insert([key])
        assert arc.evict(1) == [key]  # from T1 (t1 > p) into B1
        arc.insert([key])  # B1 hit: p += 1, key into T2
        arc.remove(key)
    assert arc.p == p_steps
    assert len(arc) == 0
    return arc


def test_arc_new_keys_enter_t1() -> None:
    arc = ARCPolicy(4)
    a, b = keys(1, 2)
    arc.insert([a, b])
    assert (arc.t1_size, arc.t2_size) == (2, 0)
    assert arc.p == 0
    assert arc.evict(1) == [a]
    assert arc.in_ghost(a) == "b1"


def test_arc_touch_moves_t1_key_to_t2() -> None:
    arc = ARCPolicy(4)
    a, b, c = keys(1, 2, 3)
    arc.insert([a, b, c])
    arc.touch([b])
    assert (arc.t1_size, arc.t2_size) == (2, 1)
    arc.touch([b])  # a T2 hit stays in T2
    assert (arc.t1_size, arc.t2_size) == (2, 1)
    # p == 0 and T1 is not empty, so T1 goes first; b goes last, from T2 into B2.
    assert arc.evict(3) == [a, c, b]
    assert [arc.in_ghost(k) for k in (a, b, c)] == ["b1", "b2", "b1"]


def test_arc_touch_moves_held_t1_key_to_t2() -> None:
    arc = ARCPolicy(4)
    a, b = keys(1, 2)
    arc.insert([a, b])
    arc.hold(a)
    arc.touch([a])
    assert (arc.t1_size, arc.t2_size) == (1, 1)
    arc.release(a)
    assert (arc.t1_size, arc.t2_size) == (1, 1)
    assert arc.evict(2) == [b, a]
    assert (arc.in_ghost(a), arc.in_ghost(b)) == ("b2", "b1")


def test_arc_t2_touch_order() -> None:
    arc = ARCPolicy(8)
    ks = keys(0, 1, 2, 3)
    arc.insert(ks)
    arc.touch(ks)  # all to T2, walked tail to head: ks[0] most recent
    assert (arc.t1_size, arc.t2_size) == (0, 4)
    arc.touch([ks[3], ks[1]])  # T2 order, least recent first: 2 0 1 3
    assert arc.evict(4) == [ks[2], ks[0], ks[1], ks[3]]


def test_arc_b1_hit_raises_p_and_enters_t2() -> None:
    arc = ARCPolicy(4)
    a, b, c = keys(1, 2, 3)
    arc.insert([a, b, c])
    assert arc.evict(2) == [a, b]
    assert arc.in_ghost(a) == arc.in_ghost(b) == "b1"
    arc.insert([a])  # |B1| = 2, |B2| = 0: delta = max(1, 0 / 2) = 1
    assert arc.p == 1
    assert arc.in_ghost(a) is None and a in arc
    assert (arc.t1_size, arc.t2_size) == (1, 1)  # c in T1, a in T2
    # T1 (1) is not above p (1): T2 is preferred, so a goes first, into B2.
    assert arc.evict(1) == [a]
    assert arc.in_ghost(a) == "b2"


def test_arc_b1_hit_delta_is_b2_over_b1() -> None:
    arc = ARCPolicy(8)
    a, b, c, d = keys(1, 2, 3, 4)
    arc.insert([a, b, c, d])
    arc.touch([b, c, d])  # b c d in T2, a in T1
    assert arc.evict(1) == [a]  # T1 (1) > p (0)
    assert arc.evict(3) == [d, c, b]  # T1 empty: from T2, into B2
    assert arc.in_ghost(a) == "b1"
    arc.insert([a])  # delta = max(1, |B2| / |B1|) = 3
    assert arc.p == 3


def test_arc_b2_hit_lowers_p_and_enters_t2() -> None:
    arc = arc_with_p(6, 3)
    a, b, c = keys(1, 2, 3)
    arc.insert([a, b, c])
    arc.touch([a])  # a to T2; T1 = b c (2 <= p = 3): T2 preferred
    assert arc.evict(1) == [a]
    assert arc.in_ghost(a) == "b2"
    # |B1| = 0, |B2| = 1: delta = max(1, 0 / 1) = 1
    arc.insert([a])
    assert arc.p == 2
    assert arc.in_ghost(a) is None
    assert (arc.t1_size, arc.t2_size) == (2, 1)


def test_arc_b2_hit_delta_is_b1_over_b2() -> None:
    arc = arc_with_p(8, 5)
    ks = keys(*range(8))
    arc.insert(ks[:3])
    arc.touch(ks[:3])  # ks 0..2 in T2
    arc.insert(ks[3:7])  # ks 3..6 in T1 (4 <= p = 5)
    assert arc.evict(1) == [ks[2]]  # T1 (4) <= p (5): T2 preferred, into B2
    # T2's rest protected, so T1 gives the other four (into B1).
    assert arc.evict(4, set(ks[:2])) == ks[3:7]
    assert arc.in_ghost(ks[2]) == "b2"
    assert all(arc.in_ghost(k) == "b1" for k in ks[3:7])
    arc.insert([ks[2]])  # |B1| = 4, |B2| = 1: delta = max(1, 4 / 1) = 4
    assert arc.p == 1


def test_arc_p_stays_within_zero_and_capacity() -> None:
    arc = arc_with_p(2, 2)
    a = int_key(1)
    arc.insert([a])
    assert arc.evict(1) == [a]  # T1 (1) <= p (2) but T2 is empty: falls back to T1
    arc.insert([a])
    assert arc.p == 2  # capped at the capacity
    b = int_key(2)
    arc2 = ARCPolicy(4)
    arc2.insert([b])
    arc2.touch([b])
    assert arc2.evict(1) == [b]
    arc2.insert([b])
    assert arc2.p == 0  # never below zero


def test_arc_ghost_lists_stay_within_capacity() -> None:
    capacity = 3
    arc = ARCPolicy(capacity)
    t1_victims = keys(*range(10))
    for key in t1_victims:
        arc.insert([key])
        assert arc.evict(1) == [key]
    ghosts1 = [k for k in t1_victims if arc.in_ghost(k) == "b1"]
    assert ghosts1 == t1_victims[-capacity:]  # the oldest ghosts are forgotten first
    t2_victims = keys(*range(100, 110))
    for key in t2_victims:
        arc.insert([key])
        arc.touch([key])
        assert arc.evict(1) == [key]
    ghosts2 = [k for k in t2_victims if arc.in_ghost(k) == "b2"]
    assert ghosts2 == t2_victims[-capacity:]
    assert [k for k in t1_victims if arc.in_ghost(k) == "b1"] == ghosts1


def test_arc_forgotten_ghost_enters_t1_again() -> None:
    arc = ARCPolicy(2)
    ks = keys(0, 1, 2)
    for key in ks:
        arc.insert([key])
        assert arc.evict(1) == [key]
    assert arc.in_ghost(ks[0]) is None  # pushed out of B1 (capacity 2)
    arc.insert([ks[0]])
    assert arc.p == 0
    assert (arc.t1_size, arc.t2_size) == (1, 0)


def test_arc_falls_back_to_t2_when_t1_has_nothing_evictable() -> None:
    a, b, c, d = keys(1, 2, 3, 4)

    def build() -> ARCPolicy:
        arc = ARCPolicy(8)
        arc.insert([a, b, c, d])
        arc.touch([c, d])  # T1 = a b, T2 = c d; p = 0 so T1 is preferred
        return arc

    arc = build()
    assert arc.evict(1) == [a]  # the preference itself

    held = build()
    held.hold(a)
    held.hold(b)
    assert held.evict(1) == [d]
    assert held.in_ghost(d) == "b2"

    protected = build()
    assert protected.evict(2, {a, b}) == [d, c]

    mixed = build()
    mixed.hold(a)
    assert mixed.evict(3, {int_key(99)}) == [b, d, c]
    assert mixed.evict(1) is None


def test_arc_falls_back_to_t1_when_t2_has_nothing_evictable() -> None:
    arc = arc_with_p(8, 3)
    a, b, c, d = keys(1, 2, 3, 4)
    arc.insert([a, b, c, d])
    arc.touch([c, d])  # T1 = a b (2 <= p = 3), T2 = c d: T2 is preferred
    probe = arc_with_p(8, 3)
    probe.insert([a, b, c, d])
    probe.touch([c, d])
    assert probe.evict(1) == [d]  # the preference itself

    arc.hold(c)
    assert arc.evict(2, {d}) == [a, b]
    assert arc.in_ghost(a) == arc.in_ghost(b) == "b1"
    assert arc.evict(1, {d}) is None
    assert len(arc) == 2


def test_arc_clear_forgets_ghosts_and_p() -> None:
    arc = ARCPolicy(4)
    a, b = keys(1, 2)
    arc.insert([a, b])
    assert arc.evict(1) == [a]
    arc.insert([a])
    assert arc.p == 1
    arc.clear()
    assert arc.p == 0
    assert arc.in_ghost(a) is None and arc.in_ghost(b) is None
    arc.insert([b])
    assert (arc.t1_size, arc.t2_size) == (1, 0)


def test_arc_hold_and_release_keep_the_list() -> None:
    arc = ARCPolicy(4)
    a, b, c = keys(1, 2, 3)
    arc.insert([a, b, c])
    arc.touch([c])  # T1 = a b, T2 = c
    arc.hold(a)
    arc.hold(c)
    assert (arc.t1_size, arc.t2_size) == (2, 1)
    arc.release(a)
    arc.release(c)
    assert (arc.t1_size, arc.t2_size) == (2, 1)
    # a is now T1's most recent: T1 (2 > p = 0) gives b, then a; T2 gives c last.
    assert arc.evict(3) == [b, a, c]
    assert [arc.in_ghost(k) for k in (a, b, c)] == ["b1", "b1", "b2"]


def test_arc_preference_is_rechecked_after_each_victim() -> None:
    # Paper's REPLACE runs once per victim: as T1 shrinks to p, T2 takes over.
    arc = arc_with_p(8, 1)
    a, b, c, x = keys(1, 2, 3, 4)
    arc.insert([x])
    arc.touch([x])  # T2 = x
    arc.insert([a, b, c])  # T1 = a b c (3 > p = 1)
    assert arc.evict(3) == [a, b, x]
    assert (arc.t1_size, arc.t2_size) == (1, 0)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_one_evict_of_n_equals_n_evicts_of_one(name: str) -> None:
    def build() -> CachePolicy:
        p = make_policy(name, 8)
        p.insert(keys(*range(8)))
        p.touch(keys(5, 2, 7))
        p.hold(int_key(5))
        return p

    batch, single = build(), build()
    protected = {int_key(0), int_key(3)}
    together = batch.evict(4, protected)
    one_by_one = [single.evict(1, protected) for _ in range(4)]
    assert together == [v[0] for v in one_by_one if v]


def test_arc_refused_evict_leaves_p_ghosts_and_lists() -> None:
    arc = arc_with_p(8, 3)
    ks = keys(*range(6))
    arc.insert(ks)
    arc.touch(ks[:2])  # T1 = 2 3 4 5, T2 = 1 0
    # T1 (4) > p (3) gives 2; then T1 (3) <= p, so T2 gives 1 (0 is protected).
    assert arc.evict(2, {ks[0]}) == [ks[2], ks[1]]
    ghosts = {k: arc.in_ghost(k) for k in ks}
    state = (arc.p, arc.t1_size, arc.t2_size, len(arc))
    arc.hold(ks[3])
    assert arc.evict(3, {ks[0], ks[4]}) is None
    arc.release(ks[3])
    assert (arc.p, arc.t1_size, arc.t2_size, len(arc)) == state
    assert {k: arc.in_ghost(k) for k in ks} == ghosts
