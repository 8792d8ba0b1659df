"""The tier chain through its public API: demotion, promotion, events, failures."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from chain_kit import chain_config, content, cpu_over_disk, keys_of, read_back, store_all

import tierd
from tierd.errors import BlockMissing, CapacityError
from tierd.events import EventKind, TierEvent
from tierd.keys import Medium, int_key
from tierd.policy import policy_names


def bytes_of(view: Any) -> bytes:
    try:
        return bytes(memoryview(view).cast("B"))
    except TypeError:
        return bytes(view.cpu().numpy().tobytes())


THREE_TIERS = [
    pytest.param(("gpu", "cpu", "disk"), id="gpu-cpu-disk"),
    pytest.param(("memory", "cpu", "disk"), id="memory-cpu-disk"),
    pytest.param(("cpu", "disk"), id="cpu-disk"),
]


@pytest.mark.parametrize("kinds", THREE_TIERS)
@pytest.mark.parametrize("policy", policy_names())
async def test_pressure_demotes_to_disk_and_promotion_returns_identical_bytes(
    tmp_path: Path, kinds: tuple[str, ...], policy: str
) -> None:
    capacities = {"gpu": 4, "memory": 4, "cpu": 8, "disk": 64}
    specs = [{"kind": k, "capacity": capacities[k], "policy": policy} for k in kinds]
    async with tierd.open(chain_config(tmp_path, *specs)) as chain:
        keys = keys_of(*range(40))
        for i in range(0, len(keys), 4):
            assert await store_all(chain, keys[i : i + 4]) == keys[i : i + 4]
        chain.check_invariants(idle=True)
        found = chain.lookup(keys)
        assert found.count == len(keys)
        assert Medium.DISK in found.media
        top = chain.levels[0]
        assert len(top.tier) == top.tier.num_blocks
        # Every block comes back to the top, byte for byte, a few at a time.
        for i in range(0, len(keys), 2):
            pair = keys[i : i + 2]
            async with chain.loading(pair, chain.levels[0].medium) as handle:
                assert handle.keys == pair
                for key, view in zip(handle.keys, handle.views(), strict=True):
                    assert bytes_of(view) == content(key)
            chain.check_invariants(idle=True)
        assert sum(level.promotions for level in chain.levels) > 0
        assert sum(level.demotions for level in chain.levels) > 0


async def test_exact_event_sequence(tmp_path: Path) -> None:
    config = chain_config(
        tmp_path, {"kind": "memory", "capacity": 2}, {"kind": "disk", "capacity": 4}
    )
    async with tierd.open(config) as chain:
        events = chain.bus.subscribe()
        a, b, c = keys_of(1, 2, 3)
        await store_all(chain, [a, b])
        await store_all(chain, [c])  # evicts a (least recent) -> demoted to disk
        async with chain.loading([a]):  # promoted back; evicts b -> demoted
            pass
        got: list[TierEvent] = []
        while (batch := events.get_nowait()) is not None:
            got.extend(batch)
        seen = [(e.kind, e.medium, e.keys) for e in got]
        assert seen == [
            (EventKind.STORED, Medium.MEMORY, (a, b)),
            (EventKind.REMOVED, Medium.MEMORY, (a,)),
            (EventKind.STORED, Medium.DISK, (a,)),
            (EventKind.STORED, Medium.MEMORY, (c,)),
            (EventKind.REMOVED, Medium.MEMORY, (b,)),
            (EventKind.STORED, Medium.DISK, (b,)),
            (EventKind.STORED, Medium.MEMORY, (a,)),
        ]
        assert {e.tier for e in got} == {"memory0", "disk1"}


async def test_demotion_is_removed_above_and_stored_below(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 1, 2)
    async with tierd.open(config) as chain:
        events = chain.bus.subscribe()
        a, b = keys_of(10, 11)
        await store_all(chain, [a])
        await store_all(chain, [b])
        got = [e for batch in iter(events.get_nowait, None) for e in batch]
        assert (EventKind.REMOVED, Medium.CPU, (a,)) in [(e.kind, e.medium, e.keys) for e in got]
        assert (EventKind.STORED, Medium.DISK, (a,)) in [(e.kind, e.medium, e.keys) for e in got]
        assert chain.levels[0].demotions == 1
        result = chain.lookup([a, b])
        assert result.media == (Medium.DISK, Medium.CPU)


async def test_clean_block_is_dropped_not_copied_again(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 2, 8, write_through=True)
    async with tierd.open(config) as chain:
        keys = keys_of(1, 2, 3, 4)
        await store_all(chain, keys[:2])
        assert all(k in chain.levels[1].tier for k in keys[:2])  # written through
        disk_route = chain.transfer.stats()[(Medium.CPU, Medium.DISK)]
        await store_all(chain, keys[2:])  # evicts two clean blocks
        after = chain.transfer.stats()[(Medium.CPU, Medium.DISK)]
        assert after.blocks - disk_route.blocks == 2  # only the write-through of keys[2:]
        assert chain.levels[0].demotions == 0
        for key in keys:
            await read_back(chain, [key])


async def test_admission_reuse_rule_refuses_cold_blocks(tmp_path: Path) -> None:
    config = chain_config(
        tmp_path,
        {"kind": "memory", "capacity": 2},
        {"kind": "disk", "capacity": 8, "admission": "reuse>=2"},
    )
    async with tierd.open(config) as chain:
        hot, cold, x, y = keys_of(1, 2, 3, 4)
        await store_all(chain, [hot, cold])
        chain.lookup([hot, cold])  # a query: no use
        chain.touch([hot])
        chain.touch([hot])  # hot: used by two requests; cold: by none
        await store_all(chain, [x, y])  # evicts both
        assert hot in chain.levels[1].tier
        assert cold not in chain.levels[1].tier
        assert chain.levels[1].refused == 1
        assert chain.levels[0].dropped == 1


async def test_lookup_reports_in_flight_and_levels(tmp_path: Path) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": 4})
    async with tierd.open(config) as chain:
        a, b = keys_of(1, 2)
        await store_all(chain, [a])
        plan = chain.levels[0].tier.prepare_store([b])  # a writer mid-flight
        assert plan is not None
        result = chain.lookup([a, b])
        assert (result.count, result.levels, result.in_flight) == (1, (0,), True)
        chain.levels[0].tier.complete_store([b], success=False)
        assert chain.lookup([a, b]).in_flight is False


async def test_concurrent_promotions_read_the_lower_tier_once(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 4, 8)
    async with tierd.open(config) as chain:
        keys = keys_of(*range(8))
        await store_all(chain, keys[:4])
        await store_all(chain, keys[4:])  # keys[:4] now only on disk
        before = chain.transfer.stats()[(Medium.DISK, Medium.CPU)].blocks
        handles = await asyncio.gather(*(chain.load(keys[:2]) for _ in range(3)))
        after = chain.transfer.stats()[(Medium.DISK, Medium.CPU)].blocks
        assert after - before == 2
        for handle in handles:
            assert handle.keys == keys[:2]
            assert [bytes_of(v) for v in handle.views()] == [content(k) for k in keys[:2]]
            handle.release()
        chain.check_invariants(idle=True)


async def test_pinned_blocks_block_stores_with_capacity_error(tmp_path: Path) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": 2})
    async with tierd.open(config) as chain:
        keys = keys_of(1, 2, 3)
        await store_all(chain, keys[:2])
        async with chain.loading(keys[:2]):
            with pytest.raises(CapacityError):
                await store_all(chain, keys[2:])
            chain.check_invariants()
        assert await store_all(chain, keys[2:]) == keys[2:]
        chain.check_invariants(idle=True)


async def test_load_stops_at_first_missing_key(tmp_path: Path) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": 4})
    async with tierd.open(config) as chain:
        a, b, c = keys_of(1, 2, 3)
        await store_all(chain, [a, c])
        async with chain.loading([a, b, c]) as handle:
            assert handle.keys == [a]
        with pytest.raises(BlockMissing):
            await chain.load([b])
        chain.check_invariants(idle=True)


async def test_flush_writes_dirty_blocks_down_and_clear_drops_them(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 4, 8)
    async with tierd.open(config) as chain:
        keys = keys_of(1, 2, 3)
        await store_all(chain, keys)
        first, second = await chain.flush(), await chain.flush()
        assert (first.copied, first.left_dirty, first.reason) == (3, 0, "")
        assert (second.copied, second.left_dirty) == (0, 0)
        assert chain.clear(0) == 3
        assert chain.lookup(keys).media == (Medium.DISK,) * 3
        await read_back(chain, keys)


async def test_cancelled_load_releases_every_pin(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 4, 16)
    async with tierd.open(config) as chain:
        keys = keys_of(*range(12))
        for i in range(0, 12, 4):
            await store_all(chain, keys[i : i + 4])
        for _ in range(5):
            task = asyncio.create_task(chain.load(keys[:4]))
            await asyncio.sleep(0)
            task.cancel()
            try:
                handle = await task
            except asyncio.CancelledError:
                pass
            else:
                handle.release()
            chain.check_invariants(idle=True)
        await read_back(chain, keys[:4])


async def test_disk_tier_survives_reopen(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 2, 8)
    keys = keys_of(*range(6))
    async with tierd.open(config) as chain:
        for i in range(0, 6, 2):
            await store_all(chain, keys[i : i + 2])
        await chain.flush()
    async with tierd.open(config) as chain:
        assert chain.lookup(keys).count == len(keys)
        for i in range(0, 6, 2):
            await read_back(chain, keys[i : i + 2])


# -- two-phase stores ------------------------------------------------------------------------


async def test_begin_store_writes_in_place_and_commit_makes_blocks_ready(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 8, 16, write_through=True)
    async with tierd.open(config) as chain:
        await store_all(chain, keys_of(1))
        handle = await chain.begin_store(keys_of(1, 2, 3))
        assert handle.keys == keys_of(2, 3)  # 1 is held already
        result = chain.lookup(keys_of(1, 2, 3))
        assert (result.count, result.in_flight) == (1, True)
        for key, view in zip(handle.keys, handle.views(), strict=True):
            memoryview(view).cast("B")[:] = content(key)
        assert await handle.commit() == keys_of(2, 3)
        assert await handle.commit() == []  # finished once
        assert chain.lookup(keys_of(1, 2, 3)).count == 3
        assert chain.levels[1].tier.lookup(keys_of(1, 2, 3)) == 3  # write-through ran
        await read_back(chain, keys_of(1, 2, 3))
        chain.check_invariants(idle=True)


async def test_aborted_store_frees_slots_and_wakes_waiting_loads(tmp_path: Path) -> None:
    async with tierd.open(chain_config(tmp_path, {"kind": "cpu", "capacity": 2})) as chain:
        handle = await chain.begin_store(keys_of(1, 2))
        waiter = asyncio.create_task(chain.load(keys_of(1)))
        await asyncio.sleep(0)
        assert not waiter.done()  # the load waits for the block in flight
        handle.abort()
        with pytest.raises(BlockMissing):
            await waiter
        assert chain.lookup(keys_of(1, 2)).count == 0
        assert await store_all(chain, keys_of(3, 4)) == keys_of(3, 4)  # both slots free again
        chain.check_invariants(idle=True)


async def test_commit_with_per_key_flags_keeps_only_written_blocks(tmp_path: Path) -> None:
    async with tierd.open(chain_config(tmp_path, {"kind": "cpu", "capacity": 4})) as chain:
        handle = await chain.begin_store(keys_of(1, 2))
        memoryview(handle.views()[0]).cast("B")[:] = content(int_key(1))
        assert await handle.commit([True, False]) == keys_of(1)
        assert chain.lookup(keys_of(1, 2)).count == 1
        bad = await chain.begin_store(keys_of(5, 6))
        with pytest.raises(ValueError, match="2 flags"):
            await bad.commit([True])
        assert chain.lookup(keys_of(5)).count == 0  # a malformed commit aborts
        chain.check_invariants(idle=True)


async def test_begin_store_without_room_raises_and_changes_nothing(tmp_path: Path) -> None:
    async with tierd.open(chain_config(tmp_path, {"kind": "cpu", "capacity": 2})) as chain:
        held = await chain.begin_store(keys_of(1, 2))
        with pytest.raises(CapacityError):
            await chain.begin_store(keys_of(3))
        held.abort()
        chain.check_invariants(idle=True)


async def test_load_of_more_blocks_than_the_level_holds_returns_the_leading_ones(
    tmp_path: Path,
) -> None:
    config = cpu_over_disk(tmp_path, 4, 32)
    async with tierd.open(config) as chain:
        keys = keys_of(*range(8))
        for i in range(0, 8, 4):
            await store_all(chain, keys[i : i + 4])  # 0-3 end up on disk only
        async with chain.loading(keys) as handle:
            assert handle.keys == keys[:4]
            for key, view in zip(handle.keys, handle.views(), strict=True):
                assert bytes(memoryview(view).cast("B")) == content(key)
        chain.check_invariants(idle=True)


async def test_a_level_is_named_by_its_medium_in_either_case(tmp_path: Path) -> None:
    """``into="cpu"`` names the CPU level as ``Medium.CPU`` does (the GPU probe's first
    run on a GPU failed with "no level on medium 'cpu'"); a medium with no level says so."""
    config = chain_config(
        tmp_path, {"kind": "memory", "capacity": 4}, {"kind": "cpu", "capacity": 4}
    )
    async with tierd.open(config) as chain:
        keys = keys_of(1, 2)
        await store_all(chain, keys)
        for into in ("cpu", "Cpu", Medium.CPU):
            await read_back(chain, keys, into)
        with pytest.raises(ValueError, match="no level on medium 'disk'"):
            await chain.load(keys, into="disk")
        chain.check_invariants(idle=True)


async def test_a_release_in_pieces_unpins_every_key_even_when_cancelled(tmp_path: Path) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": 16})
    async with tierd.open(config) as chain:
        keys = keys_of(*range(10))
        await store_all(chain, keys)
        whole = await chain.load(keys)
        await whole.release_in_pieces(3)  # four pieces, a turn of the loop between them
        assert chain.levels[0].tier.stats().pinned == 0
        handle = await chain.load(keys)
        task = asyncio.get_running_loop().create_task(handle.release_in_pieces(3))
        await asyncio.sleep(0)  # the first piece is unpinned, then the task waits a turn
        assert 0 < chain.levels[0].tier.stats().pinned < len(keys)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert chain.levels[0].tier.stats().pinned == 0  # the rest, at once
        handle.release()  # a no-op now
        chain.check_invariants(idle=True)
