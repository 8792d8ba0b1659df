"""The GPU tier's CUDA paths, checked on a machine without a GPU (issue 26).

What needs no device is tested here: the split of slot runs at host-registration edges
(arithmetic), a GPU entry tier over the socket (``device: cpu`` runs the same code), old
torch without ``AcceleratorError``, clearing CUDA's last error after a failed
registration and a registration that a stop interrupts (a fake runtime binding), and the
ordering of streams and events, with recording fakes at the store's seams for the CUDA
calls (``_current_stream``, ``_device_scope``, ``_stream_scope``, ``_record``): which
stream a copy waits for, that a launched copy is always waited for, that a sticky error
or a hung copy marks the store lost. What only a GPU can show is marked ``cuda`` in
tests/test_stores.py and tests/test_transfer.py, and scripts/gpu_probe runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import torch

from tierd.client import Client
from tierd.errors import SlotError, StoreIOError
from tierd.keys import int_key
from tierd.stores import gpu as gpu_module
from tierd.stores.cpu import CpuStore
from tierd.stores.cuda import EventWaiter, host_register, split_at_boundaries
from tierd.stores.gpu import DeviceLost, GpuStore, _Lane
from tierd.testing import daemon_config, running_daemon, start_daemon_async
from tierd.transfer import TransferEngine

ROOT = Path(__file__).resolve().parent.parent
BB = 4096


# -- C2: a copy never crosses two registrations ---------------------------------------------


@pytest.mark.parametrize(
    ("slots", "boundary", "pieces"),
    [
        ([], 4, []),
        ([0, 1, 2, 3], 4, [(0, 4)]),
        ([2, 3, 4, 5], 4, [(0, 2), (2, 4)]),
        ([3, 4, 5, 6, 7, 8, 9], 4, [(0, 1), (1, 5), (5, 7)]),
        ([3, 9, 4], 4, [(0, 3)]),  # not consecutive: separate copies anyway
        ([7, 8, 8, 9], 8, [(0, 1), (1, 4)]),
        ([0, 1, 2], 1, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_runs_are_cut_at_registration_edges(
    slots: list[int], boundary: int, pieces: list[tuple[int, int]]
) -> None:
    assert split_at_boundaries(slots, boundary) == pieces


class _RecordingGpu(GpuStore):
    """A GPU store on ``device="cpu"`` that records the host slots of every copy."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.batches: list[int] = []

    async def _write(self, slots: Any, keys: Any, data: Any) -> list[bool]:
        self.batches.append(len(slots))
        return await super()._write(slots, keys, data)

    async def _read(self, slots: Any, keys: Any, out: Any) -> list[bool]:
        self.batches.append(len(slots))
        return await super()._read(slots, keys, out)


async def test_a_run_across_two_registrations_goes_as_two_copies() -> None:
    """A pool registered 4 slots at a time: slots 2..9 to the GPU and back go as 2+4+2."""
    cpu = CpuStore(num_blocks=16, block_bytes=BB, pin=False, register_chunk_bytes=4 * BB)
    assert cpu.dma_boundary == 4
    gpu = _RecordingGpu(num_blocks=16, block_bytes=BB, device="cpu")
    keys = [int_key(i) for i in range(8)]
    async with cpu, gpu, TransferEngine() as engine:
        for i, slot in enumerate(range(2, 10)):
            cpu.view(slot)[:] = bytes([i + 1]) * BB
        assert await engine.copy(cpu, range(2, 10), gpu, range(8), keys) == [True] * 8
        assert gpu.batches == [2, 4, 2]
        gpu.batches.clear()
        assert await engine.copy(gpu, range(8), cpu, range(6, 14), keys) == [True] * 8
        assert gpu.batches == [2, 4, 2]  # slots 6,7 | 8..11 | 12,13
        assert [bytes(cpu.view(s))[0] for s in range(6, 14)] == list(range(1, 9))


async def test_scattered_pool_slots_go_to_the_gpu_one_dma_per_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scattered slots of a host pool reach the GPU store as per-block tensors, each one
    copy, in both directions: never packed through a Python memcpy into staging (on an
    H100, packing moved 5 GB/s where per-block DMAs moved 22 at 256 KiB and 49 at 2 MiB)."""
    bb = 256 << 10

    def no_packing(*args: Any) -> None:
        raise AssertionError("per-block host tensors were packed into staging")

    monkeypatch.setattr(gpu_module, "pack", no_packing)
    monkeypatch.setattr(gpu_module, "new_staging", no_packing)
    cpu = CpuStore(num_blocks=8, block_bytes=bb, pin=False)
    gpu = _RecordingGpu(num_blocks=8, block_bytes=bb, device="cpu")
    keys = [int_key(i) for i in range(3)]
    async with cpu, gpu, TransferEngine() as engine:
        for slot in (6, 1, 4):
            cpu.view(slot)[:] = bytes([slot]) * bb
        assert await engine.copy(cpu, [6, 1, 4], gpu, [0, 5, 2], keys) == [True] * 3
        assert await engine.copy(gpu, [0, 5, 2], cpu, [3, 7, 0], keys) == [True] * 3
        assert gpu.batches == [3, 3]
        assert [bytes(cpu.view(s)[:2]) for s in (3, 7, 0)] == [
            b"\x06" * 2,
            b"\x01" * 2,
            b"\x04" * 2,
        ]


async def test_a_pools_own_rows_are_still_checked_for_count_size_and_range() -> None:
    """A pool's slot tensors skip the row-by-row check, not the batch's: a wrong count or
    block size is a SlotError before any byte moves, and so is a slot out of range."""
    cpu = CpuStore(num_blocks=4, block_bytes=BB, pin=False)
    gpu = GpuStore(num_blocks=4, block_bytes=BB, device="cpu")
    small = CpuStore(num_blocks=4, block_bytes=BB // 2, pin=False)
    async with cpu, gpu, small:
        with pytest.raises(SlotError, match="2 slots of 4096 bytes but 1 rows"):
            await gpu.write([0, 1], [int_key(0), int_key(1)], cpu.slot_tensors([3]))
        with pytest.raises(SlotError, match="but 1 rows of 2048"):
            await gpu.write([0], [int_key(0)], small.slot_tensors([3]))
        with pytest.raises(SlotError, match="out of range"):
            cpu.slot_tensors([4])
        assert gpu.stats().bytes_written == 0


# -- C3: a GPU entry tier over the socket -----------------------------------------------------


def _gpu_first(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    config = daemon_config(tmp_path, logging={"level": "warning"}, **sections)
    config["tiers"].insert(0, {"name": "gpu", "kind": "gpu", "capacity": 4, "device": "cpu"})
    return config


async def test_a_gpu_tier_listed_first_leaves_clients_their_pool(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(_gpu_first(tmp_path)):
            pass
    warned = [e for e in logs if "never filled by socket clients" in e["event"]]
    assert [(e["tier"], e["entry"]) for e in warned] == [("gpu", "cpu")]
    async with running_daemon(_gpu_first(tmp_path)) as daemon:
        path = str(daemon.config.socket.path)
        async with await Client.connect(path, namespace="ns") as client:
            assert client.pool is not None  # the entry is the CPU tier: its pool is mapped
            keys = [b"a", b"b"]
            assert await client.store(keys, [b"1" * BB, b"2" * BB]) == 2
            assert await client.load(keys) == [b"1" * BB, b"2" * BB]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")])
async def test_a_daemon_process_moves_blocks_through_a_gpu_entry_tier(
    tmp_path: Path, device: str
) -> None:
    """A real ``tierd serve`` whose entry tier is a GPU tier of 4 blocks over a CPU tier of
    8 and a disk tier: 16 blocks put over the socket demote down to the disk; each comes
    back with its own bytes, promoted to the GPU again (on a GPU: device memory, streams
    and pinned copies in the daemon's own process)."""
    config = daemon_config(tmp_path, logging={"level": "warning"}, entry="gpu")
    config["tiers"].insert(0, {"name": "gpu", "kind": "gpu", "capacity": 4, "device": device})
    daemon = await start_daemon_async(config, log=tmp_path / "tierd.log", timeout_s=120)
    try:
        assert daemon.socket is not None
        async with await Client.connect(daemon.socket, namespace="ns") as client:
            keys = [int_key(i) for i in range(16)]
            blocks = [bytes([i + 1]) * BB for i in range(16)]
            for first in range(0, 16, 4):  # a put is at most the entry tier's capacity
                assert await client.put(keys[first : first + 4], blocks[first : first + 4]) == 4
            for key, block in reversed(list(zip(keys, blocks, strict=True))):
                assert await client.get([key]) == [block]
            gpu, cpu, disk = (await client.stats())["tiers"]
        assert (gpu["name"], gpu["used"]) == ("gpu", 4)
        assert gpu["demotions"] >= 12 and gpu["io_errors"] == 0
        assert gpu["promotions"] == 12  # the 12 that had left the GPU came back to it
        assert cpu["demotions"] >= 4 and disk["used"] >= 4
    finally:
        assert await daemon.stop_async() == 0, daemon.log_text()


async def test_get_serves_a_block_from_a_gpu_entry_tier(tmp_path: Path) -> None:
    async with running_daemon(_gpu_first(tmp_path, entry="gpu")) as daemon:
        path = str(daemon.config.socket.path)
        async with await Client.connect(path, namespace="ns") as client:
            assert client.pool is None  # no shared pool at a GPU entry: put and get
            assert await client.put([b"a"], [b"x" * BB]) == 1
            assert await client.get([b"a"]) == [b"x" * BB]


# -- C4: torch before 2.8 has no AcceleratorError ---------------------------------------------


def test_the_gpu_tier_imports_under_a_torch_without_accelerator_error() -> None:
    code = (
        "import torch\n"
        "if hasattr(torch, 'AcceleratorError'): del torch.AcceleratorError\n"
        "from tierd.stores.gpu import is_device_error, is_sticky\n"
        "e = RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "assert is_device_error(e) and is_sticky(e)\n"
        "assert not is_device_error(RuntimeError('shape mismatch'))\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        # The project first, then whatever path the suite itself runs with (where the
        # dependencies are installed beside the interpreter's own, say).
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]]), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# -- C5 and C7: registration with a fake CUDA runtime -----------------------------------------


class FakeCudart:
    """The runtime calls registration makes, with CUDA's per-thread last error; chunk
    ``fail_at`` fails; ``gate`` (when given) holds every registration until set."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.fail_at, self.gate = fail_at, gate
        self.registered: set[int] = set()
        self.calls = 0
        self.last_error = 0
        self.started = threading.Semaphore(0)

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.started.release()
        if self.gate is not None:
            self.gate.wait()
        self.calls += 1
        if self.calls == self.fail_at:
            self.last_error = 1  # cudaErrorInvalidValue, left for the next launch
            return 1
        self.registered.add(address)
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.registered.discard(address)
        return 0

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def cudaGetErrorString(self, code: Any) -> str:
        return "invalid argument"

    def cudaError(self, code: int) -> int:
        return code


def _pinned_in_chunks(
    num_blocks: int, cudart: FakeCudart
) -> tuple[CpuStore, list[tuple[str, int]]]:
    """A CPU store pinned four blocks at a time through ``cudart``, and the list its
    progress reports (stage, blocks done) go to."""
    seen: list[tuple[str, int]] = []
    store = CpuStore(
        num_blocks=num_blocks,
        block_bytes=BB,
        register_chunk_bytes=4 * BB,
        cudart=cudart,
        progress=lambda stage, done, total: seen.append((stage, done)),
    )
    return store, seen


def test_a_failed_registration_clears_the_last_error() -> None:
    cudart = FakeCudart(fail_at=3)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        host_register(1 << 20, 8 * BB, chunk_bytes=2 * BB, cudart=cudart)
    assert cudart.registered == set()  # the two chunks before are unregistered
    assert cudart.last_error == 0  # the next launch on this thread will not raise it


async def test_a_stop_interrupts_pinning_between_chunks() -> None:
    """Cancelling the open (a SIGTERM during start-up) stops registering after the chunk
    under way and unregisters what was done, instead of pinning the whole pool first."""
    gate = threading.Event()
    cudart = FakeCudart(gate=gate)
    store, seen = _pinned_in_chunks(64, cudart)
    opening = asyncio.create_task(store.open())
    await asyncio.to_thread(cudart.started.acquire)  # the first chunk is being registered
    opening.cancel()
    # Released after the task has taken its cancellation (the loop runs callbacks in
    # order, and cancel() scheduled the task's wake-up first).
    asyncio.get_running_loop().call_soon(gate.set)
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert cudart.calls == 1  # 16 chunks in all: it stopped after the one under way
    assert cudart.registered == set()
    assert ("allocating", 64 * BB) in seen  # allocation reported its progress
    assert not store.is_open


async def test_pinning_reports_progress_per_chunk() -> None:
    cudart = FakeCudart()
    store, seen = _pinned_in_chunks(8, cudart)
    async with store:
        assert store.pinned
        # Allocation reports as its steps end (64 MiB each, in parallel: one here), up to
        # the pool's size; pinning, each registered chunk.
        allocating = [done for stage, done in seen if stage == "allocating"]
        assert allocating == sorted(allocating) and allocating[-1] == 8 * BB
        assert [entry for entry in seen if entry[0] == "pinning"] == [
            ("pinning", 4 * BB),
            ("pinning", 8 * BB),
        ]
        assert seen.index(("pinning", 4 * BB)) > seen.index(("allocating", 8 * BB))
    assert cudart.registered == set()


# -- C1, L1, L2, S3: stream and event ordering with recording fakes ---------------------------


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[Any] = []

    def wait_stream(self, other: Any) -> None:
        self.waited.append(other)


class FakeEvent:
    def __init__(self, error: Exception | None = None, gate: threading.Event | None = None):
        self.error, self.gate = error, gate
        self.synchronized = False

    def synchronize(self) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.synchronized = True
        if self.error is not None:
            raise self.error


class Rig:
    """A GpuStore on ``device="cpu"`` given fake lanes: launches go through the CUDA code
    path (streams, events, waiters) with the device calls recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: GpuStore) -> None:
        self.store = store
        self.events: list[FakeEvent] = []
        self.next_error: Exception | None = None
        self.event_gate: threading.Event | None = None
        self.launch_gate: threading.Event | None = None
        self.launch_started: asyncio.Event | None = None
        self.launch_threads: list[int] = []
        loop = asyncio.get_running_loop()

        def record(lane: Any) -> FakeEvent:
            self.launch_threads.append(threading.get_ident())
            if self.launch_started is not None:
                loop.call_soon_threadsafe(self.launch_started.set)
            if self.launch_gate is not None:
                self.launch_gate.wait()
            event = FakeEvent(self.next_error, self.event_gate)
            self.events.append(event)
            return event

        monkeypatch.setattr(gpu_module, "_record", record)
        monkeypatch.setattr(gpu_module, "_current_stream", lambda device: current())
        monkeypatch.setattr(gpu_module, "_device_scope", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(gpu_module, "_stream_scope", lambda stream: contextlib.nullcontext())

    def attach(self) -> None:
        self.store._h2d = _Lane(FakeStream("h2d"), EventWaiter("test-h2d"))  # type: ignore[arg-type]
        self.store._d2h = _Lane(FakeStream("d2h"), EventWaiter("test-d2h"))  # type: ignore[arg-type]


def current() -> str:
    """The fake of ``torch.cuda.current_stream``: each thread has its own current stream."""
    return f"stream-of-{threading.get_ident()}"


@contextlib.asynccontextmanager
async def rigged(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    store = GpuStore(num_blocks=1024, block_bytes=BB, device="cpu", **kw)
    rig = Rig(monkeypatch, store)
    async with store:
        rig.attach()
        yield rig


def _blocks(count: int, fill: int = 7) -> list[bytes]:
    return [bytes([fill]) * BB for _ in range(count)]


@pytest.mark.parametrize("count", [4, 512])  # 16 KiB inline; 2 MiB from a worker thread
async def test_copies_wait_for_the_callers_stream(
    monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """C1: with host buffers too (no device tensor in the batch), and from a worker
    thread, each lane waits for the stream current on the caller's thread."""
    async with rigged(monkeypatch) as rig:
        keys = [int_key(i) for i in range(count)]
        await rig.store.write(range(count), keys, _blocks(count))
        out = [bytearray(BB) for _ in range(count)]
        await rig.store.read(range(count), keys, out)
        assert bytes(out[-1]) == _blocks(1)[0]
        assert rig.store._h2d is not None and rig.store._d2h is not None
        caller = current()  # this test runs on the loop's thread
        assert rig.store._h2d.stream.waited == [caller]  # type: ignore[attr-defined]
        assert rig.store._d2h.stream.waited == [caller]  # type: ignore[attr-defined]


async def test_a_copy_launched_as_its_caller_is_cancelled_is_still_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L1: cancelled while its launch runs on a worker thread, a write still waits for
    the copy's event before it ends, so the store never looks idle with a DMA in flight."""
    async with rigged(monkeypatch) as rig:
        rig.launch_gate, rig.launch_started = threading.Event(), asyncio.Event()
        count = 512  # 2 MiB: launched from a worker thread
        task = asyncio.create_task(
            rig.store.write(range(count), [int_key(i) for i in range(count)], _blocks(count))
        )
        await rig.launch_started.wait()
        task.cancel()
        rig.launch_gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rig.events[0].synchronized  # waited for before the task ended
        assert rig.store._in_flight.count == 0


async def test_a_sticky_cuda_error_marks_the_store_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """L2: after an illegal access, later copies fail at once without a launch, and
    close() does not wait for the device."""
    async with rigged(monkeypatch) as rig:
        rig.next_error = RuntimeError("CUDA error: an illegal memory access was encountered")
        with pytest.raises(StoreIOError, match="illegal memory access"):
            await rig.store.write([0], [int_key(0)], _blocks(1))
        launches = len(rig.events)
        with pytest.raises(DeviceLost, match="lost"):
            await rig.store.write([1], [int_key(1)], _blocks(1))
        with pytest.raises(DeviceLost):
            await rig.store.read([0], [int_key(0)], [bytearray(BB)])
        assert len(rig.events) == launches  # refused before any launch
        assert "lost" in rig.store.stats().details


async def test_a_hung_copy_marks_the_store_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    async with rigged(monkeypatch, copy_timeout_s=0.2) as rig:
        rig.event_gate = threading.Event()  # the device never answers
        try:
            with pytest.raises(DeviceLost, match="did not finish"):
                await rig.store.write([0], [int_key(0)], _blocks(1))
            with pytest.raises(DeviceLost):
                await rig.store.write([1], [int_key(1)], _blocks(1))
            await rig.store.close()  # returns: it does not wait for the lost device
        finally:
            rig.event_gate.set()  # let the waiter thread end


async def test_unpinned_host_tensors_are_never_copied_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3: a copy from pageable memory blocks its thread in CUDA: even a small one goes
    to a worker thread, and the store counts it."""
    async with rigged(monkeypatch) as rig:
        small = torch.full((2, BB), 3, dtype=torch.uint8)  # not pinned: no CUDA here
        await rig.store.write([0, 1], [int_key(0), int_key(1)], small)
        assert rig.launch_threads == [t for t in rig.launch_threads if t != threading.get_ident()]
        assert rig.store.stats().details["unpinned_copies"] == 1


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith("test-"):
            thread.join(timeout=5)
