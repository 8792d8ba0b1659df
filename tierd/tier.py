"""One tier: a fixed number of slots on one medium, with a cache policy, pins and events.

The tier only keeps books; it never touches bytes and never awaits, so it needs no locks.
Its operations mirror vLLM's ``OffloadingManager``: ``lookup(keys)`` (how many leading
keys are present and ready), ``prepare_load``/``complete_load`` (pin and unpin ready
blocks), ``touch`` (mark used, tail to head), and ``prepare_store``/``complete_store``
(allocate slots, evicting if needed, all or nothing; later make the blocks ready, or
drop them on failure).

Block states: *writing* (slot allocated, not readable, not evictable), *ready*
(evictable), *pinned* (ready, ``ref > 0``, not evictable). A write can also be
*quarantined* (:meth:`Tier.quarantine`): its keys are gone, so that others may store
them, but its slots are given to no other block until :meth:`Tier.release_quarantine`
(a client whose lease expired may still be writing into them). The tier owns the slot index;
the policy orders the ready keys and chooses victims. Which slots are free, in what order
they are given out, and what a restart brings back is :mod:`tierd.tier_slots`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile
from operator import itemgetter

from tierd.errors import (
    BlockBusy,
    BlockMissing,
    BlockNotPinned,
    BlockNotReady,
    BlockStateError,
)
from tierd.events import EventKind, TierEvent
from tierd.keys import BlockKey, Medium
from tierd.maps import Shards, part_count
from tierd.policy import CachePolicy, make_policy
from tierd.tier_slots import FreeSlots, KeptBlocks, one_slot_per_key, reserved, restored

__all__ = ["StorePlan", "Tier", "TierStats", "one_slot_per_key"]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What ``prepare_store`` decided: keys to write into ``slots`` (co-indexed), and the
    blocks it evicted to make room, with the slots they occupied."""

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[BlockKey, ...] = ()
    evicted_slots: tuple[int, ...] = ()


_EMPTY_PLAN = StorePlan((), ())
_STORED, _REMOVED = EventKind.STORED, EventKind.REMOVED  # a module global is a cheaper lookup


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    medium: Medium
    policy: str
    capacity: int
    used: int
    hits: int
    misses: int
    stores: int
    evictions: int
    pinned: int
    writing: int
    adopting: int = 0  # blocks a restart found that are not adopted yet (held, not served)
    quarantined: int = 0  # slots of withdrawn writes a client may still touch


class Tier:
    """Bookkeeping for ``num_blocks`` slots of one medium under one cache policy."""

    def __init__(
        self,
        num_blocks: int,
        policy: str | CachePolicy = "lru",
        *,
        name: str = "tier",
        medium: Medium = Medium.MEMORY,
        parts: int | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a tier needs at least one block, got {num_blocks}")
        self.name = name
        self.medium = medium
        self.num_blocks = num_blocks
        self.policy = make_policy(policy, num_blocks) if isinstance(policy, str) else policy
        # Every present block, whatever its state, in parts (hot paths: parts[hash(k) & low])
        self._slots: Shards[BlockKey, int] = Shards(parts or part_count(num_blocks))
        self._writing: set[BlockKey] = set()
        self._pins: dict[BlockKey, int] = {}  # ready blocks with ref > 0
        self._free = FreeSlots(num_blocks)  # which slots a store may be given
        self._events: list[TierEvent] = []
        self.hits = self.misses = self.stores = self.evictions = 0
        self._kept = KeptBlocks()  # kept across a restart, not adopted yet (:meth:`reserve`)
        self._quarantined = 0  # slots of withdrawn writes, given to no store (:meth:`quarantine`)

    # -- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is present and ready (pinned or not)."""
        return key in self._slots and key not in self._writing

    def ready(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Those of ``keys`` present and ready, in order (:meth:`__contains__` of each,
        at C speed in one part)."""
        present = self._slots.present(keys)
        writing = self._writing
        return [key for key in present if key not in writing] if writing else present

    @property
    def adopting(self) -> int:
        """Reserved slots of kept blocks not adopted yet (see :meth:`reserve`)."""
        return len(self._kept.slots)

    @property
    def quarantined(self) -> int:
        """Slots of withdrawn writes, out of use until released (see :meth:`quarantine`)."""
        return self._quarantined

    @property
    def free(self) -> int:
        return self.num_blocks - len(self._slots) - self.adopting - self._quarantined

    def ready_run(self, keys: Sequence[BlockKey], start: int = 0) -> int:
        """How many consecutive ``keys`` from ``keys[start]`` on are ready (no hits)."""
        slots, writing = self._slots, self._writing
        rest = islice(keys, start, None) if start else keys
        if not writing:
            return slots.leading(rest)
        parts, low = slots.parts, slots.low
        return len(list(takewhile(lambda k: k in parts[hash(k) & low] and k not in writing, rest)))

    def is_writing(self, key: BlockKey) -> bool:
        return key in self._writing

    def is_pinned(self, key: BlockKey) -> bool:
        return key in self._pins

    def slot_of(self, key: BlockKey) -> int | None:
        """The slot of a present block (ready or writing), else ``None``."""
        return self._slots.get(key)

    def slots_of(self, keys: Sequence[BlockKey]) -> list[int]:
        """The slots of present blocks, co-indexed (``KeyError`` if one is not present)."""
        return self._slots.values_of(keys)

    def ready_keys(self) -> list[BlockKey]:
        """The ready keys, in no particular order."""
        return [k for k in self._slots if k not in self._writing]

    def state_of(self, key: BlockKey) -> str | None:
        """``"writing"``, ``"pinned"``, ``"ready"``, or ``None`` for an absent block."""
        if key not in self._slots:
            return None
        if key in self._writing:
            return "writing"
        return "pinned" if key in self._pins else "ready"

    def count_prefixes(self, length: int) -> Counter[bytes]:
        """Present blocks (every state) by the first ``length`` bytes of their keys: one
        pass over the index at C speed, for figures an operator asks for (never on the
        request path)."""
        return Counter(map(itemgetter(slice(0, length)), self._slots))

    def key_parts(self) -> Iterator[list[BlockKey]]:
        """Present keys (every state), a part of the index at a time, then kept keys not
        adopted yet (so that a delete walking them reaches those too; a key stored again
        since the restart is listed twice). Each part is copied at C speed (about 15 ns
        a key) when it is asked for: a pass can walk them in slices, yielding between
        them, while the tier changes, and no turn copies more than a part."""
        for part in self._slots.parts:
            yield list(part)
        if self._kept.slots:
            yield list(self._kept.slots)

    def writing_keys(self) -> list[BlockKey]:
        """The keys being written, copied at C speed (as many as the writes in flight)."""
        return list(self._writing)

    def keys_starting(self, prefix: bytes) -> list[BlockKey]:
        """Present keys (every state) that start with ``prefix``, and kept keys not
        adopted yet (so that deleting a prefix reaches them too)."""
        size = len(prefix)
        found = [key for key in self._slots if key[:size] == prefix]
        if self._kept.slots:
            slots = self._slots
            found += [k for k in self._kept.slots if k[:size] == prefix and k not in slots]
        return found

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are present and ready; counts hits and misses."""
        n = self.ready_run(keys)
        self.hits += n
        self.misses += len(keys) - n
        return n

    # -- loads -----------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin ready blocks for reading and return their slots, co-indexed with ``keys``.

        Raises :class:`BlockMissing` or :class:`BlockNotReady` (and pins nothing) if any
        key is not ready."""
        slots, writing = self._slots, self._writing
        if slots.absent(keys) or not writing.isdisjoint(keys):
            for key in keys:  # the first key that cannot be loaded, in order
                if key not in slots:
                    raise self._error(BlockMissing, "cannot load a missing block", key)
                if key in writing:
                    raise self._error(BlockNotReady, "cannot load a block being written", key)
        pins, held = self._pins, []
        for key in keys:
            count = pins.get(key, 0)
            if count == 0:
                held.append(key)
            pins[key] = count + 1
        self.policy.hold_all(held)
        return slots.values_of(keys)

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Unpin blocks pinned by ``prepare_load``; raises :class:`BlockNotPinned` (and
        unpins nothing) if a key was not pinned as often as it appears."""
        pins = self._pins
        for key, count in Counter(keys).items():
            if pins.get(key, 0) < count:
                raise self._error(BlockNotPinned, "complete_load without prepare_load", key)
        released: list[BlockKey] = []
        for key in keys:
            count = pins[key] - 1
            if count:
                pins[key] = count
            else:
                del pins[key]
                released.append(key)
        self.policy.release_all(released)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` used, tail to head, so ``keys[0]`` ends up the most recent."""
        self.policy.touch(keys)

    # -- stores ----------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[BlockKey], keep: Collection[BlockKey] | None = None
    ) -> StorePlan | None:
        """Allocate slots for the keys not yet present, evicting ready unpinned blocks
        that are not among ``keep`` if needed (by default ``keys``; a store made in
        pieces keeps all of its keys). All or nothing: ``None`` if not enough blocks can
        be evicted, and then nothing changed."""
        slots = self._slots
        todo = slots.absent(keys)
        if not todo:
            return _EMPTY_PLAN
        writing = self._writing
        # Marking the keys as writing first also detects a key repeated in ``keys``: the
        # set grows by fewer than len(todo). (Cheaper than a set of todo on every call.)
        before = len(writing)
        writing.update(todo)
        if len(writing) - before != len(todo):
            todo = list(dict.fromkeys(todo))
        need = len(todo) + len(slots) + self.adopting + self._quarantined - self.num_blocks
        evicted: tuple[BlockKey, ...] = ()
        evicted_slots: tuple[int, ...] = ()
        if need > 0:
            # Only keys already present can be victims: when every key is new, the policy
            # has none of them, and nothing needs protecting.
            if keep is None:
                keep = set(keys) if len(todo) != len(keys) else ()
            victims = self.policy.evict(need, keep)
            if victims is None:
                writing.difference_update(todo)
                return None
            evicted = tuple(victims)
            evicted_slots = tuple(slots.pop_all(victims))
            self._free.release(evicted_slots)
            self.evictions += len(evicted)
            self._events.append(TierEvent(_REMOVED, evicted, self.medium, self.name))
        new_slots = self._free.allocate(len(todo))
        slots.put_all(todo, new_slots)
        return StorePlan(tuple(todo), new_slots, evicted, evicted_slots)

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        """Make blocks being written ready (one ``STORED`` event), or on failure drop
        them and free their slots (no event). Keys already ready are left alone; a key
        that is not present raises :class:`BlockMissing` and nothing changes."""
        writing = self._writing
        done: Sequence[BlockKey]
        if writing.issuperset(keys):
            # The common case: every key is being written. Removing them first also
            # detects a repeated key (the set shrinks by fewer than len(keys)).
            before = len(writing)
            writing.difference_update(keys)
            done = keys if before - len(writing) == len(keys) else list(dict.fromkeys(keys))
        else:
            slots = self._slots
            for key in keys:
                if key not in slots:
                    raise self._error(
                        BlockMissing, "complete_store for a block never prepared", key
                    )
            done = list(dict.fromkeys(key for key in keys if key in writing))
            writing.difference_update(done)
        if not done:
            return
        if success:
            self.policy.insert(done)
            self.stores += len(done)
            self._events.append(TierEvent(_STORED, tuple(done), self.medium, self.name))
        else:
            self._free.release(map(self._slots.pop, done))

    def quarantine(self, keys: Sequence[BlockKey]) -> list[int]:
        """Withdraw blocks being written: their keys go (no event; another write may store
        them) but their slots are given to no block until :meth:`release_quarantine`;
        returns those slots. A key not being written (absent, or ready) is skipped."""
        writing = self._writing
        done = [key for key in dict.fromkeys(keys) if key in writing]
        writing.difference_update(done)
        held = list(map(self._slots.pop, done))
        self._quarantined += len(held)
        return held

    def release_quarantine(self, slots: Sequence[int]) -> None:
        """Give slots withdrawn by :meth:`quarantine` back to the free list."""
        if len(slots) > self._quarantined:
            raise ValueError(
                f"tier {self.name}: {len(slots)} slots released, {self._quarantined} quarantined"
            )
        self._quarantined -= len(slots)
        self._free.release(slots)

    def discard(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Remove ready, unpinned blocks (a ``REMOVED`` event); absent keys are skipped.
        A kept block not adopted yet goes too, from the store as well (see :meth:`reserve`).

        Raises :class:`BlockBusy` (and removes nothing) for a pinned or writing block."""
        for key in keys:
            if key in self._pins or key in self._writing:
                raise self._error(BlockBusy, "cannot discard a block in use", key)
        asked = dict.fromkeys(keys)
        gone = [key for key in asked if key in self._slots]
        self._free.release(map(self._slots.pop, gone))
        for key in gone:
            self.policy.remove(key)
        if gone:
            self._events.append(TierEvent(EventKind.REMOVED, tuple(gone), self.medium, self.name))
        if self._kept.slots:  # no event: nothing announced a kept block since the restart
            held = set(gone)
            gone += [key for key in self._drop_kept(asked) if key not in held]
        return gone

    def clear(self) -> list[BlockKey]:
        """Discard every ready, unpinned block, and every kept block not adopted yet (no
        event for those, as for :meth:`discard`); returns the keys removed."""
        kept = [k for k in self._drop_kept(list(self._kept.slots)) if k not in self._slots]
        idle = [k for k in self._slots if k not in self._pins and k not in self._writing]
        return self.discard(idle) + kept

    def restore(self, entries: Sequence[tuple[BlockKey, int]]) -> None:
        """Adopt ready blocks at known slots (a persistent store reopened after a restart).

        Only an empty tier can restore; no event is emitted (the blocks were announced
        before the restart). A slot out of range or given twice, or a key given twice,
        raises ``ValueError`` and nothing changes (:func:`~tierd.tier_slots.restored`)."""
        if self._slots or not self._free.untouched:
            raise ValueError(f"tier {self.name} is not empty; restore needs a fresh tier")
        adopted, free = restored(entries, self.num_blocks)
        self._free.rebuild(free)
        self._slots.put_all(adopted, adopted.values())
        self.policy.insert(list(adopted))

    def reserve(
        self, kept: Sequence[tuple[BlockKey, int]], forget: Callable[[list[int]], None]
    ) -> None:
        """Keep the slots of ``kept`` (key, slot) off the free list: blocks a persistent
        store kept across a restart, adopted later (:meth:`adopt`) while the tier already
        serves (:class:`~tierd.tier_slots.KeptBlocks`); ``forget`` is the store's
        invalidate. Only an empty tier can reserve; a slot out of range or given twice
        raises ``ValueError``."""
        if self._slots or not self._free.untouched:
            raise ValueError(f"tier {self.name} is not empty; reserve needs a fresh tier")
        self._free.rebuild(reserved(kept, self.num_blocks))
        self._free.release(self._kept.keep(kept, forget))  # other copies of a key: free now

    def adopt(self, count: int) -> int:
        """Make up to ``count`` kept blocks ready (no event: they were announced before
        the restart); returns how many it took. One call is bounded, however many a
        delete dropped; a key stored again since keeps its new block
        (:meth:`~tierd.tier_slots.KeptBlocks.take`)."""
        slots = self._slots
        taken, stale = self._kept.take(count, slots)
        slots.put_all(taken, taken.values())
        self.policy.insert(list(taken))
        self._free.release(stale)
        return len(taken)

    def _drop_kept(self, keys: Collection[BlockKey]) -> list[BlockKey]:
        """Drop the kept blocks of ``keys`` before they are adopted: their slots are
        freed, and forgotten by the store. Returns the keys dropped."""
        dropped, slots = self._kept.drop(keys)
        self._free.release(slots)
        return dropped

    # -- events and stats ------------------------------------------------------------

    def take_events(self) -> list[TierEvent]:
        """Drain the buffered events, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            medium=self.medium,
            policy=self.policy.name,
            capacity=self.num_blocks,
            used=len(self._slots),
            hits=self.hits,
            misses=self.misses,
            stores=self.stores,
            evictions=self.evictions,
            pinned=len(self._pins),
            writing=len(self._writing),
            adopting=self.adopting,
            quarantined=self._quarantined,
        )

    def _error(self, kind: type[BlockStateError], message: str, key: BlockKey) -> BlockStateError:
        return kind(message, tier=self.name, medium=str(self.medium), key=key)
