"""Tenants of other users: real system users (created and removed), a daemon config of three
tenants, the daemon for them, and client processes run as one of the users
(tests/tenant_child.py)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_kit import DaemonProcess, Spawn
from tierd.testing import daemon_config

# The marks of every module whose clients run as other users.
NEEDS_ROOT = pytest.mark.skipif(
    os.getuid() != 0, reason="clients of other users (useradd, os.setuid) need root"
)
CHILD = Path(__file__).with_name("tenant_child.py")
ROLES = ("alpha", "beta", "stranger")  # users of this run: tierd-test-<role>-<random>
QUOTA = {"cpu": 8, "disk": 32}  # each tenant's: 24 CPU blocks and 96 disk blocks in all


@contextmanager
def system_users(names: Sequence[str]) -> Iterator[dict[str, tuple[int, int]]]:
    """Real system users (uid, primary gid) by name, created when missing; the ones
    created here are removed again on exit (with their groups), so a run as root leaves
    no ``tierd-test-*`` user behind. Users that existed before are left alone."""
    created: list[str] = []
    try:
        found = {}
        for name in names:
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                _useradd(name)
                created.append(name)
                entry = pwd.getpwnam(name)
            found[name] = (entry.pw_uid, entry.pw_gid)
        yield found
    finally:
        userdel = shutil.which("userdel")
        for name in created:
            if userdel is not None:
                subprocess.run([userdel, name], check=True, capture_output=True)


def _useradd(name: str) -> None:
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.skip("useradd is not installed: cannot create the tenants' users")
    command = [useradd, "--system", "--user-group", "--no-create-home"]
    subprocess.run(
        [*command, "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True
    )


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, tuple[int, int]]]:
    # Names of this run only: two runs at once (or a run's leftovers) never share a user
    # that one of them removes.
    run = secrets.token_hex(3)
    with system_users([f"tierd-test-{role}-{run}" for role in ROLES]) as found:
        yield {role: found[f"tierd-test-{role}-{run}"] for role in ROLES}


def tenants_config(tmp_path: Path, users: dict[str, tuple[int, int]]) -> dict[str, Any]:
    cfg = daemon_config(tmp_path, cpu_blocks=24, disk_blocks=96, socket={"mode": 0o666})
    cfg["tenants"] = [
        {"name": "ops", "uids": [0], "operator": True, "quota": QUOTA},
        {
            "name": "alpha",
            "uids": [users["alpha"][0]],
            "namespaces": ["model-*"],
            "quota": QUOTA,
        },
        {"name": "beta", "uids": [users["beta"][0]]},  # the rest: 8 and 32 blocks
    ]
    return cfg


@pytest.fixture
async def daemon(tmp_path: Path, spawn: Spawn, users: dict[str, tuple[int, int]]) -> DaemonProcess:
    running = await spawn(tenants_config(tmp_path, users))
    os.chmod(os.path.dirname(running.socket_path), 0o711)  # others may reach the socket
    return running


async def as_user(
    daemon: DaemonProcess, user: tuple[int, int], *steps: dict[str, Any]
) -> list[Any]:
    """Run ``steps`` in a client process of ``user``; one result per step."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        str(user[0]),
        str(user[1]),
        daemon.socket_path,
        json.dumps(list(steps)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    results: list[Any] = json.loads(out)
    return results


def connect(namespace: str | None = "model-x") -> dict[str, Any]:
    return {"do": "connect", "namespace": namespace}
