"""A checkpoint of a slab's index taken on the event loop in bounded slices.

A snapshot of a million-entry index used to be a copy of the whole dict on the loop
(55 ms) and a per-entry encode in a writer thread holding the GIL (386 ms), inside the
next write. An :class:`IndexWalk` instead packs :data:`SLICE` slots' entries per loop
turn (:func:`~tierd.stores.disk_snapshot.take`, at C speed), so a turn costs the same at
any index size, and the index is never copied whole.

The index changes between slices. A slot changed ahead of the walk is packed as it is
when the walk reaches it; one changed behind it is *touched* (the slab calls
:meth:`IndexWalk.touch` on every change), and :meth:`IndexWalk.finish` packs the current
entries of the touched slots into a patch that replaces what the walk took for them. The
checkpoint is therefore exactly the index at the moment ``finish`` runs, and it is queued
with the journal records at that moment, as a checkpoint taken at once would be.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tierd.stores.disk_snapshot import Checkpoint, Entry, IndexPart, take

__all__ = ["SLICE", "IndexWalk"]

SLICE = 1024  # slots packed per loop turn: about 0.25 ms with every slot held


class IndexWalk:
    """Slots ``0 .. local_slots - 1`` packed :data:`SLICE` at a time (loop thread only)."""

    def __init__(self, local_slots: int) -> None:
        self.cursor = 0
        self.end = local_slots
        self._parts: list[IndexPart] = []
        self._touched: set[int] = set()

    @property
    def done(self) -> bool:
        return self.cursor >= self.end

    def step(self, entries: Mapping[int, Entry]) -> bool:
        """Pack the next slice; whether the walk is done."""
        start, stop = self.cursor, min(self.end, self.cursor + SLICE)
        self._parts.append(take(entries, range(start, stop)))
        self.cursor = stop
        return self.done

    def touch(self, local: int) -> None:
        """``local`` changed: if the walk has passed it, the patch will carry it."""
        if local < self.cursor:
            self._touched.add(local)

    def finish(
        self, epoch: int, next_gen: int, entries: Mapping[int, Entry], pending: Mapping[int, int]
    ) -> Checkpoint:
        """The checkpoint of the index as it is now (costs the slots touched meanwhile)."""
        touched = sorted(self._touched)
        return Checkpoint(
            epoch,
            next_gen,
            tuple(self._parts),
            dict(pending),
            replaced=np.fromiter(touched, dtype=np.uint32, count=len(touched)),
            patch=take(entries, touched),
        )
