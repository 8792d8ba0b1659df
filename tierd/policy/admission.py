"""Admission rules: which demoted blocks a lower level accepts.

A plain value with no dependency on stores or torch, so the config layer can validate
rules without loading the data path.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Admission"]


@dataclass(frozen=True, slots=True)
class Admission:
    """Which demoted blocks a level accepts: all (``min_reuse=0``), or only blocks used by
    at least ``min_reuse`` requests. A use is a touch (one per request, as engines touch
    the keys a request reuses); lookups are queries and count nothing."""

    min_reuse: int = 0

    @classmethod
    def parse(cls, rule: str) -> Admission:
        """``"always"`` or ``"reuse>=N"``."""
        text = rule.replace(" ", "")
        if text == "always":
            return cls(0)
        if text.startswith("reuse>="):
            try:
                n = int(text.removeprefix("reuse>="))
            except ValueError:
                n = -1
            if n >= 1:
                return cls(n)
        raise ValueError(f"admission rule {rule!r} is not 'always' or 'reuse>=N' with N >= 1")
