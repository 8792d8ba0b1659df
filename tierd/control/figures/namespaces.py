"""A tenant's namespaces as an operator sees them: names, request figures, blocks held.

Every key a client sends is stored under its namespace's 8-byte id (an xxh3 of the name,
:meth:`~tierd.control.state.context.ServerContext.namespace_id`), so the chain knows ids, not
names. A :class:`NamespaceBook` keeps, per tenant, the name behind each id, learned when a
client says ``hello`` (at most ``limits.namespaces_per_tenant`` of them), and the figures
of its requests (:class:`NamespaceFigures`, counted once per request by the session,
never per key). With a ``path`` (beside the tenant's disk slab: only the disk tier
outlives the daemon, and its blocks keep their ids) new names are written there, off the
event loop and many at a time, and read back at start, so a restarted daemon names the
blocks its disk tier kept before any client returns.

Blocks per tier are counted by the chain's :class:`~tierd.chain.PrefixCensus`, kept up to
date from its events: :func:`namespace_rows` costs the number of namespaces, not blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from tierd.control.protocol import NAMESPACE_ID_BYTES

if TYPE_CHECKING:
    from tierd.chain import TierChain

__all__ = ["DEFAULT_MAX_NAMES", "NAMES_FILE", "NamespaceBook", "NamespaceFigures", "namespace_rows"]

log = structlog.get_logger("tierd.control")

NAMES_FILE = "tierd-namespaces.json"
_FORMAT = 1
DEFAULT_MAX_NAMES = 256  # names a tenant's book keeps (limits.namespaces_per_tenant)
WRITE_DELAY_S = 1.0  # a new name waits this long for others to share its write


@dataclass(slots=True)
class NamespaceFigures:
    """What the clients of one namespace asked since the daemon started (in blocks)."""

    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    last_used: float = 0.0  # wall-clock time of its last lookup or store (0: none yet)

    def count_lookup(self, asked: int, hits: int) -> None:
        """One lookup of ``asked`` blocks, ``hits`` of them found (a few adds)."""
        self.lookups += 1
        self.hit_blocks += hits
        self.miss_blocks += asked - hits
        self.last_used = time.time()


class NamespaceBook:
    """Names and figures of one tenant's namespaces, by 8-byte id.

    At most ``max_names`` names are kept (the ones already known always keep working): a
    tenant that names a new namespace in every hello would otherwise grow this book, its
    file and what every ``namespaces`` request walks, without end. New names are written
    to ``path`` off the event loop: the first one starts a timer of ``write_delay_s``,
    and every name learned until it fires goes into the same write (a thread writes a
    temporary file and renames it into place). :meth:`close` writes what is left.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        max_names: int = DEFAULT_MAX_NAMES,
        write_delay_s: float = WRITE_DELAY_S,
    ) -> None:
        self.path = path
        self.max_names = max_names
        self.write_delay_s = write_delay_s
        self.names: dict[bytes, str] = {}
        self.figures: dict[bytes, NamespaceFigures] = {}
        self.writes = 0  # files written (one per burst of new names, not one per name)
        self.walking = asyncio.Lock()  # held by a pass over the tenant's index (a delete)
        self._dirty = False
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Future[bool] | None = None
        if path is not None:
            self.names.update(_read_names(path))

    def refusal(self, name: str, namespace_id: bytes) -> str | None:
        """Why a hello may not name ``name`` (a new name past the bound), or ``None``."""
        if namespace_id in self.names or len(self.names) < self.max_names:
            return None
        return (
            f"namespace {name!r} is new, and this tenant has named {len(self.names)}"
            f" namespaces already, at most {self.max_names} (limits.namespaces_per_tenant):"
            " use a namespace it has named before"
        )

    def learn(self, name: str, namespace_id: bytes) -> NamespaceFigures:
        """A client said hello in ``name``: its figures (written to, per request)."""
        if self.names.get(namespace_id) != name:
            self.names[namespace_id] = name
            self._dirty = True
            self._schedule()
        figures = self.figures.get(namespace_id)
        if figures is None:
            figures = self.figures[namespace_id] = NamespaceFigures()
        return figures

    def label(self, namespace_id: bytes) -> str | None:
        """The name behind ``namespace_id``, if a client ever said it."""
        return self.names.get(namespace_id)

    async def close(self) -> None:
        """Write the names not written yet (a clean stop loses none)."""
        if self._writing is not None:
            await asyncio.wait([self._writing])  # its end may set the next timer
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._dirty and self.path is not None:
            self._dirty = False
            if await asyncio.to_thread(_write_names, self.path, list(self.names.items())):
                self.writes += 1

    def _schedule(self) -> None:
        """Start the timer of the next write, unless one is set or a write is under way
        (its end schedules the next)."""
        if self.path is None or self._timer is not None or self._writing is not None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.write_delay_s, self._write)

    def _write(self) -> None:
        """Hand the names to a thread: the only work here is a copy of the list."""
        self._timer = None
        if not self._dirty or self.path is None:
            return
        self._dirty = False
        loop = asyncio.get_running_loop()
        names = list(self.names.items())
        self._writing = loop.run_in_executor(None, _write_names, self.path, names)
        self._writing.add_done_callback(self._written)

    def _written(self, done: asyncio.Future[bool]) -> None:
        self._writing = None
        error = None if done.cancelled() else done.exception()
        if error is not None:  # a bug, not a full disk (that is a warning, and False)
            log.error("writing namespace names failed", path=str(self.path), exc_info=error)
        elif not done.cancelled() and done.result():
            self.writes += 1
        if self._dirty:
            self._schedule()


def _write_names(path: Path, names: list[tuple[bytes, str]]) -> bool:
    """Write ``names`` to ``path`` atomically (a crash leaves the old file or the new one),
    in a thread; whether it was written."""
    body = {"format": _FORMAT, "names": {k.hex(): v for k, v in sorted(names)}}
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(body, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except OSError as exc:  # the names are a convenience: serving goes on without them
        log.warning("cannot save namespace names", path=str(path), error=str(exc))
        return False
    return True


def _read_names(path: Path) -> dict[bytes, str]:
    try:
        body = json.loads(path.read_text())
        names = body["names"]
        return {bytes.fromhex(k): str(v) for k, v in names.items() if len(k) == 16}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # Unreadable names cost labels, never blocks: the ids are shown instead.
        log.warning("ignoring unreadable namespace names", path=str(path), error=str(exc))
        return {}


def namespace_rows(book: NamespaceBook, *chains: TierChain) -> list[dict[str, Any]]:
    """One row per namespace that holds blocks or was used: its name (``None`` when no
    client named it since the names were last saved), id, blocks per tier, bytes held in
    all tiers, and its request figures; most bytes first. Costs the number of
    namespaces, not of blocks: each chain's census keeps the blocks per namespace. The
    chains of one tenant's block sizes (same tiers) add up."""
    tiers = [level.tier.name for level in chains[0].levels]
    parts = []
    for chain in chains:
        census = chain.prefix_census(NAMESPACE_ID_BYTES)
        parts.append(([census.counts(i) for i in range(len(tiers))], chain.block_bytes))
    names, every = book.names, book.figures
    unused = NamespaceFigures()
    rows: list[dict[str, Any]] = []
    ids = set(every).union(*(count for counts, _ in parts for count in counts))
    for namespace_id in ids:
        held = [0] * len(tiers)
        held_bytes = 0
        for counts, block_bytes in parts:
            for i, count in enumerate(counts):
                n = count.get(namespace_id, 0)
                held[i] += n
                held_bytes += n * block_bytes
        figures = every.get(namespace_id, unused)
        last = figures.last_used
        rows.append(
            {
                "namespace": names.get(namespace_id),
                "id": namespace_id.hex(),
                "blocks": dict(zip(tiers, held, strict=True)),
                "bytes": held_bytes,
                "lookups": figures.lookups,
                "hit_blocks": figures.hit_blocks,
                "miss_blocks": figures.miss_blocks,
                "stored_blocks": figures.stored_blocks,
                "last_used": round(last, 3) if last else None,
            }
        )
    rows.sort(key=lambda row: (-int(row["bytes"]), row["namespace"] or "", row["id"]))
    return rows
