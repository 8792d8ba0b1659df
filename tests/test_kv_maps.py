"""The maps under the KV events' book (tierd.maps): the ordered one behaves as an
insertion-ordered dict whose front is taken out and put back, across many buckets."""

from __future__ import annotations

import gc
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.gc_walk import references_walked
from tierd.maps import TAG_BITS, Fifo, Shards

_OPS = st.lists(
    st.tuples(st.sampled_from(["put", "pop", "evict", "clear"]), st.integers(0, 40)),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, spread=st.integers(1, 3000))
def test_a_fifo_behaves_as_an_ordered_dict_whose_front_is_taken_out(
    ops: list[tuple[str, int]], spread: int
) -> None:
    fifo: Fifo[bytes, int] = Fifo()
    model: OrderedDict[bytes, int] = OrderedDict()
    for _ in range(spread):  # numbers run past a bucket or more before the test's keys
        fifo.put(b"warm", 0)
    fifo.pop(b"warm")
    for n, (op, i) in enumerate(ops):
        key = b"k%d" % i
        if op == "put":
            fifo.put(key, n)
            model.pop(key, None)
            model[key] = n
        elif op == "pop":
            assert fifo.pop(key, -1) == model.pop(key, -1)
        elif op == "evict":
            oldest = fifo.oldest()
            assert oldest == next(iter(model), None)
            if oldest is not None:
                assert fifo.pop(oldest) == model.pop(oldest)
        elif n % 7 == 0:
            fifo.clear()
            model.clear()
        assert (key in fifo) == (key in model) and fifo.get(key) == model.get(key)
        assert len(fifo) == len(model) and bool(fifo) == bool(model)
    assert list(fifo) == list(model) and fifo.items() == list(model.items())
    assert [fifo[k] for k in model] == list(model.values())
    asked = [b"k%d" % i for _, i in ops] + [b"absent"]
    assert fifo.get_all(asked) == [model.get(k) for k in asked]


_TAG_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "replace", "retag", "untag", "pop", "evict"]),
        st.lists(st.integers(0, 20), min_size=1, max_size=4),  # keys (repeats too)
        st.integers(0, (1 << TAG_BITS) - 1),
        st.integers(0, (1 << TAG_BITS) - 1),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ops=_TAG_OPS, spread=st.integers(0, 3000))
def test_a_fifos_tags_are_kept_with_its_keys_and_changed_in_order(
    ops: list[tuple[str, list[int], int, int]], spread: int
) -> None:
    """Tags live in the low bits of a key's number: they never leak into its value, its
    place in the order or another key's tag, at any number."""
    fifo: Fifo[bytes, int] = Fifo()
    model: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
    for _ in range(spread):
        fifo.put(b"warm", 0, (1 << TAG_BITS) - 1)
    fifo.pop(b"warm")
    for n, (op, ids, a, b) in enumerate(ops):
        keys = [b"k%d" % i for i in ids]
        if op == "put":
            fifo.put(keys[0], n, a)
            model.pop(keys[0], None)
            model[keys[0]] = (n, a)
        elif op == "retag":
            expected: tuple[list[int | None], list[int]] = ([], [])
            for key in keys:  # in order: a key twice sees its first change
                value, tag = model.get(key, (None, -1))
                expected[0].append(value)
                expected[1].append(tag)
                if key in model:
                    model[key] = (value, (tag | a) & ~b)  # type: ignore[assignment]
            assert fifo.retag_all(keys, add=a, remove=b) == expected
        elif op == "untag":
            expected = ([], [])
            for key in keys:  # in order: a key twice sees its first change
                value, tag = model.get(key, (None, -1))
                expected[0].append(value)
                expected[1].append(tag)
                if key in model:
                    if tag & ~b:
                        model[key] = (value, tag & ~b)  # type: ignore[assignment]
                    else:  # no tag left: taken out
                        del model[key]
            assert fifo.untag_all(keys, remove=b) == expected
        elif op == "replace":
            before = model.pop(keys[0], None)
            assert fifo.replace(keys[0], n) == before
            model[keys[0]] = (n, 0 if before is None else before[1])
        elif op == "pop":
            assert fifo.pop_tagged(keys[0]) == model.pop(keys[0], None)
        else:
            oldest = fifo.oldest()
            assert oldest == next(iter(model), None)
            if oldest is not None:
                assert fifo.pop_tagged(oldest) == model.pop(oldest)
        for key in keys:
            assert fifo.tag(key, -1) == model.get(key, (0, -1))[1]
        assert all(numbers for numbers, _ in fifo._buckets.values())  # none kept empty
    assert fifo.items() == [(k, v) for k, (v, _) in model.items()]
    assert fifo.tagged_items(fifo.items()) == [(k, v, t) for k, (v, t) in model.items()]
    with pytest.raises(ValueError, match="tag"):
        fifo.put(b"big", 0, 1 << TAG_BITS)


def test_a_long_queue_evicted_from_its_front_keeps_its_order_and_is_not_walked() -> None:
    fifo: Fifo[bytes, bytes] = Fifo()
    for i in range(5000):
        fifo.put(b"k%d" % i, b"v%d" % i)
    for i in range(5000, 20000):  # at its budget: each new key evicts the oldest
        fifo.put(b"k%d" % i, b"v%d" % i)
        if i % 3 == 0:
            fifo.put(b"k%d" % (i - 100), b"again")  # back to the back
        oldest = fifo.oldest()
        assert oldest is not None
        fifo.pop(oldest)
    keys = list(fifo)
    assert len(keys) == len(set(keys)) == len(fifo) == 5000
    assert keys[-1] in (b"k19900", b"k19999")
    gc.collect()
    # 5,000 entries: the 64 parts of the keys' numbers and a few references per 1,024
    # entries, none per entry.
    assert references_walked(fifo) <= 128


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "pop", "del", "get"]), st.integers(0, 300))))
def test_shards_behave_as_a_dict(ops: list[tuple[str, int]]) -> None:
    shards: Shards[bytes, int] = Shards()
    model: dict[bytes, int] = {}
    for n, (op, i) in enumerate(ops):
        key = b"k%d" % i
        if op == "set":
            shards[key] = model[key] = n
        elif op == "pop" and n % 2:
            assert shards.pop(key, -1) == model.pop(key, -1)
        elif op in ("pop", "del") and key not in model:
            with pytest.raises(KeyError):
                shards.pop(key) if op == "pop" else shards.__delitem__(key)
        elif op == "pop":
            assert shards.pop(key) == model.pop(key)
        elif op == "del":
            del shards[key], model[key]
        assert shards.get(key) == model.get(key) and shards.get(key, -2) == model.get(key, -2)
        assert (key in shards) == (key in model) and len(shards) == len(model)
    assert all(shards[k] == v for k, v in model.items())
    shards.clear()
    assert len(shards) == 0 and all(k not in shards for k in model)


def test_consecutive_int_keys_do_not_fill_the_parts_in_step() -> None:
    # Ints hash to themselves: 64 parts picked by the low bits would each take every
    # 64th of consecutive keys (engine hashes a tenant chooses), grow in step and resize
    # within the same 64 puts (10.6 ms at 600,000). Mixed with a salt, the parts fill
    # at their own rates, as they do for bytes keys.
    ints: Shards[int, int] = Shards()
    keys: Shards[bytes, int] = Shards()
    for i in range(64 * 100):
        ints[i] = keys[b"k%d" % i] = i
    for shards in (ints, keys):
        sizes = [len(part) for part in shards.parts]
        assert sum(sizes) == 6400 and max(sizes) - min(sizes) >= 8
