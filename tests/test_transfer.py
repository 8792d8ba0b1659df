"""TransferEngine: routes, per-block failures, byte budgets and chunking, cancellation, stats.

The engine-mechanics tests use :class:`GateStore`, a RAM store defined here whose medium is
chosen per test, that fails chosen slots and can hold an operation open on an
``asyncio.Event`` (no sleeps). The round-trip tests at the bottom use the real stores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import random
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tierd.errors import SlotError, TransferError
from tierd.keys import BlockKey, Medium, int_key
from tierd.stores.base import BlockStore, StoreStats
from tierd.stores.cpu import CpuStore
from tierd.stores.disk.store import DiskStore
from tierd.stores.gpu import GpuStore
from tierd.stores.memory import MemoryStore
from tierd.transfer import ByteBudget, TransferEngine

BB = 4096  # block bytes for the mechanics tests


def _as_bytes(buf: Any) -> bytes:
    if isinstance(buf, torch.Tensor):
        return bytes(buf.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return bytes(memoryview(buf).cast("B"))


def _put(out: Any, data: bytes) -> None:
    if isinstance(out, torch.Tensor):
        out.view(torch.uint8).reshape(-1).copy_(
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
        )
    else:
        memoryview(out).cast("B")[:] = data


class GateStore(BlockStore):
    """A bytearray store: fails the slots in ``fail_read``/``fail_write``, holds every
    operation until ``gate`` is set (when one is given), and records batch sizes."""

    def __init__(
        self, medium: Medium, num_blocks: int = 64, block_bytes: int = BB, *, views: bool = True
    ) -> None:
        super().__init__(num_blocks=num_blocks, block_bytes=block_bytes)
        self.medium = medium
        self.has_views = views
        self.mem = bytearray(num_blocks * block_bytes)
        self.fail_read: set[int] = set()
        self.fail_write: set[int] = set()
        self.unreadable: set[int] = set()
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.batches: list[tuple[str, int]] = []
        self.finished = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def stats(self) -> StoreStats:
        return StoreStats(self.medium, self.num_blocks, self.block_bytes, 0, 0, 0, 0)

    async def _open(self) -> None:
        pass

    async def _close(self) -> None:
        pass

    def _view(self, slot: int) -> Any:
        if not self.has_views:
            raise NotImplementedError("no views")
        return memoryview(self.mem)[slot * self.block_bytes : (slot + 1) * self.block_bytes]

    async def _hold(self, kind: str, n: int) -> None:
        self.batches.append((kind, n))
        self.in_flight += n * self.block_bytes
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()

    async def _write(self, slots: Sequence[int], keys: Sequence[BlockKey], data: Any) -> list[bool]:
        await self._hold("write", len(slots))
        ok = []
        for slot, buf in zip(slots, data, strict=True):
            good = slot not in self.fail_write
            if good:
                self.mem[slot * self.block_bytes : (slot + 1) * self.block_bytes] = _as_bytes(buf)
                self.unreadable.discard(slot)
            else:
                self.unreadable.add(slot)
            ok.append(good)
        self.in_flight -= len(slots) * self.block_bytes
        self.finished += 1
        return ok

    async def _read(self, slots: Sequence[int], keys: Sequence[BlockKey], out: Any) -> list[bool]:
        await self._hold("read", len(slots))
        ok = []
        for slot, buf in zip(slots, out, strict=True):
            good = slot not in self.fail_read and slot not in self.unreadable
            if good:
                _put(buf, bytes(self.mem[slot * self.block_bytes : (slot + 1) * self.block_bytes]))
            ok.append(good)
        self.in_flight -= len(slots) * self.block_bytes
        self.finished += 1
        return ok


def _blocks(n: int, bb: int = BB, seed: int = 0) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=gen)
    return [bytes(row.numpy().tobytes()) for row in data]


def _keys(slots: Sequence[int]) -> list[BlockKey]:
    return [int_key(s) for s in slots]


async def _fake(medium: Medium, *, views: bool = True, blocks: int = 64) -> GateStore:
    return await GateStore(medium, blocks, views=views).open()


def _fake_staging(num_blocks: int, block_bytes: int) -> BlockStore:
    return GateStore(Medium.CPU, num_blocks, block_bytes)


async def _fill(store: GateStore, slots: Sequence[int], seed: int = 0) -> list[bytes]:
    data = _blocks(len(slots), store.block_bytes, seed)
    for slot, block in zip(slots, data, strict=True):
        store.mem[slot * store.block_bytes : (slot + 1) * store.block_bytes] = block
    return data


def _content(store: GateStore, slot: int) -> bytes:
    return bytes(store.mem[slot * store.block_bytes : (slot + 1) * store.block_bytes])


# -- routes ------------------------------------------------------------------------------


def test_route_table_has_every_required_route() -> None:
    ram, gpu, disk = (Medium.MEMORY, Medium.CPU), Medium.GPU, Medium.DISK
    need = {(a, b) for a in ram for b in ram}
    need |= {(a, b) for a in ram for b in (gpu, disk)} | {(b, a) for a in ram for b in (gpu, disk)}
    need |= {(gpu, disk), (disk, gpu)}
    assert need <= set(TransferEngine.routes())


@pytest.mark.parametrize(("src", "dst"), [(Medium.DISK, Medium.DISK), (Medium.GPU, Medium.GPU)])
async def test_unsupported_route_names_both_media(src: Medium, dst: Medium) -> None:
    a, b = await _fake(src), await _fake(dst)
    async with TransferEngine() as engine:
        with pytest.raises(TransferError, match=f"from {src} to {dst}"):
            await engine.copy(a, [0], b, [0], _keys([0]))
    assert a.batches == b.batches == []


async def test_bad_batches_raise_before_any_byte_moves() -> None:
    a, b = await _fake(Medium.MEMORY), await _fake(Medium.CPU)
    small = await GateStore(Medium.CPU, 4, BB // 2).open()
    async with TransferEngine() as engine:
        with pytest.raises(SlotError):
            await engine.copy(a, [0, 1], b, [0], _keys([0, 1]))
        with pytest.raises(TransferError, match="block sizes differ"):
            await engine.copy(a, [0], small, [0], _keys([0]))
        with pytest.raises(SlotError):
            await engine.copy(a, [0], b, [99], _keys([0]))
        assert await engine.copy(a, [], b, [], []) == []
    assert b.batches == []


@pytest.mark.parametrize(
    ("src", "dst", "src_views", "dst_views"),
    [
        (Medium.MEMORY, Medium.CPU, True, True),
        (Medium.CPU, Medium.GPU, True, False),
        (Medium.GPU, Medium.CPU, False, True),
        (Medium.CPU, Medium.DISK, True, False),
        (Medium.DISK, Medium.MEMORY, False, True),
        (Medium.GPU, Medium.DISK, False, False),
        (Medium.DISK, Medium.GPU, False, False),
        (Medium.MEMORY, Medium.CPU, False, False),  # no views on either side: staged
    ],
)
async def test_fake_routes_copy_bytes(
    src: Medium, dst: Medium, src_views: bool, dst_views: bool
) -> None:
    a, b = await _fake(src, views=src_views), await _fake(dst, views=dst_views)
    slots = list(range(10))
    data = await _fill(a, slots)
    engine = TransferEngine(staging_bytes=3 * BB, staging_factory=_fake_staging)
    async with engine:
        ok = await engine.copy(a, slots, b, [s + 20 for s in slots], _keys(slots))
    assert ok == [True] * 10
    assert [_content(b, s + 20) for s in slots] == data


# -- per-block failures ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "reads_src", "writes_dst"),
    [
        (Medium.MEMORY, Medium.MEMORY, False, True),  # the destination writes from views
        (Medium.CPU, Medium.GPU, False, True),
        (Medium.GPU, Medium.CPU, True, False),  # the source reads into views
        (Medium.DISK, Medium.CPU, True, False),
        (Medium.GPU, Medium.DISK, True, True),  # staged: both
    ],
)
async def test_failed_blocks_are_reported_and_never_readable(
    src: Medium, dst: Medium, reads_src: bool, writes_dst: bool
) -> None:
    ram = (Medium.MEMORY, Medium.CPU)
    a, b = await _fake(src, views=src in ram), await _fake(dst, views=dst in ram)
    slots = list(range(8))
    data = await _fill(a, slots)
    a.fail_read, b.fail_write = {1, 5}, {12, 13}  # src slot 5 is dst slot 13 too
    engine = TransferEngine(staging_bytes=3 * BB, staging_factory=_fake_staging)
    async with engine:
        ok = await engine.copy(a, slots, b, [s + 8 for s in slots], _keys(slots))
    failed = ({1, 5} if reads_src else set()) | ({4, 5} if writes_dst else set())
    assert ok == [s not in failed for s in slots]
    for s in slots:
        if ok[s]:
            assert _content(b, s + 8) == data[s]
    if writes_dst:  # the destination itself refuses the blocks whose write failed
        assert await b.read([12], _keys([4]), [bytearray(BB)]) == [False]
    stats = engine.stats()[src, dst]
    assert (stats.blocks, stats.failures) == (8 - len(failed), len(failed))


async def test_staged_route_skips_the_write_of_blocks_whose_read_failed() -> None:
    a, b = await _fake(Medium.GPU, views=False), await _fake(Medium.DISK, views=False)
    await _fill(a, range(4))
    a.fail_read = {0, 1, 2, 3}
    async with TransferEngine(staging_factory=_fake_staging) as engine:
        assert await engine.copy(a, range(4), b, range(4), _keys(range(4))) == [False] * 4
    assert b.batches == []


# -- budget and chunking -----------------------------------------------------------------


async def test_batch_larger_than_budget_is_chunked() -> None:
    a, b = await _fake(Medium.CPU), await _fake(Medium.DISK, views=False)
    data = await _fill(a, range(10))
    engine = TransferEngine(route_budgets={(Medium.CPU, Medium.DISK): 3 * BB})
    ok = await engine.copy(a, range(10), b, range(10), _keys(range(10)))
    assert ok == [True] * 10
    assert b.batches == [("write", 3), ("write", 3), ("write", 3), ("write", 1)]
    assert [_content(b, s) for s in range(10)] == data
    assert b.max_in_flight <= 3 * BB


async def test_concurrent_copies_share_the_route_budget() -> None:
    a, b = await _fake(Medium.MEMORY), await _fake(Medium.CPU)
    await _fill(a, range(12))
    b.gate = asyncio.Event()
    engine = TransferEngine(route_budgets={(Medium.MEMORY, Medium.CPU): 4 * BB})
    budget = engine.budget(Medium.MEMORY, Medium.CPU)
    tasks = [
        asyncio.create_task(engine.copy(a, range(i, i + 3), b, range(i, i + 3), _keys(range(3))))
        for i in (0, 3, 6, 9)
    ]
    await b.entered.wait()
    for _ in range(5):  # let every task run as far as it can
        await asyncio.sleep(0)
    assert b.in_flight == budget.in_flight == 3 * BB  # a second 3-block copy does not fit
    assert engine.stats()[Medium.MEMORY, Medium.CPU].in_flight_bytes == 3 * BB
    b.gate.set()
    assert await asyncio.gather(*tasks) == [[True] * 3] * 4
    assert b.max_in_flight <= 4 * BB
    assert budget.available == budget.capacity


async def test_block_larger_than_budget_runs_alone() -> None:
    a, b = await _fake(Medium.MEMORY), await _fake(Medium.MEMORY)
    await _fill(a, range(3))
    engine = TransferEngine(budget_bytes=BB // 2)
    assert await engine.copy(a, range(3), b, range(3), _keys(range(3))) == [True] * 3
    assert b.batches == [("write", 1)] * 3


async def test_byte_budget_is_fifo_and_cancelled_waiters_leave_no_trace() -> None:
    budget = ByteBudget(10)
    assert await budget.acquire(8) == 8
    big = asyncio.create_task(budget.acquire(5))
    small = asyncio.create_task(budget.acquire(2))
    await asyncio.sleep(0)
    assert not big.done()
    assert not small.done()  # FIFO: small waits behind big
    big.cancel()
    assert await small == 2  # the head left, so the smaller waiter fits now
    with pytest.raises(asyncio.CancelledError):
        await big
    budget.release(8)
    budget.release(2)
    assert budget.available == 10
    assert await budget.acquire(50) == 10  # oversize: charged the whole budget


# -- cancellation ------------------------------------------------------------------------


async def test_cancel_waits_for_the_started_write_then_frees_the_budget() -> None:
    a, b = await _fake(Medium.CPU), await _fake(Medium.DISK, views=False)
    await _fill(a, range(6))
    b.gate = asyncio.Event()
    engine = TransferEngine(route_budgets={(Medium.CPU, Medium.DISK): 2 * BB})
    budget = engine.budget(Medium.CPU, Medium.DISK)
    task = asyncio.create_task(engine.copy(a, range(6), b, range(6), _keys(range(6))))
    await b.entered.wait()
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()  # the started write still runs; the copy has not returned
    assert budget.in_flight == 2 * BB
    b.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.finished == 1  # the write had finished before the copy returned...
    assert b.batches == [("write", 2)]  # ...and no further chunk started
    assert budget.available == budget.capacity
    b.gate = None
    data = await _fill(a, range(6), seed=7)
    assert await engine.copy(a, range(6), b, range(6), _keys(range(6))) == [True] * 6
    assert [_content(b, s) for s in range(6)] == data


async def test_cancel_while_waiting_for_budget_leaks_nothing() -> None:
    a, b = await _fake(Medium.MEMORY), await _fake(Medium.MEMORY)
    b.gate = asyncio.Event()
    engine = TransferEngine(budget_bytes=2 * BB)
    budget = engine.budget(Medium.MEMORY, Medium.MEMORY)
    first = asyncio.create_task(engine.copy(a, [0, 1], b, [0, 1], _keys([0, 1])))
    await b.entered.wait()
    queued = asyncio.create_task(engine.copy(a, [2], b, [2], _keys([2])))
    await asyncio.sleep(0)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    b.gate.set()
    assert await first == [True, True]
    assert budget.available == budget.capacity
    assert b.batches == [("write", 2)]


async def test_cancel_between_staged_hops_starts_no_write() -> None:
    a, b = await _fake(Medium.GPU, views=False), await _fake(Medium.DISK, views=False)
    await _fill(a, range(4))
    a.gate = asyncio.Event()
    engine = TransferEngine(staging_factory=_fake_staging)
    task = asyncio.create_task(engine.copy(a, range(4), b, range(4), _keys(range(4))))
    await a.entered.wait()
    task.cancel()
    a.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.finished == 1
    assert b.batches == []
    assert engine.budget(Medium.GPU, Medium.DISK).in_flight == 0
    a.gate = None
    assert await engine.copy(a, range(4), b, range(4), _keys(range(4))) == [True] * 4
    await engine.close()


async def test_repeated_cancellation_still_waits_for_the_store() -> None:
    a, b = await _fake(Medium.MEMORY), await _fake(Medium.CPU)
    b.gate = asyncio.Event()
    engine = TransferEngine()
    task = asyncio.create_task(engine.copy(a, [0], b, [0], _keys([0])))
    await b.entered.wait()
    for _ in range(3):
        task.cancel()
        await asyncio.sleep(0)
    assert not task.done()
    b.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.finished == 1
    assert engine.budget(Medium.MEMORY, Medium.CPU).in_flight == 0


# -- stats -------------------------------------------------------------------------------


async def test_stats_count_bytes_blocks_failures_and_time() -> None:
    a, b = await _fake(Medium.CPU), await _fake(Medium.MEMORY)
    await _fill(a, range(5))
    b.fail_write = {3}
    engine = TransferEngine()
    await engine.copy(a, range(5), b, range(5), _keys(range(5)))
    await engine.copy(a, range(2), b, range(2), _keys(range(2)))
    st = engine.stats()[Medium.CPU, Medium.MEMORY]
    assert (st.src, st.dst) == (Medium.CPU, Medium.MEMORY)
    assert (st.blocks, st.bytes, st.failures) == (6, 6 * BB, 1)
    assert st.busy_s > 0
    assert st.gb_per_s == pytest.approx(st.bytes / st.busy_s / 1e9)
    assert (st.in_flight_bytes, st.budget_bytes) == (0, 256 << 20)
    untouched = engine.stats()[Medium.DISK, Medium.CPU]
    assert (untouched.bytes, untouched.busy_s, untouched.gb_per_s) == (0, 0.0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.bytes = 0  # type: ignore[misc]


async def test_store_errors_propagate_and_count_as_failures() -> None:
    class Broken(GateStore):
        async def _write(self, slots: Sequence[int], keys: Sequence[BlockKey], data: Any) -> Any:
            raise TransferError("medium gone")

    a, b = await _fake(Medium.MEMORY), await Broken(Medium.MEMORY).open()
    engine = TransferEngine(budget_bytes=2 * BB)
    with pytest.raises(TransferError, match="medium gone"):
        await engine.copy(a, range(4), b, range(4), _keys(range(4)))
    st = engine.stats()[Medium.MEMORY, Medium.MEMORY]
    assert (st.failures, st.in_flight_bytes) == (2, 0)


# -- real stores: every route on this machine, byte-identical ----------------------------

RT_BLOCKS = 24
MEDIA_HERE = set(Medium)  # GPU: a GpuStore on device "cpu"


def _make_store(medium: Medium, block_bytes: int, tmp: Path, gpu: str = "cpu") -> BlockStore:
    n, bb = RT_BLOCKS, block_bytes
    if medium is Medium.MEMORY:
        return MemoryStore(num_blocks=n, block_bytes=bb)
    if medium is Medium.CPU:
        return CpuStore(num_blocks=n, block_bytes=bb, name=f"tierd-test-{uuid.uuid4().hex}")
    if medium is Medium.GPU:
        return GpuStore(num_blocks=n, block_bytes=bb, device=gpu)
    tmp.mkdir(parents=True, exist_ok=True)
    return DiskStore(num_blocks=n, block_bytes=bb, directories=[tmp], fsync="never")


def _aligned(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))  # page-aligned, as O_DIRECT wants


async def _store_roundtrip(src: BlockStore, dst: BlockStore, engine: TransferEngine, seed: int):
    rng = random.Random(seed)
    bb = src.block_bytes
    for round_ in range(4):
        n = rng.randint(1, RT_BLOCKS)
        s_slots, d_slots = rng.sample(range(RT_BLOCKS), n), rng.sample(range(RT_BLOCKS), n)
        if round_ == 0:  # consecutive runs: the engine hands over one [n, block_bytes] tensor
            start = rng.randint(0, RT_BLOCKS - n)
            s_slots, d_slots = list(range(start, start + n)), list(range(RT_BLOCKS - n, RT_BLOCKS))
        keys = [int_key(rng.getrandbits(63)) for _ in range(n)]
        data = _blocks(n, bb, seed=rng.getrandbits(31))
        bufs = [_aligned(bb) for _ in range(n)]
        for buf, block in zip(bufs, data, strict=True):
            buf[:] = block
        assert await src.write(s_slots, keys, bufs) == [True] * n
        assert await engine.copy(src, s_slots, dst, d_slots, keys) == [True] * n
        out = [_aligned(bb) for _ in range(n)]
        assert await dst.read(d_slots, keys, out) == [True] * n
        assert [bytes(o) for o in out] == data


ROUTES_HERE = [
    route for route in TransferEngine.routes() if route[0] in MEDIA_HERE and route[1] in MEDIA_HERE
]


@pytest.mark.parametrize("block_bytes", [4096, 3 * 4096])
@pytest.mark.parametrize(("src_medium", "dst_medium"), ROUTES_HERE, ids=str)
async def test_every_route_here_is_byte_identical(
    src_medium: Medium, dst_medium: Medium, block_bytes: int, tmp_path: Path
) -> None:
    await _route_roundtrip(src_medium, dst_medium, block_bytes, tmp_path, "cpu")


CUDA_ROUTES = [r for r in TransferEngine.routes() if Medium.GPU in r]


@pytest.mark.parametrize(("src_medium", "dst_medium"), CUDA_ROUTES, ids=str)
async def test_gpu_routes_with_big_blocks(
    src_medium: Medium, dst_medium: Medium, tmp_path: Path
) -> None:
    # From 1 MiB per block the engine hands per-block tensors to the GPU store.
    await _route_roundtrip(src_medium, dst_medium, 1 << 20, tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("block_bytes", [256 * 1024, 2 << 20])
@pytest.mark.parametrize(("src_medium", "dst_medium"), CUDA_ROUTES, ids=str)
async def test_cuda_routes_are_byte_identical(
    src_medium: Medium, dst_medium: Medium, block_bytes: int, tmp_path: Path
) -> None:
    await _route_roundtrip(src_medium, dst_medium, block_bytes, tmp_path, "cuda")


async def _route_roundtrip(
    src_medium: Medium, dst_medium: Medium, block_bytes: int, tmp: Path, gpu: str
) -> None:
    seed = zlib.crc32(f"{src_medium}-{dst_medium}-{block_bytes}".encode())
    budget = random.Random(seed).choice([block_bytes, 5 * block_bytes, 256 << 20])
    async with (
        _make_store(src_medium, block_bytes, tmp / "src", gpu) as src,
        _make_store(dst_medium, block_bytes, tmp / "dst", gpu) as dst,
        TransferEngine(budget_bytes=budget, staging_bytes=4 * block_bytes) as engine,
    ):
        await _store_roundtrip(src, dst, engine, seed)
        stats = engine.stats()[src_medium, dst_medium]
        assert stats.failures == 0
        assert stats.bytes == stats.blocks * block_bytes > 0
