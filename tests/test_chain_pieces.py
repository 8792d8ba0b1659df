"""A big store through the chain, a piece a turn of the loop (issue 34, finding 5's kin).

A store of more than ``STORE_KEYS`` keys reserves its slots and ends its write piece by
piece, the loop's other work between the pieces. What it promised as one step still
holds: a reservation is all or nothing, and nothing is left half done when the caller
gives up midway.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tierd
from tests.chain_kit import chain_config, content, read_back
from tierd.chain import TierChain
from tierd.errors import CapacityError
from tierd.keys import BlockKey, int_key
from tierd.turns import STORE_KEYS

CAPACITY = 4 * STORE_KEYS
BIG = 3 * STORE_KEYS  # three pieces


def keys_from(start: int, count: int) -> list[BlockKey]:
    return [int_key(i) for i in range(start, start + count)]


async def write_and_commit_task(chain: TierChain, keys: list[BlockKey]) -> asyncio.Task[object]:
    handle = await chain.begin_store(keys)
    for key, view in zip(handle.keys, handle.views(), strict=True):
        memoryview(view).cast("B")[:] = content(key)
    return asyncio.get_running_loop().create_task(handle.commit(True))


async def test_a_big_reservation_that_runs_out_of_room_midway_leaves_nothing_reserved(
    tmp_path: Path,
) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": CAPACITY})
    async with tierd.open(config) as chain:
        tier = chain.levels[0].tier
        held = keys_from(0, CAPACITY - STORE_KEYS - 8)
        await chain.store(held, [content(k) for k in held])
        pins = await chain.load(held)  # pinned: only STORE_KEYS + 8 slots are left
        big = keys_from(10_000, BIG)
        with pytest.raises(CapacityError):
            await chain.begin_store(big)  # the first piece fits, the second does not
        assert not any(key in tier for key in big)
        chain.check_invariants()
        assert tier.stats().writing == 0 and tier.stats().used == len(held)
        pins.release()
        handle = await chain.begin_store(big)  # every slot the first piece took is back
        assert handle.keys == big
        handle.abort()
        chain.check_invariants(idle=True)


async def test_no_piece_of_a_big_store_evicts_a_key_the_store_names(tmp_path: Path) -> None:
    """The store's keys already held are skipped, not written; no piece's room is made
    by evicting one of them, however old."""
    config = chain_config(tmp_path, {"kind": "memory", "capacity": CAPACITY})
    async with tierd.open(config) as chain:
        oldest = keys_from(0, STORE_KEYS)  # the least recent blocks of the full tier
        rest = keys_from(STORE_KEYS, CAPACITY - STORE_KEYS)
        await chain.store(oldest, [content(k) for k in oldest])
        await chain.store(rest, [content(k) for k in rest])
        # New keys first, then the oldest: the new pieces must not evict the oldest.
        big = keys_from(10_000, 2 * STORE_KEYS) + oldest
        stored = await chain.store(big, [content(k) for k in big])
        assert stored == big[: 2 * STORE_KEYS]
        await read_back(chain, big)
        chain.check_invariants(idle=True)


async def test_a_big_reservation_cancelled_midway_leaves_nothing_reserved(
    tmp_path: Path,
) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": CAPACITY})
    async with tierd.open(config) as chain:
        tier = chain.levels[0].tier
        big = keys_from(0, BIG)
        task = asyncio.get_running_loop().create_task(chain.begin_store(big))
        await asyncio.sleep(0)  # the first piece is reserved, then the task waits a turn
        assert 0 < tier.stats().writing < BIG
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tier.stats().writing == 0 and tier.stats().used == 0
        chain.check_invariants(idle=True)
        assert await chain.store(big, [content(k) for k in big]) == big


async def test_a_big_commit_cancelled_midway_still_ends_every_block(tmp_path: Path) -> None:
    config = chain_config(tmp_path, {"kind": "memory", "capacity": CAPACITY})
    async with tierd.open(config) as chain:
        tier = chain.levels[0].tier
        big = keys_from(0, BIG)
        task = await write_and_commit_task(chain, big)
        await asyncio.sleep(0)  # the first piece is ready, then the task waits a turn
        assert 0 < tier.stats().writing < BIG
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tier.stats().writing == 0  # the rest, at once
        await read_back(chain, big)
        chain.check_invariants(idle=True)


async def test_a_load_waiting_on_a_big_store_gets_the_block_its_writer_wrote(
    tmp_path: Path,
) -> None:
    """A load of a key in flight waits for its write; the write's futures are resolved
    with the commit's last piece, so no load is woken to find its block still being
    written (a load of the last block alone then came back empty)."""
    many = 8 * STORE_KEYS  # enough pieces for a waiter woken early to run between two
    config = chain_config(tmp_path, {"kind": "memory", "capacity": many})
    async with tierd.open(config) as chain:
        big = keys_from(0, many)
        handle = await chain.begin_store(big)
        loop = asyncio.get_running_loop()
        # One load from the first block on, one of the last block alone (whose write
        # ends with the commit's last piece, many turns after the first).
        loading = [loop.create_task(read_back(chain, ks)) for ks in (big, big[-1:])]
        await asyncio.sleep(0)  # both loads wait on their first key's write
        assert not any(task.done() for task in loading)
        for key, view in zip(handle.keys, handle.views(), strict=True):
            memoryview(view).cast("B")[:] = content(key)
        assert await handle.commit(True) == big
        await asyncio.gather(*loading)
        chain.check_invariants(idle=True)


async def test_a_withdrawn_store_keeps_its_slots_until_aborted_even_mid_withdrawal(
    tmp_path: Path,
) -> None:
    """An expired lease's write is withdrawn a piece a turn: its keys leave flight (and
    may be stored again) while its slots stay out of use; an abort that comes while the
    pieces run frees them once the last is withdrawn, never before."""
    config = chain_config(tmp_path, {"kind": "memory", "capacity": CAPACITY})
    async with tierd.open(config) as chain:
        tier = chain.levels[0].tier
        big = keys_from(0, BIG)
        handle = await chain.begin_store(big)
        withdrawing = asyncio.get_running_loop().create_task(handle.withdraw_in_pieces())
        await asyncio.sleep(0)  # the first piece
        handle.abort()  # the client is done while the pieces still run
        assert tier.stats().quarantined < BIG and tier.stats().writing > 0
        await withdrawing
        assert tier.stats().quarantined == 0 and tier.stats().writing == 0
        assert tier.free == CAPACITY
        handle.abort()  # a second end changes nothing
        assert await handle.commit(True) == []
        chain.check_invariants(idle=True)

        again = await chain.begin_store(big)
        again.withdraw()
        assert tier.stats().quarantined == BIG
        assert not any(chain.lookup([key]).count for key in big[:3])
        stored = await chain.store(big[:STORE_KEYS], [content(k) for k in big[:STORE_KEYS]])
        assert stored == big[:STORE_KEYS]  # the keys are free, the slots are not
        assert not set(again.quarantined) & set(tier.slots_of(stored))
        again.abort()
        assert tier.stats().quarantined == 0
        chain.check_invariants(idle=True)
