"""Reading back everything a full chain holds (issue 60, item 11).

A chain of 16 CPU blocks over 32 disk blocks holds 48 distinct blocks once stores have
filled it (evictions demote: nothing is written through). Reading them all back, oldest
first, a prefix at a time, promotes every disk hit into the CPU tier, whose eviction
demotes a CPU block to the disk, which must then make room: with the promoted blocks'
disk copies kept (a promotion copies), the disk used to evict the next blocks the
read-back was about to ask for (32 of 48 served). These tests count what is served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tierd
from tests.chain_kit import chain_config, content, cpu_over_disk, store_all
from tierd.chain import TierChain
from tierd.errors import BlockMissing
from tierd.events import EventKind
from tierd.keys import BlockKey, Medium, int_key
from tierd.policy import policy_names

CPU_BLOCKS, DISK_BLOCKS = 16, 32
HELD = CPU_BLOCKS + DISK_BLOCKS


def prefixes(count: int, size: int) -> list[list[BlockKey]]:
    """``count`` distinct prefixes of ``size`` blocks each, in the order stored."""
    return [[int_key(p * 1000 + i) for i in range(size)] for p in range(count)]


async def served(chain: TierChain, prefix: list[BlockKey]) -> int:
    """How many leading blocks of ``prefix`` one load serves, every byte checked."""
    try:
        handle = await chain.load(prefix)
    except BlockMissing:
        return 0
    try:
        for key, view in zip(handle.keys, handle.views(), strict=True):
            assert bytes(memoryview(view).cast("B")) == content(key), key
        return len(handle.keys)
    finally:
        handle.release()


async def read_back_all(chain: TierChain, stored: list[list[BlockKey]]) -> int:
    """Load every prefix, oldest first; the blocks served in all."""
    total = 0
    for prefix in stored:
        total += await served(chain, prefix)
        chain.check_invariants(idle=True)
    return total


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("size", [1, 4, 8, 16])
async def test_a_full_chain_serves_every_block_it_holds_read_back_oldest_first(
    tmp_path: Path, policy: str, size: int
) -> None:
    config = cpu_over_disk(tmp_path, CPU_BLOCKS, DISK_BLOCKS, policy=policy)
    config["tiers"][1]["policy"] = policy
    stored = prefixes(HELD // size, size)
    async with tierd.open(config) as chain:
        for prefix in stored:
            assert await store_all(chain, prefix) == prefix
        every = [key for prefix in stored for key in prefix]
        held = sum(key in level.tier for key in every for level in chain.levels)
        assert held == HELD  # both tiers full, no block in both: the chain holds all 48
        assert chain.lookup(every).count == HELD
        assert await read_back_all(chain, stored) == HELD


async def test_a_second_read_back_serves_everything_again(tmp_path: Path) -> None:
    """The swaps of one read-back leave the chain holding all 48 for the next one."""
    async with tierd.open(cpu_over_disk(tmp_path, CPU_BLOCKS, DISK_BLOCKS)) as chain:
        stored = prefixes(HELD // 4, 4)
        for prefix in stored:
            await store_all(chain, prefix)
        assert await read_back_all(chain, stored) == HELD
        assert await read_back_all(chain, stored) == HELD
        every = [key for prefix in stored for key in prefix]
        assert chain.lookup(every).count == HELD


async def test_a_demotion_drops_the_copy_of_a_promoted_block_before_a_unique_one(
    tmp_path: Path,
) -> None:
    """With room below for the promotion's own victim (no swap), the promoted block's
    disk copy stays; the next demotion into the full disk drops that copy, not the
    disk's least recent block, which is held nowhere else."""
    k1, k2, k3, k4, k5 = keys = [int_key(i) for i in range(1, 6)]
    async with tierd.open(cpu_over_disk(tmp_path, 2, 3)) as chain:
        cpu, disk = chain.levels
        await store_all(chain, [k1, k2])
        await store_all(chain, [k3, k4])  # k1, k2 demoted: the disk has one slot left
        assert await served(chain, [k1]) == 1  # copied up; k3 demoted into the last slot
        assert k1 in cpu.tier and k1 in disk.tier  # the promotion copied (no swap)
        await store_all(chain, [k5])  # k4 demoted into a full disk
        assert disk.copies_dropped == 1 and disk.dropped == 0
        assert k1 in cpu.tier and k1 not in disk.tier  # its copy made the room
        assert chain.lookup(keys).count == len(keys)  # k2, the disk's least recent, stayed
        for key in keys:
            assert await served(chain, [key]) == 1
        chain.check_invariants(idle=True)


async def test_a_promotion_into_a_full_chain_swaps_with_the_last_level(tmp_path: Path) -> None:
    """Both levels full, no copies: the promoted block leaves the disk for the CPU tier's
    victim, with the events of a move (removed below, stored above, and the victim the
    other way), and nothing is lost."""
    a, b, c, d = keys = [int_key(i) for i in range(1, 5)]
    async with tierd.open(cpu_over_disk(tmp_path, 2, 2)) as chain:
        cpu, disk = chain.levels
        await store_all(chain, [a, b])
        await store_all(chain, [c, d])  # a, b on the disk; c, d in the CPU tier
        events = chain.bus.subscribe()
        assert await served(chain, [a]) == 1
        got = [(e.kind, e.medium, e.keys) for batch in iter(events.get_nowait, None) for e in batch]
        assert got == [
            (EventKind.REMOVED, Medium.CPU, (c,)),  # the victim, least recent above
            (EventKind.REMOVED, Medium.DISK, (a,)),  # the promoted block's slot below ...
            (EventKind.STORED, Medium.DISK, (c,)),  # ... taken by the victim
            (EventKind.STORED, Medium.CPU, (a,)),
        ]
        assert disk.copies_dropped == 1 and disk.dropped == 0 and cpu.promotions == 1
        assert chain.lookup(keys).count == len(keys)
        for key in keys:
            assert await served(chain, [key]) == 1
        chain.check_invariants(idle=True)


async def test_concurrent_loads_of_a_swapped_prefix_read_the_disk_once(tmp_path: Path) -> None:
    """A second caller finds the swap's blocks in flight above and waits for them."""
    async with tierd.open(cpu_over_disk(tmp_path, 4, 4)) as chain:
        first, second = prefixes(2, 4)
        await store_all(chain, first)
        await store_all(chain, second)  # first on the disk, second in the CPU tier: full
        disk = chain.levels[1]
        read_before = disk.store.stats().bytes_read
        handles = await asyncio.gather(*(chain.load(first[:2]) for _ in range(3)))
        try:
            for handle in handles:
                assert handle.keys == first[:2]
                views = [bytes(memoryview(v).cast("B")) for v in handle.views()]
                assert views == [content(k) for k in first[:2]]
        finally:
            for handle in handles:
                handle.release()
        assert disk.store.stats().bytes_read - read_before == 2 * chain.block_bytes
        assert disk.copies_dropped == 2 and disk.dropped == 0
        chain.check_invariants(idle=True)
        every = first + second
        assert sum(key in level.tier for key in every for level in chain.levels) == len(every)


async def test_a_level_with_a_level_below_it_still_copies_on_promotion(tmp_path: Path) -> None:
    """Only the last level swaps (what it evicts is lost); a middle level's victims are
    demoted further down, so a promotion from it copies as ever."""
    config = chain_config(
        tmp_path,
        {"kind": "memory", "capacity": 2},
        {"kind": "cpu", "capacity": 2},
        {"kind": "disk", "capacity": 8},
    )
    keys = [int_key(i) for i in range(1, 7)]
    async with tierd.open(config) as chain:
        top, middle, _ = chain.levels
        for pair in (keys[0:2], keys[2:4], keys[4:6]):
            await store_all(chain, pair)  # 1, 2 end on the disk; 3, 4 in the middle
        assert await served(chain, [keys[2]]) == 1
        assert keys[2] in middle.tier and keys[2] in top.tier  # copied, not moved
        assert middle.copies_dropped == 0
        assert chain.lookup(keys).count == len(keys)
        chain.check_invariants(idle=True)
