"""One tenant cannot hold the event loop that every tenant shares (issue 34, 4 to 6).

Each test reproduces what a client could do before, through a daemon run in the test's
event loop (``running_daemon``) on a real socket, and checks it by order or by counting
turns of the loop, never by time:

- a 4,096-key load held the loop for all of its keys at once (and, by a set rebuilt per
  key, for about a second): another client's request sent behind it now gets its answer
  first;
- ``delete --all`` walked the whole index of the tenant in one go: it now walks 4,096
  keys per turn, and a coroutine beside it gets a turn for every slice;
- ``namespaces`` and ``stats`` with namespaces counted every tier's index on each
  request: they now read the chain's census, and answer without any index pass;
- every hello with a new namespace name rewrote the names file, on the loop, and the
  names grew without bound: a new name past ``limits.namespaces_per_tenant`` is refused
  (``too_many_namespaces``), and a burst of new names is written in one go, off the loop,
  and whole at a clean stop.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import threading
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
from loop_turns_kit import BLOCK, answered_first, connect, names, rows_of, turns_given

from tierd.client import Client, DaemonError
from tierd.control.figures.namespaces import NAMES_FILE
from tierd.control.figures.prometheus import render_prometheus as render
from tierd.control.protocol import NAMESPACE_ID_BYTES
from tierd.control.state import context
from tierd.control.state.tenant_table import Tenant
from tierd.daemon import Daemon, metrics_http
from tierd.keys import BlockKey
from tierd.testing import daemon_config, running_daemon
from tierd.tier import Tier

WALK_SLICE = 4096  # what the daemon promises: keys of an index looked at per loop turn


@asynccontextmanager
async def serve(tmp_path: Path, **config: Any) -> AsyncIterator[Daemon]:
    cfg = daemon_config(tmp_path, block_bytes=BLOCK, **config)
    async with asyncio.timeout(120), running_daemon(cfg) as daemon:
        yield daemon


def tenant_of(daemon: Daemon) -> Tenant:
    assert daemon.server is not None
    return daemon.server.ctx.tenants.tenants[0]


@contextmanager
def loop_turns() -> Iterator[list[int]]:
    """Count the turns of the event loop: a coroutine that yields once per turn."""
    turns = [0]

    async def tick() -> None:
        while turns[0] < 10_000_000:  # bounded: far more turns than any test here takes
            turns[0] += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(tick())
    try:
        yield turns
    finally:
        task.cancel()


# -- finding 5: a load of many keys ------------------------------------------------------


@asynccontextmanager
async def hostile_and_bystander(
    tmp_path: Path, keys: list[bytes]
) -> AsyncIterator[tuple[Client, Client]]:
    """A daemon of 8,192 CPU blocks, a hostile tenant holding ``keys`` and a bystander
    holding ``mine``: their clients."""
    async with (
        serve(tmp_path, cpu_blocks=8192, disk_blocks=None) as daemon,
        await connect(daemon, "hostile") as hostile,
        await connect(daemon, "bystander") as bystander,
    ):
        assert await hostile.store(keys, rows_of(keys)) == len(keys)
        assert await bystander.store([b"mine"], rows_of([b"mine"])) == 1
        yield hostile, bystander


async def test_a_bystanders_request_is_answered_before_a_4096_key_load_sent_ahead_of_it(
    tmp_path: Path,
) -> None:
    keys = names("big", 4096)
    async with hostile_and_bystander(tmp_path, keys) as (hostile, bystander):
        for _ in range(3):  # bounded: three rounds, each checked
            loaded, mine = await answered_first(
                hostile.send("prepare_load", keys=keys),
                bystander.send("prepare_load", keys=[b"mine"]),
            )
            assert loaded["count"] == len(keys) and mine["count"] == 1
            await hostile.request("complete_load", lease=loaded["lease"])
            await bystander.request("complete_load", lease=mine["lease"])


async def test_a_bystanders_request_is_answered_before_a_4096_key_unpin_sent_ahead_of_it(
    tmp_path: Path,
) -> None:
    """A big load's unpin (each key to its policy's recent end, a Python step a key) is
    done in pieces, the loop's turn between them; its reply comes once all are unpinned."""
    keys = names("big", 4096)
    async with hostile_and_bystander(tmp_path, keys) as (hostile, bystander):
        for _ in range(3):  # bounded: three rounds, each checked
            loaded = await hostile.request("prepare_load", keys=keys)
            assert loaded["count"] == len(keys)
            assert (await hostile.stats())["tiers"][0]["pinned"] == len(keys)
            await answered_first(
                hostile.send("complete_load", lease=loaded["lease"]),
                bystander.send("lookup", keys=[b"mine"]),
            )
            assert (await hostile.stats())["tiers"][0]["pinned"] == 0
        # Every key is evictable again: a store of as many new blocks fits.
        fresh = names("fresh", 8191)
        assert await hostile.store(fresh, rows_of(fresh)) == len(fresh)


async def test_a_bystanders_requests_are_answered_before_a_4096_key_store_sent_ahead_of_them(
    tmp_path: Path,
) -> None:
    """A big store reserves its slots (evicting as it goes) and ends its write a piece a
    turn of the loop: a bystander's lookup sent behind either step is answered first,
    and the store still ends whole (every block ready, its bytes the client's)."""
    keys = names("big", 4096)
    async with hostile_and_bystander(tmp_path, keys) as (hostile, bystander):
        for round_ in range(3):  # bounded: three rounds, each checked; 2 and 3 evict
            fresh = names(f"fresh{round_}", 4096)
            reserved, mine = await answered_first(
                hostile.send("prepare_store", keys=fresh),
                bystander.send("prepare_load", keys=[b"mine"]),  # a task, as the store
            )
            await bystander.request("complete_load", lease=mine["lease"])
            assert reserved["lease"] is not None and None not in reserved["slots"]
            assert hostile.pool is not None
            for slot, row in zip(reserved["slots"], rows_of(fresh), strict=True):
                hostile.pool.view(slot)[:] = row
            stored, mine = await answered_first(
                hostile.send("complete_store", lease=reserved["lease"], ok=True),
                bystander.send("prepare_load", keys=[b"mine"]),
            )
            await bystander.request("complete_load", lease=mine["lease"])
            assert stored["stored"] == len(fresh)
            assert (await hostile.lookup(fresh)).count == len(fresh)
            assert await hostile.load(fresh[::511]) == rows_of(fresh[::511])
        stats = (await hostile.stats())["tiers"][0]
        assert stats["writing"] == 0 and stats["pinned"] == 0


async def test_a_bystanders_request_is_answered_before_a_long_describe_sent_ahead_of_it(
    tmp_path: Path,
) -> None:
    # A description costs the loop some 20 us to check and keep: 256 of them in one
    # request held every other client 5-7 ms, 1,024 of them four times as long.
    events = {"enabled": True, "endpoint": f"ipc://{tmp_path}/kv.pub", "replay_endpoint": None}
    keys = names("described", 1024)
    blocks = [
        msgpack.packb({"hashes": [i + 1], "parent": i, "tokens": [7] * 16, "block_size": 16})
        for i in range(len(keys))
    ]
    async with (
        serve(tmp_path, cpu_blocks=64, disk_blocks=None, kv_events=events) as daemon,
        await connect(daemon, "hostile") as hostile,
        await connect(daemon, "bystander") as bystander,
    ):
        assert await bystander.store([b"mine"], rows_of([b"mine"])) == 1
        for _ in range(3):  # bounded: three rounds, each checked
            described, mine = await answered_first(
                hostile.send("describe", keys=keys, blocks=blocks),
                bystander.send("lookup", keys=[b"mine"]),
            )
            assert described["kept"] == len(keys) and mine["count"] == 1


async def test_a_describe_of_big_descriptions_takes_a_bounded_share_of_each_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 57, item 2: descriptions of 16 KiB each (long token lists, within the
    bounds), 64 in a request: the loop took 64 descriptions a turn whatever their size,
    so the whole request was one turn (933 such a request gave another tenant's lookups
    a p99 over a second). A turn now takes at most DESCRIBE_PIECE_BYTES of them: the
    request gives the loop a turn between every two such pieces, and a bystander's
    request is still answered first."""
    from tierd.control.requests import kv_requests

    given = turns_given(monkeypatch, kv_requests)
    events = {"enabled": True, "endpoint": f"ipc://{tmp_path}/kv.pub", "replay_endpoint": None}
    keys = names("big-described", 64)
    size = 16384
    blocks = [
        msgpack.packb({"hashes": [i + 1], "parent": i, "tokens": [7] * size, "block_size": size})
        for i in range(len(keys))
    ]
    pieces = -(-sum(map(len, blocks)) // (32 << 10))  # what the daemon promises a turn
    async with (
        serve(tmp_path, cpu_blocks=64, disk_blocks=None, kv_events=events) as daemon,
        await connect(daemon, "hostile") as hostile,
        await connect(daemon, "bystander") as bystander,
    ):
        assert await bystander.store([b"mine"], rows_of([b"mine"])) == 1
        described, mine = await answered_first(
            hostile.send("describe", keys=keys, blocks=blocks),
            bystander.send("lookup", keys=[b"mine"]),
        )
        assert described["kept"] == len(keys) and mine["count"] == 1
        # A turn between pieces, checked then kept: twice as many as the pieces, less one.
        assert given[0] >= 2 * pieces - 1 >= 2 * 31


async def test_a_load_in_pieces_still_pins_exactly_its_leading_run(tmp_path: Path) -> None:
    keys = names("k", 3000)
    async with (
        serve(tmp_path, cpu_blocks=4000, disk_blocks=None) as daemon,
        await connect(daemon, "ns") as client,
    ):
        assert await client.store(keys, rows_of(keys)) == len(keys)
        async with client.loading(keys) as lease:
            assert lease.count == len(keys)
            assert [bytes(v) for v in lease.views()[-3:]] == rows_of(keys[-3:])
        gap = [*keys[:1500], b"absent", *keys[1501:]]  # the run ends in the second piece
        async with client.loading(gap) as lease:
            assert lease.count == 1500
        stats = await client.stats()
        assert [tier["pinned"] for tier in stats["tiers"]] == [0]  # nothing left pinned


# -- finding 6: passes over the index --------------------------------------------------


async def test_deleting_a_namespace_gives_the_loop_a_turn_per_slice_of_the_index(
    tmp_path: Path,
) -> None:
    big, small = names("big", 16 * WALK_SLICE), names("small", 3)
    async with (
        serve(tmp_path, cpu_blocks=len(big) + 64, disk_blocks=None) as daemon,
        await connect(daemon, "crowd") as crowd,
        await connect(daemon, "few") as few,
    ):
        assert await crowd.store(big, rows_of(big)) == len(big)
        assert await few.store(small, rows_of(small)) == len(small)
        with loop_turns() as turns:
            before = turns[0]
            deleted = await few.delete(everything=True)
            during = turns[0] - before
        assert deleted["removed"] == len(small)
        # The walk looks at every key of the tier (the crowd's too), a slice per turn.
        assert during >= len(big) // WALK_SLICE
        for start in range(0, len(big), WALK_SLICE):  # nothing else went
            part = big[start : start + WALK_SLICE]
            assert (await crowd.lookup(part)).count == len(part)


async def test_a_delete_walks_no_index_where_the_namespace_has_no_blocks_beside_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any write in flight in a tier made every delete copy and walk the tier's whole
    # index, however few blocks the namespace held there. Now only the writes in flight
    # are walked where the census says the namespace holds no ready block.
    big = names("big", 16 * WALK_SLICE)
    walked: list[int] = []
    copy = Tier.key_parts

    def key_parts(tier: Tier) -> Iterator[list[BlockKey]]:
        for found in copy(tier):
            walked.append(len(found))
            yield found

    async with (
        serve(tmp_path, cpu_blocks=len(big) + 64, disk_blocks=None) as daemon,
        await connect(daemon, "crowd") as crowd,
        await connect(daemon, "idle") as idle,
    ):
        assert daemon.server is not None
        assert await crowd.store(big, rows_of(big)) == len(big)
        tier = tenant_of(daemon).chain.levels[0].tier
        crowds = BlockKey(daemon.server.ctx.namespace_id("crowd") + b"in flight")
        idles = BlockKey(daemon.server.ctx.namespace_id("idle") + b"in flight")
        assert tier.prepare_store([crowds, idles]) is not None  # two writes in flight
        monkeypatch.setattr(Tier, "key_parts", key_parts)
        try:
            deleted = await idle.delete(everything=True)
        finally:
            tier.complete_store([crowds, idles], success=False)
        assert (deleted["removed"], deleted["busy"]) == (0, 1)  # its write: busy
        assert walked == []  # the crowd's index was not walked
        assert (await crowd.lookup(big[:WALK_SLICE])).count == WALK_SLICE


async def test_two_walks_of_one_tenants_index_run_one_after_the_other(tmp_path: Path) -> None:
    big = names("big", 16 * WALK_SLICE)
    async with (
        serve(tmp_path, cpu_blocks=len(big) + 64, disk_blocks=None) as daemon,
        await connect(daemon, "crowd") as crowd,
        await connect(daemon, "one") as one,
        await connect(daemon, "two") as two,
    ):
        assert await crowd.store(big, rows_of(big)) == len(big)
        assert await one.store([b"a"], rows_of([b"a"])) == 1
        assert await two.store([b"b"], rows_of([b"b"])) == 1
        with loop_turns() as turns:
            before = turns[0]
            first, second = await asyncio.gather(
                one.delete(everything=True), two.delete(everything=True)
            )
            during = turns[0] - before
        assert first["removed"] == second["removed"] == 1
        # Side by side, both walks would share their turns; one after the other, each
        # takes a turn per slice of its own.
        assert during >= 2 * (len(big) // WALK_SLICE)


async def test_a_delete_stays_right_while_stores_and_evictions_run_between_its_slices(
    tmp_path: Path,
) -> None:
    doomed, kept = names("doomed", 2 * WALK_SLICE + 100), names("kept", 2048)
    async with (
        serve(tmp_path, cpu_blocks=WALK_SLICE, disk_blocks=3 * WALK_SLICE) as daemon,
        await connect(daemon, "doomed") as victim,
        await connect(daemon, "kept") as other,
        await connect(daemon, None) as operator,
    ):
        assert await victim.store(doomed, rows_of(doomed)) == len(doomed)
        deleting = asyncio.ensure_future(victim.delete(everything=True))
        # Meanwhile another namespace stores, evicting and demoting between the slices.
        for start in range(0, len(kept), 256):
            part = kept[start : start + 256]
            assert await other.store(part, rows_of(part)) == len(part)
        deleted = await deleting
        assert deleted["removed"] + deleted["busy"] <= len(doomed)
        survivors = sum(await victim.lookup_each(doomed))
        assert survivors <= deleted["busy"]  # kept whole only while a tier was moving it
        assert (await other.lookup(kept)).count == len(kept)  # room for all: none lost
        held = {r["namespace"]: r for r in (await operator.namespaces())["default"]}
        assert_figures_match_the_index(tenant_of(daemon), held)


def assert_figures_match_the_index(tenant: Tenant, rows: dict[str | None, Any]) -> None:
    """The figures per namespace and tier equal a count of every tier's ready blocks."""
    for level in tenant.chain.levels:
        tier = level.tier
        truth = Counter(key[:NAMESPACE_ID_BYTES] for key in tier.ready_keys())
        listed = {
            bytes.fromhex(row["id"]): row["blocks"][tier.name]
            for row in rows.values()
            if row["blocks"][tier.name]
        }
        assert listed == dict(truth), tier.name


async def test_namespaces_and_stats_answer_without_a_pass_over_any_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        serve(tmp_path, cpu_blocks=64, disk_blocks=256) as daemon,
        await connect(daemon, "a") as a,
        await connect(daemon, "b") as b,
        await connect(daemon, None) as operator,
    ):
        assert await a.store(names("a", 100), rows_of(names("a", 100))) == 100
        assert await b.store(names("b", 30), rows_of(names("b", 30))) == 30

        def no_pass(self: Tier, *args: Any) -> Any:
            raise AssertionError(f"a pass over tier {self.name}'s index on a request")

        with monkeypatch.context() as patched:
            for method in ("count_prefixes", "keys_starting", "ready_keys", "keys"):
                patched.setattr(Tier, method, no_pass, raising=False)
            before = {r["namespace"]: r for r in (await operator.namespaces())["default"]}
            stats = await operator.stats(namespaces=True)
            metrics = await operator.metrics()
            # Blocks leave between requests: the figures follow.
            assert (await a.delete(names("a", 10)))["removed"] == 10
            after = {r["namespace"]: r for r in (await operator.namespaces())["default"]}
        assert_figures_match_the_index(tenant_of(daemon), after)
    assert {r["namespace"] for r in stats["tenants"]["default"]["namespaces"]} == {"a", "b"}
    assert 'tierd_namespaces{tenant="default"} 2.0' in metrics
    assert sum(after["a"]["blocks"].values()) < sum(before["a"]["blocks"].values())
    assert after["b"] == before["b"]


async def test_figures_per_namespace_count_the_blocks_a_restart_adopts_in_the_background(
    tmp_path: Path,
) -> None:
    kept = names("kept", 300)
    async with (
        serve(tmp_path, cpu_blocks=16, disk_blocks=512) as daemon,
        await connect(daemon, "kept") as client,
    ):
        for start in range(0, len(kept), 16):
            part = kept[start : start + 16]
            assert await client.store(part, rows_of(part)) == len(part)
        await client.flush()
    config = daemon_config(tmp_path, block_bytes=BLOCK, cpu_blocks=16, disk_blocks=512)
    # Every kept block adopted in the background, 100 per tenth of a second.
    config["tiers"][1].update(adopt_inline=0, adopt_rate=1000)
    async with asyncio.timeout(120), running_daemon(config) as daemon:
        adopting = [t for t in asyncio.all_tasks() if t.get_name().startswith("adopt-")]
        async with await connect(daemon, None) as operator:
            await operator.namespaces()  # while adopting: answered, no pass per request
            if adopting:
                await asyncio.wait(adopting)
            rows = {r["namespace"]: r for r in (await operator.namespaces())["default"]}
        assert rows["kept"]["blocks"]["disk"] == len(kept)
        assert_figures_match_the_index(tenant_of(daemon), rows)


# -- finding 4: namespace names -------------------------------------------------------


async def test_a_new_namespace_past_the_bound_is_refused_and_known_ones_keep_working(
    tmp_path: Path,
) -> None:
    limits = {"namespaces_per_tenant": 3}
    async with serve(tmp_path, limits=limits) as daemon:
        for name in ("one", "two", "three"):
            async with await connect(daemon, name):
                pass
        with pytest.raises(DaemonError) as refused:
            await connect(daemon, "four")
        assert refused.value.code == "too_many_namespaces"
        assert "limits.namespaces_per_tenant" in str(refused.value)
        async with await connect(daemon, "two") as known:  # a name it used keeps working
            assert await known.store([b"k"], rows_of([b"k"])) == 1
        async with await connect(daemon, None) as operator:  # no namespace: not counted
            listed = {row["namespace"] for row in (await operator.namespaces())["default"]}
        assert listed == {"one", "two", "three"}  # the refused name left no trace
    async with serve(tmp_path, limits=limits) as daemon:  # the names came back from disk
        with pytest.raises(DaemonError) as again:
            await connect(daemon, "five")
        assert again.value.code == "too_many_namespaces"
        async with await connect(daemon, "three"):
            pass


async def test_a_burst_of_new_names_is_written_once_and_whole_at_a_clean_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = [f"burst-{i}" for i in range(40)]
    names_file = tmp_path / "disk" / NAMES_FILE
    written: list[str] = []  # each time a names file is renamed into place
    rename = os.replace

    def counted(src: Any, dst: Any, **kwargs: Any) -> None:
        if Path(dst) == names_file:
            written.append(str(dst))
        rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", counted)
    async with serve(tmp_path) as daemon:
        for name in fresh:  # one hello each, as fast as the loop answers them
            async with await connect(daemon, name):
                pass
        # One write per burst, not one per name (a write waits for the names after it).
        assert len(written) <= len(fresh) // 10
        assert tenant_of(daemon).book.names  # learned, whether written yet or not
    assert written  # the clean stop wrote what was left
    saved = json.loads(names_file.read_text())["names"]
    assert sorted(saved.values()) == sorted(fresh)


# -- the metrics endpoint ---------------------------------------------------------------


async def test_a_scrape_is_rendered_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any local user may scrape the metrics port: its text (70 ms at 1,000 tenants) is
    made in a thread, from figures read on the loop."""
    threads: list[str] = []

    def watched(*args: Any, **kwargs: Any) -> str:
        threads.append(threading.current_thread().name)
        return render(*args, **kwargs)

    for module in (metrics_http, context):  # where the daemon may call it from
        monkeypatch.setattr(module, "render_prometheus", watched, raising=False)
    port = free_port()
    async with serve(tmp_path, disk_blocks=None, metrics={"http_port": port}) as daemon:
        async with await connect(daemon, "ns") as client:
            assert await client.store([b"k"], rows_of([b"k"])) == 1
        text = await asyncio.to_thread(scrape, port)
    assert 'tierd_namespace_bytes{namespace="ns",tenant="default"} 1024.0' in text
    assert threads and threading.main_thread().name not in threads


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return str(reply.read().decode())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- the collector ----------------------------------------------------------------------


async def test_the_objects_made_at_start_are_kept_out_of_full_collections(
    tmp_path: Path,
) -> None:
    """A full collection walked every object made at start (50,000: 35-80 ms of the
    loop), whenever a flood of connections triggered one; frozen once the daemon is
    ready, they are not walked while it serves, and given back when it stops."""
    async with serve(tmp_path, disk_blocks=None):
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0
