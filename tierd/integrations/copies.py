"""Copies between an engine's rows of KV bytes and the daemon, through leases.

``rows`` is a 2-D uint8 array, one block per row (an engine's CPU KV region); a job names
the rows to copy by index. Stores write the rows into the daemon's pool slots through a
store lease (or send them inline when the daemon has no pool); loads copy pinned pool
slots into the rows through load leases, as many keys as the daemon can serve.

These run on a :class:`~tierd.integrations.link.DaemonLink`'s loop (through
``DaemonLink.run``) and raise nothing but :class:`~tierd.errors.TierdError` and
``OSError`` subclasses; callers turn those into failed jobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tierd.client import Client
from tierd.errors import TierdError

__all__ = ["LoadOutcome", "load_rows", "store_rows"]

Rows = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """Indices (into the job's keys) whose rows now hold the daemon's bytes, and why the
    rest did not load (``None``: every key loaded, or the rest were misses)."""

    loaded: tuple[int, ...]
    error: str | None = None


def _batch_size(client: Client, total: int) -> int:
    """Keys per lease: at most half of what the daemon lets one connection hold in open
    leases (``max_lease_blocks``, a share of the entry tier), so a store job and a load
    job of this link can hold leases at once without one being refused ``capacity``."""
    pool = client.pool
    if pool is None:
        return max(1, min(total, 256))
    bound = int(client.info.get("max_lease_blocks") or pool.num_blocks)
    return max(1, min(total, bound // 2))


async def store_rows(
    client: Client, keys: Sequence[bytes], rows: Rows, row_ids: Sequence[int]
) -> int:
    """Store ``rows[row_ids[i]]`` under ``keys[i]``; returns how many blocks were new."""
    stored = 0
    size = _batch_size(client, len(keys))
    for first in range(0, len(keys), size):
        batch = list(keys[first : first + size])
        ids = row_ids[first : first + size]
        if client.pool is None:
            stored += await client.put(batch, [rows[int(r)].data for r in ids])
            continue
        lease = await client.prepare_store(batch)
        if lease.finished:
            continue  # the daemon holds (or is being given) every block already
        try:
            for view, i in zip(lease.views(), lease.to_write, strict=True):
                view[:] = rows[int(ids[i])].data
        except BaseException:
            with contextlib.suppress(TierdError, OSError):
                await lease.abort()
            raise
        stored += await lease.commit()
    return stored


async def load_rows(
    client: Client, keys: Sequence[bytes], rows: Rows, row_ids: Sequence[int]
) -> LoadOutcome:
    """Copy the daemon's blocks of ``keys`` into ``rows[row_ids[i]]``.

    A key the daemon cannot serve (evicted, never stored, failed its checksum) is skipped
    and the load goes on with the next one, so a short load still fills what it can. An
    error before anything loaded is raised; after, the keys loaded so far are returned
    with the error.
    """
    loaded: list[int] = []
    start = 0
    try:
        while start < len(keys):  # each round settles at least one key
            batch = list(keys[start : start + _batch_size(client, len(keys) - start)])
            count = await _load_batch(client, batch, rows, row_ids[start:], loaded, start)
            start += count if count == len(batch) else count + 1
    except (TierdError, OSError) as exc:
        if not loaded:
            raise
        return LoadOutcome(tuple(loaded), str(exc))
    return LoadOutcome(tuple(loaded))


async def _load_batch(
    client: Client,
    batch: list[bytes],
    rows: Rows,
    row_ids: Sequence[int],
    loaded: list[int],
    offset: int,
) -> int:
    """Load the leading keys of ``batch`` the daemon serves; returns how many."""
    if client.pool is None:
        blocks = await client.get(batch)
        for i, block in enumerate(blocks):
            rows[int(row_ids[i])] = np.frombuffer(block, dtype=np.uint8)
            loaded.append(offset + i)
        return len(blocks)
    lease = await client.prepare_load(batch)
    try:
        for i, view in enumerate(lease.views()):
            rows[int(row_ids[i])] = np.frombuffer(view, dtype=np.uint8)
            loaded.append(offset + i)
    finally:
        await lease.release()
    return lease.count
