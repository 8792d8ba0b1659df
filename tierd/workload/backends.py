"""The caches a replay can drive (:class:`~tierd.workload.replayer.ReplayBackend`).

- :class:`DaemonBackend`: one connection to a running daemon, in its own namespace; block
  bytes go through the shared-memory pool when the client maps it (``Client.load`` and
  ``Client.store`` take the zero-copy path), else inline in the messages.
  :func:`daemon_backends` opens one per worker.
- :class:`ChainBackend`: an in-process :class:`~tierd.chain.TierChain` that the caller
  opened (``tierd.library.open_chain``; this layer may not build one itself). Any number
  of them may share one chain: :func:`chain_backends`. :func:`replay_chain` is what
  ``tierd simulate --config`` runs on one.

Both settle (what an ordered replay waits for after each store): the chain awaits its
write-behind tasks and queued remote writes (:meth:`~tierd.chain.TierChain.settle`); a
daemon is asked for its ``stats`` until no tier has a ``behind`` backlog and its remote
level no ``pending_bytes``, for at most :data:`SETTLE_S` seconds.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

from tierd.control.clients.client import Client, DaemonError, Unreachable
from tierd.control.figures.stats import collect_stats
from tierd.errors import BlockMissing, CapacityError
from tierd.keys import BlockKey
from tierd.workload.replay_figures import ReplaySummary
from tierd.workload.replayer import replay
from tierd.workload.trace import Trace, TraceRequest

if TYPE_CHECKING:
    from tierd.chain import TierChain

__all__ = [
    "ChainBackend",
    "DaemonBackend",
    "chain_backends",
    "daemon_backends",
    "replay_chain",
]

DEFAULT_NAMESPACE = "replay"
SETTLE_S = 60.0  # the most a daemon backend waits for the daemon to come to rest
SETTLE_POLL_S = (0.0005, 0.005)  # between two stats while it does not: first, longest


class DaemonBackend:
    """One client connection; a ``capacity`` error reply becomes :class:`CapacityError`."""

    kind = "daemon"

    def __init__(self, client: Client, target: str) -> None:
        self.client = client
        self.target = target
        info = client.info
        self._max_keys = int(info.get("max_keys_per_request", 4096))
        entry = info.get("entry")
        tiers: list[dict[str, Any]] = info.get("tiers", [])
        self._entry_capacity = next(
            (int(t["capacity"]) for t in tiers if t["name"] == entry), self._max_keys
        )

    @classmethod
    async def connect(
        cls,
        socket: str | os.PathLike[str],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        block_bytes: int | None = None,
    ) -> DaemonBackend:
        """Connect and say hello; ``block_bytes``, when given, must match the daemon's
        (a ``DaemonError`` with code ``block_size_mismatch`` otherwise)."""
        client = await Client.connect(socket, namespace=namespace, block_bytes=block_bytes)
        return cls(client, os.fspath(socket))

    @property
    def block_bytes(self) -> int:
        return self.client.block_bytes

    @property
    def entry_capacity(self) -> int:
        return self._entry_capacity

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        # A request longer than the daemon takes in one message is looked up piece by
        # piece, as long as every key so far was a hit.
        count, media = 0, tuple[str, ...]()
        for start in range(0, len(keys), self._max_keys):
            part = keys[start : start + self._max_keys]
            found = await self.client.lookup(part)
            count, media = count + found.count, media + found.media
            if found.count < len(part):
                break
        return count, media

    async def touch(self, keys: Sequence[bytes]) -> None:
        for start in range(0, len(keys), self._max_keys):
            await self.client.touch(keys[start : start + self._max_keys])

    async def load(self, keys: Sequence[bytes]) -> list[bytes]:
        return await self.client.load(keys)

    async def store(self, keys: Sequence[bytes], data: Sequence[bytes]) -> int:
        try:
            return await self.client.store(keys, data)
        except DaemonError as exc:
            if exc.code == "capacity":
                raise CapacityError(str(exc)) from exc
            raise

    async def stats(self) -> dict[str, Any]:
        return await self.client.stats()

    async def settle(self) -> bool:
        """Ask for ``stats`` until the daemon's background copies are done (see the
        module's docstring); ``False`` for a daemon that does not report its ``behind``
        backlog (older than this client), or one still busy after :data:`SETTLE_S`."""
        pause, longest = SETTLE_POLL_S  # so at most SETTLE_S / first stats calls
        try:
            async with asyncio.timeout(SETTLE_S):
                while (backlog := _backlog(await self.client.stats())) is not None:
                    if backlog == 0:
                        return True
                    await asyncio.sleep(pause)  # the daemon's work: nothing here to await
                    pause = min(2 * pause, longest)
        except TimeoutError:
            pass
        return False

    async def close(self) -> None:
        await self.client.close()


def _backlog(stats: dict[str, Any]) -> int | None:
    """Blocks and bytes the daemon still has to copy behind stores (``None``: it does not
    say)."""
    tiers = stats.get("tiers", [])
    if any("behind" not in tier for tier in tiers):
        return None
    remote = stats.get("remote") or {}
    return sum(int(tier["behind"]) for tier in tiers) + int(remote.get("pending_bytes", 0))


@asynccontextmanager
async def daemon_backends(
    socket: str | os.PathLike[str],
    clients: int,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    block_bytes: int | None = None,
    connect_timeout: float | None = None,
) -> AsyncIterator[list[DaemonBackend]]:
    """``clients`` connections to the daemon at ``socket``, closed on exit. A daemon that
    does not answer a connection's hello within ``connect_timeout`` seconds is
    :class:`~tierd.control.clients.client.Unreachable`."""
    opened: list[DaemonBackend] = []
    try:
        for _ in range(clients):
            try:
                async with asyncio.timeout(connect_timeout):
                    backend = await DaemonBackend.connect(
                        socket, namespace=namespace, block_bytes=block_bytes
                    )
            except TimeoutError:
                raise Unreachable(
                    f"{os.fspath(socket)}: no answer in {connect_timeout:g} s"
                ) from None
            opened.append(backend)
        yield opened
    finally:
        await asyncio.gather(*(backend.close() for backend in opened))


class ChainBackend:
    """A worker's handle on an in-process chain; closing it leaves the chain open."""

    kind = "chain"

    def __init__(self, chain: TierChain, target: str = "<memory>") -> None:
        self.chain = chain
        self.target = target

    @property
    def block_bytes(self) -> int:
        return self.chain.block_bytes

    @property
    def entry_capacity(self) -> int:
        return self.chain.levels[self.chain.entry].tier.num_blocks

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        # find: lookup, then the remote level (if any) for what the local tiers lack
        found = await self.chain.find(cast(Sequence[BlockKey], keys))
        return found.count, tuple(str(m) for m in found.media)

    async def touch(self, keys: Sequence[bytes]) -> None:
        self.chain.touch(cast(Sequence[BlockKey], keys))

    async def load(self, keys: Sequence[bytes]) -> list[bytes]:
        try:
            handle = await self.chain.load(cast(Sequence[BlockKey], keys))
        except BlockMissing:
            return []
        try:
            if handle.store.has_views:
                return [_copy(view) for view in handle.views()]
            out = [bytearray(self.block_bytes) for _ in handle.keys]
            ok = await handle.read_into(out)
            good = ok.index(False) if False in ok else len(ok)
            return [bytes(b) for b in out[:good]]
        finally:
            handle.release()

    async def store(self, keys: Sequence[bytes], data: Sequence[bytes]) -> int:
        return len(await self.chain.store(cast(Sequence[BlockKey], keys), data))

    async def stats(self) -> dict[str, Any]:
        return collect_stats(self.chain)

    async def settle(self) -> bool:
        await self.chain.settle()
        return True

    async def close(self) -> None:
        return None


def chain_backends(chain: TierChain, clients: int, target: str = "<memory>") -> list[ChainBackend]:
    """``clients`` handles on one chain."""
    return [ChainBackend(chain, target) for _ in range(clients)]


def _copy(view: Any) -> bytes:
    """The bytes of one slot view: a memoryview, or a tensor on any device."""
    try:
        return bytes(memoryview(view).cast("B"))
    except TypeError:  # a tensor (a GPU entry tier): torch is loaded already then
        import torch

        from tierd.stores.base import tensor_memoryview

        flat = view.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        return bytes(tensor_memoryview(flat))


async def replay_chain(
    chain: TierChain,
    requests: Trace | Sequence[Sequence[BlockKey]],
    *,
    progress: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> ReplaySummary:
    """What ``tierd simulate --config`` runs: the replayer in its hit-ratio mode
    (``verify=False``), one worker, as fast as it goes, through an in-process chain.
    ``requests``: a trace, or the key lists of its requests."""
    trace = (
        requests
        if isinstance(requests, Trace)
        else [TraceRequest(0, 0, 0, tuple(keys)) for keys in requests]
    )
    report = None if progress is None else (lambda p: progress(p.done, p.total))
    return await replay(
        trace, [ChainBackend(chain)], speed=None, progress=report, stop=stop, verify=False
    )
