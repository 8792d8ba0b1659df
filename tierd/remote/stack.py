"""Remote levels chained: a fast shared level (Redis) above a durable one (S3), seen by
the chain as one remote level.

- **Written down:** a block that leaves the node goes to every level (the upper for
  speed, the lower to outlive the upper's evictions and restarts): the upper's server
  evicts on its own, unseen, so the lower level cannot wait for an eviction to receive it.
- **Found:** the upper level is asked first; the keys past its leading run are asked of
  the next level, and so on.
- **Promoted:** blocks read from a lower level are queued for a write into every level
  above it, so that the next node to ask finds them in the fast one.

Faults stay per level: each has its own deadline and breaker, and a level that is down
costs only its own deadline, then nothing, while the others keep serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tierd.events import TierEvent
from tierd.keys import BlockKey, Medium
from tierd.remote.level import Landing, LevelBase, Payload

__all__ = ["RemoteStack"]


class RemoteStack:
    """Remote levels, fastest first, as one :class:`~tierd.chain.remote.RemoteLevel`."""

    def __init__(self, levels: Sequence[LevelBase]) -> None:
        if len(levels) < 2:
            raise ValueError("a stack needs two remote levels or more")
        self.levels = list(levels)
        self.name = "+".join(level.name for level in levels)
        self.medium: Medium = levels[0].medium
        self.promoted = 0  # blocks read from a lower level and queued for the ones above

    async def exists(self, keys: Sequence[BlockKey]) -> int:
        run = 0
        for level in self.levels:
            if run == len(keys):
                break
            run += await level.exists(keys[run:])
        return run

    async def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        held = [False] * len(keys)
        for level in self.levels:
            missing = [i for i, flag in enumerate(held) if not flag]
            if not missing:
                break
            there = await level.present([keys[i] for i in missing])
            for i, flag in zip(missing, there, strict=True):
                held[i] = flag
        return held

    async def get(self, keys: Sequence[BlockKey]) -> list[memoryview]:
        out: list[memoryview] = []
        for depth, level in enumerate(self.levels):
            if len(out) == len(keys):
                break
            found = await level.get(keys[len(out) :])
            if found and depth:
                self._promote(depth, keys[len(out) : len(out) + len(found)], found)
            if not found:
                continue
            out += found
        return out

    def _promote(self, depth: int, keys: Sequence[BlockKey], payloads: list[memoryview]) -> None:
        for level in self.levels[:depth]:
            if level.put_later(keys, payloads):
                self.promoted += len(keys)

    async def write(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> Landing:
        """Write to every level at once; what became of each block on each level."""
        each = await asyncio.gather(*(level.write(keys, payloads) for level in self.levels))
        landing = Landing(sent=len(keys), written=max(part.written for part in each))
        for part in each:
            landing.missed.update(part.missed)
        return landing

    async def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> int:
        return (await self.write(keys, payloads)).written

    def put_later(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> bool:
        accepted = [level.put_later(keys, payloads) for level in self.levels]
        return any(accepted)

    async def drain(self) -> None:
        for level in self.levels:
            await level.drain()

    async def settle(self) -> None:
        await asyncio.gather(*(level.settle() for level in self.levels))

    def health(self) -> list[dict[str, Any]]:
        return [line for level in self.levels for line in level.health()]

    async def close(self) -> None:
        await asyncio.gather(*(level.close() for level in self.levels))

    def take_events(self) -> list[TierEvent]:
        return [event for level in self.levels for event in level.take_events()]

    def stats(self) -> dict[str, Any]:
        """The levels' counts added up, the worst breaker states, and each level's own
        stats under ``levels``."""
        each = [level.stats() for level in self.levels]
        total = dict(each[0])
        for key, value in total.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = sum(s.get(key, 0) for s in each)
        states = [s["state"] for s in each if s["state"] != "closed"]
        write_states = [s["write_state"] for s in each if s["write_state"] != "closed"]
        latest = max(each, key=lambda s: float(s.get("last_error_at", 0.0)))
        total.update(
            name=self.name,
            endpoint=" > ".join(str(s["endpoint"]) for s in each),
            state=states[0] if states else "closed",
            write_state=write_states[0] if write_states else "closed",
            last_error=latest["last_error"],
            last_error_at=latest["last_error_at"],
            recovered=latest["recovered"],
            stack_promotions=self.promoted,
            levels=each,
        )
        return total
