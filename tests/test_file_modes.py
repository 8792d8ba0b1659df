"""The disk tier's files hold cached blocks, which reveal the prompts they came from:
the daemon creates its disk directory 0700 and its slab, journal and index 0600, and
tightens files an older daemon left readable by others (they were 0644 in 0755)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.test_daemon_lifecycle import BLOCK, Spawn, block, keys, spawn
from tierd.client import Client
from tierd.testing import daemon_config

__all__ = ["spawn"]

FILES = ("tierd-slab.bin", "tierd-journal.bin", "tierd-index.msgpack")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def store_and_flush(socket_path: str) -> None:
    names = keys("private", 4)
    client = await Client.connect(socket_path, namespace="modes", block_bytes=BLOCK)
    try:
        assert await client.store(names, [block(k) for k in names]) == len(names)
        assert (await client.flush()).dirty == 0
    finally:
        await client.close()


async def test_a_new_disk_tier_is_private(tmp_path: Path, spawn: Spawn) -> None:
    cfg = daemon_config(tmp_path)
    directory = tmp_path / "fresh"  # missing: the daemon creates it
    cfg["tiers"][1]["directories"] = [str(directory)]
    daemon = await spawn(cfg)
    await store_and_flush(daemon.socket_path)
    assert mode(directory) == 0o700
    assert {name: mode(directory / name) for name in FILES[:2]} == dict.fromkeys(FILES[:2], 0o600)
    assert await daemon.stop() == 0
    assert mode(directory / "tierd-index.msgpack") == 0o600


async def test_files_left_readable_by_an_older_daemon_are_tightened(
    tmp_path: Path, spawn: Spawn
) -> None:
    cfg = daemon_config(tmp_path)
    directory = Path(cfg["tiers"][1]["directories"][0])
    daemon = await spawn(cfg)
    await store_and_flush(daemon.socket_path)
    assert await daemon.stop() == 0
    for name in ("tierd-slab.bin", "tierd-index.msgpack"):
        os.chmod(directory / name, 0o644)
    again = await spawn(cfg)
    try:
        assert mode(directory / "tierd-slab.bin") == 0o600
        assert mode(directory / "tierd-journal.bin") == 0o600
    finally:
        assert await again.stop() == 0
    assert mode(directory / "tierd-index.msgpack") == 0o600


async def test_a_disk_directory_others_can_read_or_write_is_refused(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Like ssh with a key file others can read: the daemon will not keep blocks where
    another user could list or read them, and says how to fix it."""
    cfg = daemon_config(tmp_path)
    directory = Path(cfg["tiers"][1]["directories"][0])
    for loose, who in ((0o755, "its group and others"), (0o750, "its group"), (0o703, "others")):
        os.chmod(directory, loose)
        daemon = await spawn(cfg, ready=False)
        assert await daemon.wait() != 0
        err = daemon.stderr()
        assert f"can be read or written by {who} (mode {loose:o})" in err, err
        assert f"chmod 700 {directory}" in err
        assert "tiers.1.directories" in err
        assert not (directory / "tierd-slab.bin").exists()  # refused before anything
    os.chmod(directory, 0o711)  # search only: nobody can list or read it
    daemon = await spawn(cfg)
    assert await daemon.stop() == 0


async def test_a_disk_directory_of_another_user_is_refused(tmp_path: Path, spawn: Spawn) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user (chown) needs root")
    cfg = daemon_config(tmp_path)
    directory = Path(cfg["tiers"][1]["directories"][0])
    os.chown(directory, 65534, 65534)
    daemon = await spawn(cfg, ready=False)
    assert await daemon.wait() != 0
    assert "belongs to uid 65534, not to the daemon's user" in daemon.stderr()
