"""Bounds on leases: one client cannot take its tenant's whole entry tier, a reservation
that is never committed expires, and a load waiting on another client's store gives up
after its deadline. Each reproduces what a client could do before: reserve every slot
and sit on them, so other clients' stores failed and loads waited forever.

The daemon runs in the test's event loop (``running_daemon``), on a real socket.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.loop_daemon_kit import serve
from tierd.client import Client, DaemonError
from tierd.daemon import Daemon

BLOCK = 4096
NS = "leases"
WAIT_S = 30.0  # safety net only


def names(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


def data(keys: list[bytes]) -> list[bytes]:
    return [bytes([len(k)]) * BLOCK for k in keys]


def bounded(**limits: Any) -> dict[str, Any]:
    """The options of this module's daemons: an 8-block CPU tier and the default lease
    bounds, unless given."""
    bounds = {"lease_blocks_per_connection": "50%", "lease_blocks_per_tenant": "75%"}
    return {
        "cpu_blocks": 8,
        "disk_blocks": None,
        "limits": {**bounds, **limits},
        "watch_loop": False,
    }


async def connect(daemon: Daemon) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=NS)


async def test_one_connection_cannot_reserve_the_whole_entry_tier(tmp_path: Path) -> None:
    async with serve(tmp_path, **bounded()) as daemon, await connect(daemon) as greedy:
        with pytest.raises(DaemonError) as refused:
            await greedy.prepare_store(names("all", 8))
        assert refused.value.code == "capacity"
        assert "limits.lease_blocks_per_connection" in str(refused.value)
        held = await greedy.prepare_store(names("half", 4))  # half the tier: allowed
        with pytest.raises(DaemonError):
            await greedy.prepare_store(names("more", 1))  # pipelining cannot go past it
        # A second connection of the same tenant gets what the tenant bound leaves (6).
        async with await connect(daemon) as other:
            with pytest.raises(DaemonError) as tenant_bound:
                await other.prepare_store(names("other", 4))
            assert "limits.lease_blocks_per_tenant" in str(tenant_bound.value)
            assert await other.store(names("other", 2), data(names("other", 2))) == 2
        for view, i in zip(held.views(), held.to_write, strict=True):
            view[:] = data(held.keys)[i]
        assert await held.commit() == 4
        # Finished leases count no more: the whole bound is free again.
        assert await greedy.store(names("again", 4), data(names("again", 4))) == 4
        stats = await greedy.stats()
        assert stats["leases"]["lease_refusals"] == 3
        assert stats["leases"]["leases_held_blocks"] == 0


async def test_concurrent_requests_cannot_pass_the_bound_together(tmp_path: Path) -> None:
    async with serve(tmp_path, **bounded()) as daemon, await connect(daemon) as client:
        sent = [client.send("prepare_store", keys=names(f"p{i}", 2)) for i in range(4)]
        replies = await asyncio.gather(*sent, return_exceptions=True)
        granted = [r for r in replies if isinstance(r, dict)]
        assert len(granted) == 2  # 2 x 2 blocks = the connection's 4
        assert all(isinstance(r, DaemonError) and r.code == "capacity" for r in replies[2:])


async def test_a_reservation_never_committed_expires(tmp_path: Path) -> None:
    ttl = 0.3
    async with (
        serve(tmp_path, **bounded(store_lease_ttl_s=ttl)) as daemon,
        await connect(daemon) as sitter,
    ):
        lease = await sitter.prepare_store(names("sit", 4))
        assert lease.lease is not None
        # The daemon runs in this loop: its expiry timer (due at ttl) fires before this
        # sleep (due at 3 x ttl) ends, however late the loop is.
        await asyncio.sleep(3 * ttl)
        stats = await sitter.stats()
        assert stats["leases"]["leases_expired"] == 1
        # Expiry ended the write (its keys are free for another store) but not the
        # slots' quarantine: the sitter may still be writing into them, so they are
        # given to no other block and count against the bounds while it is connected.
        assert stats["tiers"][0]["writing"] == 0
        assert stats["tiers"][0]["quarantined"] == 4
        assert stats["leases"]["leases_held_blocks"] == 4
        async with await connect(daemon) as other:
            assert await other.store(names("sit", 2), data(names("sit", 2))) == 2
            with pytest.raises(DaemonError) as bound:
                await other.prepare_store(names("new", 4))  # 4 + 4 > the tenant's 6
            assert bound.value.code == "capacity"
            # The sitter finishing its lease is done with the slots: they are freed.
            with pytest.raises(DaemonError) as late:
                await lease.commit()
            assert late.value.code == "unknown_lease"
            assert "expired" in str(late.value) and "store_lease_ttl_s" in str(late.value)
            assert await other.store(names("new", 4), data(names("new", 4))) == 4
        assert (await sitter.lookup(names("sit", 4))).count == 2  # the other's, not the sitter's
        stats = await sitter.stats()
        assert stats["leases"]["leases_held_blocks"] == 0
        assert stats["tiers"][0]["writing"] == 0
        assert stats["tiers"][0]["quarantined"] == 0


async def test_a_load_waiting_on_another_clients_store_has_a_deadline(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, **bounded(load_wait_s=0.3, store_lease_ttl_s=600)) as daemon,
        await connect(daemon) as writer,
        await connect(daemon) as reader,
    ):
        ready = names("ready", 1)
        assert await writer.store(ready, data(ready)) == 1
        slow = await writer.prepare_store(names("slow", 1))  # not finished in time
        async with asyncio.timeout(WAIT_S):  # before: it waited for the lease, 600 s
            loaded = await reader.load(ready + names("slow", 1))
        assert loaded == data(ready)  # the prefix up to the block still being written
        await slow.abort()


async def test_a_load_that_asks_not_to_wait_stops_at_once_before_a_block_being_written(
    tmp_path: Path,
) -> None:
    """``wait_s: 0`` (an engine's scheduler that must not stall): the leading ready blocks
    are pinned and the load stops before the first one another client is writing, at
    once, however long ``load_wait_s`` is; a bad value is refused. ``lookup: true``
    counts the pin as a lookup (the hits of an engine whose lookups are its pins)."""
    async with (
        serve(tmp_path, **bounded(load_wait_s=600, store_lease_ttl_s=600)) as daemon,
        await connect(daemon) as writer,
        await connect(daemon) as reader,
    ):
        ready = names("ready", 2)
        assert await writer.store(ready, data(ready)) == 2
        slow = await writer.prepare_store(names("slow", 1))
        async with asyncio.timeout(WAIT_S):  # without wait_s: 600 s
            reply = await reader.request("prepare_load", keys=ready + names("slow", 1), wait_s=0)
        assert reply["count"] == 2
        await reader.request("complete_load", lease=reply["lease"])
        hits = (await reader.stats())["tiers"][0]["hits"]
        counted = await reader.request("prepare_load", keys=ready, wait_s=0, lookup=True)
        await reader.request("complete_load", lease=counted["lease"])
        assert (await reader.stats())["tiers"][0]["hits"] == hits + 2  # a lookup, counted
        with pytest.raises(DaemonError) as bad:
            await reader.request("prepare_load", keys=ready, wait_s=-1)
        assert bad.value.code == "bad_request"
        await slow.abort()
