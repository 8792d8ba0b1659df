"""The pieces under the namespace operations and reload, without a daemon: the chain's
``delete`` across levels (pinned and in-flight keys kept whole, invariants intact, a disk
tier that forgets), the metrics' bound on namespace label sets, how a reload sorts
changed config paths into live and restart-only, the chain's census of blocks per
namespace (kept from its events, counted again after blocks came in without one), and
the book of names (bounded, written once per burst).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import tierd
from tests.chain_kit import chain_config, content, cpu_over_disk, keys_of, store_all
from tierd.chain import TierChain
from tierd.config import DaemonConfig
from tierd.control.figures.namespaces import NAMES_FILE, NamespaceBook
from tierd.control.figures.prometheus import OTHER, top_namespaces
from tierd.control.protocol import NAMESPACE_ID_BYTES
from tierd.daemon.reload import plan_reload
from tierd.errors import ConfigError
from tierd.events import EventKind
from tierd.keys import BlockKey
from tierd.testing import daemon_config


async def store_in_twos(chain: TierChain, keys: list[BlockKey]) -> None:
    """Stores ``keys`` two at a time (a small CPU tier demotes the older ones to disk),
    then flushes what is dirty."""
    for start in range(0, len(keys), 2):
        await store_all(chain, keys[start : start + 2])
    await chain.flush()


async def test_delete_removes_every_copy_and_keeps_busy_keys_whole(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 4, 16)
    keys = keys_of(*range(8))
    async with tierd.open(config) as chain:
        await store_in_twos(chain, keys)  # the last four in both tiers (clean), the rest on disk
        events = chain.bus.subscribe()
        pinned_low = keys[0]  # only on the disk tier
        async with chain.loading([pinned_low, keys[1]], into=None):
            # A load promotes and pins; while it holds them the keys stay whole.
            handle = await chain.begin_store([keys_of(99)[0]])  # a key being written
            done = chain.delete([*keys, keys_of(99)[0], keys_of(77)[0]])
            assert (done.removed, done.busy) == (6, 3)
            chain.check_invariants()
            for key in (pinned_low, keys[1]):
                assert chain.lookup([key]).count == 1
            assert chain.lookup(keys[2:]).count == 0
            handle.abort()
        chain.check_invariants(idle=True)
        removed: set[bytes] = set()
        while (batch := events.get_nowait()) is not None:
            removed.update(k for e in batch if e.kind is EventKind.REMOVED for k in e.keys)
        assert set(keys[2:]) <= removed
        again = chain.delete(keys)
        assert (again.removed, again.busy) == (2, 0)
        chain.check_invariants(idle=True)
        assert all(level.tier.stats().used == 0 for level in chain.levels)
    async with tierd.open(config) as chain:  # the disk tier forgot them all
        assert chain.levels[1].tier.stats().used == 0


def rows(*sizes: int) -> list[dict[str, Any]]:
    return [
        {
            "namespace": f"ns-{i}",
            "id": f"{i:016x}",
            "blocks": {"cpu": size},
            "bytes": size * 10,
            "lookups": 1,
            "hit_blocks": size,
            "miss_blocks": 0,
            "stored_blocks": size,
        }
        for i, size in enumerate(sizes)
    ]


def test_metrics_keep_the_top_namespaces_and_one_other_per_tenant() -> None:
    tenants = {"a": {"namespaces": rows(5, 50, 1, 2)}, "b": {"namespaces": rows(40, 3)}}
    shown = top_namespaces(tenants, 2)
    assert [(t, label) for t, label, _ in shown] == [
        ("a", "ns-1"),
        ("b", "ns-0"),
        ("a", OTHER),
        ("b", OTHER),
    ]
    other_a = shown[2][2]
    assert other_a["bytes"] == (5 + 1 + 2) * 10 and other_a["blocks"] == {"cpu": 8}
    assert sum(row["stored_blocks"] for _, _, row in shown) == 5 + 50 + 1 + 2 + 40 + 3
    # A thousand namespaces still make top + one series per tenant.
    many = {"a": {"namespaces": rows(*range(1000))}}
    assert len(top_namespaces(many, 20)) == 21


def cfg(tmp_path: Path, **sections: Any) -> DaemonConfig:
    socket = str(tmp_path / "s.sock")  # never bound: the configs only compare
    return DaemonConfig.model_validate(daemon_config(tmp_path, socket_path=socket, **sections))


def test_reload_sorts_changes_into_live_and_restart(tmp_path: Path) -> None:
    running = cfg(tmp_path)
    new = cfg(tmp_path, limits={"load_wait_s": 1}, logging={"level": "debug"})
    new.tiers[1] = new.tiers[1].model_copy(update={"admission": "reuse>=2", "capacity": 99})
    plan = plan_reload(running, new)
    assert set(plan.applied) == {"limits.load_wait_s", "logging.level", "tiers.disk.admission"}
    assert plan.restart == ("tiers.disk.capacity",)
    assert plan.config.tiers[1].capacity == 64 and plan.config.tiers[1].admission == "reuse>=2"
    assert plan.config.limits.load_wait_s == 1
    renamed = cfg(tmp_path)
    renamed.tiers[1] = renamed.tiers[1].model_copy(update={"name": "nvme", "admission": "reuse>=2"})
    plan = plan_reload(running, renamed)
    # The tiers no longer line up: nothing of them changes live.
    assert plan.applied == () and plan.restart == ("tiers",)
    assert plan.config.tiers[1].admission == running.tiers[1].admission


def test_reload_refuses_live_values_that_do_not_fit_what_keeps_running(tmp_path: Path) -> None:
    running = cfg(tmp_path, block_bytes=256 << 10)
    new = cfg(tmp_path, block_bytes=4096, limits={"max_frame_bytes": 100_000})
    with pytest.raises(ConfigError, match="max_frame_bytes"):
        plan_reload(running, new)


async def test_cleared_disk_blocks_do_not_come_back_after_a_reopen(tmp_path: Path) -> None:
    config = cpu_over_disk(tmp_path, 2, 8)
    keys = keys_of(*range(4))
    async with tierd.open(config) as chain:
        await store_in_twos(chain, keys)
        assert chain.clear(1) == 4
    async with tierd.open(config) as chain:
        assert chain.levels[1].tier.stats().used == 0
        assert chain.lookup(keys).count == 0


# -- the census of blocks per namespace, and the book of names --------------------------


def ns_key(namespace: int, i: int) -> BlockKey:
    return BlockKey(namespace.to_bytes(NAMESPACE_ID_BYTES, "big") + i.to_bytes(8, "big"))


def truth(chain: TierChain) -> list[dict[bytes, int]]:
    """Ready blocks per level by namespace, counted the slow way."""
    return [
        dict(Counter(k[:NAMESPACE_ID_BYTES] for k in level.tier.ready_keys()))
        for level in chain.levels
    ]


async def test_the_census_follows_stores_evictions_demotions_deletes_and_clears(
    tmp_path: Path,
) -> None:
    config = cpu_over_disk(tmp_path, 8, 24)
    async with tierd.open(config) as chain:
        census = chain.prefix_census(NAMESPACE_ID_BYTES)
        seen = lambda: [dict(census.counts(i)) for i in range(len(chain.levels))]  # noqa: E731
        for namespace in (1, 2, 3):  # 30 blocks through 8 slots: evictions and demotions
            for i in range(0, 10, 2):
                await chain.store(
                    [ns_key(namespace, i), ns_key(namespace, i + 1)],
                    [content(ns_key(namespace, i)), content(ns_key(namespace, i + 1))],
                )
                assert seen() == truth(chain)
        async with chain.loading([ns_key(1, 0)]):  # a promotion from the disk tier
            assert seen() == truth(chain)
        chain.delete([ns_key(2, i) for i in range(10)])
        assert seen() == truth(chain)
        assert census.held(0, (2).to_bytes(NAMESPACE_ID_BYTES, "big")) == 0
        chain.clear(0)
        assert seen() == truth(chain)
        assert census.recounts == len(chain.levels)  # once each, at the start: no pass since


async def test_the_census_counts_a_level_again_when_blocks_came_in_without_an_event(
    tmp_path: Path,
) -> None:
    config = chain_config(tmp_path, {"kind": "disk", "capacity": 16})
    async with tierd.open(config) as chain:
        await chain.store([ns_key(1, i) for i in range(6)], [content(ns_key(1, 0))] * 6)
    config["tiers"][0]["adopt_inline"] = 0  # the restart adopts them in the background
    async with tierd.open(config) as chain:
        census = chain.prefix_census(NAMESPACE_ID_BYTES)  # before adoption: none counted
        assert chain.levels[0].tier.adopting == 6
        await chain.store([ns_key(2, 0)], [content(ns_key(2, 0))])
        adopting = [t for t in asyncio.all_tasks() if t.get_name().startswith("adopt-")]
        if adopting:  # it may have ended while the store awaited its write
            await asyncio.wait(adopting)
        assert chain.levels[0].tier.adopting == 0  # adopted, without an event
        assert [dict(census.counts(0))] == truth(chain)
        assert truth(chain) == [{ns_key(1, 0)[:8]: 6, ns_key(2, 0)[:8]: 1}]
        assert census.recounts == 2  # at the start, and once after the adoption


async def test_the_book_writes_a_burst_of_names_once_at_close_and_refuses_past_its_bound(
    tmp_path: Path,
) -> None:
    path = tmp_path / NAMES_FILE
    book = NamespaceBook(path, max_names=50, write_delay_s=3600.0)  # no timer fires here
    for i in range(50):
        assert book.refusal(f"ns-{i}", bytes([i]) * 8) is None
        book.learn(f"ns-{i}", bytes([i]) * 8)
    assert book.writes == 0 and not path.exists()  # learning costs the loop no file work
    refusal = book.refusal("one-more", b"\xff" * 8)
    assert refusal is not None and "limits.namespaces_per_tenant" in refusal
    assert book.refusal("ns-7", bytes([7]) * 8) is None  # a known name is never refused
    await book.close()
    assert book.writes == 1
    again = NamespaceBook(path)
    assert again.names == book.names and len(again.names) == 50
