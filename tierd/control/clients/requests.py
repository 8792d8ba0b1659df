"""The request layer both clients share: how a call is cut into requests the daemon
takes, and how their replies read. The asyncio client and the blocking client differ
only in how they wait (futures on a loop; ``recv`` on the calling thread); what they
send for a call, and what the answers mean, is decided here once.

Every request carries at most the hello's ``max_keys_per_request`` keys: a longer call
goes as several (:func:`key_parts`), sent together and answered in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["key_parts", "lookup_count", "present", "touch_requests"]


def _step(info: dict[str, Any], keys: Sequence[bytes]) -> int:
    return int(info.get("max_keys_per_request") or len(keys) or 1)


def key_parts(info: dict[str, Any], keys: Sequence[bytes]) -> list[list[bytes]]:
    """``keys`` in the parts one request each takes, in order."""
    step = _step(info, keys)
    return [list(keys[start : start + step]) for start in range(0, len(keys), step)]


def lookup_count(parts: Sequence[Sequence[bytes]], replies: Sequence[dict[str, Any]]) -> int:
    """The leading keys held, from the ``lookup`` replies of :func:`key_parts`' parts: a
    part found short ends the prefix."""
    found = 0
    for part, reply in zip(parts, replies, strict=True):
        found += int(reply["count"])
        if int(reply["count"]) < len(part):
            break
    return found


def present(replies: Sequence[dict[str, Any]]) -> list[bool]:
    """Per key, whether it is held, from the ``lookup_each`` replies of the parts."""
    return [bool(flag) for reply in replies for flag in reply["present"]]


def touch_requests(info: dict[str, Any], keys: Sequence[bytes], uses: bool) -> list[dict[str, Any]]:
    """The fields of the ``touch`` requests that mark ``keys`` used, ``keys[0]`` the most
    recent: more keys than one request takes go as several, the tail's first, so the
    order holds across them. ``uses=False``: the order only, no use counted for
    admission rules."""
    step = _step(info, keys)
    extra = {} if uses else {"uses": False}
    return [
        {"keys": list(keys[max(0, end - step) : end]), **extra}
        for end in range(len(keys), 0, -step)
    ]
