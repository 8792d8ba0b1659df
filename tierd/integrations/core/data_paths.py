"""The data paths of an engine call, each over one thread's blocking connection.

A call moves blocks between the daemon and an engine's memory, named by their position
in the call (:class:`Blocks`: vLLM's rows, :class:`RowBlocks`; SGLang's pages of pieces,
:class:`~tierd.integrations.sglang.pages.PageBlocks`). Which path a call takes is
:func:`tierd.integrations.core.route.way`'s choice; the paths are here:

- **staged** (:func:`staged_load`, :func:`staged_store`): region requests into, or out
  of, a memfd of the connection's own (registered on its first use), and one copy
  between it and the engine's memory on the caller's thread. A copy the daemon makes
  late (a call that gave up) lands in memory nobody reads again: the connection is
  closed, and the next one brings a fresh memfd.
- **engine region** (:func:`engine_region_store`, stores only): the daemon reads the
  engine's own memfd, told the call's deadline as the job's ``expires`` (it keeps
  nothing read past it). Never for loads: a copy under way at the deadline could land
  in memory the engine has reused.
- **lease** (:func:`copied_load`, and for stores
  :func:`~tierd.integrations.core.engine_calls.leased_store`): the daemon's pool is mapped
  here; slots are pinned or reserved, and the caller's thread copies. A load's release
  is posted (not waited for).
- **inline** (:func:`copied_load` without a lease, :func:`inline_store`): the bytes in
  the messages, for a daemon with neither regions nor a pool.

So a byte of the daemon's lands in an engine's memory only from the caller's thread,
inside the call. A load fills ``loaded`` (positions) as it goes, so a failure partway
keeps what was copied before it; ``leading`` loads stop at the first miss (SGLang uses
the leading pages only), the others skip it.

**A connection's private staging memory** (:func:`staging_memory`): the staged way moves
an engine's blocks through a memfd of the connection's own, not through the engine's
memory: a job the engine gave up on (a daemon stopped past the deadline, then resumed)
may still be copied by the daemon later, and it must land where nobody reads or writes
again. A staging memfd belongs to one connection; when a call times out the connection
is dropped, and the next connection gets a fresh memfd.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tierd.control.clients.blocking_client import MAX_REPLY_BYTES, BlockingClient
from tierd.control.clients.regions import job_keys
from tierd.errors import TierdError
from tierd.integrations.core.channel import ThreadConnection

__all__ = [
    "Blocks",
    "LoadOutcome",
    "NO_REGIONS",
    "RowBlocks",
    "copied_load",
    "engine_region_store",
    "inline_store",
    "row_offsets",
    "staged_load",
    "staged_store",
    "staging_memory",
]

Rows = npt.NDArray[np.uint8]
Positions = npt.NDArray[np.intp]

# What a daemon without engine regions answers a registration with.
NO_REGIONS = frozenset({"unknown_op", "bad_region", "not_allowed"})


def staging_memory(rows: int, row_bytes: int) -> tuple[int, Rows]:
    """A memfd of ``rows`` rows of ``row_bytes``, mapped here with every page faulted in
    (not in the first job): its descriptor (the caller closes it once the daemon has it;
    the mapping keeps the memory) and the rows."""
    size = rows * row_bytes
    # Sealable: the daemon seals a region it loads into (its pages cannot go meanwhile).
    fd = os.memfd_create("tierd-engine-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        raise
    array = np.frombuffer(mapping, dtype=np.uint8).reshape(rows, row_bytes)
    array[:] = 0
    return fd, array


def row_offsets(rows: int, row_bytes: int) -> npt.NDArray[np.uint64]:
    """The byte offset of each of ``rows`` rows."""
    return np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """Positions (into the call's keys) whose blocks now hold the daemon's bytes, and why
    the rest did not load (``None``: every key loaded, or the rest were misses)."""

    loaded: tuple[int, ...]
    error: str | None = None


class Blocks(Protocol):
    """An engine's memory of one call's blocks, by position in the call."""

    def fill(self, positions: Positions, source: Rows) -> None:
        """Block ``positions[i]`` := ``source[i]``."""
        ...

    def gather(self, positions: Positions, out: Rows) -> None:
        """``out[i]`` := block ``positions[i]``."""
        ...

    def fill_one(self, position: int, block: memoryview) -> None: ...

    def gather_one(self, position: int, out: memoryview) -> None: ...


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """vLLM's rows: block ``i`` of the call is ``rows[row_ids[i]]``."""

    rows: Rows
    row_ids: Positions

    def fill(self, positions: Positions, source: Rows) -> None:
        self.rows[self.row_ids[positions]] = source

    def gather(self, positions: Positions, out: Rows) -> None:
        np.take(self.rows, self.row_ids[positions], axis=0, out=out)

    def fill_one(self, position: int, block: memoryview) -> None:
        self.rows[self.row_ids[position]] = np.frombuffer(block, dtype=np.uint8)

    def gather_one(self, position: int, out: memoryview) -> None:
        out[:] = self.rows[self.row_ids[position]].data


@dataclass(frozen=True, slots=True)
class _Staging:
    """A connection's staging memfd: its region id, its rows here, their offsets."""

    region: int
    array: Rows
    offsets: npt.NDArray[np.uint64]


def staging_of(conn: ThreadConnection, rows: int, row_bytes: int, deadline: float) -> _Staging:
    """``conn``'s staging region of ``rows`` rows (registered on first use; a daemon
    without regions answers a :class:`~tierd.control.clients.handshake.DaemonError`)."""
    staging = conn.held.get("staging")
    if isinstance(staging, _Staging):
        return staging
    fd, array = staging_memory(rows, row_bytes)
    try:
        region = conn.client.register_region(fd, array.nbytes, deadline)
    finally:
        os.close(fd)  # the mapping and the daemon's copy keep the memory
    conn.held["staging"] = staging = _Staging(region, array, row_offsets(rows, row_bytes))
    return staging


def staged_load(
    conn: ThreadConnection,
    keys: Sequence[bytes],
    blocks: Blocks,
    deadline: float,
    loaded: list[int],
    *,
    rows: int,
    leading: bool = False,
) -> None:
    """Copy the daemon's blocks of ``keys`` into ``blocks`` through the staging memfd,
    ``rows`` blocks a round at most; ``loaded`` gets the positions copied."""
    client = conn.client
    staging = staging_of(conn, rows, client.block_bytes, deadline)
    step = job_keys(client.info, len(staging.array))
    for first in range(0, len(keys), step):
        count = min(step, len(keys) - first)
        done = client.region_load(
            staging.region, keys[first : first + count], staging.offsets[:count], deadline
        )
        flags = np.asarray(done, dtype=bool)
        if leading and not flags.all():
            flags[int(np.argmin(flags)) :] = False
        got = np.flatnonzero(flags)
        for run in _runs(got):  # a view of the rows: each byte is copied once, into blocks
            blocks.fill(first + run, staging.array[run[0] : run[-1] + 1])
        loaded.extend((first + got).tolist())
        if leading and len(got) < count:
            return


def _runs(rows: Positions) -> list[Positions]:
    """``rows`` (ascending) cut into runs of consecutive rows, none empty."""
    if len(rows) == 0:
        return []
    return np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)


def staged_store(
    conn: ThreadConnection, keys: Sequence[bytes], blocks: Blocks, deadline: float, *, rows: int
) -> list[bool]:
    """Store ``blocks`` under ``keys`` through the staging memfd; per key, whether the
    daemon holds it now."""
    client = conn.client
    staging = staging_of(conn, rows, client.block_bytes, deadline)
    step = len(staging.array)
    done: list[bool] = []
    for first in range(0, len(keys), step):
        positions = np.arange(first, min(first + step, len(keys)), dtype=np.intp)
        blocks.gather(positions, staging.array[: len(positions)])
        done += client.move(
            "region_store",
            staging.region,
            keys[first : first + len(positions)],
            staging.offsets[: len(positions)],
            None,
            deadline,
        )
    return done


def engine_region_store(
    conn: ThreadConnection,
    region: int,
    keys: Sequence[bytes],
    offsets: npt.NDArray[np.uint64],
    pieces: Sequence[int],
    deadline: float,
) -> list[bool]:
    """Store blocks the daemon reads out of the engine's own memfd (``region`` on this
    connection): piece ``j`` of key ``i`` at ``offsets[i, j]``."""
    return conn.client.move("region_store", region, keys, offsets, list(pieces), deadline)


def copied_load(
    conn: ThreadConnection,
    keys: Sequence[bytes],
    blocks: Blocks,
    deadline: float,
    loaded: list[int],
    *,
    leading: bool = False,
    lease: bool = True,
) -> None:
    """Copy the daemon's blocks of ``keys`` out of its pool, pinned a lease at a time
    (``lease``), or out of its messages (a daemon with neither regions nor a pool)."""
    client = conn.client

    def pinned(batch: list[bytes]) -> tuple[list[memoryview], Callable[[], None]]:
        pool = client.require_pool()
        reply = client.request("prepare_load", deadline, keys=batch)
        count = int(reply["count"])
        if list(dict.fromkeys(batch))[:count] != batch[:count]:
            count = 0  # a repeated key: its slot is another position's, not guessed
        views = [pool.view(int(slot)) for slot in reply["slots"][:count]]
        return views, lambda: _post(client, deadline, "complete_load", reply.get("lease"))

    def sent(batch: list[bytes]) -> tuple[list[memoryview], Callable[[], None]]:
        data = client.request("get", deadline, keys=batch)["data"]
        return [memoryview(block) for block in data], lambda: None

    if lease:
        step = lambda left: job_keys(client.info, left)  # noqa: E731
        _load_in_rounds(keys, blocks, loaded, leading, step, pinned)
    else:
        _load_in_rounds(keys, blocks, loaded, leading, lambda n: _inline_step(client, n), sent)


def _load_in_rounds(
    keys: Sequence[bytes],
    blocks: Blocks,
    loaded: list[int],
    leading: bool,
    step: Callable[[int], int],
    fetch: Callable[[list[bytes]], tuple[list[memoryview], Callable[[], None]]],
) -> None:
    """Rounds of ``step(keys left)`` keys: ``fetch(batch)`` gives the views of the
    batch's leading blocks the daemon holds and what to do once they are copied; past a
    miss the next round starts after it (``leading``: the load ends there)."""
    start = 0
    while start < len(keys):
        batch = list(keys[start : start + step(len(keys) - start)])
        views, finish = fetch(batch)
        try:
            for i, view in enumerate(views):
                blocks.fill_one(start + i, view)
                loaded.append(start + i)
        finally:
            finish()
        if len(views) < len(batch) and leading:
            return
        start += len(views) if len(views) == len(batch) else len(views) + 1


def inline_store(
    conn: ThreadConnection, keys: Sequence[bytes], blocks: Blocks, deadline: float
) -> list[bool]:
    """Store ``blocks`` in the messages themselves (no pool, no regions); per key, whether
    the daemon holds it now (a request stored short is looked up)."""
    client = conn.client
    done: list[bool] = []
    for start in range(0, len(keys), step := _inline_step(client, len(keys))):
        batch = list(keys[start : start + step])
        data = []
        for i in range(len(batch)):
            out = bytearray(client.block_bytes)
            blocks.gather_one(start + i, memoryview(out))
            data.append(bytes(out))
        reply = client.request("put", deadline, keys=batch, data=data)
        if int(reply.get("stored", 0)) == len(batch):
            done += [True] * len(batch)
        else:  # stored short (no room, a key another writer holds): ask which are held
            done += client.lookup_each(batch, deadline)
    return done


def _inline_step(client: BlockingClient, total: int) -> int:
    """Blocks per inline request: its keys and bytes must fit one frame."""
    info = client.info
    room = min(int(info.get("max_frame_bytes") or 1 << 62), MAX_REPLY_BYTES) - (64 << 10)
    each = client.block_bytes + int(info.get("max_key_bytes") or 64) + 16
    return max(1, min(job_keys(info, total), room // each))


def _post(client: BlockingClient, deadline: float, op: str, lease: int | None) -> None:
    """Finish a lease without waiting; if that fails the connection is closed, and the
    daemon releases every lease of a closed connection."""
    if lease is not None and not client.closed:
        with contextlib.suppress(TierdError, OSError):
            client.post(op, deadline, lease=lease)
