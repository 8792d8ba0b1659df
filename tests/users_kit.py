"""A throwaway local user for attacks that need another uid: created with ``useradd`` (a
system user, its own group, no home, no shell) and removed with ``userdel`` when the
fixture ends. Needs root; the tests that use it skip without.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Attacker", "attacker", "as_user"]


@dataclass(frozen=True, slots=True)
class Attacker:
    name: str
    uid: int
    gid: int


def as_user(
    user: Attacker, *command: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as ``user`` (``setpriv``: uid, gid, no supplementary groups)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed")
    return subprocess.run(
        [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    """A fresh local user, removed (with its group) at the end of the test."""
    if os.getuid() != 0:
        pytest.skip("creating another user (useradd) needs root")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if useradd is None or userdel is None:
        pytest.skip("useradd/userdel are not installed")
    name = f"tierd-atk-{os.getpid() % 100000}"
    subprocess.run(
        [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    try:
        yield Attacker(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run([userdel, name], check=False, capture_output=True)
