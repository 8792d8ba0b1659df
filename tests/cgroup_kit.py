"""A memory cgroup of the tests' own (v1 or v2), for a daemon that must stay within it."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["memory_cgroup"]


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int, prefix: str = "tierd-test-") -> Iterator[Path]:
    """A fresh memory cgroup limited to ``limit_bytes`` (a skip where none can be made:
    it needs root); removed at the end, once the processes put in it are gone."""
    v1 = Path("/sys/fs/cgroup/memory")
    base = v1 if (v1 / "memory.limit_in_bytes").exists() else Path("/sys/fs/cgroup")
    limit_file = "memory.limit_in_bytes" if base == v1 else "memory.max"
    try:
        group = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here: {exc}")
    try:
        yield group
    finally:
        for _ in range(50):  # bounded: until the processes' exit left it empty
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)
