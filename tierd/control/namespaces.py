"""A tenant's namespaces as an operator sees them: names, request figures, blocks held.

Every key a client sends is stored under its namespace's 8-byte id (an xxh3 of the name,
:meth:`~tierd.control.context.ServerContext.namespace_id`), so the chain knows ids, not
names. A :class:`NamespaceBook` keeps, per tenant, the name behind each id, learned when a
client says ``hello``, and the figures of its requests (:class:`NamespaceFigures`,
counted once per request by the session, never per key). With a ``path`` (beside the
tenant's disk slab: only the disk tier outlives the daemon, and its blocks keep their
ids) the names are written there whenever a new one is learned and read back at start,
so a restarted daemon names the blocks its disk tier kept before any client returns.

Blocks per tier are not counted on the request path: :func:`namespace_rows` counts them
when asked, one pass over each tier's index (about 0.2 s per million blocks).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from tierd.control.protocol import NAMESPACE_ID_BYTES

if TYPE_CHECKING:
    from tierd.chain import TierChain

__all__ = ["NAMES_FILE", "NamespaceBook", "NamespaceFigures", "namespace_rows"]

log = structlog.get_logger("tierd.control")

NAMES_FILE = "tierd-namespaces.json"
_FORMAT = 1


@dataclass(slots=True)
class NamespaceFigures:
    """What the clients of one namespace asked since the daemon started (in blocks)."""

    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    last_used: float = 0.0  # wall-clock time of its last lookup or store (0: none yet)


class NamespaceBook:
    """Names and figures of one tenant's namespaces, by 8-byte id."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.names: dict[bytes, str] = {}
        self.figures: dict[bytes, NamespaceFigures] = {}
        if path is not None:
            self.names.update(_read_names(path))

    def learn(self, name: str, namespace_id: bytes) -> NamespaceFigures:
        """A client said hello in ``name``: its figures (written to, per request)."""
        if self.names.get(namespace_id) != name:
            self.names[namespace_id] = name
            self._save()
        figures = self.figures.get(namespace_id)
        if figures is None:
            figures = self.figures[namespace_id] = NamespaceFigures()
        return figures

    def label(self, namespace_id: bytes) -> str | None:
        """The name behind ``namespace_id``, if a client ever said it."""
        return self.names.get(namespace_id)

    def _save(self) -> None:
        """Write the names (atomically: a crash leaves the old file or the new one)."""
        if self.path is None:
            return
        body = {"format": _FORMAT, "names": {k.hex(): v for k, v in sorted(self.names.items())}}
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(body, out)
            os.replace(temporary, self.path)
        except OSError as exc:  # the names are a convenience: serving goes on without them
            log.warning("cannot save namespace names", path=str(self.path), error=str(exc))


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


def namespace_rows(book: NamespaceBook, chain: TierChain) -> list[dict[str, Any]]:
    """One row per namespace that holds blocks or was used: its name (``None`` when no
    client named it since the names were last saved), id, blocks per tier, bytes held in
    all tiers, and its request figures; most bytes first."""
    counts = [
        (level.tier.name, level.tier.count_prefixes(NAMESPACE_ID_BYTES)) for level in chain.levels
    ]
    ids = set(book.figures)
    for _, count in counts:
        ids.update(count)
    rows: list[dict[str, Any]] = []
    for namespace_id in ids:
        blocks = {tier: count.get(namespace_id, 0) for tier, count in counts}
        figures = book.figures.get(namespace_id) or NamespaceFigures()
        rows.append(
            {
                "namespace": book.label(namespace_id),
                "id": namespace_id.hex(),
                "blocks": blocks,
                "bytes": sum(blocks.values()) * chain.block_bytes,
                "lookups": figures.lookups,
                "hit_blocks": figures.hit_blocks,
                "miss_blocks": figures.miss_blocks,
                "stored_blocks": figures.stored_blocks,
                "last_used": round(figures.last_used, 3) if figures.last_used else None,
            }
        )
    rows.sort(key=lambda row: (-int(row["bytes"]), row["namespace"] or "", row["id"]))
    return rows
