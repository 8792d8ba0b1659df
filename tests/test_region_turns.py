"""Region jobs take turns per tenant (issue 57, item 4): one tenant's many connections
with jobs in flight ran every one of them at once, so 40 engines of one tenant took 40
times the event loop of one (another tenant's lookups: p99 0.4 -> 18 ms, max 215 ms,
``scripts/bench neighbours_regions``). At most ``limits.region_jobs_per_tenant`` jobs of
a tenant run now, the others wait in order, and each still ends right.

A real daemon in this event loop, real sockets and memfds; the copies of the jobs that
run are held (their copy threads wait on an event) so that what runs can be counted.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tierd.client import Client
from tierd.testing import daemon_config, running_daemon

BLOCK = 4096
CONNECTIONS, JOBS_EACH, TURNS = 5, 2, 2


def row(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


async def until(check: Callable[[], bool]) -> None:
    for _ in range(50_000):  # bounded: far more turns than the jobs need
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("not reached")


async def test_a_tenants_region_jobs_run_a_few_at_a_time_and_each_ends_right(
    tmp_path: Path,
) -> None:
    cfg = daemon_config(
        tmp_path,
        cpu_blocks=64,
        disk_blocks=None,
        block_bytes=BLOCK,
        limits={"region_jobs_per_tenant": TURNS},
    )
    keys = [f"turn-{i}".encode() for i in range(4)]
    async with asyncio.timeout(120), running_daemon(cfg) as daemon:
        assert daemon.server is not None
        ctx = daemon.server.ctx
        path = str(daemon.config.socket.path)
        clients = [await Client.connect(path, namespace="turns") for _ in range(CONNECTIONS)]
        memories: list[mmap.mmap] = []
        regions: list[int] = []
        try:
            for client in clients:
                fd = os.memfd_create("turns", os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, 8 * BLOCK)
                memories.append(mmap.mmap(fd, 8 * BLOCK))
                memories[-1][:] = bytes(8 * BLOCK)  # paid for: the daemon fills no hole
                regions.append(await client.register_region(fd, 8 * BLOCK))
                os.close(fd)
            memories[0][: 4 * BLOCK] = b"".join(row(k) for k in keys)
            front = np.arange(4, dtype=np.uint64).reshape(4, 1) * np.uint64(BLOCK)
            assert await clients[0].region_store(regions[0], keys, front) == [True] * 4

            held = asyncio.Event()
            copying: list[int] = []
            run = ctx.copy_threads.run

            async def held_copy(tenant: Any, conn: Any, fn: Callable[[], Any]) -> Any:
                copying.append(conn)
                await held.wait()
                return await run(tenant, conn, fn)

            ctx.copy_threads.run = held_copy  # type: ignore[method-assign]
            jobs = []
            for i, client in enumerate(clients):
                for j in range(JOBS_EACH):
                    back = front + np.uint64(4 * j * BLOCK)
                    jobs.append(asyncio.create_task(client.region_load(regions[i], keys, back)))
            total = CONNECTIONS * JOBS_EACH
            await until(lambda: ctx.region_jobs.waiting("default") == total - TURNS)
            for _ in range(100):  # the waiting ones stay waiting, whatever turns pass
                await asyncio.sleep(0)
            assert len(copying) == TURNS  # only the jobs whose turn it is copy
            assert ctx.region_jobs.running("default") == TURNS
            async with await Client.connect(path, namespace="turns") as other:
                assert (await other.lookup(keys)).count == 4  # nothing else waits
            held.set()
            done = await asyncio.gather(*jobs)
            assert done == [[True] * 4] * total
            assert len(copying) == total
            assert (ctx.region_jobs.running("default"), ctx.region_jobs.waiting("default")) == (
                0,
                0,
            )
            for memory in memories:
                assert memory[:] == b"".join(row(k) for k in keys) * 2
        finally:
            for client in clients:
                await client.close()
            for memory in memories:
                memory.close()


async def test_a_job_given_up_while_it_waits_passes_its_turn_on(tmp_path: Path) -> None:
    """A waiting job whose request is cancelled (its connection gone, the daemon
    stopping) never runs and leaves its place; the next one takes the turn."""
    from tierd.control.state.copy_threads import TenantJobs

    gate = TenantJobs(lambda: 1)
    order: list[str] = []
    first_in = asyncio.Event()
    release = asyncio.Event()

    async def job(name: str, hold: bool) -> None:
        async with gate.turn("t"):
            order.append(name)
            if hold:
                first_in.set()
                await release.wait()

    first = asyncio.create_task(job("first", True))
    await first_in.wait()
    second = asyncio.create_task(job("second", False))
    third = asyncio.create_task(job("third", False))
    await until(lambda: gate.waiting("t") == 2)
    second.cancel()
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, third)
    assert second.cancelled() and order == ["first", "third"]
    assert (gate.running("t"), gate.waiting("t")) == (0, 0)


def _niceness_of_threads(prefix: str) -> list[int]:
    """The niceness of this process's threads (the daemon's, run in this process) whose
    name starts with ``prefix``."""
    return [
        os.getpriority(os.PRIO_PROCESS, thread.native_id)
        for thread in threading.enumerate()
        if thread.name.startswith(prefix) and thread.native_id is not None
    ]


async def test_the_threads_of_bulk_work_run_below_the_event_loop(tmp_path: Path) -> None:
    """Region copies and disk writes run at a lower priority than the event loop: on 2
    busy cores, three copy threads left the loop half a core (another tenant's lookups
    p99 9.8-13.5 ms; 4.0-4.5 ms once below it, ``scripts/bench neighbours_regions``)."""
    cfg = daemon_config(tmp_path, cpu_blocks=4, disk_blocks=64, block_bytes=BLOCK)
    keys = [f"bulk-{i}".encode() for i in range(8)]  # twice the CPU tier: demotions
    async with asyncio.timeout(120), running_daemon(cfg) as daemon:
        path = str(daemon.config.socket.path)
        async with await Client.connect(path, namespace="bulk") as client:
            assert await client.store(keys, [row(k) for k in keys]) == len(keys)
            fd = os.memfd_create("bulk", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 8 * BLOCK)
            memory = mmap.mmap(fd, 8 * BLOCK)
            memory[:] = bytes(8 * BLOCK)
            region = await client.register_region(fd, 8 * BLOCK)
            os.close(fd)
            offsets = np.arange(4, dtype=np.uint64).reshape(4, 1) * np.uint64(BLOCK)
            assert await client.region_load(region, keys[-4:], offsets) == [True] * 4
            memory.close()
            own = os.getpriority(os.PRIO_PROCESS, 0)
            copies, writes = (
                _niceness_of_threads("tierd-region"),
                _niceness_of_threads("tierd-disk-w"),
            )
            assert copies and writes
            assert {n - own for n in copies + writes} == {10}
            loop_thread = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            assert loop_thread == own
