"""What ``scripts/bench daemon`` measures through ``tierd.client`` itself: its lookups
(round trip and pipelined, information only) and the zero-copy data path (stores and
loads through the mapped pool against two plain copies of the same bytes)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from bench.daemon_wire import NAMESPACE, lookup_keys
from bench.figures import median_of


async def store_lookup_keys(path: str, count: int) -> None:
    from tierd.control.clients.client import Client

    async with await Client.connect(path, namespace=NAMESPACE) as client:
        keys = lookup_keys(count)
        await client.store(keys, [bytes(client.block_bytes)] * count)
        found = await client.lookup(keys)
        if found.count != count:
            raise RuntimeError(f"stored {count} keys, a lookup finds {found.count}")


async def tierd_client_lookups(path: str, keys: int, n: int, window: int) -> tuple[float, float]:
    """``tierd.client`` figures: median ``lookup`` round trip (s), pipelined requests/s."""
    from tierd.control.clients.client import Client

    batch = lookup_keys(keys)
    async with await Client.connect(path, namespace=NAMESPACE) as client:
        for _ in range(min(n, 500)):
            await client.lookup(batch)
        lats = []
        for _ in range(n):
            started = time.perf_counter()
            await client.lookup(batch)
            lats.append(time.perf_counter() - started)
        pending: deque[asyncio.Future[dict[str, Any]]] = deque()
        count = 10 * n
        started = time.perf_counter()
        for _ in range(count):
            if len(pending) >= window:
                await pending.popleft()
            pending.append(client.send("lookup", keys=batch))
        for future in pending:
            await future
        rate = count / (time.perf_counter() - started)
    return median_of(lats), rate


@dataclass(frozen=True, slots=True)
class DataPlan:
    path: str
    runs: int
    batch: int
    blocks: int  # per run, a multiple of batch


async def data_path(plan: DataPlan) -> dict[str, list[float]]:
    """Per run, bytes/s of: zero-copy store and load through the pool, and the two plain
    copies of the same bytes (into a preallocated buffer, and out of it)."""
    from tierd.control.clients.client import Client

    # ``clear`` drops every namespace's blocks: only a connection without one may send it.
    async with (
        await Client.connect(plan.path, namespace=NAMESPACE) as client,
        await Client.connect(plan.path) as operator,
    ):
        bb, pool = client.block_bytes, client.require_pool()
        srcs = [memoryview(bytearray(os.urandom(64) * (bb // 64))) for _ in range(plan.batch)]
        dsts = [memoryview(bytearray(bb)) for _ in range(plan.batch)]
        buffer = memoryview(bytearray(plan.blocks * bb))  # the baseline's "pool"
        total = plan.blocks * bb
        # Warm-up: touch every pool slot in this process's mapping once (the page
        # faults of a first touch are not the steady state), and the baseline's buffer.
        await _store_load(client, srcs, dsts, pool.num_blocks // plan.batch * plan.batch, "w")
        await operator.clear()
        _copies(buffer, srcs, dsts, plan.blocks)
        out: dict[str, list[float]] = {"store": [], "load": [], "copy_in": [], "copy_out": []}
        for run in range(plan.runs):
            for which in ("base", "tierd") if run % 2 == 0 else ("tierd", "base"):
                if which == "base":
                    t_in, t_out = _copies(buffer, srcs, dsts, plan.blocks)
                    out["copy_in"].append(total / t_in)
                    out["copy_out"].append(total / t_out)
                else:
                    t_in, t_out = await _store_load(client, srcs, dsts, plan.blocks, f"r{run}")
                    out["store"].append(total / t_in)
                    out["load"].append(total / t_out)
                    if bytes(dsts[-1]) != bytes(srcs[-1]):
                        raise RuntimeError("a block loaded back differs from the one stored")
                    await operator.clear()
    return out


def _copies(
    buffer: memoryview, srcs: list[memoryview], dsts: list[memoryview], blocks: int
) -> tuple[float, float]:
    bb, batch = len(srcs[0]), len(srcs)
    started = time.perf_counter()
    for i in range(blocks):
        buffer[i * bb : (i + 1) * bb] = srcs[i % batch]
    copied_in = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(blocks):
        dsts[i % batch][:] = buffer[i * bb : (i + 1) * bb]
    return copied_in, time.perf_counter() - started


async def _store_load(
    client: Any, srcs: list[memoryview], dsts: list[memoryview], blocks: int, tag: str
) -> tuple[float, float]:
    """Seconds to store ``blocks`` new blocks in batches, then to load them back."""
    batch = len(srcs)
    keys = [f"{tag}-{i}".encode() for i in range(blocks)]
    groups = [keys[i : i + batch] for i in range(0, blocks, batch)]
    started = time.perf_counter()
    for group in groups:
        async with client.storing(group) as lease:
            views = lease.views()
            if len(views) != len(group):
                raise RuntimeError(f"{len(group) - len(views)} blocks were already stored")
            for view, src in zip(views, srcs, strict=False):
                view[:] = src
    stored = time.perf_counter() - started
    started = time.perf_counter()
    for group in groups:
        async with client.loading(group) as lease:
            if lease.count != len(group):
                raise RuntimeError(f"loaded {lease.count} of {len(group)} blocks")
            for view, dst in zip(lease.views(), dsts, strict=False):
                dst[:] = view
    return stored, time.perf_counter() - started
