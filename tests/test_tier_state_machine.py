"""A Hypothesis state machine drives a Tier, under every policy, against a reference model.

The model is deliberately naive: a dict of key -> state (writing or ready), pin counts, the
slot of every key, a never-used counter and a stack of freed slots. Victim choice belongs to
the policy, so the model only checks that victims are allowed (ready, unpinned, not among
the keys being stored); for LRU it also keeps the recency order and checks the exact victims.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tierd.errors import BlockBusy, BlockMissing, BlockNotPinned, BlockNotReady
from tierd.events import EventKind, TierEvent
from tierd.keys import BlockKey, Medium, int_key
from tierd.policy import ARCPolicy, CachePolicy, LRUPolicy, policy_names
from tierd.tier import Tier

WRITING, READY = "writing", "ready"
NAME, MEDIUM = "gpu0", Medium.GPU
KEYS = [int_key(i) for i in range(9)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=7)
store_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)


class TierModel(RuleBasedStateMachine):
    """Drives one Tier; ``policy_name`` is set by the factory below."""

    policy_name = "lru"
    parts: int | None = None  # a big tier's index and LRU order: in parts (set below)

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.tier: Tier | None = None
        self.state: dict[BlockKey, str] = {}
        self.pins: Counter[BlockKey] = Counter()
        self.slot: dict[BlockKey, int] = {}
        self.next_unused = 0
        self.freed: list[int] = []
        self.quarantined: list[int] = []  # slots of withdrawn writes, out of use
        # Unpinned ready keys, least recent first (checked exactly under LRU only).
        self.recency: OrderedDict[BlockKey, None] = OrderedDict()
        self.hits = self.misses = self.stores = self.evictions = 0

    @initialize(capacity=st.integers(1, 6))
    def start(self, capacity: int) -> None:
        self.capacity = capacity
        policy: str | CachePolicy = self.policy_name
        if self.parts and policy == "lru":  # the order of a big LRU: generations, parts
            policy = LRUPolicy(capacity, part_keys=1, one_dict=0)
        self.tier = Tier(capacity, policy, name=NAME, medium=MEDIUM, parts=self.parts)

    # -- helpers -----------------------------------------------------------------------

    @property
    def t(self) -> Tier:
        assert self.tier is not None
        return self.tier

    def keys_in(self, state: str) -> list[BlockKey]:
        return [k for k in KEYS if self.state.get(k) == state]

    def snapshot(self) -> tuple[Any, ...]:
        t = self.t
        return (
            t.stats(),
            {k: (t.slot_of(k), t.is_writing(k), t.is_pinned(k), k in t) for k in KEYS},
            len(t.policy),
        )

    def expect_events(self, *events: TierEvent) -> None:
        assert self.t.take_events() == list(events)

    def free_slot(self, slot: int) -> None:
        self.freed.append(slot)

    def allocate(self, n: int) -> tuple[int, ...]:
        out = []
        for _ in range(n):
            if self.next_unused < self.capacity:
                out.append(self.next_unused)
                self.next_unused += 1
            else:
                out.append(self.freed.pop())
        return tuple(out)

    # -- rules -------------------------------------------------------------------------

    @rule(keys=key_lists)
    def lookup(self, keys: list[BlockKey]) -> None:
        expected = 0
        for key in keys:
            if self.state.get(key) != READY:
                break
            expected += 1
        assert self.t.lookup(keys) == expected
        self.hits += expected
        self.misses += len(keys) - expected
        self.expect_events()

    @rule(keys=key_lists)
    def touch(self, keys: list[BlockKey]) -> None:
        self.t.touch(keys)
        for key in reversed(keys):
            if key in self.recency:
                self.recency.move_to_end(key)
        self.expect_events()

    @rule(keys=store_lists)
    def prepare_store(self, keys: list[BlockKey]) -> None:
        self.check_prepare_store(keys)

    @rule(keys=store_lists)
    def store(self, keys: list[BlockKey]) -> None:
        # The common path: prepare, then complete what was planned (duplicates included).
        planned = self.check_prepare_store(keys)
        if planned:
            self.check_complete_store([*planned, planned[0]], success=True)

    def check_prepare_store(self, keys: list[BlockKey]) -> tuple[BlockKey, ...]:
        todo = list(dict.fromkeys(k for k in keys if k not in self.state))
        need = len(todo) - (self.capacity - len(self.state) - len(self.quarantined))
        evictable = [
            k for k in self.recency if self.state[k] == READY and not self.pins[k] and k not in keys
        ]
        before = self.snapshot()
        plan = self.t.prepare_store(keys)
        if need > len(evictable):
            event("prepare_store refused")
            assert plan is None
            assert self.snapshot() == before
            self.expect_events()
            return ()
        assert plan is not None
        assert plan.keys == tuple(todo)
        victims = plan.evicted
        assert len(victims) == max(need, 0)
        assert len(set(victims)) == len(victims)
        assert set(victims) <= set(evictable), "evicted a pinned, writing or requested block"
        if self.policy_name == "lru":
            assert list(victims) == evictable[: len(victims)]
        if isinstance(self.t.policy, ARCPolicy):
            assert all(self.t.policy.in_ghost(k) is not None for k in victims)
        assert plan.evicted_slots == tuple(self.slot[k] for k in victims)
        for key in victims:
            del self.state[key]
            del self.recency[key]
            self.free_slot(self.slot.pop(key))
        self.evictions += len(victims)
        event(f"prepare_store evicted {min(len(victims), 2)}")
        assert plan.slots == self.allocate(len(todo))
        for key, slot in zip(todo, plan.slots, strict=True):
            self.state[key] = WRITING
            self.slot[key] = slot
        if victims:
            self.expect_events(TierEvent(EventKind.REMOVED, victims, MEDIUM, NAME))
        else:
            self.expect_events()
        return plan.keys

    @precondition(lambda self: self.state)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        # Mostly blocks being written, sometimes ready ones and repeats among them.
        writing, ready = self.keys_in(WRITING), self.keys_in(READY)
        pool = writing * 3 + ready if writing else ready
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6), label="keys")
        self.check_complete_store(keys, success)

    def check_complete_store(self, keys: Sequence[BlockKey], success: bool) -> None:
        self.t.complete_store(keys, success=success)
        done = [k for k in dict.fromkeys(keys) if self.state[k] == WRITING]
        event(f"complete_store success={success} done={bool(done)}")
        for key in done:
            if success:
                self.state[key] = READY
                self.recency[key] = None
            else:
                del self.state[key]
                self.free_slot(self.slot.pop(key))
        if success and done:
            self.stores += len(done)
            self.expect_events(TierEvent(EventKind.STORED, tuple(done), MEDIUM, NAME))
        else:
            self.expect_events()

    @precondition(lambda self: WRITING in self.state.values())
    @rule()
    def finish_all_writes(self) -> None:
        self.check_complete_store(self.keys_in(WRITING), success=True)

    @precondition(lambda self: WRITING in self.state.values())
    @rule(data=st.data())
    def quarantine(self, data: st.DataObject) -> None:
        """A client's lease expired: its write withdrawn, its slots kept from any store."""
        pool = self.keys_in(WRITING) * 2 + self.keys_in(READY) + KEYS[:1]
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5), label="keys")
        withdrawn = [k for k in dict.fromkeys(keys) if self.state.get(k) == WRITING]
        assert self.t.quarantine(keys) == [self.slot[k] for k in withdrawn]
        for key in withdrawn:
            del self.state[key]
            self.quarantined.append(self.slot.pop(key))
        event(f"quarantine {min(len(withdrawn), 2)}")
        self.expect_events()

    @precondition(lambda self: self.quarantined)
    @rule(data=st.data())
    def release_quarantine(self, data: st.DataObject) -> None:
        slots = data.draw(st.permutations(self.quarantined), label="order")
        slots = slots[: data.draw(st.integers(1, len(slots)), label="count")]
        self.t.release_quarantine(slots)
        for slot in slots:
            self.quarantined.remove(slot)
            self.free_slot(slot)
        self.expect_events()

    @rule(keys=key_lists, success=st.booleans())
    def complete_store_unknown(self, keys: list[BlockKey], success: bool) -> None:
        absent = [k for k in KEYS if k not in self.state]
        if not absent:
            return
        keys = [*keys, absent[len(keys) % len(absent)]]
        before = self.snapshot()
        with pytest.raises(BlockMissing):
            self.t.complete_store(keys, success=success)
        assert self.snapshot() == before
        self.expect_events()

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[BlockKey]) -> None:
        bad = next((k for k in keys if self.state.get(k) != READY), None)
        before = self.snapshot()
        if bad is not None:
            error = BlockMissing if bad not in self.state else BlockNotReady
            event(f"prepare_load {error.__name__}")
            with pytest.raises(error) as info:
                self.t.prepare_load(keys)
            assert info.value.key == bad
            assert self.snapshot() == before
        else:
            assert self.t.prepare_load(keys) == [self.slot[k] for k in keys]
            for key in keys:
                if not self.pins[key]:
                    del self.recency[key]
                self.pins[key] += 1
        self.expect_events()

    @precondition(lambda self: any(self.state.get(k) == READY for k in KEYS))
    @rule(data=st.data())
    def prepare_load_ready(self, data: st.DataObject) -> None:
        ready = self.keys_in(READY)
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4), label="keys")
        self.prepare_load(keys)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def complete_load_pinned(self, data: st.DataObject) -> None:
        # Pinned keys only, though a repeat may still release more pins than were taken.
        pinned = [k for k in KEYS if self.pins[k]]
        keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=3), label="keys")
        self.complete_load(keys)

    @rule(keys=key_lists)
    def complete_load(self, keys: list[BlockKey]) -> None:
        before = self.snapshot()
        if any(self.pins[k] < n for k, n in Counter(keys).items()):
            event("complete_load BlockNotPinned")
            with pytest.raises(BlockNotPinned):
                self.t.complete_load(keys)
            assert self.snapshot() == before
        else:
            self.t.complete_load(keys)
            for key in keys:
                self.pins[key] -= 1
                if not self.pins[key]:
                    self.recency[key] = None
        self.expect_events()

    @rule(keys=key_lists)
    def discard(self, keys: list[BlockKey]) -> None:
        self.remove_idle(keys)

    @rule()
    def clear(self) -> None:
        idle = [k for k in self.state if self.state[k] == READY and not self.pins[k]]
        removed = self.t.clear()
        assert sorted(removed) == sorted(idle)
        self.forget(removed)

    def remove_idle(self, keys: Sequence[BlockKey]) -> None:
        busy = next((k for k in keys if self.pins[k] or self.state.get(k) == WRITING), None)
        before = self.snapshot()
        if busy is not None:
            event("discard BlockBusy")
            with pytest.raises(BlockBusy) as info:
                self.t.discard(keys)
            assert info.value.key == busy
            assert self.snapshot() == before
            self.expect_events()
            return
        gone = [k for k in dict.fromkeys(keys) if k in self.state]
        assert self.t.discard(keys) == gone
        self.forget(gone)

    def forget(self, gone: Sequence[BlockKey]) -> None:
        for key in gone:
            del self.state[key]
            del self.recency[key]
            self.free_slot(self.slot.pop(key))
        if gone:
            self.expect_events(TierEvent(EventKind.REMOVED, tuple(gone), MEDIUM, NAME))
        else:
            self.expect_events()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.tier is None:
            return
        t = self.t
        stats = t.stats()
        assert stats.capacity == self.capacity
        assert stats.used == len(self.state) == len(t) <= self.capacity
        assert t.free == self.capacity - len(self.state) - len(self.quarantined)
        assert stats.quarantined == len(self.quarantined)
        assert stats.writing == len(self.keys_in(WRITING))
        assert stats.pinned == sum(1 for n in self.pins.values() if n)
        assert (stats.hits, stats.misses) == (self.hits, self.misses)
        assert (stats.stores, stats.evictions) == (self.stores, self.evictions)
        assert sorted(t.ready_keys()) == sorted(self.keys_in(READY))
        assert len(t.policy) == len(self.keys_in(READY))
        for key in KEYS:
            assert t.slot_of(key) == self.slot.get(key)
            assert t.is_writing(key) == (self.state.get(key) == WRITING)
            assert t.is_pinned(key) == bool(self.pins[key])
            assert (key in t) == (self.state.get(key) == READY)
            assert (key in t.policy) == (self.state.get(key) == READY)

    @invariant()
    def slots_are_owned_once_and_in_range(self) -> None:
        if self.tier is None:
            return
        slots = [s for s in map(self.t.slot_of, KEYS) if s is not None]
        assert len(slots) == len(set(slots))
        assert all(0 <= s < self.capacity for s in slots)
        # The model's free list and the owned slots partition what has been handed out.
        # (and the quarantined ones, which are neither owned nor free).
        assert sorted(slots + self.freed + self.quarantined) == list(range(self.next_unused))


@pytest.mark.parametrize("parts", [None, 4])
@pytest.mark.parametrize("policy", policy_names())
def test_tier_state_machine(policy: str, parts: int | None) -> None:
    fields = {"policy_name": policy, "parts": parts}
    machine = type(f"TierModel_{policy}_{parts}", (TierModel,), fields)
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=60))
