"""Which of an engine's blocks the daemon still holds, from the daemon's event stream.

An engine that announces its stored blocks (vLLM's KV events) must also announce when
they are gone. The daemon's ``subscribe`` stream says, per tier, when a block of this
namespace became ready there or left it; a block leaves *tierd* when the last tier holding
it lets it go (a demotion stores it below before the tier above drops it). This module
keeps the set of tiers holding each block, and reports this engine's keys that left every
tier. Blocks of other engines sharing the namespace are ignored: they were never this
engine's to announce. No engine imports.

A tier announces an eviction when it plans it, before the block's demotion stores it in
the tier below; so a block that leaves an upper tier (not the chain's last, ``bottom``)
and no other is *pending* for ``grace_s``: a ``stored`` below in that time was its
demotion, else it is gone (a clear, or a drop the tier below refused).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Residency"]


class Residency:
    """The namespace's blocks and the daemon tiers that hold each (as the stream told),
    and which of them are this engine's; thread-safe."""

    def __init__(self, grace_s: float = 2.0) -> None:
        self.bottom: str | None = None  # the chain's last tier, once the daemon said
        self.grace_s = grace_s
        self._pending: dict[bytes, float] = {}  # left an upper tier, maybe on its way down
        self._tiers: dict[bytes, set[str]] = {}
        self._ours: set[bytes] = set()
        self._gone: list[bytes] = []
        self._lock = threading.Lock()
        self._pushes = threading.Condition(self._lock)
        self.pushes = 0  # pushes applied so far (``wait_pushes`` waits on it)

    def stored(self, keys: Iterable[bytes]) -> None:
        """This engine stored ``keys`` (a successful store job): report their removal."""
        with self._lock:
            self._ours.update(keys)

    def on_push(self, push: dict[str, Any]) -> None:
        """One ``events`` push from the daemon (a list of {kind, tier, keys})."""
        with self._lock:
            for event in push.get("events", ()):
                self._apply(str(event.get("kind")), str(event.get("tier")), event.get("keys", ()))
            self.pushes += 1
            self._pushes.notify_all()

    def wait_pushes(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` pushes were applied (at most ``timeout_s``); whether so."""
        with self._pushes:
            return self._pushes.wait_for(lambda: self.pushes >= count, timeout_s)

    def holds(self, key: bytes) -> bool:
        """Whether the stream says some tier holds ``key``."""
        with self._lock:
            return bool(self._tiers.get(key))

    def _apply(self, kind: str, tier: str, keys: Sequence[bytes]) -> None:
        for key in keys:
            if kind == "stored":
                self._tiers.setdefault(key, set()).add(tier)
                self._pending.pop(key, None)  # a demotion: it never left tierd
                continue
            if kind != "removed":
                continue
            held = self._tiers.get(key)
            if held is not None:
                held.discard(tier)
                if held:
                    continue  # still in another tier
                del self._tiers[key]
            if self.bottom is not None and tier != self.bottom:
                if key in self._ours:
                    self._pending[key] = time.monotonic()
                continue
            if key in self._ours:
                self._ours.discard(key)
                self._gone.append(key)

    def take_gone(self) -> list[bytes]:
        """This engine's keys that left every tier since the last call."""
        with self._lock:
            due = time.monotonic() - self.grace_s
            for key in [k for k, since in self._pending.items() if since <= due]:
                del self._pending[key]
                if key in self._ours:
                    self._ours.discard(key)
                    self._gone.append(key)
            gone, self._gone = self._gone, []
            return gone
