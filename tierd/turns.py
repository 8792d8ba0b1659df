"""A piece a turn: the one way long work on the event loop is cut into turns.

The daemon serves every client from one event loop, so no request may hold it for long:
work that walks many keys or blocks (a store's reservations, a load's pins, a clear, a
delete, a scan of an index, a checkpoint, restored descriptions) is cut into pieces, and
:func:`next_turn` runs between two pieces. Every piece is sized from one budget,
:data:`TURN_BUDGET_S` of loop time a turn, and the cost one item of its work is allowed
(:func:`per_turn`): a costlier step gets fewer items a turn, never a longer turn. The
sizes below are the only ones; a module that walks blocks takes its size from here.
The allowed costs are not measurements: they keep the sizes each walk had before it took
its size from here, which the loop-bound tests (``tests/test_loop_*.py``) hold to.

============================  =======  ======================================================
size                          items    one item
============================  =======  ======================================================
:data:`STORE_KEYS`            512      a store's key reserved, or its write ended
:data:`LOAD_KEYS`             512      a load's key gathered or released
:data:`TOUCH_KEYS`            512      a key marked used
:data:`DELETE_KEYS`           256      a key deleted (its slot freed, its events told)
:data:`INDEX_KEYS`            4,096    a key of an index looked at (flush, clear, namespaces,
                                       restored descriptions settled)
:data:`CHECKPOINT_SLOTS`      1,024    a slot of a disk index packed into a checkpoint
:data:`ADOPT_BLOCKS`          8,192    a block kept across a restart adopted by its tier
:data:`DESCRIPTIONS`          64       a client's block description checked and kept, with
                                       at most :data:`DESCRIPTION_BYTES` of them a turn
============================  =======  ======================================================
"""

from __future__ import annotations

import asyncio
import math
import time

__all__ = [
    "ADOPT_BLOCKS",
    "CHECKPOINT_SLOTS",
    "DELETE_KEYS",
    "DESCRIPTIONS",
    "DESCRIPTION_BYTES",
    "GIL_NAP_EVERY_S",
    "GIL_NAP_S",
    "INDEX_KEYS",
    "LOAD_KEYS",
    "STORE_KEYS",
    "TOUCH_KEYS",
    "TURN_BUDGET_S",
    "next_turn",
    "per_turn",
]

TURN_BUDGET_S = 1e-3  # the loop time one piece of a long walk may take


def per_turn(item_s: float) -> int:
    """How many items of ``item_s`` seconds each fit one turn's budget (a power of two)."""
    return 1 << max(0, int(math.log2(TURN_BUDGET_S / item_s)))


STORE_KEYS = per_turn(1.5e-6)
LOAD_KEYS = per_turn(1.5e-6)
TOUCH_KEYS = per_turn(1.5e-6)
DELETE_KEYS = per_turn(3e-6)
INDEX_KEYS = per_turn(0.2e-6)
CHECKPOINT_SLOTS = per_turn(0.8e-6)
ADOPT_BLOCKS = per_turn(0.1e-6)
DESCRIPTIONS = per_turn(12e-6)
DESCRIPTION_BYTES = 32 << 10

GIL_NAP_S = 20e-6  # how long next_turn leaves the GIL to a thread that waits for it
GIL_NAP_EVERY_S = 1e-3  # next_turn naps once this long has passed since its last nap
_last_nap = 0.0  # monotonic time of next_turn's last nap (the GIL is the process's)


async def next_turn() -> None:
    """Yield to the loop's other work and to the threads that wait for the GIL, between
    two pieces of a long piece of loop work.

    ``await asyncio.sleep(0)`` alone starves threads: a loop that always has work ready
    never blocks, it lets go of the GIL only inside a poll of no timeout and takes it
    straight back, and a thread waiting for the GIL sees it change hands and so never
    asks for it (a thread-pool hop beside such a loop waited seconds). A short nap with
    the GIL let go hands it over. The nap is a system call, so pieces shorter than
    :data:`GIL_NAP_EVERY_S` nap only once in that time."""
    global _last_nap
    now = time.monotonic()
    if now - _last_nap >= GIL_NAP_EVERY_S:
        time.sleep(GIL_NAP_S)  # noqa: ASYNC251  (on purpose: the GIL let go, not a wait)
        _last_nap = time.monotonic()
    await asyncio.sleep(0)
