"""A bounded wait for a condition another thread or process brings about: the tests'
one way to poll (a thread's log line, an engine's event, a store started)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["poll_until"]

T = TypeVar("T")


def poll_until(check: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.01) -> T:
    """What ``check()`` returns once it is true, looked at every ``every_s``; an
    AssertionError naming ``what`` when it is not true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return got
