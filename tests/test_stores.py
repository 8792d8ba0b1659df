"""The store conformance suite over every in-memory store, plus what each store adds:
the shared-memory file of the CPU pool, GPU streams (under the cuda marker), the copy
helpers and the fakes."""

from __future__ import annotations

import asyncio
import os
import random
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierd.errors import SlotError, StoreClosed, StoreIOError
from tierd.keys import int_key
from tierd.stores import BlockStore, CpuStore, GpuStore, MemoryStore
from tierd.stores.base import block_views, run_copy, settle, slot_run_start
from tierd.stores.cpu import PAGE, default_pool_name
from tierd.stores.cuda import EventWaiter, cuda_available
from tierd.testing import FailingStore, StoreConformance, as_bytes, keys_for, random_blocks

SHM = "/dev/shm"


def _exists(path: str | Path) -> bool:
    return os.path.exists(path)


def _mode_and_size(path: str | Path) -> tuple[int, int]:
    info = os.stat(path)
    return stat.S_IMODE(info.st_mode), info.st_size


def _read_at(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as raw:
        raw.seek(offset)
        return raw.read(size)


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"tierd-test-{default_pool_name()}"
    yield name
    path = os.path.join(SHM, name)
    if _exists(path):
        os.unlink(path)
        pytest.fail(f"{path} was left behind")


# -- the conformance suite over every store ---------------------------------------------


class TestMemoryStore(StoreConformance):
    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        return MemoryStore(num_blocks=num_blocks, block_bytes=block_bytes)


class TestCpuStore(StoreConformance):
    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        return CpuStore(
            num_blocks=num_blocks, block_bytes=block_bytes, name=f"tierd-test-{default_pool_name()}"
        )


class TestGpuStoreOnCpu(StoreConformance):
    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        return GpuStore(num_blocks=num_blocks, block_bytes=block_bytes, device="cpu")


@pytest.mark.cuda
class TestGpuStoreOnCuda(StoreConformance):
    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        return GpuStore(num_blocks=num_blocks, block_bytes=block_bytes, device="cuda:0")


class TestFailingStoreWithoutFailures(StoreConformance):
    async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
        return FailingStore(MemoryStore(num_blocks=num_blocks, block_bytes=block_bytes))


# -- CpuStore: the shared-memory file ---------------------------------------------------


async def test_cpu_pool_file_mode_size_and_unlink(pool_name: str) -> None:
    path = Path(SHM, pool_name)
    store = CpuStore(num_blocks=5, block_bytes=5000, name=pool_name)
    async with store:
        assert store.path == str(path)
        mode, size = _mode_and_size(path)
        assert mode == 0o600
        assert store.stride == 2 * PAGE
        assert size == 5 * 2 * PAGE  # exact, no power-of-two rounding
        assert [store.slot_offset(s) for s in range(5)] == [s * 2 * PAGE for s in range(5)]
        assert all(store.tensor_view(s).data_ptr() % PAGE == 0 for s in range(5))
        assert store.pool_tensor().shape == (5, 2 * PAGE)
    assert not _exists(path)


async def test_cpu_pool_mode_is_honoured_despite_umask(pool_name: str) -> None:
    old = os.umask(0o077)
    try:
        async with CpuStore(num_blocks=1, block_bytes=64, name=pool_name, mode=0o640) as store:
            assert _mode_and_size(store.path)[0] == 0o640
    finally:
        os.umask(old)


async def test_cpu_pool_refuses_an_existing_file(pool_name: str) -> None:
    async with CpuStore(num_blocks=1, block_bytes=64, name=pool_name):
        with pytest.raises(StoreIOError):
            await CpuStore(num_blocks=1, block_bytes=64, name=pool_name).open()


async def test_cpu_pool_second_mapping_sees_the_bytes(pool_name: str) -> None:
    data = random_blocks(random.Random(1), 2, 3000)
    async with CpuStore(num_blocks=4, block_bytes=3000, name=pool_name) as owner:
        await owner.write([1, 3], keys_for([1, 3]), data)
        async with CpuStore(num_blocks=4, block_bytes=3000, name=pool_name, create=False) as peer:
            assert as_bytes(peer.view(3)) == data[1]
            # the documented layout: slot s at s * stride
            assert _read_at(owner.path, owner.slot_offset(1), 3000) == data[0]
            await peer.write([0], keys_for([0]), [data[1]])
            assert as_bytes(owner.view(0)) == data[1]
        assert _exists(owner.path)  # an attached store never unlinks


async def test_cpu_pool_attach_checks_size(pool_name: str) -> None:
    async with CpuStore(num_blocks=4, block_bytes=3000, name=pool_name):
        with pytest.raises(StoreIOError):
            await CpuStore(num_blocks=5, block_bytes=3000, name=pool_name, create=False).open()


async def test_cpu_pool_keep_leaves_the_file(pool_name: str) -> None:
    async with CpuStore(num_blocks=1, block_bytes=64, name=pool_name, keep=True) as store:
        path = store.path
    assert _exists(path)
    os.unlink(path)


async def test_cpu_pool_views_outlive_close_safely(pool_name: str) -> None:
    store = CpuStore(num_blocks=2, block_bytes=100, name=pool_name)
    async with store:
        await store.write([1], keys_for([1]), [b"x" * 100])
        view, row = store.view(1), store.tensor_view(1)
    assert not _exists(store.path)
    assert bytes(view) == b"x" * 100  # still mapped: the views hold the mapping
    assert as_bytes(row) == b"x" * 100
    del view, row


@pytest.mark.skipif(cuda_available(), reason="checks the report without CUDA")
async def test_cpu_pool_without_cuda_says_unpinned(pool_name: str) -> None:
    async with CpuStore(num_blocks=1, block_bytes=64, name=pool_name) as store:
        details = store.stats().details
        assert details["pinned"] is False
        assert details["reason"]
        assert not store.pinned


@pytest.mark.cuda
async def test_cpu_pool_is_pinned_with_cuda(pool_name: str) -> None:
    store = CpuStore(num_blocks=8, block_bytes=5000, name=pool_name, register_chunk_bytes=3 * PAGE)
    async with store:
        assert store.pinned, store.stats().details
        assert store.stats().details["pinned"] is True
        assert store.pool_tensor().is_pinned()
        data = torch.randint(0, 256, (8, 5000), dtype=torch.uint8, device="cuda:0")
        await store.write(list(range(8)), keys_for(range(8)), data)
        out = torch.empty_like(data)
        await store.read(list(range(8)), keys_for(range(8)), out)
        assert torch.equal(out, data)
    # Unregistered before unmapping: a fresh pool of the same size registers again.
    async with CpuStore(num_blocks=8, block_bytes=5000, name=pool_name) as again:
        assert again.pinned


# -- GpuStore -----------------------------------------------------------------------------


async def test_gpu_store_on_cpu_reports_it() -> None:
    async with GpuStore(num_blocks=2, block_bytes=16, device="cpu") as store:
        details = store.stats().details
        assert details["device"] == "cpu"
        assert details["cuda"] is False
        assert store.view(1).shape == (16,)
        assert store.pool_tensor().shape == (2, 16)


@pytest.mark.skipif(cuda_available(), reason="checks the failure without CUDA")
async def test_gpu_store_without_cuda_fails_to_open() -> None:
    with pytest.raises(StoreIOError):
        await GpuStore(num_blocks=2, block_bytes=16, device="cuda:0").open()


def test_gpu_store_rejects_other_devices() -> None:
    with pytest.raises(ValueError, match="cuda or cpu"):
        GpuStore(num_blocks=2, block_bytes=16, device="meta")


@pytest.mark.cuda
async def test_gpu_store_between_pinned_pool_and_device_views(pool_name: str) -> None:
    block = 4096
    slots = [5, 0, 9, 3]
    async with (
        GpuStore(num_blocks=16, block_bytes=block, device="cuda:0") as gpu,
        CpuStore(num_blocks=16, block_bytes=block, name=pool_name) as cpu,
    ):
        data = random_blocks(random.Random(2), len(slots), block)
        await cpu.write(slots, keys_for(slots), data)
        # host views -> GPU (pinned staging, one copy, index_copy_), then back
        await gpu.write(slots, keys_for(slots), [cpu.view(s) for s in slots])
        assert [as_bytes(gpu.view(s)) for s in slots] == data
        await gpu.read(slots, keys_for(slots), [cpu.view(s) for s in [1, 2, 4, 6]])
        assert [as_bytes(cpu.view(s)) for s in [1, 2, 4, 6]] == data
        # GPU rows straight into the host pool, and device tensors in both directions
        await cpu.write([10, 11], keys_for([10, 11]), [gpu.view(5), gpu.view(0)])
        assert [as_bytes(cpu.view(s)) for s in (10, 11)] == data[:2]
        dev = torch.empty((len(slots), block), dtype=torch.uint8, device="cuda:0")
        await gpu.read(slots, keys_for(slots), dev)
        await gpu.write([12, 13, 14, 15], keys_for(range(4)), dev)
        assert [as_bytes(gpu.view(s)) for s in range(12, 16)] == data
        assert gpu.stats().details["cuda"] is True


# -- copy helpers ---------------------------------------------------------------------


def test_slot_run_start() -> None:
    assert slot_run_start([4, 5, 6]) == 4
    assert slot_run_start([4]) == 4
    assert slot_run_start([]) is None
    assert slot_run_start([4, 6]) is None
    assert slot_run_start([5, 4]) is None


def test_block_views_accepts_buffers_and_host_tensors() -> None:
    views = block_views(
        [b"ab", bytearray(b"cd"), torch.tensor([1, 2], dtype=torch.uint8)], 3, 2, writable=False
    )
    assert [bytes(v) for v in views] == [b"ab", b"cd", b"\x01\x02"]
    whole = torch.arange(6, dtype=torch.uint8).view(3, 2)
    assert [bytes(v) for v in block_views(whole, 3, 2, writable=True)] == [
        b"\0\1",
        b"\2\3",
        b"\4\5",
    ]
    with pytest.raises(SlotError):
        block_views(
            [torch.zeros(2, dtype=torch.uint8)[::1].expand(2, 2).t()[0]], 1, 2, writable=False
        )


async def test_settle_waits_for_the_worker_through_cancellation() -> None:
    release, finished = threading.Event(), threading.Event()

    def worker() -> int:
        release.wait()
        finished.set()
        return 7

    future = asyncio.get_running_loop().run_in_executor(None, worker)
    task = asyncio.ensure_future(settle(future))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not task.done()  # cancelled, but the copy is still running
    task.cancel()  # a second cancellation is held too
    await asyncio.sleep(0)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()
    assert future.result() == 7


async def test_settle_returns_the_result_and_raises_the_error() -> None:
    loop = asyncio.get_running_loop()
    assert await settle(loop.run_in_executor(None, lambda: 3)) == 3

    def boom() -> None:
        raise OSError("x")

    with pytest.raises(OSError, match="x"):
        await settle(loop.run_in_executor(None, boom))


async def test_run_copy_inline_below_the_limit_and_threaded_above() -> None:
    here = threading.get_ident()
    assert await run_copy(threading.get_ident, 10, inline_limit=100) == here
    assert await run_copy(threading.get_ident, 1000, inline_limit=100) != here


# -- the event waiter (with a fake event: no CUDA needed) ------------------------------


class _FakeEvent:
    def __init__(self, error: Exception | None = None) -> None:
        self.done = threading.Event()
        self.error = error

    def synchronize(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


async def test_event_waiter_resolves_in_order_and_passes_errors() -> None:
    waiter = EventWaiter("test-waiter")
    try:
        first, second = _FakeEvent(), _FakeEvent(RuntimeError("device lost"))
        f1, f2 = waiter.wait(first), waiter.wait(second)
        await asyncio.sleep(0)
        assert not f1.done()
        first.done.set()
        await f1
        second.done.set()
        with pytest.raises(RuntimeError, match="device lost"):
            await f2
    finally:
        waiter.close(timeout=5)
    with pytest.raises(RuntimeError):
        waiter.wait(_FakeEvent())


async def test_event_waiter_tolerates_a_cancelled_awaiter() -> None:
    waiter = EventWaiter("test-waiter")
    try:
        event = _FakeEvent()
        future = waiter.wait(event)
        future.cancel()
        event.done.set()
        later = _FakeEvent()
        later.done.set()
        await waiter.wait(later)
    finally:
        waiter.close(timeout=5)


# -- FailingStore ---------------------------------------------------------------------


async def test_failing_store_fails_chosen_keys_until_rewritten() -> None:
    store = FailingStore(MemoryStore(num_blocks=4, block_bytes=8), fail_writes=[int_key(1)])
    async with store:
        data = [b"a" * 8, b"b" * 8]
        assert await store.write([0, 1], keys_for([0, 1]), data) == [True, False]
        out = [bytearray(8), bytearray(8)]
        assert await store.read([0, 1], keys_for([0, 1]), out) == [True, False]
        assert bytes(out[0]) == data[0]
        store.fail_writes.clear()
        store.fail_reads.add(int_key(0))
        assert await store.write([1], keys_for([1]), [data[1]]) == [True]
        assert await store.read([0, 1], keys_for([0, 1]), out) == [False, True]
        assert bytes(out[1]) == data[1]
        assert store.stats().write_errors == 1
        assert store.stats().read_errors == 2


async def test_failing_store_gate_holds_copies() -> None:
    gate = asyncio.Event()
    store = FailingStore(MemoryStore(num_blocks=2, block_bytes=4), gate=gate)
    async with store:
        task = asyncio.ensure_future(store.write([0], keys_for([0]), [b"abcd"]))
        await store.entered.wait()
        assert not task.done()
        gate.set()
        assert await task == [True]
    with pytest.raises(StoreClosed):
        store.view(0)
