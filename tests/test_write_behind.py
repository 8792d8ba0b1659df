"""Write-behind (``write_behind: true`` on a tier): blocks a client stores are copied down
in the background, so that a later store into the full tier evicts clean blocks (drops)
instead of waiting for a demotion to the disk.

Real chains over a real disk tier in ``tmp_path``; the daemon case is a real ``tierd
serve`` process on a real socket. A held disk write (the disk store's own ``_write``
waiting at a gate) is how a slow disk is made: the store beside it must not wait for it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError
from write_behind_kit import BLOCK, block, chain_at, chain_config, held_disk_writes

from tierd.client import Client
from tierd.config.chain import ChainConfig
from tierd.library import open_chain
from tierd.testing import daemon_config, start_daemon


async def until(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether ``check`` came true within ``seconds`` (polled; bounded)."""
    for _ in range(int(seconds / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


async def test_stored_blocks_go_down_behind_and_leave_as_drops(tmp_path: Path) -> None:
    async with chain_at(tmp_path) as chain:
        cpu, disk = chain.levels
        first = [b"a%d" % i for i in range(8)]
        await chain.store(first, [block(k) for k in first])
        assert await until(lambda: cpu.written_behind == 8)
        assert all(k in disk.tier for k in first)
        later = [b"b%d" % i for i in range(8)]
        await chain.store(later, [block(k) for k in later])  # evicts all of the first
        assert cpu.demotions == 0 and cpu.dropped == 0  # each was clean: a drop
        assert await until(lambda: cpu.written_behind == 16)
        for key in first + later:  # every block, from whichever tier holds it
            async with chain.loading([key]) as handle:
                out = [bytearray(BLOCK)]
                assert await handle.read_into([memoryview(out[0])]) == [True]
                assert bytes(out[0]) == block(key)
        chain.check_invariants(idle=True)


@pytest.mark.parametrize("behind", [True, False])
async def test_a_store_into_the_full_tier_waits_for_no_disk_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, behind: bool
) -> None:
    """The tier is full of blocks already copied down; the disk then stops writing. With
    write-behind a store evicts them at once; without it, it waits on the disk."""
    async with chain_at(tmp_path, behind=behind) as chain:
        cpu, _disk = chain.levels
        first = [b"a%d" % i for i in range(8)]
        await chain.store(first, [block(k) for k in first])
        if behind:
            assert await until(lambda: cpu.written_behind == 8)
        _writing, gate = held_disk_writes(monkeypatch)
        later = [b"b%d" % i for i in range(4)]
        store = asyncio.ensure_future(chain.store(later, [block(k) for k in later]))
        try:
            done, _ = await asyncio.wait([store], timeout=2)
            assert bool(done) is behind
        finally:
            gate.set()
        assert await store == later
        if behind:
            assert await until(lambda: cpu.written_behind == 12)  # the disk went on


async def test_a_store_that_needs_the_pinned_batch_waits_for_it_not_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch being copied behind is pinned; a store that needs every slot of the tier
    waits for the batch to end and then goes in (it was refused with ``capacity``)."""
    async with chain_at(tmp_path) as chain:
        cpu, disk = chain.levels
        writing, gate = held_disk_writes(monkeypatch)
        first = [b"p0", b"p1"]
        await chain.store(first, [block(k) for k in first])
        await asyncio.wait_for(writing.wait(), 10)  # the batch is pinned, its write held
        assert cpu.tier.stats().pinned == 2
        whole = [b"w%d" % i for i in range(8)]
        store = asyncio.ensure_future(chain.store(whole, [block(k) for k in whole]))
        await asyncio.sleep(0.2)
        assert not store.done()  # waiting for the batch, not refused
        gate.set()
        assert await asyncio.wait_for(store, 30) == whole
        assert cpu.demotions == 0 and all(k in disk.tier for k in first)


async def test_a_flush_waits_for_the_copy_behind_and_leaves_nothing_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with chain_at(tmp_path) as chain:
        _cpu, disk = chain.levels
        writing, gate = held_disk_writes(monkeypatch)
        keys = [b"f%d" % i for i in range(6)]
        await chain.store(keys, [block(k) for k in keys])
        await asyncio.wait_for(writing.wait(), 10)  # a copy behind is under way, held
        flush = asyncio.ensure_future(chain.flush())
        await asyncio.sleep(0.2)
        assert not flush.done()  # it waits for the copy under way
        gate.set()
        result = await asyncio.wait_for(flush, 30)
        assert result.dirty == {} and all(k in disk.tier for k in keys)
        chain.check_invariants(idle=True)


async def test_nothing_goes_behind_where_the_tier_below_has_an_admission_rule(
    tmp_path: Path,
) -> None:
    """A rule decides at eviction, when a block's uses are known."""
    async with chain_at(tmp_path, admission="reuse>=2") as chain:
        cpu, disk = chain.levels
        keys = [b"r%d" % i for i in range(4)]
        await chain.store(keys, [block(k) for k in keys])
        assert not await until(lambda: cpu.written_behind > 0, seconds=0.3)
        assert len(disk.tier) == 0


def test_write_behind_needs_a_tier_below_and_not_write_through(tmp_path: Path) -> None:
    last = chain_config(tmp_path)
    last["tiers"][1]["write_behind"] = True
    with pytest.raises(ValidationError, match="no tier below"):
        ChainConfig.model_validate(last)
    both = chain_config(tmp_path)
    both["tiers"][0]["write_through"] = True
    with pytest.raises(ValidationError, match="write_through copies every block"):
        ChainConfig.model_validate(both)


async def test_the_daemon_copies_behind_and_says_so(tmp_path: Path) -> None:
    """A real ``tierd serve``: stores over its socket are copied down behind them,
    counted in ``stats`` and on the metrics' text."""
    config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64)
    config["tiers"][0]["write_behind"] = True
    child = start_daemon(config, env=dict(os.environ), log=tmp_path / "tierd.log", timeout_s=60)
    try:
        async with await Client.connect(str(child.socket), namespace="wb") as client:
            keys = [b"d%d" % i for i in range(16)]

            async def behind(count: int) -> bool:
                for _ in range(1000):  # bounded: 10 s
                    tiers = (await client.stats())["tiers"]
                    if tiers[0]["written_behind"] >= count:
                        break
                    await asyncio.sleep(0.01)
                return bool(tiers[0]["written_behind"] == count)

            for start in (0, 4):
                part = keys[start : start + 4]
                await client.store(part, [block(k) for k in part])
                assert await behind(start + 4)
            await client.store(keys[8:], [block(k) for k in keys[8:]])  # evicts the first 8
            assert await behind(16)
            cpu, disk = (await client.stats())["tiers"]
            assert cpu["demotions"] == 0 and disk["stores"] == 16  # each written down once
            assert "tierd_tier_written_behind" in await client.metrics()
            for part in (keys[:8], keys[8:]):  # from the disk tier, then the CPU tier
                assert await client.load(part) == [block(k) for k in part]
    finally:
        child.stop()


async def test_three_levels_copy_behind_and_demote_below_without_losing_a_block(
    tmp_path: Path,
) -> None:
    """A write-behind top level over a small middle one: the copies behind fill the
    middle level, whose evictions demote to the disk while the top keeps storing."""
    config = chain_config(tmp_path)
    config["tiers"].insert(
        0, {"name": "top", "kind": "memory", "capacity": 8, "write_behind": True}
    )
    config["tiers"][1]["write_behind"] = False
    async with asyncio.timeout(60), open_chain(config) as chain:
        top, _middle, disk = chain.levels
        keys = [b"t%d" % i for i in range(32)]
        for start in range(0, 32, 4):
            part = keys[start : start + 4]
            await chain.store(part, [block(k) for k in part])
        assert await until(lambda: top.written_behind + top.demotions >= 32 - 8)
        await chain.flush()
        assert all(k in disk.tier for k in keys)
        for key in keys:
            async with chain.loading([key]) as handle:
                out = bytearray(BLOCK)
                assert await handle.read_into([memoryview(out)]) == [True]
                assert bytes(out) == block(key)
        chain.check_invariants(idle=True)


@pytest.mark.parametrize("behind", [True, False], ids=["write-behind", "no-write-behind"])
async def test_the_disk_tiers_stored_events_come_once_from_whichever_copies_down(
    tmp_path: Path, behind: bool
) -> None:
    """The README said `tierd flush` emits the disk tier's `stored DISK` events; with
    `write_behind` (the shipped config) it emitted none. By design: each block is stored
    on the disk tier once, so it is announced once, by the copy that stores it there. With
    write-behind that copy runs right after the client's store, so the events come then
    (before any flush), and a flush that then finds nothing dirty copies and announces
    nothing; without it, the flush's copies store the blocks, and emit the events. Either
    way every block's `stored DISK` event comes, exactly once, through the subscription
    (the client's, as `tierd events` reads it)."""
    config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64)
    config["tiers"][0]["write_behind"] = behind
    child = start_daemon(config, env=dict(os.environ), log=tmp_path / "tierd.log", timeout_s=60)
    try:
        watcher = await Client.connect(str(child.socket))  # the operator: every namespace
        await watcher.subscribe()
        stored: list[tuple[str, bytes]] = []  # (medium, client key), in the order announced
        pushes = watcher.events()

        async def until_stored(medium: str, keys: list[bytes]) -> None:
            """Read pushes until every key of ``keys`` was stored on ``medium`` (bounded)."""
            async with asyncio.timeout(10):
                while not {(medium, k) for k in keys} <= set(stored):
                    push = await anext(pushes)
                    for event in push["events"]:
                        if event["kind"] == "stored":
                            stored.extend((event["medium"], bytes(k)[8:]) for k in event["keys"])

        async with await Client.connect(str(child.socket), namespace="ev") as client:
            keys = [b"e%d" % i for i in range(4)]
            await client.store(keys, [block(k) for k in keys])
            await until_stored("CPU", keys)
            if behind:
                await until_stored("DISK", keys)  # copied behind the store: no flush yet
            flushed = await watcher.flush()
            assert (flushed.copied, flushed.dirty) == (0 if behind else len(keys), 0), flushed
            marker = [b"marker"]  # stored after the flush: its events end the flush's
            await client.store(marker, [block(marker[0])])
            await until_stored("CPU", marker)
            await until_stored("DISK", keys)  # without write-behind: the flush's copies
        disk = [key for medium, key in stored if medium == "DISK" and key in keys]
        assert sorted(disk) == sorted(keys)  # each block's stored DISK event, once
        await watcher.close()
    finally:
        child.stop()
