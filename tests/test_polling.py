"""The tests' bounded wait (tierd.testing.poll_until): it returns what the check found
once another thread brings it about, and fails naming what it waited for when nothing
does, within its bound."""

from __future__ import annotations

import threading
import time

import pytest

from tierd.testing import poll_until


def test_it_returns_what_the_check_found_once_another_thread_brings_it() -> None:
    found: list[str] = []
    timer = threading.Timer(0.05, found.append, ["done"])
    timer.start()
    try:
        assert poll_until(lambda: list(found), 5.0, "the timer's item") == ["done"]
    finally:
        timer.cancel()


def test_it_fails_naming_what_it_waited_for_once_its_bound_passed() -> None:
    began = time.monotonic()
    with pytest.raises(AssertionError, match=r"the impossible: not within 0.2 s"):
        poll_until(lambda: 0, 0.2, "the impossible")
    assert 0.2 <= time.monotonic() - began < 2.0
