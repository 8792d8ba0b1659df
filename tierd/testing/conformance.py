"""The block-store conformance suite: the contract every :class:`~tierd.stores.BlockStore`
keeps (round trips, views, bad input, lifecycle, cancellation), as pytest tests a test
class inherits by subclassing :class:`StoreConformance`. Imports pytest: for tests only.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch

from tierd.errors import SlotError, StoreClosed
from tierd.stores.base import BlockStore
from tierd.testing.blocks import as_bytes, keys_for, random_blocks

__all__ = ["StoreConformance"]


class StoreConformance:
    """The contract every block store keeps; subclass it and implement :meth:`make_store`."""

    num_blocks = 16
    block_bytes = 1536
    # A batch above the 1 MiB inline limit, to run the worker-thread path.
    large_num_blocks = 24
    large_block_bytes = 1 << 16

    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        raise NotImplementedError("subclasses build the store under test")

    @pytest.fixture
    async def store(self) -> AsyncIterator[BlockStore]:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        async with store:
            yield store

    async def read_back(self, store: BlockStore, slots: Sequence[int]) -> list[bytes]:
        out = [bytearray(store.block_bytes) for _ in slots]
        assert await store.read(slots, keys_for(slots), out) == [True] * len(slots)
        return [bytes(b) for b in out]

    # -- round trips -----------------------------------------------------------------

    async def test_write_then_read_back(self, store: BlockStore) -> None:
        rng = random.Random(1)
        slots = [0, 5, store.num_blocks - 1]
        data = random_blocks(rng, len(slots), store.block_bytes)
        assert await store.write(slots, keys_for(slots), data) == [True] * 3
        assert await self.read_back(store, slots) == data

    async def test_random_batches_match_reference(self, store: BlockStore) -> None:
        rng = random.Random(2)
        reference: dict[int, bytes] = {}
        for _ in range(12):
            slots = rng.sample(range(store.num_blocks), rng.randint(1, store.num_blocks))
            data = random_blocks(rng, len(slots), store.block_bytes)
            assert await store.write(slots, keys_for(slots), data) == [True] * len(slots)
            reference.update(zip(slots, data, strict=True))
            check = rng.sample(sorted(reference), rng.randint(1, len(reference)))
            assert await self.read_back(store, check) == [reference[s] for s in check]

    async def test_consecutive_and_reversed_slots(self, store: BlockStore) -> None:
        rng = random.Random(3)
        slots = list(range(2, 9))
        data = random_blocks(rng, len(slots), store.block_bytes)
        await store.write(slots, keys_for(slots), data)
        assert await self.read_back(store, slots[::-1]) == data[::-1]

    async def test_tensor_batches(self, store: BlockStore) -> None:
        gen = torch.Generator().manual_seed(4)
        slots = [7, 1, 4]
        shape = (len(slots), store.block_bytes)
        src = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        assert await store.write(slots, keys_for(slots), src) == [True] * 3
        out = torch.zeros(shape, dtype=torch.uint8)
        assert await store.read(slots, keys_for(slots), out) == [True] * 3
        assert torch.equal(out, src)
        assert await self.read_back(store, slots) == [as_bytes(row) for row in src]
        rows = [torch.zeros(store.block_bytes, dtype=torch.uint8) for _ in slots]
        await store.read(slots, keys_for(slots), rows)
        assert torch.equal(torch.stack(rows), src)

    async def test_large_batch_round_trip(self) -> None:
        rng = random.Random(5)
        store = await self.make_store(self.large_num_blocks, self.large_block_bytes)
        async with store:
            slots = list(range(store.num_blocks))[::-1]
            data = random_blocks(rng, len(slots), store.block_bytes)
            assert await store.write(slots, keys_for(slots), data) == [True] * len(slots)
            assert await self.read_back(store, slots) == data

    async def test_concurrent_batches(self, store: BlockStore) -> None:
        rng = random.Random(6)
        groups = [list(range(i, store.num_blocks, 4)) for i in range(4)]
        datas = [random_blocks(rng, len(g), store.block_bytes) for g in groups]
        writes = [store.write(g, keys_for(g), d) for g, d in zip(groups, datas, strict=True)]
        assert all(all(ok) for ok in await asyncio.gather(*writes))
        for group, data in zip(groups, datas, strict=True):
            assert await self.read_back(store, group) == data

    async def test_empty_batch(self, store: BlockStore) -> None:
        assert await store.write([], [], []) == []
        assert await store.read([], [], []) == []

    async def test_stats_count_bytes(self, store: BlockStore) -> None:
        before = store.stats()
        await store.write(
            [1, 2], keys_for([1, 2]), random_blocks(random.Random(7), 2, store.block_bytes)
        )
        await self.read_back(store, [2])
        after = store.stats()
        assert after.medium == store.medium
        assert (after.num_blocks, after.block_bytes) == (store.num_blocks, store.block_bytes)
        assert after.bytes_written - before.bytes_written == 2 * store.block_bytes
        assert after.bytes_read - before.bytes_read == store.block_bytes
        assert isinstance(after.details, dict)

    # -- views -----------------------------------------------------------------------

    async def test_view_reflects_writes(self, store: BlockStore) -> None:
        if not store.has_views:
            pytest.skip(f"{type(store).__name__} has no zero-copy views")
        rng = random.Random(8)
        view = store.view(3)  # taken before the write: a view, not a copy
        data = random_blocks(rng, 1, store.block_bytes)
        await store.write([3], keys_for([3]), data)
        assert as_bytes(view) == data[0]
        assert as_bytes(store.view(3)) == data[0]
        assert len(as_bytes(view)) == store.block_bytes

    # -- bad input -------------------------------------------------------------------

    async def test_out_of_range_slot(self, store: BlockStore) -> None:
        buf = [bytes(store.block_bytes)]
        for slot in (-1, store.num_blocks):
            with pytest.raises(SlotError):
                await store.write([slot], keys_for([0]), buf)
            with pytest.raises(SlotError):
                await store.read([slot], keys_for([0]), [bytearray(store.block_bytes)])
            with pytest.raises(SlotError):
                store.view(slot)

    async def test_keys_slots_length_mismatch(self, store: BlockStore) -> None:
        with pytest.raises(SlotError):
            await store.write([0, 1], keys_for([0]), [bytes(store.block_bytes)] * 2)
        with pytest.raises(SlotError):
            await store.read([0], keys_for([0, 1]), [bytearray(store.block_bytes)])

    async def test_bad_write_buffers_change_nothing(self, store: BlockStore) -> None:
        size = store.block_bytes
        original = random_blocks(random.Random(9), 2, size)
        await store.write([0, 1], keys_for([0, 1]), original)
        fresh = bytes([0xAB]) * size
        bad_batches: list[Any] = [
            [fresh, bytes(size - 1)],  # short
            [fresh, bytes(size + 1)],  # long
            [fresh],  # too few buffers
            [fresh, 12345],  # not a buffer
            torch.zeros((2, size // 4), dtype=torch.float32),  # wrong dtype
            torch.zeros((2, size + 1), dtype=torch.uint8),  # wrong shape
            torch.zeros((3, size), dtype=torch.uint8),  # wrong count
        ]
        for batch in bad_batches:
            with pytest.raises(SlotError):
                await store.write([0, 1], keys_for([0, 1]), batch)
        assert await self.read_back(store, [0, 1]) == original

    async def test_bad_read_buffers_raise(self, store: BlockStore) -> None:
        size = store.block_bytes
        for out in (
            [bytearray(size - 1)],
            [bytes(size)],
            torch.zeros((1, size), dtype=torch.int16),
        ):
            with pytest.raises(SlotError):
                await store.read([0], keys_for([0]), out)

    # -- lifecycle -------------------------------------------------------------------

    async def test_close_twice(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        await store.open()
        await store.close()
        await store.close()
        assert not store.is_open

    async def test_use_after_close(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        async with store:
            pass
        with pytest.raises(StoreClosed):
            await store.write([0], keys_for([0]), [bytes(store.block_bytes)])
        with pytest.raises(StoreClosed):
            await store.read([0], keys_for([0]), [bytearray(store.block_bytes)])
        with pytest.raises(StoreClosed):
            store.view(0)

    async def test_open_after_close(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        async with store:
            pass
        with pytest.raises(StoreClosed):
            await store.open()

    async def test_not_opened(self) -> None:
        store = await self.make_store(self.num_blocks, self.block_bytes)
        with pytest.raises(StoreClosed):
            await store.write([0], keys_for([0]), [bytes(store.block_bytes)])
        await store.close()  # closing a never-opened store is harmless

    async def test_cancelled_large_write_leaves_store_usable(self) -> None:
        rng = random.Random(10)
        store = await self.make_store(self.large_num_blocks, self.large_block_bytes)
        async with store:
            slots = list(range(store.num_blocks))
            task = asyncio.ensure_future(
                store.write(
                    slots, keys_for(slots), random_blocks(rng, len(slots), store.block_bytes)
                )
            )
            await asyncio.sleep(0)  # let the write start
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            data = random_blocks(rng, len(slots), store.block_bytes)
            await store.write(slots, keys_for(slots), data)
            assert await self.read_back(store, slots) == data
