"""The LRU policy's order in generations (tierd.policy.order): it behaves as one
``OrderedDict`` least recent first, across many generations and parts, and no dict of a
big order, nor of a big tier, holds more than a part's or a generation's worth of keys."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Collection

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.gc_walk import largest_dict
from tierd.keys import BlockKey, int_key
from tierd.policy import LRUPolicy, policy_class
from tierd.policy.order import DictOrder, PartedOrder
from tierd.tier import Tier

_KEYS = st.integers(0, 60)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(_KEYS, max_size=12)),
        st.tuples(st.just("to_end"), st.lists(_KEYS, max_size=12)),
        st.tuples(st.just("move"), _KEYS),
        st.tuples(st.just("discard"), _KEYS),
        st.tuples(st.just("take"), st.lists(_KEYS, max_size=6)),
        st.tuples(st.just("take_oldest"), st.integers(0, 15)),
        st.tuples(st.just("clear"), st.integers(0, 20)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=_OPS,
    generation=st.integers(2, 9),
    part_keys=st.integers(1, 40),
    one_dict=st.booleans(),
)
def test_both_orders_behave_as_one_ordered_dict(
    ops: list[tuple[str, object]], generation: int, part_keys: int, one_dict: bool
) -> None:
    order: DictOrder[BlockKey] | PartedOrder[BlockKey] = (
        DictOrder() if one_dict else PartedOrder(64, part_keys, generation)
    )
    model: OrderedDict[BlockKey, None] = OrderedDict()
    for op, arg in ops:
        if op == "append":
            assert isinstance(arg, list)
            order.append([int_key(i) for i in arg])
            for i in arg:
                model.pop(int_key(i), None)
                model[int_key(i)] = None
        elif op == "to_end":
            assert isinstance(arg, list)
            order.to_end([int_key(i) for i in arg])
            for i in arg:
                if int_key(i) in model:
                    model.move_to_end(int_key(i))
        elif op == "move":
            assert isinstance(arg, int)
            order.move(int_key(arg))
            if int_key(arg) in model:
                model.move_to_end(int_key(arg))
        elif op == "discard":
            assert isinstance(arg, int)
            assert order.discard(int_key(arg)) == (model.pop(int_key(arg), 0) is None)
        elif op == "take":
            assert isinstance(arg, list)
            present = list(dict.fromkeys(k for i in arg if (k := int_key(i)) in model))
            order.take(present)
            for key in present:
                del model[key]
        elif op == "take_oldest":
            assert isinstance(arg, int)
            n = min(arg, len(model))
            expected = list(model)[:n]
            assert order.oldest(n) == expected
            order.take_oldest(n)
            for key in expected:
                del model[key]
        elif arg == 0:
            order.clear()
            model.clear()
        assert list(order) == list(model) and len(order) == len(model)
        assert order.oldest(3) == list(model)[:3]
        assert all(int_key(i) in order for i in range(0, 61, 5) if int_key(i) in model)


class ModelLRU:
    """LRU as the contract states it, on one OrderedDict: held keys are never victims,
    and a release makes its key the most recent."""

    def __init__(self) -> None:
        self.order: OrderedDict[BlockKey, None] = OrderedDict()
        self.held: set[BlockKey] = set()

    def evict(self, n: int, protected: Collection[BlockKey]) -> list[BlockKey] | None:
        free = [k for k in self.order if k not in self.held and k not in protected]
        if n > len(self.order) - len(self.held) or len(free) < n:
            return None
        for key in free[:n]:
            del self.order[key]
        return free[:n]


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "touch", "hold", "release", "remove", "evict"]),
            st.lists(st.integers(0, 30), min_size=1, max_size=8),
        ),
        max_size=100,
    ),
    part_keys=st.integers(1, 8),
)  # a small LRU in parts (one_dict=0): a big one's order
def test_an_lru_in_parts_evicts_as_one_ordered_dict(
    ops: list[tuple[str, list[int]]], part_keys: int
) -> None:
    lru = LRUPolicy(40, part_keys=part_keys, one_dict=0)
    model = ModelLRU()
    for op, ids in ops:
        keys = [int_key(i) for i in ids]
        if op == "insert":
            new = [k for k in dict.fromkeys(keys) if k not in model.order]
            lru.insert(new)
            model.order.update(dict.fromkeys(new))
        elif op == "touch":
            lru.touch(keys)
            for key in reversed(keys):
                if key in model.order and key not in model.held:
                    model.order.move_to_end(key)
        elif op == "hold" and keys[0] in model.order:
            lru.hold(keys[0])
            model.held.add(keys[0])
        elif op == "release" and keys[0] in model.held:
            lru.release(keys[0])
            model.held.discard(keys[0])
            model.order.move_to_end(keys[0])
        elif op == "remove":
            assert lru.remove(keys[0]) == (keys[0] in model.order)
            model.order.pop(keys[0], None)
            model.held.discard(keys[0])
        elif op == "evict":
            assert lru.evict(len(keys), set(keys[1:])) == model.evict(len(keys), set(keys[1:]))
        assert len(lru) == len(model.order)
    model.held.clear()  # what is left, least recent first (held keys' places are not kept)
    for key in list(lru._held):
        lru.release(key)
        model.order.move_to_end(key)
    assert lru.evict(len(model.order)) == list(model.order)


def test_a_generation_that_lost_most_of_its_keys_is_copied_small() -> None:
    order: PartedOrder[BlockKey] = PartedOrder(100_000, generation=256)
    keys = [int_key(i) for i in range(256 * 40)]
    order.append(keys)
    sizes = [sys.getsizeof(gen) for gen in order._gens.values()]
    order.take([key for i, key in enumerate(keys) if i % 256])  # one key left in each
    assert len(order) == 40 and list(order) == keys[::256]
    thinned = [sys.getsizeof(gen) for gen in order._gens.values()][:-1]
    assert max(thinned) * 8 < min(sizes[:-1])  # not the tables of 256 keys


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_no_dict_of_a_big_tier_holds_all_its_blocks(policy: str) -> None:
    """A tier of 200,000 blocks that stored 300,000 (so 100,000 evicted, which ARC's
    ghosts remember): its slots and its policy's lists are in parts and generations, so
    no put copies a dict of all of them (each was one dict of 100,000 to 200,000 keys)."""
    tier = Tier(200_000, policy, name="cpu")
    keys = [int_key(i) for i in range(300_000)]
    for start in range(0, len(keys), 4_096):
        piece = keys[start : start + 4_096]
        plan = tier.prepare_store(piece)
        assert plan is not None
        tier.complete_store(piece)
        tier.touch(piece[::3])  # seen twice: ARC's T2
    assert len(tier) == 200_000 and tier.lookup(keys[-1000:]) == 1000
    assert largest_dict(tier) <= 16_384


_POLICY_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "hold", "release", "remove", "evict"]),
        st.lists(st.integers(0, 60), min_size=1, max_size=8),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(ops=_POLICY_OPS, part_keys=st.integers(1, 8), name=st.sampled_from(["arc", "duel"]))
def test_arc_and_duel_in_parts_answer_as_with_one_dict_a_list(
    ops: list[tuple[str, list[int]]], part_keys: int, name: str
) -> None:
    """ARC's four lists (and the duel's stamps) in parts and generations, as a big tier
    has them, against the same policy with one dict a list: every answer the same."""
    cls = policy_class(name)
    parted = cls(20, part_keys=part_keys, one_dict=0)
    whole = cls(20)
    held: set[BlockKey] = set()
    for op, ids in ops:
        keys = [int_key(i) for i in ids]
        if op == "insert":
            new = [k for k in dict.fromkeys(keys) if k not in whole]
            room = len(whole) + len(new) - whole.capacity
            if room > 0 and parted.evict(room) != whole.evict(room):
                raise AssertionError("the eviction that made room differs")
            if len(whole) + len(new) <= whole.capacity:
                parted.insert(new)
                whole.insert(new)
        elif op == "touch":
            parted.touch(keys)
            whole.touch(keys)
        elif op == "hold" and keys[0] in whole and keys[0] not in held:
            parted.hold(keys[0])
            whole.hold(keys[0])
            held.add(keys[0])
        elif op == "release" and keys[0] in held:
            parted.release(keys[0])
            whole.release(keys[0])
            held.discard(keys[0])
        elif op == "remove":
            assert parted.remove(keys[0]) == whole.remove(keys[0])
            held.discard(keys[0])
        elif op == "evict":
            protect = set(keys[1:])
            assert parted.evict(len(keys), protect) == whole.evict(len(keys), protect)
        assert len(parted) == len(whole)
        assert all((k in parted) == (k in whole) for k in map(int_key, range(61)))
        assert parted.p == whole.p and parted.in_ghost(keys[0]) == whole.in_ghost(keys[0])
    for key in held:
        parted.release(key)
        whole.release(key)
    assert parted.evict(len(whole)) == whole.evict(len(whole))
