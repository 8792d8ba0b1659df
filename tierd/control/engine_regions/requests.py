"""Engine host regions: an engine's own KV memory, handed to the daemon once as a file
descriptor, so that a store or a load is one small request of (key, offsets) descriptors
and the daemon copies the bytes between that memory and its tiers, off the engine's GIL.

- ``register_region`` (size): the descriptor comes beside the request, is checked, and
  gets an id of this connection's, all of it :mod:`~tierd.control.engine_regions.registration`'s.
- ``region_store`` (region, keys, offsets[, pieces]): the keys the chain does not hold
  get entry-level slots (a store handle, as ``prepare_store``), their pieces are read from
  the region into the slots (:mod:`~tierd.control.engine_regions.byte_moves`), and the handle is
  committed with a flag per key. Keys held already are not read again.
- ``region_load`` (same fields): each key is loaded into the entry level and pinned (as
  ``prepare_load``; promotion from lower levels as for any load), its bytes are written
  into the region, and the pins are released. Keys are independent: a miss fails that key.
- ``unregister_region`` (region).

**Ownership.** A :class:`RegionTable` belongs to one session: an id means nothing on
another connection (and so to another tenant). At most :data:`MAX_REGIONS` per
connection. A region's descriptor is closed when it is unregistered or the connection
closes, and not before the last job using it has ended (a thread copying into a closed,
reused descriptor number would write into another file).

**Jobs.** Every (offset, length) is checked against the registered size before anything
moves (``bad_request``, nothing changes). The blocks a job holds count against the
connection's lease bounds while it runs. A job's bytes move in one task of a small
thread pool of its own (a slow region cannot starve the tiers' copies), and its pins and
slots are released on every path, after the copy has ended, cancellation included. Where
the entry tier has no host memory views, the bytes are staged through private buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from tierd.chain import LoadHandle, StoreHandle
from tierd.control.engine_regions.byte_moves import (
    Layout,
    Offsets,
    bounds_problem,
    read_region,
    write_region,
)
from tierd.control.engine_regions.registration import MAX_REGION_BYTES, FdLine, Registrations
from tierd.control.engine_regions.table import MAX_REGIONS, Region, RegionTable
from tierd.control.protocol import ErrorCode, int_field, opt_seconds_field
from tierd.control.requests.block_requests import BlockRequests, Requester, distinct
from tierd.control.state.context import ServerContext
from tierd.control.state.copy_threads import slices
from tierd.errors import CapacityError, ProtocolError
from tierd.keys import BlockKey
from tierd.stores import BlockStore
from tierd.stores.base import settle

__all__ = ["MAX_REGION_BYTES", "MAX_REGIONS", "Region", "RegionTable", "RegionRequests"]

PIECES = 4  # pieces a load from a lower level is cut into, at most (_pieces)
PIECE_BYTES = 2 << 20  # bytes of blocks in one of those pieces, at least


class RegionRequests:
    """The region operations of one session; a ``register_region`` is its
    :class:`~tierd.control.engine_regions.registration.Registrations`' (descriptors come on
    ``line``, the connection's; None: they cannot come)."""

    def __init__(
        self, ctx: ServerContext, session: Requester, blocks: BlockRequests, line: FdLine | None
    ) -> None:
        self.ctx = ctx
        self.session = session
        self.blocks = blocks
        self.table = RegionTable()
        self.registrations = Registrations(ctx, session, self.table, line)

    def unregister(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.table.remove(int_field(msg, "region"))
        return {}

    def close(self) -> None:
        self.table.close()

    # -- jobs -----------------------------------------------------------------------------

    def job(
        self, msg: dict[str, Any], *, store: bool
    ) -> tuple[Region, list[BlockKey], Layout, Offsets]:
        """A job's region, keys, layout and offsets, every descriptor inside the region."""
        region = self.table.named(int_field(msg, "region"))
        keys = self.session.keys(msg)
        if store:
            distinct(keys)
        block_bytes = self.session.chain().block_bytes
        pieces = msg.get("pieces", [block_bytes])
        if not isinstance(pieces, list):
            raise ProtocolError(
                "field 'pieces' must be a list of sizes", code=ErrorCode.BAD_REQUEST
            )
        layout = Layout.of(pieces, block_bytes)
        if isinstance(layout, str):
            raise ProtocolError(layout, code=ErrorCode.BAD_REQUEST)
        raw = msg.get("offsets")
        want = len(keys) * len(layout.pieces) * 8
        if type(raw) is not bytes or len(raw) != want:
            raise ProtocolError(
                f"field 'offsets' must be bin of {want} bytes: a little-endian u64 per piece"
                f" of each key ({len(keys)} keys x {len(layout.pieces)} pieces)",
                code=ErrorCode.BAD_REQUEST,
            )
        offsets = np.frombuffer(raw, dtype="<u8").reshape(len(keys), len(layout.pieces))
        problem = bounds_problem(offsets, layout, region.size)
        if problem is not None:
            raise ProtocolError(problem, code=ErrorCode.BAD_REQUEST)
        return region, keys, layout, offsets

    async def store(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Read the keys the chain does not hold from the region into new entry-level
        blocks; per key, whether the daemon holds it now (or is storing it). Past the
        job's ``expires`` nothing more is read, and nothing read is kept: the engine has
        given the job up and may have reused the memory being read."""
        region, keys, layout, offsets = self.job(msg, store=True)
        until = expires_field(msg)
        async with self.ctx.region_jobs.turn(self._tenant_name()):
            if _past(until):  # it waited its turn past the engine's deadline
                return {"done": [False] * len(keys)}
            return await self._store(region, keys, layout, offsets, until)

    def _tenant_name(self) -> str:
        tenant = self.blocks.leases.tenant
        return tenant.name if tenant is not None else ""

    async def _store(
        self,
        region: Region,
        keys: list[BlockKey],
        layout: Layout,
        offsets: Offsets,
        until: float | None,
    ) -> dict[str, Any]:
        with region.job() as fd:
            try:
                handle, held = await self.blocks.reserve(keys)
            except (CapacityError, ProtocolError) as exc:
                if isinstance(exc, ProtocolError) and exc.code != ErrorCode.CAPACITY:
                    raise
                return {"done": [False] * len(keys)}
            with held:
                try:
                    row = {key: i for i, key in enumerate(keys)}
                    rows = offsets[[row[k] for k in handle.keys]]
                    ok = await self._fill(handle, fd, rows, layout, until)
                    if _past(until):
                        ok = [False] * len(ok)
                except BaseException:
                    handle.abort()
                    raise
            self.blocks._stored(await handle.commit(ok))  # counted as stored_blocks
        failed = {k for k, flag in zip(handle.keys, ok, strict=True) if not flag}
        return {"done": [k not in failed for k in keys]}

    def _pieces(self, count: int, *, whole: bool) -> list[range]:
        """``range(count)`` whole, or cut into at most :data:`PIECES` pieces of
        :data:`PIECE_BYTES` or more (a piece's reads all go at once: a smaller piece
        would leave the disk's threads idle)."""
        if whole or not count:
            return [range(count)]
        size = max(-(-count // PIECES), -(-PIECE_BYTES // self.session.chain().block_bytes))
        return [range(i, min(count, i + size)) for i in range(0, count, size)]

    async def _fill(
        self,
        handle: StoreHandle,
        fd: int,
        rows: Offsets,
        layout: Layout,
        until: float | None,
    ) -> list[bool]:
        """Read the region's pieces into the handle's slots (or through staging buffers)."""
        if not handle.keys:
            return []
        views = host_views(handle.store, handle.slots)
        if views is not None:
            return await self._copy(read_region, fd, rows, views, (layout, until))
        staged = [memoryview(bytearray(handle.store.block_bytes)) for _ in handle.keys]
        read = await self._copy(read_region, fd, rows, staged, (layout, until))
        written = await handle.store.write(handle.slots, handle.keys, staged)
        return [a and b for a, b in zip(read, written, strict=True)]

    async def _copy(
        self,
        move: Callable[..., list[bool]],
        fd: int,
        rows: Offsets,
        blocks: Sequence[memoryview],
        how: tuple[Layout, float | None],
    ) -> list[bool]:
        """``move`` (:func:`read_region` or :func:`write_region`) the blocks at ``rows``,
        slice by slice in the copy threads, each slice in this connection's turn (a
        slice past the job's time moves nothing)."""
        layout, until = how
        leases = self.blocks.leases
        tenant = leases.tenant.name if leases.tenant is not None else ""
        conn = leases.conn
        ok: list[bool] = []
        for part in slices(len(rows), self.session.chain().block_bytes):
            rows_part, blocks_part = rows[part.start : part.stop], blocks[part.start : part.stop]
            job = functools.partial(_in_rows, move, fd, rows_part, blocks_part, layout, until)
            ok += await self.ctx.copy_threads.run(tenant, conn, job)
        return ok

    async def load(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Write each key the chain holds into the region; per key, whether it was. No
        write starts past the job's ``expires``. Where blocks come from a lower level,
        the job goes in pieces at once: one piece's copy into the region runs while the
        next one is still being read."""
        region, keys, layout, offsets = self.job(msg, store=False)
        how = (layout, expires_field(msg))
        async with self.ctx.region_jobs.turn(self._tenant_name()):
            return await self._load(region, keys, offsets, how)

    async def _load(
        self,
        region: Region,
        keys: list[BlockKey],
        offsets: Offsets,
        how: tuple[Layout, float | None],
    ) -> dict[str, Any]:
        done = [False] * len(keys)
        with contextlib.ExitStack() as held:
            # A repeated key is pinned once but written as often as it is named: each
            # copy counts against the lease bounds like a block of its own.
            held.enter_context(self.blocks.leases.hold(len(keys) - len(set(keys))))
            held.enter_context(region.job())
            target = region.for_loads()  # sealed: no page of it can go under a write
            wanted = await self._worth_loading(list(dict.fromkeys(keys)))
            deadline = asyncio.get_running_loop().time() + self.ctx.limits.load_wait_s

            async def piece(part: list[BlockKey]) -> None:
                handles = await self._pin_each(part, held, deadline)
                for i, flag in (await self._drain(handles, target, keys, offsets, how)).items():
                    done[i] = flag

            chain = self.session.chain()
            ready = chain.levels[chain.entry].tier.ready_run(wanted) == len(wanted)
            parts = self._pieces(len(wanted), whole=ready)
            await together([piece(wanted[part.start : part.stop]) for part in parts])
        return {"done": done}

    async def _pin_each(
        self, wanted: list[BlockKey], held: contextlib.ExitStack, deadline: float
    ) -> list[LoadHandle]:
        """Pin every key of ``wanted`` the chain can load, each run of them with one
        load, their pins and holds released when ``held`` closes; a key that cannot be
        loaded is skipped (keys are independent), and past a bound on held blocks the
        rest are. Waits until ``deadline`` (loop time) at most on blocks being written."""
        handles: list[LoadHandle] = []
        loop = asyncio.get_running_loop()
        while wanted:
            try:
                pinned = await self.blocks.pin(wanted, max(0.0, deadline - loop.time()))
            except (CapacityError, ProtocolError) as exc:
                if isinstance(exc, ProtocolError) and exc.code != ErrorCode.CAPACITY:
                    raise
                return handles
            if pinned is None:
                wanted = wanted[1:]  # the first cannot be loaded: skip it
                continue
            handle, hold = pinned
            held.callback(handle.release)
            held.enter_context(hold)
            handles.append(handle)
            wanted = wanted[len(handle.keys) :]
        return handles

    async def _worth_loading(self, keys: list[BlockKey]) -> list[BlockKey]:
        """The keys some level holds, the remote level asked once for the rest, so that a
        load of many misses costs no load (nor remote read) per miss."""
        chain = self.session.chain()
        held = chain.held_locally(keys)
        if chain.remote is not None and not all(held):
            missing = [key for key, flag in zip(keys, held, strict=True) if not flag]
            there = await chain.remote.level.present(missing)
            remote = {key for key, flag in zip(missing, there, strict=True) if flag}
            held = [flag or key in remote for key, flag in zip(keys, held, strict=True)]
        return [key for key, flag in zip(keys, held, strict=True) if flag]

    async def _drain(
        self,
        handles: list[LoadHandle],
        target: int,
        keys: list[BlockKey],
        offsets: Offsets,
        how: tuple[Layout, float | None],
    ) -> dict[int, bool]:
        """Write the pinned blocks into the region (mapped here at ``target``) at each of
        their keys' offsets (cut by ``how``'s layout, no write starting past its time); by
        position in ``keys``, whether each of theirs was written."""
        source: dict[BlockKey, memoryview] = {}
        for handle in handles:
            views = host_views(handle.store, handle.slots)
            if views is None:  # staged: read the blocks out first
                staged = [memoryview(bytearray(handle.store.block_bytes)) for _ in handle.keys]
                read = await handle.read_into(staged)
                source.update(
                    (k, v) for k, v, f in zip(handle.keys, staged, read, strict=True) if f
                )
            else:
                source.update(zip(handle.keys, views, strict=True))
        if all(map(source.__contains__, keys)):  # the common case, at C speed
            found: Sequence[int] = range(len(keys))
            rows, blocks = offsets, list(map(source.__getitem__, keys))
        else:
            found = [i for i, key in enumerate(keys) if key in source]
            if not found:
                return {}
            rows, blocks = offsets[found], [source[keys[i]] for i in found]
        wrote = await self._copy(write_region, target, rows, blocks, how)
        return dict(zip(found, wrote, strict=True))


async def together(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` at once. The first to fail cancels the others, and nothing returns
    or raises before every one has ended (their copies into a region included)."""
    if len(coros) == 1:
        return await coros[0]
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await settle(asyncio.gather(*tasks, return_exceptions=True))
        raise


def _in_rows(
    move: Callable[..., list[bool]],
    fd: int,
    rows: Offsets,
    blocks: Sequence[memoryview],
    layout: Layout,
    until: float | None,
) -> list[bool]:
    """``move`` one slice, its offsets made Python ints here, in the copy thread (a job's
    whole table as Python lists held ~13 MiB per queued 4,096-piece job)."""
    return move(fd, rows.tolist(), blocks, layout, until)


def expires_field(msg: dict[str, Any]) -> float | None:
    """A job's optional ``expires``: the ``time.monotonic()`` second (the machine's
    monotonic clock, which every process of it shares) at which its engine gives it up."""
    return opt_seconds_field(msg, "expires")


def _past(until: float | None) -> bool:
    return until is not None and time.monotonic() >= until


def host_views(store: BlockStore, slots: Sequence[int]) -> list[memoryview] | None:
    """Writable byte views of ``slots`` when the store is host memory, else None."""
    if not store.has_views:
        return None
    views = [store.view(slot) for slot in slots]
    if not all(isinstance(v, memoryview) for v in views):
        return None  # device memory: staged through host buffers
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
