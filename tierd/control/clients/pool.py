"""The client's side of the shared-memory pool: the mapping, and leases on its slots.

- :class:`PoolMap` maps the tenant's pool into this process from the descriptor the
  daemon passed with its hello reply, and hands out views (or torch tensors) of one slot
  at a time, bounds checked.
- :class:`PoolShare` keeps one mapping of the pool for every blocking connection of an
  engine's threads that passes it.
- :class:`StoreLease` and :class:`LoadLease` are the replies of ``prepare_store`` and
  ``prepare_load``: slots to write, or pinned slots to read, until the lease is finished
  (``commit``/``abort``, ``release``). A lease knows its client only through
  :class:`PoolUser`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol, cast

from tierd.errors import ProtocolError

# Imported with the client, not when a pool is mapped: a client that drops privileges
# after its imports (tests/tenant_child.py) may no longer read the standard library.
from tierd.prefault import Prefault

__all__ = ["LoadLease", "PoolMap", "PoolShare", "PoolUser", "StoreLease"]


class PoolMap:
    """The tenant's shared-memory pool, mapped into this process from the descriptor the
    daemon passed with its hello reply (the pool has no path anyone could open)."""

    def __init__(
        self, fd: int, size: int, stride: int, num_blocks: int, block_bytes: int, name: str = ""
    ) -> None:
        self.name, self.stride, self.block_bytes = name, stride, block_bytes
        self.num_blocks = num_blocks
        if num_blocks < 1 or stride < block_bytes or size < num_blocks * stride:
            raise ProtocolError(f"the daemon described an impossible pool ({size} bytes)")
        found = os.fstat(fd).st_size
        if found < size:
            raise ProtocolError(f"the pool passed holds {found} bytes, not the {size} named")
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._mm)
        # Page tables filled in the background: a copy into a slot this process never
        # touched would otherwise fault on every 4 KiB page (tierd/prefault.py).
        self.prefault = Prefault(self._mm, name or "pool")

    def view(self, slot: int) -> memoryview:
        if not 0 <= slot < self.num_blocks:
            raise ProtocolError(f"the daemon named slot {slot}, outside the pool")
        start = slot * self.stride
        return self._view[start : start + self.block_bytes]

    def tensor(self, slot: int) -> Any:
        """A uint8 torch tensor over one slot (no copy)."""
        import torch

        self.view(slot)  # bounds check
        return torch.frombuffer(
            self._mm, dtype=torch.uint8, count=self.block_bytes, offset=slot * self.stride
        )

    def as_tensor(self) -> Any:
        """An int8 torch tensor over the whole mapping (no copy), for an engine whose own
        copies move blocks in and out of the pool's rows (slot ``s`` at ``s * stride``)."""
        import torch

        return torch.frombuffer(self._mm, dtype=torch.int8)

    def close(self) -> None:
        self.prefault.stop()  # never populating a range after it is unmapped
        self._view.release()
        # A caller may still hold a view: the mapping then goes when the last one does.
        with contextlib.suppress(BufferError):
            self._mm.close()


class PoolShare:
    """One mapping of a tenant's pool for every connection that passes it (their page
    tables filled once, not once per connection): the newest ``keep`` pools only, the
    oldest closed when another comes (a restarted daemon's), and :meth:`close` for the
    rest. :meth:`find` gives a mapping by the pool's name (an engine's workers find the
    pool its scheduler's rows lie in)."""

    def __init__(self, keep: int = 1) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._held: list[tuple[tuple[Any, ...], PoolMap]] = []  # oldest first

    def mapping(self, fd: int, block_bytes: int, named: dict[str, Any]) -> PoolMap:
        """The mapping of the pool ``fd`` is (as the hello reply ``named`` it)."""
        found = os.fstat(fd)
        key = (found.st_dev, found.st_ino, block_bytes, *sorted(named.items()))
        with self._lock:
            for held_key, held in self._held:
                if held_key == key:
                    return held
            pool = PoolMap(fd, block_bytes=block_bytes, **named)
            self._held.append((key, pool))
            old = self._held[: -self._keep]
            del self._held[: -self._keep]
        for _, gone in old:
            gone.close()  # a view still in use keeps the mapping until it goes
        return pool

    def find(self, name: str) -> PoolMap | None:
        """The mapping of the pool named ``name``, if one is held."""
        with self._lock:
            return next((pool for _, pool in self._held if pool.name == name), None)

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for _, pool in held:
            pool.close()


class PoolUser(Protocol):
    """What a lease asks of its client (:class:`~tierd.control.clients.client.Client`)."""

    def require_pool(self) -> PoolMap:
        """The mapped pool; refused when none is mapped."""
        ...

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply."""
        ...


class StoreLease:
    """Pool slots reserved for the blocks of ``keys`` that the daemon does not hold yet:
    ``to_write[i]`` is the index in ``keys`` of the i-th view."""

    def __init__(self, client: PoolUser, keys: Sequence[bytes], reply: dict[str, Any]) -> None:
        self._client = client
        self.keys = list(keys)
        self.lease: int | None = reply["lease"]
        self.slots: list[int | None] = reply["slots"]
        self.to_write = [i for i, slot in enumerate(self.slots) if slot is not None]
        self.finished = self.lease is None

    def views(self) -> list[memoryview]:
        pool = self._client.require_pool()
        return [pool.view(cast(int, self.slots[i])) for i in self.to_write]

    def tensors(self) -> list[Any]:
        pool = self._client.require_pool()
        return [pool.tensor(cast(int, self.slots[i])) for i in self.to_write]

    async def commit(self, ok: bool | Sequence[bool] = True) -> int:
        """Tell the daemon the views are written; returns how many blocks it stored."""
        if self.finished:
            return 0
        self.finished = True
        reply = await self._client.request("complete_store", lease=self.lease, ok=ok)
        return int(reply["stored"])

    async def abort(self) -> None:
        if not self.finished:
            self.finished = True
            await self._client.request("abort_store", lease=self.lease)


class LoadLease:
    """The leading ``count`` keys, pinned in the pool until ``release``."""

    def __init__(self, client: PoolUser, keys: Sequence[bytes], reply: dict[str, Any]) -> None:
        self._client = client
        self.lease: int | None = reply["lease"]
        self.count: int = reply["count"]
        self.slots: list[int] = reply["slots"]
        self.keys = list(dict.fromkeys(keys))[: self.count]
        self.released = self.lease is None

    def views(self) -> list[memoryview]:
        pool = self._client.require_pool()
        return [pool.view(slot) for slot in self.slots]

    def tensors(self) -> list[Any]:
        pool = self._client.require_pool()
        return [pool.tensor(slot) for slot in self.slots]

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self._client.request("complete_load", lease=self.lease)
