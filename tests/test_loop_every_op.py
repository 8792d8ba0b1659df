"""Every operation a client can send, at its worst, takes a share of a loop turn that does
not grow with the blocks the daemon holds (issue 57, item 6): one table, every op, so
that the next operation that walks an index in one turn cannot be missed.

How it is told, without a clock: a daemon run in this event loop holds ``SMALL`` blocks
of one namespace, then one of ``BIG`` (four times as many); each op of :data:`TABLE` is
sent at its worst (4,096 keys, a walk of the whole namespace, a whole tier flushed or
cleared) while ``sys.settrace`` counts the lines of the daemon's own code run in each
turn of the loop. An op that does its work a bounded piece a turn runs about as many
lines in its longest turn at ``BIG`` as at ``SMALL``; one that walks the index in one
turn runs four times as many. The test fails when an op's longest turn grows with the
daemon's blocks, and when an operation of the protocol has no row in the table.

Checked against a walk made one turn again (a flush's and a clear's scan of the whole
index at once): their longest turns grew 3.4 and 3.1 times from ``SMALL`` to ``BIG``
(1.5 and 7.3 million lines to 5.0 and 22.9 million); every op as it is grows at most
1.1 times. What a request of 4,096 keys does in one turn is bounded by its keys, not the
blocks held: up to about 90,000 lines (a region job's pins and slices).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import msgpack
import numpy as np
import pytest

from tierd.client import Client, DaemonError
from tierd.control.protocol import OPERATIONS
from tierd.testing import daemon_config, running_daemon

BLOCK = 4096
# Both past the size a map keeps in one dict (tierd.maps.ONE_DICT_KEYS): the same code
# paths at both, a map cut into parts.
SMALL, BIG = 65_536, 262_144
BURST = 4096  # keys of one request at most (limits.max_keys_per_request)
NS = "crowd"
# What a turn may grow by between SMALL and BIG blocks (a dict's resize, a log line).
SLACK = 2_000
GROWTH = 1.5

# The client's own modules (they run in this loop too) and the test helpers: not counted.
_NOT_THE_DAEMON = (
    "/tierd/testing/",
    "/tierd/control/client",
    "/tierd/control/clients/handshake.py",
    "/tierd/control/clients/blocking_client.py",
)


class LinesPerTurn:
    """Lines of the daemon's code run in each turn of the loop, while :meth:`counting`."""

    def __init__(self) -> None:
        self.turn = 0
        self.lines: Counter[int] = Counter()

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if "/tierd/" not in name or any(part in name for part in _NOT_THE_DAEMON):
            return None
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines[self.turn] += 1
        return self._line

    async def _tick(self) -> None:
        for _ in range(50_000_000):  # bounded: far more turns than any op here takes
            self.turn += 1
            await asyncio.sleep(0)

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.lines.clear()
        ticker = asyncio.get_running_loop().create_task(self._tick())
        sys.settrace(self._call)
        try:
            yield
        finally:
            sys.settrace(None)
            ticker.cancel()

    @property
    def longest(self) -> int:
        return max(self.lines.values(), default=0)


@dataclass
class Bench:
    """A daemon holding ``blocks`` of :data:`NS`, and what the rows use."""

    path: str
    member: Client
    operator: Client
    blocks: int
    region: int = 0
    memory: mmap.mmap | None = None


Row = Callable[[Bench], Awaitable[Any]]


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


_ROUNDS = iter(range(1_000_000))


def fresh(what: str, count: int) -> list[bytes]:
    """Keys never stored before (each call its own)."""
    return keys(f"{what}{next(_ROUNDS)}", count)


def rows_of(count: int) -> list[bytes]:
    return [bytes([i % 251]) * BLOCK for i in range(count)]


def offsets(count: int) -> np.ndarray:
    return np.arange(count, dtype=np.uint64).reshape(count, 1) * np.uint64(BLOCK)


async def _hello(b: Bench) -> None:
    async with await Client.connect(b.path, namespace=NS):
        pass


async def _prepare_complete_store(b: Bench) -> None:
    new = fresh("store", BURST)
    lease = await b.member.request("prepare_store", keys=new)
    await b.member.request("complete_store", lease=lease["lease"], ok=True)


async def _prepare_abort_store(b: Bench) -> None:
    new = fresh("abort", BURST)
    lease = await b.member.request("prepare_store", keys=new)
    await b.member.request("abort_store", lease=lease["lease"])


async def _prepare_complete_load(b: Bench) -> None:
    reply = await b.member.request("prepare_load", keys=keys(NS, BURST))
    await b.member.request("complete_load", lease=reply["lease"])


async def _describe(b: Bench) -> None:
    described = [
        {"hashes": [10_000 + i], "parent": None, "tokens": list(range(16)), "block_size": 16}
        for i in range(256)
    ]
    blocks = [msgpack.packb(block, use_bin_type=True) for block in described]
    await b.member.request("describe", keys=keys(NS, 256), blocks=blocks)


async def _subscribe(b: Bench) -> None:
    await b.member.request("subscribe")
    await b.member.request("unsubscribe")


async def _regions(b: Bench) -> None:
    assert b.memory is not None
    await b.member.region_store(b.region, fresh("region", BURST), offsets(BURST))
    await b.member.region_load(b.region, keys(NS, BURST), offsets(BURST))


async def _register_unregister(b: Bench) -> None:
    fd = os.memfd_create("every-op", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, BLOCK)
        region = await b.member.register_region(fd, BLOCK)
    finally:
        os.close(fd)
    await b.member.unregister_region(region)


async def _refused(call: Awaitable[Any]) -> None:
    with pytest.raises(DaemonError):
        await call


# Every operation, at its worst. ``None``: not measured here, and why. Order matters: the
# last rows empty the tier.
TABLE: dict[str, Row | str] = {
    "hello": _hello,
    "lookup": lambda b: b.member.lookup(keys(NS, BURST)),
    "lookup_each": lambda b: b.member.lookup_each(keys(NS, BURST)),
    "touch": lambda b: b.member.touch(keys(NS, BURST)),
    "prepare_store": _prepare_complete_store,
    "complete_store": _prepare_complete_store,
    "abort_store": _prepare_abort_store,
    "prepare_load": _prepare_complete_load,
    "complete_load": _prepare_complete_load,
    "put": lambda b: b.member.put(fresh("put", 1024), rows_of(1024)),
    "get": lambda b: b.member.get(keys(NS, BURST)),
    "subscribe": _subscribe,
    "unsubscribe": _subscribe,
    "stats": lambda b: b.operator.stats(namespaces=True),
    "health": lambda b: b.operator.health(),
    "config": lambda b: b.operator.config(),
    "metrics": lambda b: b.operator.metrics(),
    "register_region": _register_unregister,
    "unregister_region": _register_unregister,
    "region_store": _regions,
    "region_load": _regions,
    "namespaces": lambda b: b.operator.namespaces(),
    "inspect": lambda b: b.operator.inspect(b"crowd-7", namespace=NS),
    "reload": lambda b: _refused(b.operator.reload()),  # no file to read: refused at once
    "trace": lambda b: b.operator.request("trace"),
    "describe": _describe,
    "blocks_held": lambda b: b.member.blocks_held([list(range(BURST))]),
    "sizes": lambda b: b.operator.sizes(),
    "delete": lambda b: b.member.delete(prefix=b"no-such-prefix"),  # a walk, nothing found
    "flush": lambda b: b.operator.flush(),
    "clear": lambda b: b.operator.clear(),
    "stop": "ends the daemon: its drain is bounded by shutdown.grace, for the operator only",
}


def test_every_operation_has_a_row() -> None:
    assert set(TABLE) == set(OPERATIONS)


@asynccontextmanager
async def bench(tmp_path: Path, blocks: int) -> AsyncIterator[Bench]:
    os.mkdir(tmp_path)
    events = {"enabled": True}
    cfg = daemon_config(
        tmp_path,
        cpu_blocks=blocks + 4 * BURST,
        disk_blocks=blocks + 4 * BURST,  # holds every block: 8 KiB each on disk
        block_bytes=BLOCK,
        kv_events=events,
    )
    async with asyncio.timeout(600), running_daemon(cfg) as daemon:
        path = str(daemon.config.socket.path)
        member = await Client.connect(path, namespace=NS)
        operator = await Client.connect(path)
        try:
            names = keys(NS, blocks)
            row = rows_of(1)[0]
            for start in range(0, blocks, BURST):
                part = names[start : start + BURST]
                assert await member.store(part, [row] * len(part)) == len(part)
            await operator.flush()  # written down now: no write-behind runs beside an op
            for _ in range(100):  # and the events of the fill published
                await asyncio.sleep(0.01)
            fd = os.memfd_create("every-op-region", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, BURST * BLOCK)
            memory = mmap.mmap(fd, BURST * BLOCK)
            memory[:] = bytes(BURST * BLOCK)
            region = await member.register_region(fd, BURST * BLOCK)
            os.close(fd)
            yield Bench(path, member, operator, blocks, region, memory)
            memory.close()
        finally:
            await member.close()
            await operator.close()


async def longest_turns(tmp_path: Path, blocks: int) -> dict[str, int]:
    """Each measured op's longest turn (lines of the daemon's code), at ``blocks``: the
    smaller of two tries (a timer's work, the same at any size, may land in one)."""
    found: dict[str, int] = {}
    counter = LinesPerTurn()
    async with bench(tmp_path, blocks) as b:
        for op, row in TABLE.items():
            if isinstance(row, str):
                continue
            tries = []
            for _ in range(2 if op not in ("clear",) else 1):
                with counter.counting():
                    await row(b)
                    for _ in range(20):  # the pieces a reply left running (an unpin, say)
                        await asyncio.sleep(0)
                tries.append(counter.longest)
            found[op] = min(tries)
    shutil.rmtree(tmp_path)  # its slab (2 GiB at BIG) is not kept for the next size
    return found


async def test_no_operation_takes_a_longer_turn_with_more_blocks(tmp_path: Path) -> None:
    small = await longest_turns(tmp_path / "small", SMALL)
    big = await longest_turns(tmp_path / "big", BIG)
    grown = {op: (small[op], big[op]) for op in small if big[op] > GROWTH * small[op] + SLACK}
    assert not grown, f"ops whose longest turn grows with the blocks held: {grown}"
    assert all(lines > 0 for lines in big.values()), big  # each was measured
