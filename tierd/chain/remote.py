"""The chain's side of a shared remote level (Redis, Valkey): what it needs of one, and
how blocks leave the local tiers for it.

The remote level is not a :class:`~tierd.tier.Tier`: other nodes write to it and its
server evicts, so the chain keeps no index of it. It asks instead, one round trip per
batch: which leading keys the server holds (``exists``), their verified bytes (``get``).
Blocks go to it from the last local level, on eviction and through write-through, as
private copies read out of their slots first, so a slot is never read after it is reused;
a flush writes them and learns what became of each (:class:`~tierd.remote.level.Landing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierd.events import TierEvent
from tierd.keys import BlockKey, Medium
from tierd.policy.admission import Admission
from tierd.remote.level import Landing
from tierd.stores import BlockStore

__all__ = ["Landing", "Payload", "RemoteLevel", "RemoteSide"]

Payload = bytes | bytearray | memoryview


class RemoteLevel(Protocol):
    """What the chain uses of a remote level (see :class:`tierd.remote.redis_level.RedisLevel`).
    None of these raise for a fault of the server: a fault is a miss, or a write not made."""

    name: str
    medium: Medium

    async def exists(self, keys: Sequence[BlockKey]) -> int: ...
    async def present(self, keys: Sequence[BlockKey]) -> list[bool]: ...
    async def get(self, keys: Sequence[BlockKey]) -> list[memoryview]: ...
    async def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> int: ...
    async def write(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> Landing: ...
    def put_later(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> bool: ...
    async def drain(self) -> None: ...
    async def settle(self) -> None: ...
    async def close(self) -> None: ...
    def take_events(self) -> list[TierEvent]: ...
    def stats(self) -> dict[str, Any]: ...
    def health(self) -> list[dict[str, Any]]: ...


@dataclass(slots=True)
class RemoteSide:
    """A remote level as the chain holds it, with the admission rule for blocks sent to
    it and the chain's own counts (hits found by lookups, blocks sent, promotions)."""

    level: RemoteLevel
    admission: Admission = field(default_factory=Admission)
    hits: int = 0  # block hits lookups found only on the remote level
    sent: int = 0  # blocks queued or written to it
    refused: int = 0  # blocks its admission rule kept back
    promotions: int = 0  # blocks copied from it into a local level
    read_errors: int = 0  # local reads that failed while copying a block out

    async def copy_out(
        self, store: BlockStore, slots: Sequence[int], keys: Sequence[BlockKey]
    ) -> int:
        """Read blocks out of ``store`` into private buffers and queue them (the caller is
        evicting, or writing through, and must not wait on the network). Returns how many
        were handed to the remote level."""
        good_keys, good = await self._read(store, slots, keys)
        if not good_keys or not self.level.put_later(good_keys, good):
            return 0
        self.sent += len(good_keys)
        return len(good_keys)

    async def write_out(
        self, store: BlockStore, slots: Sequence[int], keys: Sequence[BlockKey]
    ) -> Landing:
        """Read blocks out of ``store`` and write them before returning (a flush): what
        became of each, those that could not be read included."""
        good_keys, good = await self._read(store, slots, keys)
        landing = await self.level.write(good_keys, good) if good_keys else Landing()
        landing.unread += len(keys) - len(good_keys)
        self.sent += len(good_keys)
        return landing

    async def _read(
        self, store: BlockStore, slots: Sequence[int], keys: Sequence[BlockKey]
    ) -> tuple[list[BlockKey], list[bytearray]]:
        """The keys read out of their slots, and their private copies."""
        if not keys:
            return [], []
        buffers = [bytearray(store.block_bytes) for _ in keys]
        ok = await store.read(slots, keys, buffers)
        good_keys = [key for key, flag in zip(keys, ok, strict=True) if flag]
        good = [buf for buf, flag in zip(buffers, ok, strict=True) if flag]
        self.read_errors += len(keys) - len(good_keys)
        return good_keys, good
