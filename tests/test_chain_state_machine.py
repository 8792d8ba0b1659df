"""A Hypothesis state machine drives a memory -> cpu -> disk chain through its public API.

The model is small on purpose: which keys were ever handed to ``store`` (so a lookup or a
load can never report anything else) and the bytes every key must carry (derived from the
key). Capacities and policies are drawn per example. Besides the sequential rules, one rule
runs several stores and loads at once and cancels some of them part-way, and after every
step the chain must be idle: no pins, no writes in flight, no pending futures.

The chain is async; the machine owns one event loop for its lifetime and runs each rule's
coroutine to completion on it, so every step starts and ends idle. Two load bugs it found
are pinned down as plain tests at the end of the module.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tierd
from tierd.chain import LoadHandle, TierChain
from tierd.errors import BlockMissing, CapacityError
from tierd.keys import BlockKey, int_key
from tierd.policy import policy_names
from tierd.testing import as_bytes

BLOCK = 4096
KEYS = [int_key(i) for i in range(10)]
store_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)
small_store_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=2)
policies = st.sampled_from(policy_names())


def content(key: BlockKey) -> bytes:
    """Deterministic bytes for a key, different for every key."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def check_views(handle: LoadHandle) -> None:
    """Every byte of every pinned block equals the content of its key."""
    views = handle.views()
    assert len(views) == len(handle.keys)
    for key, view in zip(handle.keys, views, strict=True):
        assert as_bytes(view) == content(key), f"wrong bytes for {key!r}"


def is_prefix(got: Sequence[BlockKey], wanted: Sequence[BlockKey]) -> bool:
    return list(got) == list(wanted[: len(got)])


class ChainMachine(RuleBasedStateMachine):
    """memory(2..3) -> cpu(3..4) -> disk(6..8), a random policy per tier."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = Path(tempfile.mkdtemp(prefix="tierd-sm-"))
        self.context: AbstractAsyncContextManager[TierChain] | None = None
        self.chain_: TierChain | None = None
        self.stored: set[BlockKey] = set()  # every key ever handed to store
        # What the chain held after the last step, and the blocks it had counted as
        # dropped by then: a sequential step may lose a block only by dropping it.
        self.held_before: set[BlockKey] = set()
        self.dropped_before = 0
        self.cancelled_step = False

    # -- set-up and tear-down ------------------------------------------------------------

    @initialize(
        caps=st.tuples(st.integers(2, 3), st.integers(3, 4), st.integers(6, 8)),
        pols=st.tuples(policies, policies, policies),
    )
    def open_chain(self, caps: tuple[int, int, int], pols: tuple[str, str, str]) -> None:
        disk_dir = self.root / "disk"
        disk_dir.mkdir()
        config: dict[str, Any] = {
            "block_bytes": BLOCK,
            "tiers": [
                {"name": "mem", "kind": "memory", "capacity": caps[0], "policy": pols[0]},
                {"name": "cpu", "kind": "cpu", "capacity": caps[1], "policy": pols[1]},
                {
                    "name": "disk",
                    "kind": "disk",
                    "capacity": caps[2],
                    "policy": pols[2],
                    "directories": [str(disk_dir)],
                },
            ],
        }
        self.context = tierd.open(config)
        self.chain_ = self.run(self.context.__aenter__())

    def teardown(self) -> None:
        try:
            if self.context is not None:
                self.run(self.context.__aexit__(None, None, None))
        finally:
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------

    @property
    def chain(self) -> TierChain:
        assert self.chain_ is not None
        return self.chain_

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @property
    def entry_capacity(self) -> int:
        return self.chain.levels[0].tier.num_blocks

    def held(self, level: int) -> set[BlockKey]:
        return set(self.chain.levels[level].tier.ready_keys())

    def held_anywhere(self) -> set[BlockKey]:
        return set().union(*(self.held(i) for i in range(len(self.chain.levels))))

    async def load_and_check(self, keys: list[BlockKey]) -> list[BlockKey]:
        """Load, check every byte (again after yielding to other tasks), release."""
        handle = await self.chain.load(keys)
        try:
            assert handle.keys, "a load returned an empty handle instead of BlockMissing"
            assert is_prefix(handle.keys, keys), (handle.keys, keys)
            assert set(handle.keys) <= self.stored
            check_views(handle)
            for _ in range(2):
                await asyncio.sleep(0)  # pinned blocks must survive other tasks' work
            check_views(handle)
        finally:
            handle.release()
        return handle.keys

    # -- rules ---------------------------------------------------------------------------

    @rule(keys=store_lists)
    def store(self, keys: list[BlockKey]) -> None:
        self.stored.update(keys)
        distinct = list(dict.fromkeys(keys))
        try:
            got = self.run(self.chain.store(keys, [content(k) for k in keys]))
        except CapacityError:
            # Nothing is pinned between steps: only a batch larger than the tier can fail.
            assert len(distinct) > self.entry_capacity
            event("store: capacity error")
            return
        assert set(got) <= set(distinct)
        result = self.chain.lookup(keys)
        assert result.count == len(keys), "a stored batch is not all in the chain"
        assert set(result.levels) == {0}, "a stored batch is not all at the entry level"

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def lookup(self, keys: list[BlockKey]) -> None:
        result = self.chain.lookup(keys)
        assert 0 <= result.count <= len(keys)
        assert not result.in_flight, "nothing can be in flight between steps"
        assert len(result.levels) == len(result.media) == result.count
        for key, level, medium in zip(keys, result.levels, result.media, strict=False):
            assert key in self.stored, f"lookup reported {key!r}, which was never stored"
            assert key in self.chain.levels[level].tier
            assert self.chain.levels[level].medium == medium
            assert all(key not in self.chain.levels[i].tier for i in range(level))
        if result.count < len(keys):
            missing = keys[result.count]
            assert all(missing not in level.tier for level in self.chain.levels)

    def draw_load_keys(self, data: st.DataObject) -> list[BlockKey]:
        """Mostly keys that were stored (so loads hit), sometimes any key."""
        hits = bool(self.stored) and data.draw(st.booleans())
        pool = sorted(self.stored) if hits else KEYS
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        keys = self.draw_load_keys(data)
        present = self.chain.lookup(keys).count
        try:
            loaded = self.run(self.load_and_check(keys))
        except BlockMissing:
            # Only a miss at the head, or a batch too big to promote into the entry tier.
            assert present == 0 or present > self.entry_capacity, (present, keys)
            event("load: miss")
            return
        if present <= self.entry_capacity:
            assert len(loaded) == present, (loaded, present)
        event(f"load: {len(loaded)} of {len(keys)}")

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def touch(self, keys: list[BlockKey]) -> None:
        before = [self.held(i) for i in range(len(self.chain.levels))]
        self.chain.touch(keys)
        assert [self.held(i) for i in range(len(self.chain.levels))] == before

    @rule()
    def flush(self) -> None:
        held = self.held_anywhere()
        done = self.run(self.chain.flush())
        assert done.copied >= 0
        assert done.left_dirty == sum(done.dirty.values()) >= 0
        # The last level ends up holding everything it can. (A block may still be dirty
        # at an upper level: copying into level i+1 may evict the clean copy of another
        # block there, which is then demoted, so a second flush need not copy nothing.)
        disk = self.chain.levels[2].tier
        if len(held) <= disk.num_blocks:
            assert held <= self.held(2), held - self.held(2)
        else:
            assert len(disk) == disk.num_blocks

    @rule()
    def audit(self) -> None:
        """Read every ready block of every level straight from its store."""

        async def audit() -> None:
            for level in self.chain.levels:
                keys = level.tier.ready_keys()
                assert set(keys) <= self.stored
                slots = level.tier.prepare_load(keys)
                try:
                    out = [bytearray(BLOCK) for _ in keys]
                    ok = await level.store.read(slots, keys, out)
                finally:
                    level.tier.complete_load(keys)
                assert all(ok), f"{level.tier.name}: unreadable ready blocks"
                for key, buf in zip(keys, out, strict=True):
                    assert bytes(buf) == content(key), f"{level.tier.name}: wrong bytes"

        self.run(audit())

    @rule(data=st.data(), count=st.integers(2, 5), spins=st.integers(0, 4))
    def concurrent(self, data: st.DataObject, count: int, spins: int) -> None:
        # A cancelled store may abandon the demotion of its victims: those blocks are
        # gone without being counted, so the conservation check skips this step.
        self.cancelled_step = True
        ops: list[tuple[str, list[BlockKey], bool]] = []
        for _ in range(count):
            kind = data.draw(st.sampled_from(["store", "load"]))
            keys = self.draw_load_keys(data) if kind == "load" else data.draw(small_store_lists)
            ops.append((kind, keys, data.draw(st.booleans())))
        for kind, keys, _ in ops:
            if kind == "store":
                self.stored.update(keys)

        async def one(kind: str, keys: list[BlockKey]) -> list[BlockKey]:
            if kind == "store":
                return await self.chain.store(keys, [content(k) for k in keys])
            return await self.load_and_check(keys)

        async def run_all() -> list[Any]:
            tasks = [asyncio.ensure_future(one(kind, keys)) for kind, keys, _ in ops]
            for _ in range(spins):
                await asyncio.sleep(0)
            for task, (_, _, cancel) in zip(tasks, ops, strict=True):
                if cancel:
                    task.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = self.run(run_all())
        for (kind, keys, _), result in zip(ops, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                event(f"concurrent: {kind} cancelled")
            elif kind == "store" and isinstance(result, CapacityError):
                event("concurrent: store capacity error")
            elif kind == "load" and isinstance(result, BlockMissing):
                event("concurrent: load miss")
            elif isinstance(result, BaseException):
                raise result
            elif kind == "store":
                assert set(result) <= set(keys)
            else:
                assert is_prefix(result, keys)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def idle_and_consistent(self) -> None:
        if self.chain_ is None:
            return
        self.chain.check_invariants(idle=True)
        held = self.held_anywhere()
        assert held <= self.stored, held - self.stored
        dropped = sum(level.dropped for level in self.chain.levels)
        if not self.cancelled_step:
            lost = self.held_before - held
            assert len(lost) <= dropped - self.dropped_before, (lost, self.dropped_before)
        self.held_before, self.dropped_before = held, dropped
        self.cancelled_step = False


# ~40 examples of ~20 steps under the default "ci" profile; more under "thorough".
# (settings() starts from the loaded profile, so its deadline and health checks apply.)
_PROFILE_EXAMPLES = settings().max_examples
_EXAMPLES = 40 if _PROFILE_EXAMPLES <= 60 else _PROFILE_EXAMPLES // 4
ChainMachine.TestCase.settings = settings(max_examples=_EXAMPLES, stateful_step_count=20)
TestChainMachine = ChainMachine.TestCase


# -- regressions the machine found, pinned down as plain tests ---------------------------------


def _three_tier_config(root: Path, caps: tuple[int, int, int]) -> dict[str, Any]:
    (root / "disk").mkdir()
    return {
        "block_bytes": BLOCK,
        "tiers": [
            {"name": "mem", "kind": "memory", "capacity": caps[0]},
            {"name": "cpu", "kind": "cpu", "capacity": caps[1]},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": caps[2],
                "directories": [str(root / "disk")],
            },
        ],
    }


async def _store(chain: TierChain, keys: list[BlockKey]) -> None:
    assert await chain.store(keys, [content(k) for k in keys]) == keys


async def test_keys_past_the_first_miss_do_not_take_room_from_the_prefix(tmp_path: Path) -> None:
    """load([a, b, x, c]) with a one level down, b and c at the top, x nowhere: the prefix
    is [a, b]. Pinning c (past the miss) used to leave no room to promote a: a miss."""
    a, b, c, x = (int_key(i) for i in (1, 2, 3, 4))
    async with tierd.open(_three_tier_config(tmp_path, (2, 4, 8))) as chain:
        await _store(chain, [a, b])
        await _store(chain, [c])  # evicts a -> cpu
        assert chain.lookup([a, b, x, c]).count == 2
        async with chain.loading([a, b, x, c]) as handle:
            assert handle.keys == [a, b]
            check_views(handle)
        chain.check_invariants(idle=True)


async def test_promoting_one_group_does_not_push_away_another_groups_source(
    tmp_path: Path,
) -> None:
    """load([d, c]) with d on disk and c in a full cpu tier: promoting d evicts at the top,
    the victim is demoted into the cpu tier, which used to evict c before its own promotion."""
    a, b, c, d, e, f = (int_key(i) for i in range(1, 7))
    async with tierd.open(_three_tier_config(tmp_path, (2, 2, 8))) as chain:
        await _store(chain, [d, a])
        await _store(chain, [c, b])  # d, a -> cpu
        await _store(chain, [e, f])  # c, b -> cpu, which demotes d, a to disk
        assert chain.lookup([d, c]).levels == (2, 1)
        async with chain.loading([d, c]) as handle:
            assert handle.keys == [d, c]
            check_views(handle)
        chain.check_invariants(idle=True)
