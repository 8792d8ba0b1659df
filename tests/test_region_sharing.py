"""Region jobs on a shared daemon: what one client's job may cost the engine's memory, the
daemon's memory and the other tenants' copies.

- **No late write.** A load's bytes move in calls of at most ``CALL_BYTES``, and no call
  starts at or past the job's ``expires``: one call used to move a whole run of pieces
  (64 MiB), and its last byte landed after the deadline, into memory the engine had
  reused, with ``done: true``.
- **A client pays for its memory.** A sparse region (an empty 1 TiB memfd) loaded into
  made the daemon create the tmpfs pages, charged to the daemon's memory cgroup: the daemon
  was OOM-killed. Pages that do not exist are never written; a repeated key counts against
  the lease bounds as often as it is written.
- **Fair copy threads.** A slice of another tenant's job runs before a backlog queued
  earlier by one tenant; one tenant never holds every copy thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tierd.control.engine_regions.byte_moves as region_copy
from tests.loop_daemon_kit import connect_watched, serve
from tests.regions_kit import connect, held_disk_reads, memfd, pattern, put, read, refused, rows
from tierd.control.engine_regions.byte_moves import CALL_BYTES, Layout, write_region
from tierd.control.serving.connection import MAX_REGION_JOBS
from tierd.control.state.copy_threads import FairThreads, slices

# The daemon's connections, watched (conftest's fixture).
pytestmark = pytest.mark.usefixtures("_watch_connections")

BLOCK = 4096
MiB = 1 << 20


# -- no late write -----------------------------------------------------------------------------


def test_no_call_starts_past_the_jobs_time_and_each_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One 8 MiB piece, a clock that moves one second per look, a job time 2.5 s away:
    three calls of 1 MiB start in time, the rest of the piece is never written and the
    block fails. (One call used to write all 8 MiB, however late its end.)"""
    size = 8 * MiB
    with memfd(size, "late-write") as fd:
        now = [1000.0]

        def clock() -> float:
            now[0] += 1.0
            return now[0] - 1.0

        monkeypatch.setattr(region_copy.time, "monotonic", clock)
        block = memoryview(pattern(b"daemon", size))
        layout = Layout.of([size], size)
        assert isinstance(layout, Layout)
        address = region_copy.map_for_loads(fd, size)
        try:
            ok = write_region(address, [[0]], [block], layout, until=1002.5)
        finally:
            region_copy.unmap(address, size)
        monkeypatch.undo()
        assert ok == [False]
        written = os.pread(fd, size, 0)
        assert written[: 3 * CALL_BYTES] == bytes(block[: 3 * CALL_BYTES])
        assert written[3 * CALL_BYTES :] == bytes(size - 3 * CALL_BYTES)


async def test_a_load_past_its_time_through_the_daemon_writes_nothing_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real daemon: 16 blocks of 1 MiB, contiguous in the region; the copy
    thread is held (a preempted thread) until the engine's time has passed. Nothing is
    written after that, and the keys are answered as failed."""
    gate, entered = threading.Event(), threading.Event()
    real = region_copy._MappedWrites.__call__

    def held(self: Any, fd: int, buffers: Any, offset: int) -> int:
        entered.set()
        gate.wait(30)
        return real(self, fd, buffers, offset)

    async with (
        serve(tmp_path, block_bytes=MiB, cpu_blocks=32, disk_blocks=None) as daemon,
        await connect(daemon) as client,
    ):
        keys = [b"k%d" % i for i in range(16)]
        await client.store(keys, [pattern(b"v%d-" % i, MiB) for i in range(16)])
        with memfd(16 * MiB, "late-daemon") as fd:
            region = await client.register_region(fd, 16 * MiB)
            expires = time.monotonic() + 2.0
            monkeypatch.setattr(region_copy._MappedWrites, "__call__", held)
            job = asyncio.ensure_future(
                client.region_load(region, keys, rows(*range(16), size=MiB), expires=expires)
            )
            await asyncio.to_thread(entered.wait, 30)
            monkeypatch.setattr(region_copy._MappedWrites, "__call__", real)
            # The engine gives the job up at ``expires`` and reuses its memory.
            await asyncio.sleep(max(0.0, expires - time.monotonic()) + 0.05)
            put(fd, pattern(b"engine", 16 * MiB), 0)
            gate.set()
            done = await job
            # The one call that had started may complete (1 MiB at most); no more.
            assert done[1:] == [False] * 15
            after = os.pread(fd, 16 * MiB, 0)
            assert after[CALL_BYTES:] == pattern(b"engine", 16 * MiB)[CALL_BYTES:]


# -- a client pays for its memory ---------------------------------------------------------------


async def test_a_sparse_region_is_never_filled_by_the_daemon(tmp_path: Path) -> None:
    """An empty memfd (no page allocated), a stored key loaded at 64 fresh offsets: no
    page is created (st_blocks stays 0), every key fails, the daemon keeps serving."""
    async with serve(tmp_path, cpu_blocks=128) as daemon, await connect(daemon) as client:
        await client.store([b"k"], [pattern(b"stored", BLOCK)])
        fd = os.memfd_create("sparse-attack", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 1 << 30)
            own = mmap.mmap(fd, 1 << 30)  # the engine's mapping, made before it registers
            region = await client.register_region(fd, 1 << 30)
            spread = rows(*range(0, 64 * 997, 997))
            done = await client.region_load(region, [b"k"] * 64, spread)
            assert done == [False] * 64
            assert os.fstat(fd).st_blocks == 0
            assert os.fstat(fd).st_size == 1 << 30
            # A page the engine wrote itself is written into.
            own[5 * BLOCK : 6 * BLOCK] = bytes(BLOCK)
            assert await client.region_load(region, [b"k"], rows(5)) == [True]
            assert own[5 * BLOCK : 6 * BLOCK] == pattern(b"stored", BLOCK)
            own.close()
        finally:
            os.close(fd)


class _PunchAfterCheck:
    """The daemon's libc, with a client that punches its window the moment the daemon's
    page check (``mincore``) has answered: the race of issue 57, item 1, won every time."""

    def __init__(self, real: Any, fd: int, window: tuple[int, int]) -> None:
        self.real, self.fd, self.window = real, fd, window
        self.punched = 0
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def mincore(self, *args: Any) -> int:
        answer = int(self.real.mincore(*args))
        start, length = self.window
        if self.real.fallocate(self.fd, _PUNCH_HOLE, ctypes.c_long(start), ctypes.c_long(length)):
            self.refused += 1
        else:
            self.punched += 1
        return answer


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


async def test_a_hole_punched_between_the_page_check_and_the_write_costs_the_daemon_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 57, item 1: a client paid for a window of its memfd, asked for a load into
    it, and punched the window just after the daemon's page check; the daemon's write
    created the pages again, charged to the daemon (a new window each round: a daemon in
    a 512 MiB cgroup was OOM-killed in 110 s). Here the punch comes right after every
    check, 32 rounds of a fresh 1 MiB window: the daemon never creates a page (the file
    is sealed on the first load: the punch is refused), and every load is whole."""
    window = MiB
    rounds = 32
    async with serve(tmp_path, cpu_blocks=512) as daemon, await connect(daemon) as client:
        keys = [b"p%d" % i for i in range(window // BLOCK)]
        await client.store(keys, [pattern(k, BLOCK) for k in keys])
        with memfd(rounds * window, "punch-race") as fd:
            region = await client.register_region(fd, rounds * window)
            libc = region_copy._libc()
            created = 0
            for r in range(rounds):
                start = r * window
                race = _PunchAfterCheck(libc, fd, (start, window))
                monkeypatch.setattr(region_copy, "_libc", lambda race=race: race)
                offsets = rows(*range(start // BLOCK, (start + window) // BLOCK))
                done = await client.region_load(region, keys, offsets)
                monkeypatch.setattr(region_copy, "_libc", lambda: libc)
                # Pages of the window now that the client's punch did not leave: the
                # daemon's, charged to it. None, and the punch never took.
                there = os.lseek(fd, start, os.SEEK_DATA) if race.punched else None
                created += window if race.punched and there == start and any(done) else 0
                assert race.punched == 0 and race.refused >= 1
                assert done == [True] * len(keys)
                assert read(fd, start, window) == b"".join(pattern(k, BLOCK) for k in keys)
            assert created == 0


async def test_a_repeated_key_counts_against_the_lease_bound_each_time(tmp_path: Path) -> None:
    """One stored key named 64 times is 64 writes: over a bound of 16 blocks it is
    refused (capacity), and nothing is held afterwards."""
    limits = {"lease_blocks_per_connection": 16, "lease_blocks_per_tenant": 16}
    async with (
        serve(tmp_path, cpu_blocks=64, limits=limits) as daemon,
        await connect(daemon) as client,
    ):
        await client.store([b"k"], [pattern(b"stored", BLOCK)])
        with memfd(64 * BLOCK, "repeats") as fd:
            region = await client.register_region(fd, 64 * BLOCK)
            message = await refused(
                client.request(
                    "region_load",
                    region=region,
                    keys=[b"k"] * 64,
                    offsets=rows(*range(64)).tobytes(),
                ),
                "capacity",
            )
            assert "lease" in message
            assert await client.region_load(region, [b"k"] * 8, rows(*range(8))) == [True] * 8
        tenant = next(iter(daemon.server.ctx.tenants.tenants))  # type: ignore[union-attr]
        assert tenant.held == 0


# -- fair copy threads --------------------------------------------------------------------------


async def test_another_tenants_slice_runs_before_a_backlog_queued_earlier() -> None:
    """Tenant A (two connections) fills every thread it may use and queues 32 more
    slices; B's one slice,
    queued last, runs as soon as a thread is free, before A's backlog; A never holds
    every thread."""
    threads = FairThreads(4, name="test-fair")
    gate = threading.Event()
    order: list[str] = []
    most_a = [0]
    running_a = [0]
    lock = threading.Lock()

    def a_job(i: int) -> None:
        with lock:
            running_a[0] += 1
            most_a[0] = max(most_a[0], running_a[0])
        gate.wait(30)
        with lock:
            running_a[0] -= 1
            order.append(f"a{i}")

    def b_job() -> None:
        with lock:
            order.append("b")

    a = [
        asyncio.ensure_future(threads.run("A", 1 + i % 2, lambda i=i: a_job(i))) for i in range(35)
    ]
    await asyncio.sleep(0)
    b = asyncio.ensure_future(threads.run("B", 9, b_job))
    async with asyncio.timeout(30):
        await b  # ran while A's three threads are held
    assert order == ["b"]
    gate.set()
    async with asyncio.timeout(30):
        await asyncio.gather(*a)
    assert most_a[0] == 3  # one thread always left for the other tenants
    assert len(order) == 36


async def test_connections_of_one_tenant_take_turns() -> None:
    threads = FairThreads(2, name="test-turns")
    order: list[int] = []
    jobs = [threads.run("T", conn, lambda c=conn: order.append(c)) for conn in (1, 1, 1, 2)]
    await asyncio.gather(*jobs)
    assert order.index(2) < 3  # connection 2's one job did not wait for all of 1's


def test_slices_cut_a_job_by_bytes() -> None:
    assert [len(r) for r in slices(10, 3 * MiB, 8 * MiB)] == [2, 2, 2, 2, 2]
    assert [len(r) for r in slices(5, 64 * MiB, 8 * MiB)] == [1, 1, 1, 1, 1]
    assert list(slices(0, BLOCK)) == []


async def test_a_connection_whose_copies_hang_leaves_threads_for_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real daemon, one tenant (an untenanted daemon): connection A's loads
    hang in their copy calls (as on its own file's inode lock) with eight in flight;
    connection B's load is served meanwhile. (The first-come pool gave A every thread.)"""
    gate = threading.Event()
    real = region_copy.write_region
    entered = threading.Semaphore(0)

    def copy(address: int, *args: Any) -> list[bool]:
        if _mapped_file(address) == "/memfd:hangs (deleted)":
            entered.release()
            gate.wait(30)
        return real(address, *args)

    monkeypatch.setattr("tierd.control.engine_regions.requests.write_region", copy)
    async with serve(tmp_path, cpu_blocks=64) as daemon:
        a, b = await connect(daemon), await connect(daemon)
        try:
            await a.store([b"k"], [pattern(b"stored", BLOCK)])
            with memfd(8 * BLOCK, "hangs") as fd_a, memfd(8 * BLOCK, "bystander") as fd_b:
                region_a = await a.register_region(fd_a, 8 * BLOCK)
                region_b = await b.register_region(fd_b, 8 * BLOCK)
                stuck = [
                    asyncio.ensure_future(a.region_load(region_a, [b"k"], rows(i)))
                    for i in range(8)
                ]
                try:
                    for _ in range(2):  # A's jobs have reached the copy threads
                        assert await asyncio.to_thread(entered.acquire, True, 30)
                    async with asyncio.timeout(20):
                        assert await b.region_load(region_b, [b"k"], rows(3)) == [True]
                finally:
                    gate.set()
                assert await asyncio.gather(*stuck) == [[True]] * 8
        finally:
            await a.close()
            await b.close()


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process (the in-loop daemon's mapping of a
    region it loads into), from ``/proc/self/maps``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


async def test_a_free_thread_serves_at_once_after_busy_times() -> None:
    """Threads that have served bursts before, three of them then held by tenant A: B's
    slice runs at once on the fourth (a lazily grown pool could keep only three, with
    B's slice queued behind A's held ones)."""
    threads = FairThreads(4, name="test-warm")
    for burst in (1, 2, 3, 4, 2, 1, 3):  # threads come and go idle
        await asyncio.gather(*(threads.run("A", i, lambda: None) for i in range(burst)))
    gate = threading.Event()
    held = [asyncio.ensure_future(threads.run("A", i, lambda: gate.wait(30))) for i in range(3)]
    try:
        async with asyncio.timeout(10):
            assert await threads.run("B", 9, lambda: "served") == "served"
    finally:
        gate.set()
    assert await asyncio.gather(*held) == [True] * 3


@pytest.mark.usefixtures("_watch_connections")
async def test_a_connection_runs_a_few_region_jobs_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 region loads pipelined on one connection, their copies held: the daemon runs
    MAX_REGION_JOBS (4) of them (the rest wait unread, holding nothing: each would cost
    the loop its parse, and at 8 a neighbour's pipeline kept a bystander's loads at 10
    ms); all are answered once the copies go on."""
    gate, entered = threading.Event(), threading.Semaphore(0)
    real = region_copy.write_region

    def copy(fd: int, *args: Any) -> list[bool]:
        entered.release()
        gate.wait(30)
        return real(fd, *args)

    monkeypatch.setattr("tierd.control.engine_regions.requests.write_region", copy)
    async with serve(tmp_path, cpu_blocks=64) as daemon:
        client, conn = await connect_watched(daemon)
        async with client:
            await client.store([b"k"], [pattern(b"stored", BLOCK)])
            with memfd(32 * BLOCK, "pipelined") as fd:
                region = await client.register_region(fd, 32 * BLOCK)
                jobs = [
                    client.send(
                        "region_load", region=region, keys=[b"k"], offsets=rows(i).tobytes()
                    )
                    for i in range(32)
                ]
                try:
                    for _ in range(2):  # the connection's two copy threads are held
                        assert await asyncio.to_thread(entered.acquire, True, 30)
                    running = len(conn.session.tasks)
                finally:
                    gate.set()
                replies = await asyncio.gather(*jobs)
        assert 2 <= running <= MAX_REGION_JOBS == 4
        assert [r["done"] for r in replies] == [[True]] * 32


async def test_a_load_of_many_groups_is_byte_exact_with_repeats_and_misses(
    tmp_path: Path,
) -> None:
    """A load from below goes in pieces (2 MiB at least), each piece's copy beside the
    other pieces' reads from disk: 12 keys of 1 MiB, a miss and two repeats among them,
    blocks on the disk tier and on the CPU tier, every row right."""
    async with (
        serve(tmp_path, block_bytes=MiB, cpu_blocks=4, disk_blocks=32) as daemon,
        await connect(daemon) as client,
    ):
        stored = [b"g%d" % i for i in range(10)]
        await client.store(stored, [pattern(b"g%d-" % i, MiB) for i in range(10)])
        asked = [*stored[:5], b"missing", stored[2], *stored[5:], stored[9]]
        with memfd(len(asked) * MiB, "groups") as fd:
            region = await client.register_region(fd, len(asked) * MiB)
            done = await client.region_load(region, asked, rows(*range(len(asked)), size=MiB))
            assert done == [key != b"missing" for key in asked]
            for row, key in enumerate(asked):
                if key != b"missing":
                    want = pattern(key + b"-", MiB)
                    assert os.pread(fd, MiB, row * MiB) == want, row


async def test_a_load_from_disk_copies_its_first_pieces_while_the_last_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 keys of 1 MiB on the disk tier, loaded in one job while the disk read of the
    last key is held: the first keys' bytes are in the engine's memory before that read
    ends (the job goes in pieces, each copied once it is read), and the job is whole and
    byte-exact once the read goes on. Before, nothing was copied until every key was."""
    reading, gate = held_disk_reads(monkeypatch, b"d7")
    async with (
        serve(tmp_path, block_bytes=MiB, cpu_blocks=16, disk_blocks=64) as daemon,
        await connect(daemon) as client,
    ):
        keys = [b"d%d" % i for i in range(24)]  # the first 8 go down to the disk tier
        await client.store(keys, [pattern(b"%s-" % key, MiB) for key in keys])
        assert set((await client.lookup(keys[:8])).media) == {"DISK"}
        with memfd(8 * MiB, "pieces") as fd:
            region = await client.register_region(fd, 8 * MiB)
            job = asyncio.ensure_future(
                client.region_load(region, keys[:8], rows(*range(8), size=MiB))
            )
            try:
                await asyncio.wait_for(reading.wait(), 30)
                first = pattern(b"d0-", MiB)
                for _ in range(300):  # bounded: 30 s at most
                    if os.pread(fd, MiB, 0) == first:
                        break
                    await asyncio.sleep(0.1)
                copied_early = os.pread(fd, MiB, 0) == first
                assert not job.done()
            finally:
                gate.set()
            assert await job == [True] * 8
            assert copied_early
            for i in range(8):
                assert os.pread(fd, MiB, i * MiB) == pattern(b"d%d-" % i, MiB), i


async def test_closed_threads_end_after_their_work_and_start_again_for_more() -> None:
    threads = FairThreads(2, name="test-close")
    gate = threading.Event()
    held = asyncio.ensure_future(threads.run("T", 1, lambda: gate.wait(30)))
    await asyncio.sleep(0)
    threads.close()  # work is running: the threads stay until it ends
    ours = [t for t in threading.enumerate() if t.name.startswith("test-close")]
    assert len(ours) == 2 and all(t.is_alive() for t in ours)
    gate.set()
    assert await held is True
    for thread in ours:
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive()
    assert await threads.run("T", 1, lambda: "again") == "again"
    threads.close()
