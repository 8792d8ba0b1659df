"""The staged way's loads (``tierd.integrations.core.data_paths.staged_load``, vLLM's first way)
copy each byte once, on the scheduler's thread: from the staging memfd straight into the
engine's rows, with no temporary copy of the load in between, and byte for byte.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from tierd.integrations.core.data_paths import RowBlocks
from tierd.integrations.core.engine_calls import EngineCalls
from tierd.integrations.core.link import DaemonLink, LinkSettings
from tierd.testing import daemon_config

BLOCK = 512 << 10  # the rows; far above what reading replies allocates
DEADLINE_S = 5.0
STAGING_ROWS = 4  # fewer than a load's keys: a load takes several rounds


class SpyRows:
    """vLLM's rows (:class:`RowBlocks`), saying what each fill was handed."""

    def __init__(self, rows: np.ndarray, row_ids: np.ndarray) -> None:
        self.inner = RowBlocks(rows, row_ids)
        self.sources: list[np.ndarray] = []

    def fill(self, positions: np.ndarray, source: np.ndarray) -> None:
        self.sources.append(source)
        self.inner.fill(positions, source)

    def gather(self, positions: np.ndarray, out: np.ndarray) -> None:
        self.inner.gather(positions, out)

    def fill_one(self, position: int, block: memoryview) -> None:
        self.inner.fill_one(position, block)

    def gather_one(self, position: int, out: memoryview) -> None:
        self.inner.gather_one(position, out)


async def test_a_staged_load_copies_each_byte_once_and_exactly(tmp_path: Path, spawn: Any) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=32, block_bytes=BLOCK))
    settings = LinkSettings(daemon.socket_path, "copies", BLOCK, job_deadline_s=DEADLINE_S)
    link = DaemonLink(settings, name="tierd-test-copies", map_pool=False)
    calls = EngineCalls(link, "vllm", staging_rows=STAGING_ROWS, map_pool=False)
    try:
        source = np.random.default_rng(7).integers(0, 256, (8, BLOCK), dtype=np.uint8)
        stored = [f"b-{i}".encode() for i in range(8)]
        assert calls.store(stored, RowBlocks(source, np.arange(8, dtype=np.intp)), DEADLINE_S)
        # Misses between hits (vLLM's jobs skip them): runs of rows in each round.
        keys = [
            stored[0],
            stored[1],
            b"miss-a",
            stored[2],
            stored[3],
            stored[4],
            b"miss-b",
            b"miss-c",
            stored[5],
            stored[6],
            stored[7],
        ]
        hits = [i for i, key in enumerate(keys) if key in stored]
        target = np.full((16, BLOCK), 0xA5, dtype=np.uint8)
        ids = np.asarray([15, 3, 9, 0, 12, 6, 1, 14, 4, 11, 7], dtype=np.intp)  # scattered
        spy = SpyRows(target, ids)
        tracemalloc.start()
        try:
            outcome = calls.load(keys, spy, DEADLINE_S)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert outcome.error is None and list(outcome.loaded) == hits
        # Byte for byte where a block loaded; the rows of the misses untouched.
        assert np.array_equal(target[ids[hits]], source[[stored.index(keys[i]) for i in hits]])
        untouched = np.setdiff1d(np.arange(16), ids[hits])
        assert (target[untouched] == 0xA5).all()
        # One copy: every fill was handed rows of the staging memfd itself (a view, not
        # a copy of them), and no temporary the size of a block was allocated meanwhile.
        conn = calls.channel.here()
        assert conn is not None and "staging" in conn.held
        staging = conn.held["staging"].array
        assert sum(len(s) for s in spy.sources) == len(hits)
        assert all(np.shares_memory(s, staging) for s in spy.sources), [
            s.flags.owndata for s in spy.sources
        ]
        assert peak < BLOCK, f"{peak} bytes allocated by a load of {len(hits)} x {BLOCK}"
    finally:
        calls.close()
        link.close()
