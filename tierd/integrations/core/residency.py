"""Which of an engine's blocks the daemon still holds, from the daemon's event stream.

An engine that announces its stored blocks (vLLM's KV events) must also announce when
they are gone. The daemon's ``subscribe`` stream says, per tier, when a block of this
namespace became ready there or left it; a block leaves *tierd* when the last tier holding
it lets it go (a demotion stores it below before the tier above drops it). This module
keeps the set of tiers holding each block, and reports this engine's keys that left every
tier. Blocks of other engines sharing the namespace are ignored: they were never this
engine's to announce. No engine imports.

A store job may be evicted in part before it ends (its later rounds push out its first
ones): the stream then says a block left before the job has made it this engine's. So a
job's keys are *in flight* from before its first round (:meth:`Residency.storing`) until
it ends (:meth:`Residency.ended`); a removal of an in-flight key is kept, and when the job
ends each stored key that left meanwhile, and was not stored again since, is pending as
below (the job's own store of a key removed just before it may still be on its way).

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
        self._flight: dict[bytes, int] = {}  # keys of store jobs under way: how many jobs
        self._left: dict[bytes, float] = {}  # in-flight keys that left tierd, and when
        self._gone: list[bytes] = []
        self._lock = threading.Lock()
        self._pushes = threading.Condition(self._lock)
        self.pushes = 0  # pushes applied so far (``wait_pushes`` waits on it)

    def storing(self, keys: Iterable[bytes]) -> None:
        """A store job of ``keys`` starts: their removals are kept until it ends."""
        with self._lock:
            for key in keys:
                self._flight[key] = self._flight.get(key, 0) + 1

    def ended(self, keys: Sequence[bytes], stored: Iterable[bytes]) -> None:
        """The store job of ``keys`` (each announced by :meth:`storing`) ended, having
        stored ``stored``: those are this engine's; report their removal, the ones that
        left while it ran included."""
        with self._lock:
            self._ours.update(stored)
            for key in keys:
                count = self._flight.pop(key, 1) - 1
                if count > 0:
                    self._flight[key] = count
                    continue
                since = self._left.pop(key, None)
                if since is not None and key in self._ours:
                    self._pending.setdefault(key, since)

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
                self._left.pop(key, None)
                continue
            if kind != "removed":
                continue
            held = self._tiers.get(key)
            if held is not None:
                held.discard(tier)
                if held:
                    continue  # still in another tier
                del self._tiers[key]
            if key in self._flight:  # decided when its store job ends
                self._left.setdefault(key, time.monotonic())
                continue
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
