"""How much of a structure a garbage collection walks: the references it follows from the
tracked objects reachable from the structure's roots (an index held as one dict of
tuples: two per entry, followed by every collection of the dict's generation)."""

from __future__ import annotations

import gc
import types

# Shared by everything: walked once whatever the size of a structure, so not followed.
_SHARED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def references_walked(*roots: object) -> int:
    seen: set[int] = set()
    todo = list(roots)
    count = 0
    while todo:
        obj = todo.pop()
        if not gc.is_tracked(obj) or isinstance(obj, _SHARED) or id(obj) in seen:
            continue
        seen.add(id(obj))
        referents = gc.get_referents(obj)
        count += len(referents)
        todo += referents
    return count


def largest_dict(*roots: object) -> int:
    """The most keys of any one dict reachable from ``roots``, tracked or not: what a
    put that makes that dict resize copies in one go."""
    seen: set[int] = set()
    todo = list(roots)
    largest = 0
    while todo:
        obj = todo.pop()
        if isinstance(obj, _SHARED) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            largest = max(largest, len(obj))
            continue  # its keys and values are the structure's data
        if isinstance(obj, (tuple, list)) or type(obj).__module__.startswith("tierd."):
            todo += gc.get_referents(obj)
    return largest
