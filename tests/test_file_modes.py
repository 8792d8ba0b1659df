"""The disk tier's files hold cached blocks, which reveal the prompts they came from:
the daemon creates its disk directory 0700 and its slab, journal and index 0600, and
tightens files an older daemon left readable by others (they were 0644 in 0755)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest
from users_kit import Attacker, as_user

from tests.daemon_kit import BLOCK, Spawn, block, keys
from tierd.client import Client
from tierd.testing import daemon_config

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


# -- links --------------------------------------------------------------------------------


async def test_a_slab_file_that_is_a_link_is_never_opened_through(
    tmp_path: Path, spawn: Spawn
) -> None:
    """``tierd-slab.bin`` links to a file of the daemon's user: the daemon refuses to
    open it (and so never formats it) rather than following the link."""
    cfg = daemon_config(tmp_path)
    directory = Path(cfg["tiers"][1]["directories"][0])
    victim = tmp_path / "precious"
    victim.write_bytes(b"the daemon user's own data\n")
    (directory / "tierd-slab.bin").symlink_to(victim)
    daemon = await spawn(cfg, ready=False)
    assert await daemon.wait() != 0
    assert "cannot open disk slab" in daemon.stderr()
    assert "Traceback" not in daemon.stderr()
    assert victim.read_bytes() == b"the daemon user's own data\n"


async def test_a_disk_directory_named_through_another_users_link_is_refused(
    tmp_path: Path, spawn: Spawn, attacker: Attacker
) -> None:
    """The attacker owns a link that names the daemon's private directory (so every
    check of the directory itself passes) and could flip it later, to a directory of
    theirs where the slab's name links to a root file."""
    cfg = daemon_config(tmp_path)
    real = Path(cfg["tiers"][1]["directories"][0])
    theirs = Path(tempfile.mkdtemp(prefix="tierd-atk-", dir="/tmp"))
    try:
        os.chown(theirs, attacker.uid, attacker.gid)
        link = theirs / "disk"
        plant = f"import os; os.symlink({str(real)!r}, {str(link)!r})"
        planted = as_user(attacker, sys.executable, "-c", plant)
        assert planted.returncode == 0, planted.stderr
        cfg["tiers"][1]["directories"] = [str(link)]
        daemon = await spawn(cfg, ready=False)
        assert await daemon.wait() == 78
        assert f"is named through the link {theirs}/disk, which uid {attacker.uid}" in (
            daemon.stderr()
        )
        assert os.listdir(real) == []
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
