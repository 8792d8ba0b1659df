"""The soak's load: the key space (prefix chains, Zipf popularity), the tallies of what
the clients did and saw (every loaded byte verified), the gate that lets the load run in
turns, and the :class:`Worker` clients."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from soak_daemon import content
from soak_settings import DEADLINE_S, NAMESPACE

from tierd.client import Client, DaemonError, Unreachable
from tierd.errors import ProtocolError
from tierd.stores.base import InFlight

# Error codes after which the daemon hangs up (the client's view of a dead connection).
_HANGUP = frozenset({"not_allowed", "busy", "shutting_down", "frame_too_large"})


class KeySpace:
    """``sequences`` prefix chains of ``seq_len`` keys; chain ``i`` is picked with weight
    ``1 / (i + 1) ** 0.9`` (a few hot prompts, a long tail)."""

    def __init__(self, sequences: int, seq_len: int) -> None:
        self.sequences, self.seq_len = sequences, seq_len
        self._cum = list(itertools.accumulate(1.0 / (i + 1) ** 0.9 for i in range(sequences)))

    def keys(self, sequence: int) -> list[bytes]:
        return [f"s{sequence:05d}-b{i}".encode() for i in range(self.seq_len)]

    def pick(self, rng: random.Random) -> list[bytes]:
        return self.keys(rng.choices(range(self.sequences), cum_weights=self._cum)[0])

    def all_keys(self) -> list[bytes]:
        return [k for s in range(self.sequences) for k in self.keys(s)]


@dataclass
class Tally:
    """What the clients did and saw. ``wrong`` counts blocks with any wrong byte."""

    block_bytes: int
    started: float = field(default_factory=time.monotonic)
    ops: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    per_second: Counter[int] = field(default_factory=Counter)
    wrong: int = 0
    wrong_examples: list[str] = field(default_factory=list)

    def op(self, kind: str) -> None:
        self.ops[kind] += 1
        self.per_second[int(time.monotonic() - self.started)] += 1

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    def verify(self, keys: Sequence[bytes], blocks: Sequence[bytes], where: str) -> int:
        """Check each block against its key's bytes; returns how many were wrong."""
        bad = 0
        for key, data in zip(keys, blocks, strict=False):
            self.blocks["verified"] += 1
            if data != content(key, self.block_bytes):
                bad += 1
                if len(self.wrong_examples) < 20:
                    self.wrong_examples.append(f"{where}: {key!r} ({len(data)} bytes)")
        self.wrong += bad
        return bad


class Gate:
    """Lets the load run in turns; :meth:`close` waits until no turn is running."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._turns = InFlight()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        await self._open.wait()
        with self._turns.tracked():
            yield

    async def close(self) -> None:
        self._open.clear()
        async with asyncio.timeout(DEADLINE_S * 2):
            await self._turns.idle()

    def open(self) -> None:
        self._open.set()


async def close_client(client: Client | None) -> None:
    """Closes ``client`` (if any) within the deadline; a daemon already gone or too slow
    to answer the goodbye is expected in the campaign (it kills and stalls the daemon)."""
    if client is not None:
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(DEADLINE_S):
                await client.close()


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, DaemonError):
        return exc.code
    if isinstance(exc, Unreachable):
        return "unreachable"
    if isinstance(exc, ProtocolError):
        return f"protocol:{exc.code}"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return type(exc).__name__


class Worker:
    """One client connection running lookup / load (verified) / store / touch rounds,
    reconnecting (with a 0.2 s back-off, as an engine would) while the daemon is down."""

    def __init__(
        self, path: str, keys: KeySpace, tally: Tally, gate: Gate, rng: random.Random
    ) -> None:
        self.path, self.keys, self.tally, self.gate, self.rng = path, keys, tally, gate, rng
        self.client: Client | None = None

    async def run(self, stop: asyncio.Event, rounds: int | None = None) -> None:
        done = 0
        try:
            while not stop.is_set() and (rounds is None or done < rounds):
                backoff = 0.0
                async with self.gate.turn():
                    if stop.is_set():
                        break
                    if self.client is None:
                        backoff = 0.0 if await self._connect() else 0.2
                    else:
                        await self._round()
                        done += 1
                if backoff:
                    await asyncio.sleep(backoff)  # the daemon is down: retry later
        finally:
            await self.drop()

    async def _connect(self) -> bool:
        try:
            async with asyncio.timeout(DEADLINE_S):
                self.client = await Client.connect(
                    self.path, namespace=NAMESPACE, block_bytes=self.tally.block_bytes
                )
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.tally.error(f"connect:{error_kind(exc)}")
            return False
        self.tally.blocks["connects"] += 1
        return True

    async def drop(self) -> None:
        client, self.client = self.client, None
        await close_client(client)

    async def _round(self) -> None:
        client = self.client
        if client is None:
            return
        keys, tally = self.keys.pick(self.rng), self.tally
        try:
            async with asyncio.timeout(DEADLINE_S):
                found = await client.lookup(keys)
                tally.op("lookup")
                if found.count:
                    blocks = await client.load(keys[: found.count])
                    tally.op("load")
                    tally.verify(keys, blocks, "load")
                    tally.blocks["loaded"] += len(blocks)
                    tally.blocks["load_shortfall"] += found.count - len(blocks)
                if found.count < len(keys):
                    size = tally.block_bytes
                    tally.blocks["stored"] += await client.store(
                        keys, [content(k, size) for k in keys]
                    )
                    tally.op("store")
                if self.rng.random() < 0.1:
                    await client.touch(keys)
                    tally.op("touch")
        except (DaemonError, Unreachable, ProtocolError, OSError, TimeoutError) as exc:
            kind = error_kind(exc)
            tally.error(kind)
            if not isinstance(exc, DaemonError) or kind in _HANGUP:
                await self.drop()
