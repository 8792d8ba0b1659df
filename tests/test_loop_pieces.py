"""Leases the daemon ends, and keys it deletes, without holding the loop (issue 34, 5-6).

A client may hold up to ``limits.lease_blocks_per_connection`` blocks in open leases (half
the entry tier by default), and the daemon ends them when the client aborts one, when
its connection closes, or when a store lease outlives ``store_lease_ttl_s``. Each end
is a Python step per key (a slot freed, a key unpinned to its policy's recent end). Done
at once, a connection closed with 40 leases of 4,096 keys held every other tenant 200 ms
(stores) and 270 ms (loads) on a 2-core machine; store leases expiring together, as
long. Now an abort of more than 512 keys ends 512 a turn of the loop, and what a closed
connection or an expiry leaves is ended by one task per tenant, 512 keys a turn. A
delete is a Python step per key at every level too: 4,096 named keys, or a namespace's
slice of 4,096, held the loop 15-20 ms at once; they now go 256 a turn, and a touch of
4,096 keys (4-5 ms) 512 a turn. A get of 4,096 blocks of 16 KiB (64 MiB in its reply)
copied, packed and wrote its reply in one turn (up to 300 ms): it now copies the blocks
out (encoded for the reply as they are copied) 256 KiB a turn while they are pinned,
unpins them 512 a turn, and writes its reply a piece a turn as the client's socket takes
it, the frame's bytes those of one message as before.

Each test runs the daemon in the test's event loop on a real socket and checks by order
or by watching the tier between turns of the loop, never by time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest

from tests.loop_daemon_kit import serve
from tests.loop_turns_kit import BLOCK, answered_first, connect, names, rows_of, turns_given
from tierd.client import Client, DaemonError
from tierd.control.protocol import encode
from tierd.control.requests.frame_pieces import (
    PIECE_BYTES,
    EncodedBins,
    encode_bins,
    frame_in_pieces,
)
from tierd.daemon import Daemon
from tierd.testing import daemon_config, running_daemon
from tierd.tier import Tier

T = TypeVar("T")
PIECE = 512  # what the daemon promises: keys of a lease ended (or touched) per turn
DELETE_PIECE = 256  # and keys deleted per turn
SETTLE_S = 30.0  # a liveness bound on a tier's pieces all ending
LEASE_KEYS = 4096


def pieces(cpu_blocks: int, disk_blocks: int | None = None, **limits: Any) -> dict[str, Any]:
    """The options of this module's daemons: 1 KiB blocks, a CPU tier of ``cpu_blocks``
    (over a disk tier of ``disk_blocks``), ``limits``."""
    return {
        "timeout_s": 120,
        "block_bytes": BLOCK,
        "cpu_blocks": cpu_blocks,
        "disk_blocks": disk_blocks,
        "limits": limits,
        "watch_loop": False,
    }


def entry_tier(daemon: Daemon) -> Tier:
    assert daemon.server is not None
    return daemon.server.ctx.tenants.tenants[0].chain.levels[0].tier


@contextmanager
def _watch(value: Callable[[], T]) -> Iterator[list[T]]:
    """``value()`` each time it changes, looked at once per turn of the event loop."""
    seen: list[T] = []

    async def look() -> None:
        for _ in range(10_000_000):  # bounded: far more turns than any test here takes
            now = value()
            if not seen or seen[-1] != now:
                seen.append(now)
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(look())
    try:
        yield seen
    finally:
        task.cancel()


def watched(tier: Tier) -> AbstractContextManager[list[tuple[int, int]]]:
    """The tier's (writing, pinned) counts each time they change, once per turn."""
    return _watch(lambda: (tier.stats().writing, tier.stats().pinned))


async def settled(tier: Tier) -> None:
    """Until the tier has no block being written and none pinned (bounded in turns and in
    time: a busy machine ran 100,000 turns before the last piece's, and the test read a
    tier not settled yet)."""
    deadline = time.monotonic() + SETTLE_S
    for _ in range(10_000_000):
        stats = tier.stats()
        if stats.writing == 0 and stats.pinned == 0:
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0)
    raise AssertionError(f"the tier never settled: {tier.stats()}")
    raise AssertionError(f"the tier did not settle: {tier.stats()}")


def assert_ended_in_pieces(seen: list[tuple[int, int]], blocks: int) -> None:
    """From ``blocks`` held to none, never more than a piece less at a time."""
    held = [writing + pinned for writing, pinned in seen]
    assert held[0] == blocks and held[-1] == 0, seen[:4] + seen[-4:]
    drops = [before - after for before, after in itertools.pairwise(held)]
    assert max(drops) <= PIECE, f"{max(drops)} keys ended in one turn"


async def test_a_bystanders_request_is_answered_before_a_4096_key_abort_sent_ahead_of_it(
    tmp_path: Path,
) -> None:
    """An abort of 4,096 reserved slots frees them 512 a turn; a bystander's request sent
    behind it is answered first, and every slot is free for the next store."""
    async with (
        serve(tmp_path, **pieces(cpu_blocks=2 * LEASE_KEYS)) as daemon,
        await connect(daemon, "hostile") as hostile,
        await connect(daemon, "bystander") as bystander,
    ):
        assert await bystander.store([b"mine"], rows_of([b"mine"])) == 1
        tier = entry_tier(daemon)
        for round_ in range(3):  # bounded: three rounds, each checked
            reserved = await hostile.request("prepare_store", keys=names(f"r{round_}", 4096))
            assert tier.stats().writing == LEASE_KEYS
            _, mine = await answered_first(
                hostile.send("abort_store", lease=reserved["lease"]),
                bystander.send("prepare_load", keys=[b"mine"]),  # a task, as the abort
            )
            await bystander.request("complete_load", lease=mine["lease"])
            assert tier.stats().writing == 0
        # Every slot is free: a store of all the blocks the bystander does not hold fits.
        fresh = names("fresh", 2 * LEASE_KEYS - 1)
        assert await hostile.store(fresh, rows_of(fresh)) == len(fresh)


async def test_a_closed_connections_leases_are_ended_a_piece_a_turn(tmp_path: Path) -> None:
    """A client closes its connection holding three store leases and two load leases of
    4,096 keys: the daemon ends them a piece a turn, and then holds nothing of them."""
    async with serve(tmp_path, **pieces(cpu_blocks=6 * LEASE_KEYS)) as daemon:
        tier = entry_tier(daemon)
        assert daemon.server is not None
        tenant = daemon.server.ctx.tenants.tenants[0]
        loaded = [names(f"l{i}", LEASE_KEYS) for i in range(2)]
        async with await connect(daemon, "hostile") as writer:
            for keys in loaded:
                assert await writer.store(keys, rows_of(keys)) == LEASE_KEYS
        for round_ in range(2):  # bounded: two rounds, each checked
            hostile = await connect(daemon, "hostile")
            for i in range(3):
                reply = await hostile.request("prepare_store", keys=names(f"s{round_}{i}", 4096))
                assert len(reply["slots"]) == LEASE_KEYS
            for keys in loaded:
                assert (await hostile.request("prepare_load", keys=keys))["count"] == LEASE_KEYS
            assert tier.stats().writing == 3 * LEASE_KEYS
            assert tier.stats().pinned == 2 * LEASE_KEYS
            assert tenant.held == 5 * LEASE_KEYS
            with watched(tier) as seen:
                await hostile.close()
                await settled(tier)
            assert_ended_in_pieces(seen, 5 * LEASE_KEYS)
            # Ended, their blocks are given back to the tenant's lease bound.
            assert tenant.held == 0
        async with await connect(daemon, "hostile") as writer:
            # Nothing of the closed connections is left: the tier takes a store of all
            # the blocks it does not hold, and the loaded blocks are whole.
            fresh = names("fresh", 4 * LEASE_KEYS)
            assert await writer.store(fresh, rows_of(fresh)) == len(fresh)
            assert await writer.load(loaded[0][::511]) == rows_of(loaded[0][::511])


async def test_store_leases_expiring_together_are_ended_a_piece_a_turn(tmp_path: Path) -> None:
    """Four store leases of 4,096 keys left unfinished past ``store_lease_ttl_s`` expire
    together: their writes are withdrawn a piece a turn (the slots stay quarantined while
    the client may still write), and each lease is refused after, which frees its slots."""
    async with serve(
        tmp_path, **pieces(cpu_blocks=5 * LEASE_KEYS, store_lease_ttl_s=0.5)
    ) as daemon:
        tier = entry_tier(daemon)
        async with await connect(daemon, "hostile") as hostile:
            leases = []
            for i in range(4):
                reply = await hostile.request("prepare_store", keys=names(f"x{i}", 4096))
                leases.append(reply["lease"])
            with watched(tier) as seen:
                for _ in range(1000):  # bounded: 10 s of polls at most
                    if tier.stats().writing < 4 * LEASE_KEYS:
                        break
                    await asyncio.sleep(0.01)
                await settled(tier)
            assert_ended_in_pieces(seen, 4 * LEASE_KEYS)
            assert tier.stats().quarantined == 4 * LEASE_KEYS
            for lease in leases:
                with pytest.raises(DaemonError, match="expired"):
                    await hostile.request("complete_store", lease=lease, ok=True)
            for _ in range(100_000):  # bounded: until the lease ends have run
                if tier.stats().quarantined == 0:
                    break
                await asyncio.sleep(0)
            assert tier.stats().quarantined == 0


async def test_a_stop_ends_at_once_what_closed_connections_left(tmp_path: Path) -> None:
    """The daemon stops while a closed connection's leases are still being ended: the
    stop ends the rest at once, and every slot is free before the chain closes."""
    async with serve(tmp_path, **pieces(cpu_blocks=5 * LEASE_KEYS)) as daemon:
        assert daemon.server is not None
        tier, tenant = entry_tier(daemon), daemon.server.ctx.tenants.tenants[0]
        hostile = await connect(daemon, "hostile")
        for i in range(4):
            await hostile.request("prepare_store", keys=names(f"x{i}", 4096))
        await hostile.close()
        for _ in range(100_000):  # bounded: until the daemon has seen the close
            if len(tenant.lease_ends):
                break
            await asyncio.sleep(0)
        assert len(tenant.lease_ends) > 1  # queued: the stop comes while they are ended
        assert await daemon.server.drain(1.0)
        assert len(tenant.lease_ends) == 0
        assert tier.stats().writing == 0 and tenant.held == 0


# -- deletes: a key is a Python step at every level -------------------------------------


async def test_a_bystanders_request_is_answered_before_a_4096_key_delete_sent_ahead_of_it(
    tmp_path: Path,
) -> None:
    """A delete of 4,096 named keys (15-20 ms of the loop at once at a million blocks)
    goes 256 keys a turn: a bystander's request sent behind it is answered first."""
    async with (
        serve(tmp_path, **pieces(cpu_blocks=4 * LEASE_KEYS)) as daemon,
        await connect(daemon, "hostile") as hostile,
        await connect(daemon, "bystander") as bystander,
    ):
        assert await bystander.store([b"mine"], rows_of([b"mine"])) == 1
        for round_ in range(3):  # bounded: three rounds, each checked
            doomed = names(f"d{round_}", LEASE_KEYS)
            assert await hostile.store(doomed, rows_of(doomed)) == LEASE_KEYS
            deleted, mine = await answered_first(
                hostile.send("delete", keys=doomed),
                bystander.send("prepare_load", keys=[b"mine"]),  # a task, as the delete
            )
            await bystander.request("complete_load", lease=mine["lease"])
            assert deleted["removed"] == LEASE_KEYS and deleted["busy"] == 0
            assert (await hostile.lookup(doomed[:1])).count == 0


async def test_deleting_a_whole_namespace_removes_256_keys_a_turn(tmp_path: Path) -> None:
    """``delete --all`` of a namespace of 16,384 blocks: never more than 256 of them
    gone in one turn of the loop, and every one gone at the end."""
    doomed = names("doomed", 4 * LEASE_KEYS)
    async with (
        serve(tmp_path, **pieces(cpu_blocks=len(doomed) + 64)) as daemon,
        await connect(daemon, "hostile") as hostile,
    ):
        assert await hostile.store(doomed, rows_of(doomed)) == len(doomed)
        with _watch(lambda: entry_tier(daemon).stats().used) as seen:
            deleted = await hostile.delete(everything=True)
        assert deleted["removed"] == len(doomed)
        assert seen[0] == len(doomed) and seen[-1] == 0
        drops = [before - after for before, after in itertools.pairwise(seen)]
        assert max(drops) <= DELETE_PIECE, f"{max(drops)} keys deleted in one turn"


# -- touches: a key is a Python step at every level --------------------------------------


async def test_a_bystanders_request_is_answered_before_a_4096_key_touch_sent_ahead_of_it(
    tmp_path: Path,
) -> None:
    """A touch of 4,096 keys (4-5 ms of the loop at once at a million blocks) goes 512
    keys a turn, the tail's first: a bystander's request sent behind it is answered
    first, and ``keys[0]`` still ends up the most recent."""
    touched = names("t", LEASE_KEYS)
    async with (
        serve(tmp_path, **pieces(cpu_blocks=LEASE_KEYS + 1)) as daemon,
        await connect(daemon, "hostile") as hostile,
        await connect(daemon, "bystander") as bystander,
    ):
        assert await bystander.store([b"mine"], rows_of([b"mine"])) == 1
        assert await hostile.store(touched, rows_of(touched)) == LEASE_KEYS
        for _ in range(3):  # bounded: three rounds, each checked
            _, mine = await answered_first(
                hostile.send("touch", keys=touched),
                bystander.send("prepare_load", keys=[b"mine"]),  # a task, as the touch
            )
            await bystander.request("complete_load", lease=mine["lease"])
        await hostile.request("touch", keys=touched)  # after the bystander's last load
        # The least recent are the bystander's block and then the touch's tail: a store
        # of 513 blocks evicts those 1 + 512.
        fresh = names("fresh", PIECE + 1)
        assert await hostile.store(fresh, rows_of(fresh)) == PIECE + 1
        held = await hostile.lookup_each(touched)
        assert held == [True] * (LEASE_KEYS - PIECE) + [False] * PIECE


async def test_a_flush_leaves_room_for_the_stores_beside_it(tmp_path: Path) -> None:
    """Issue 57, item 7: a flush of a full CPU tier's dirty blocks pinned all of them
    until it ended, so 71 of 72 puts beside it were refused ``capacity``. It now copies
    them down a batch at a time (a quarter of the tier at most pinned): every put made
    while it runs is stored."""
    full = 4096
    async with (
        serve(tmp_path, **pieces(cpu_blocks=full, disk_blocks=4 * full)) as daemon,
        await connect(daemon, "ns") as writer,
        await connect(daemon, None) as operator,
    ):
        dirty = names("dirty", full)
        for start in range(0, len(dirty), 512):
            part = dirty[start : start + 512]
            assert await writer.store(part, rows_of(part)) == len(part)
        tier = entry_tier(daemon)
        flushing = asyncio.ensure_future(operator.flush())
        for _ in range(100_000):  # bounded: until the flush has pinned its first blocks
            if tier.stats().pinned:
                break
            await asyncio.sleep(0)
        assert tier.stats().pinned <= full // 4
        stored = beside = 0
        for round_ in range(64):  # bounded: puts while the flush runs, one after the other
            if flushing.done():
                break
            fresh = names(f"beside{round_}", 8)
            stored += await writer.store(fresh, rows_of(fresh))
            beside += len(fresh)
        done = await flushing
        assert beside > 0  # some were made while it ran
        assert stored == beside, f"puts beside the flush stored {stored} of {beside}"
        assert done.copied >= full - beside


async def test_a_flush_and_a_clear_walk_a_big_tier_a_piece_a_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 57, item 5: a flush's scan and a clear of a whole tier were each one turn of
    the loop (0.8 s and 1.4 s at 300,000 blocks). Both now look at a piece of the tier's
    index a turn."""
    from tierd.chain import core

    turns = turns_given(monkeypatch, core)
    blocks = 5 * 4096
    async with serve(tmp_path, **pieces(cpu_blocks=blocks, disk_blocks=2 * blocks)) as daemon:
        async with await connect(daemon, "ns") as writer:
            keys = names("big", blocks)
            for start in range(0, blocks, 4096):
                part = keys[start : start + 4096]
                assert await writer.store(part, rows_of(part)) == len(part)
        async with await connect(daemon, None) as operator:
            turns[0] = 0
            flushed = await operator.flush()
            assert flushed.copied == blocks
            assert turns[0] >= 2 * (blocks // 4096)  # the copy's scan and the count's, in pieces
            turns[0] = 0
            assert (await operator.clear(tier="cpu")) == blocks
            assert turns[0] >= blocks // 4096 - 1


# -- gets: a 64 MiB reply -----------------------------------------------------------------

GET_BLOCK = 16 << 10  # 4,096 of them: 64 MiB in one get's reply


async def test_a_bystanders_lookup_is_answered_while_a_4096_key_get_sent_ahead_of_it_copies(
    tmp_path: Path,
) -> None:
    """Issue 57, item 3: a get of 4,096 blocks of 16 KiB copied them out, packed its 64 MiB
    reply and handed it to the socket in one turn of the loop (other tenants waited up to
    310 ms). A bystander's lookup sent once the get's blocks are pinned is now answered
    while they still are (they are copied out a piece a turn, then unpinned 512 a turn),
    and the get's socket never holds more than a piece or two of its reply unsent."""
    cfg = daemon_config(
        tmp_path,
        block_bytes=GET_BLOCK,
        cpu_blocks=LEASE_KEYS + 1,
        disk_blocks=None,
        limits={"max_frame_bytes": 65 << 20},  # room for 4,096 blocks of 16 KiB
    )
    keys = names("g", LEASE_KEYS)
    rows = [bytes([i % 251]) * GET_BLOCK for i in range(LEASE_KEYS)]
    socket = str(cfg["socket"]["path"])
    async with asyncio.timeout(120), running_daemon(cfg) as daemon:
        hostile = await Client.connect(socket, namespace="hostile", block_bytes=GET_BLOCK)
        bystander = await Client.connect(socket, namespace="bystander", block_bytes=GET_BLOCK)
        async with hostile, bystander:
            assert await hostile.store(keys, rows) == LEASE_KEYS
            assert await bystander.store([b"mine"], [rows[0]]) == 1
            assert daemon.server is not None
            (line,) = [c for c in daemon.server.connections if c.session.namespace == "hostile"]
            transport = line.transport
            assert transport is not None
            tier = entry_tier(daemon)
            for _ in range(2):  # bounded: two rounds, each checked
                state = lambda: (tier.stats().pinned, transport.get_write_buffer_size())  # noqa: E731
                with _watch(state) as seen:
                    got = hostile.send("get", keys=keys)
                    for _ in range(100_000):  # bounded: until the get's blocks are pinned
                        if tier.stats().pinned == LEASE_KEYS or got.done():
                            break
                        await asyncio.sleep(0)
                    mine = await bystander.send("lookup", keys=[b"mine"])
                    pinned = tier.stats().pinned
                    reply = await got
                    await settled(tier)
                assert mine["count"] == 1
                assert pinned == LEASE_KEYS, "the get's blocks were copied out before the lookup"
                assert reply["count"] == LEASE_KEYS and reply["data"] == rows
                held = [pins for pins, _ in seen]
                drops = [before - after for before, after in itertools.pairwise(held)]
                assert max(drops) <= PIECE, f"{max(drops)} blocks unpinned in one turn"
                unsent = max(size for _, size in seen)
                assert unsent <= 2 * PIECE_BYTES, f"{unsent} bytes of the reply queued at once"


async def test_replies_answered_while_a_get_is_written_in_pieces_follow_its_frame(
    tmp_path: Path,
) -> None:
    """Two gets of 4 MiB and lookups pipelined on one connection (room for one get's reply
    at a time): the lookups behind the second get are answered when the first ends, while
    the second's reply goes out a piece a turn. Their replies follow its frame, never
    inside it: every reply decodes, each with its own fields."""
    keys = names("p", LEASE_KEYS)
    async with (
        serve(tmp_path, **pieces(cpu_blocks=LEASE_KEYS, output_buffer_bytes=6 << 20)) as daemon,
        await connect(daemon, "ns") as client,
    ):
        assert await client.store(keys, rows_of(keys)) == LEASE_KEYS
        for _ in range(2):  # bounded: two rounds, each checked
            first = [client.send("get", keys=keys)]
            first += [client.send("lookup", keys=keys[:3]) for _ in range(8)]
            second = [client.send("get", keys=keys[::-1])]
            second += [client.send("lookup", keys=keys[:2]) for _ in range(8)]
            async with asyncio.timeout(15):  # a frame cut into would leave the client waiting
                got, *found = await asyncio.gather(*first)
                got_back, *found_after = await asyncio.gather(*second)
            assert got["data"] == rows_of(keys) and got_back["data"] == rows_of(keys[::-1])
            assert [each["count"] for each in found + found_after] == [3] * 8 + [2] * 8


@pytest.mark.parametrize(
    ("count", "size"), [(0, 8), (1, 0), (15, 255), (16, 256), (70, 65535), (3, 65536)]
)
def test_a_reply_encoded_in_pieces_is_the_frame_of_the_whole_message(count: int, size: int) -> None:
    """A get's reply goes out in pieces (its blocks encoded a few at a time): joined, they
    are the very bytes of the one message clients decode, whatever the sizes' headers."""
    blocks = [bytes([i % 251]) * size for i in range(count)]
    whole = encode({"id": 7, "ok": True, "count": count, "data": blocks})
    pieces = [encode_bins(blocks[start : start + 4]) for start in range(0, count, 4)]
    bins = EncodedBins(count, list(pieces))
    frame = frame_in_pieces({"id": 7, "ok": True, "count": count, "data": bins})
    assert b"".join(frame) == whole
    assert len(frame) == max(1, len(pieces)) and not bins.pieces  # taken: each freed when sent
    assert msgpack.unpackb(b"".join(frame)[4:])["data"] == blocks
