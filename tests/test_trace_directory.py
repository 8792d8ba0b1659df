"""``trace.directory`` is checked like a disk tier's directory: a directory of another
user, one its group or others may read, or one named through another user's link, is
refused at start (``tierd serve`` exits 78) and by ``tierd record on`` (when it was put
there after the start); a directory the daemon creates is 0700 and its files 0600.

A recorded trace is every lookup of a tenant: its prompts' block hashes, in order, with
their timing. Appended to a file in a directory another user owns, that user can read it,
or swap the directory for a link to a file of the daemon's.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import tierd
from tests.daemon_kit import BLOCK, Spawn
from tierd.client import Client
from tierd.testing import daemon_config

NOBODY = 65534
NS = "traced"


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user (chown) needs root")


def traced(tmp_path: Path, directory: Path, *, enabled: bool) -> dict[str, Any]:
    return daemon_config(
        tmp_path, disk_blocks=None, trace={"directory": str(directory), "enabled": enabled}
    )


def private(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def theirs(path: Path) -> Path:
    """A private directory of uid 65534 at ``path``."""
    private(path)
    os.chown(path, NOBODY, NOBODY)
    return path


def their_link(path: Path, target: Path) -> Path:
    """A link at ``path`` to ``target`` (a private directory of the daemon's), owned by
    uid 65534: every check of the directory itself passes, and its owner may point it
    elsewhere later."""
    path.symlink_to(target, target_is_directory=True)
    os.lchown(path, NOBODY, NOBODY)
    return path


async def refused_at_start(spawn: Spawn, cfg: dict[str, Any]) -> str:
    daemon = await spawn(cfg, ready=False)
    assert await daemon.wait() == 78, daemon.stderr()
    err = daemon.stderr()
    assert "trace.directory" in err and "Traceback" not in err
    return err


async def record_on(socket: str) -> tuple[int, str]:
    done = await tierd("record", "on", "--socket", socket)
    return done.returncode, done.stderr


async def test_another_users_trace_directory_is_refused_at_start(
    tmp_path: Path, spawn: Spawn
) -> None:
    needs_root()
    directory = theirs(tmp_path / "traces")
    err = await refused_at_start(spawn, traced(tmp_path, directory, enabled=False))
    assert f"{directory} belongs to uid {NOBODY}, not to the daemon's user" in err
    assert os.listdir(directory) == []


async def test_another_users_trace_directory_is_refused_by_record_on(
    tmp_path: Path, spawn: Spawn
) -> None:
    needs_root()
    directory = tmp_path / "traces"  # missing at start: the daemon would create it
    daemon = await spawn(traced(tmp_path, directory, enabled=False))
    theirs(directory)
    status, err = await record_on(daemon.socket_path)
    assert status == 1 and "Traceback" not in err
    assert f"{directory} belongs to uid {NOBODY}, not to the daemon's user" in err
    async with await Client.connect(daemon.socket_path) as operator:
        state = (await operator.request("trace"))["trace"]
    assert state["enabled"] is False
    assert os.listdir(directory) == []


async def test_a_trace_directory_behind_another_users_link_is_refused(
    tmp_path: Path, spawn: Spawn
) -> None:
    needs_root()
    real = private(tmp_path / "real")
    link = their_link(tmp_path / "traces", real)
    err = await refused_at_start(spawn, traced(tmp_path, link, enabled=True))
    assert f"is named through the link {link}, which uid {NOBODY} owns" in err
    # Put there after the start, it is refused by ``record on``.
    link.unlink()
    daemon = await spawn(traced(tmp_path, link, enabled=False))
    their_link(link, real)
    status, err = await record_on(daemon.socket_path)
    assert status == 1 and f"is named through the link {link}" in err
    assert os.listdir(real) == []


async def test_a_trace_directory_others_can_read_is_refused(tmp_path: Path, spawn: Spawn) -> None:
    directory = private(tmp_path / "traces")
    os.chmod(directory, 0o755)
    err = await refused_at_start(spawn, traced(tmp_path, directory, enabled=True))
    assert f"chmod 700 {directory}" in err


async def test_the_daemon_makes_its_trace_directory_private_and_files_0600(
    tmp_path: Path, spawn: Spawn
) -> None:
    directory = tmp_path / "traces"
    daemon = await spawn(traced(tmp_path, directory, enabled=False))
    status, err = await record_on(daemon.socket_path)
    assert status == 0, err
    async with await Client.connect(daemon.socket_path, namespace=NS, block_bytes=BLOCK) as c:
        await c.lookup([b"k1", b"k2"])
    async with await Client.connect(daemon.socket_path) as operator:
        state = (await operator.request("trace", enabled=False))["trace"]  # flushes
    assert state["recorded"] == 1, state
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    files = os.listdir(directory)
    assert files == ["default.jsonl"]
    assert stat.S_IMODE(os.stat(directory / files[0]).st_mode) == 0o600
