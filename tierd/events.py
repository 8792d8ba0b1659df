"""Block events: what a tier stored and removed, tagged with its medium and name.

A tier buffers :class:`TierEvent` values as its bookkeeping changes; whoever drives the
tier drains them with ``take_events()`` and hands them to subscribers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tierd.keys import BlockKey, Medium

__all__ = ["EventKind", "TierEvent"]


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Blocks that became ready (``STORED``) or left (``REMOVED``) one tier, in order."""

    kind: EventKind
    keys: tuple[BlockKey, ...]
    medium: Medium
    tier: str
