"""Two real ``tierd serve`` processes over one S3 bucket (SeaweedFS): a block stored and
flushed through daemon A is found and loaded byte-exact through daemon B, whose stats
name the object-store level (medium ``OBJECT``) and count its hits; a daemon whose disk
tier was wiped starts warm from the bucket; a restart of the S3 server loses nothing a
flush acknowledged; and the credentials come from a private secret file (one readable
by others is refused at start, with a clear error) or from the daemon's environment.
``tierd flush`` says how many of the writes it caused did not land, and why, and exits 1
when some did not (issue 61, item 2); a level whose every write is refused makes
``tierd health`` say so and exit 1.

Each daemon has its own CPU and disk tiers and its own home; all name the same bucket
under a key prefix of the test's own. Blocks reach the bucket deterministically:
``flush`` through a daemon copies its CPU tier down to its disk tier, then sends the
disk tier's blocks to the bucket and waits for the writes. Daemons are started and
stopped (by PID) with the ``spawn`` fixture of the lifecycle tests; the server is one
``weed mini`` per module (``tests/s3_kit.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import obstore
import pytest
from s3_kit import S3FaultProxy, SeaweedServer

from tests.daemon_kit import DaemonProcess, Spawn, child_env
from tests.remote_daemon_kit import BLOCK, block, cli, connect, names
from tierd.keys import BlockKey
from tierd.testing import daemon_config


def s3_section(server: SeaweedServer, prefix: str, **extra: Any) -> dict[str, Any]:
    # A generous deadline: these tests assert hits, not latency, on a busy machine.
    return {
        "kind": "s3",
        "endpoint": server.endpoint,
        "bucket": server.bucket,
        "key_prefix": prefix,
        "deadline": "2s",
        **extra,
    }


def secret_file(server: SeaweedServer, path: Path, mode: int = 0o600) -> Path:
    path.write_text(server.secret_key + "\n")
    path.chmod(mode)
    return path


def node_config(home: Path, remote: dict[str, Any]) -> dict[str, Any]:
    """A daemon of its own CPU and disk tiers (in ``home``) over the bucket."""
    home.mkdir(mode=0o700, exist_ok=True)
    config = daemon_config(home, cpu_blocks=16, disk_blocks=64, block_bytes=BLOCK)
    config["remote"] = remote
    config["logging"] = {"level": "warning"}
    return config


class Site:
    """One test's view of the bucket: its prefix, and configs of daemons that use it
    with the access key and a private secret file."""

    def __init__(self, server: SeaweedServer, root: Path) -> None:
        self.server = server
        self.root = root
        self.prefix = f"d-{secrets.token_hex(4)}/"
        self.secret = secret_file(server, root / "s3-secret")

    def config(self, name: str, **extra: Any) -> dict[str, Any]:
        keys = {"access_key_id": self.server.access_key, "secret_access_key_file": str(self.secret)}
        return node_config(self.root / name, s3_section(self.server, self.prefix, **keys, **extra))

    async def objects(self) -> list[str]:
        listed = await obstore.list(self.server.store(), self.prefix).collect_async()
        return sorted(meta["path"] for meta in listed)


@pytest.fixture
def site(seaweed: SeaweedServer, tmp_path: Path) -> Site:
    return Site(seaweed, tmp_path)


async def stopped(*daemons: DaemonProcess) -> None:
    statuses = [await daemon.stop() for daemon in daemons]
    assert statuses == [0] * len(daemons), [d.stderr() for d in daemons]


async def store_and_flush(daemon: DaemonProcess, keys: list[BlockKey]) -> dict[str, Any]:
    """Store ``keys`` through ``daemon``, flush them down to the bucket; its remote stats."""
    async with await connect(daemon) as client:
        assert await client.store(keys, [block(k) for k in keys]) == len(keys)
        flushed = await client.flush()
        assert flushed.dirty == 0, flushed
        remote: dict[str, Any] = (await client.stats())["remote"]
    return remote


async def test_blocks_flushed_through_one_daemon_load_byte_exact_through_another(
    site: Site, spawn: Spawn
) -> None:
    keys = names("shared", 6)
    a, b = await spawn(site.config("a")), await spawn(site.config("b"))
    try:
        a_remote = await store_and_flush(a, keys)
        assert (a_remote["stores"], a_remote["errors"], a_remote["write_errors"]) == (6, 0, 0)
        assert len(await site.objects()) == len(keys)
        async with await connect(b) as client:
            before = await client.stats()
            assert all(tier["used"] == 0 for tier in before["tiers"])  # B holds nothing
            found = await client.lookup([*keys, b"nobody-stored-this"])
            assert found.count == len(keys)
            assert found.media == ("OBJECT",) * len(keys)
            assert await client.load(keys) == [block(k) for k in keys]
            assert (await client.lookup(keys)).media == ("CPU",) * len(keys)  # promoted
            remote = (await client.stats())["remote"]
        assert remote["medium"] == "OBJECT" and remote["state"] == "closed"
        assert remote["endpoint"] == f"{site.server.endpoint}/{site.server.bucket}"
        assert (remote["lookup_hits"], remote["hits"], remote["promotions"]) == (6, 6, 6)
        assert remote["corrupt"] == remote["errors"] == remote["timeouts"] == 0
        assert remote["bytes_read"] >= len(keys) * BLOCK

        status, out = await cli("stats", "--socket", b.socket_path)
        assert status == 0
        where = f"{site.server.endpoint}/{site.server.bucket}"
        assert f"remote s3 (OBJECT) {where}: breaker closed, 6 lookup hits" in out, out
        status, out = await cli(
            "top", "--socket", b.socket_path, "--plain", "--count", "1", "--interval", "0.05"
        )
        assert status == 0, out
        assert f"remote s3 (OBJECT) {where}" in out, out
    finally:
        await stopped(a, b)


async def test_a_daemon_with_its_disk_wiped_starts_warm_from_the_bucket(
    site: Site, spawn: Spawn
) -> None:
    keys = names("warm", 8)
    config = site.config("a")
    a = await spawn(config)
    await store_and_flush(a, keys)
    await stopped(a)
    disk = site.root / "a" / "disk"
    assert any(disk.iterdir())  # the disk tier kept the blocks...
    shutil.rmtree(disk)  # ...and loses them
    disk.mkdir(mode=0o700)
    a = await spawn(config)
    try:
        async with await connect(a) as client:
            assert all(tier["used"] == 0 for tier in (await client.stats())["tiers"])
            found = await client.lookup(keys)
            assert found.count == len(keys) and found.media == ("OBJECT",) * len(keys)
            assert await client.load(keys) == [block(k) for k in keys]
            assert (await client.stats())["remote"]["hits"] == len(keys)
    finally:
        await stopped(a)


async def test_a_restarted_server_keeps_what_a_flush_acknowledged(site: Site, spawn: Spawn) -> None:
    keys = names("durable", 6)
    a = await spawn(site.config("a"))
    try:
        assert (await store_and_flush(a, keys))["stores"] == len(keys)
    finally:
        await stopped(a)
    await asyncio.to_thread(site.server.restart)
    b = await spawn(site.config("b"))
    try:
        async with await connect(b) as client:
            assert (await client.lookup(keys)).count == len(keys)
            assert await client.load(keys) == [block(k) for k in keys]
    finally:
        await stopped(b)


async def test_a_secret_file_readable_by_others_is_refused_at_start(
    site: Site, spawn: Spawn
) -> None:
    site.secret.chmod(0o644)
    daemon = await spawn(site.config("a"), ready=False)
    status = await daemon.wait()
    err = daemon.stderr()
    assert status == 78, err
    assert "Traceback" not in err
    assert "remote.secret_access_key_file" in err and "chmod 600" in err, err


@pytest.mark.parametrize("through", ["file", "root's link", "another user's link"])
async def test_a_secret_file_of_another_user_or_behind_their_link_is_refused_at_start(
    site: Site, spawn: Spawn, through: str
) -> None:
    """Issue 57, item 10: a root daemon accepted a secret file of mode 0600 that another
    user owns (whoever owns it chooses what the daemon reads), and a link to it. The file
    must be the daemon's user's; a link is followed only when that user or root owns
    it, and then the file it names is checked."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user (chown) needs root")
    other = 54321
    theirs = site.root / "their-secret"
    theirs.write_text(site.server.secret_key + "\n")
    theirs.chmod(0o600)
    named = site.secret
    if through == "file":
        os.chown(theirs, other, other)
        named = theirs
    elif through == "root's link":
        os.chown(theirs, other, other)
        named = site.root / "root-link"
        named.symlink_to(theirs)
    else:  # another user's link to the daemon's own, private file
        named = site.root / "their-link"
        named.symlink_to(site.secret)
        os.chown(named, other, other, follow_symlinks=False)
    config = site.config("a")
    config["remote"]["secret_access_key_file"] = str(named)
    daemon = await spawn(config, ready=False)
    status = await daemon.wait()
    err = daemon.stderr()
    assert status == 78, err
    assert "Traceback" not in err
    assert "remote.secret_access_key_file" in err and f"uid {other}" in err, err


async def test_credentials_from_the_daemons_environment(site: Site, spawn: Spawn) -> None:
    keys = names("env", 4)
    remote = s3_section(site.server, site.prefix)  # no key in the config
    env = {k: v for k, v in child_env().items() if not k.startswith("AWS_")}
    given = {"AWS_ACCESS_KEY_ID": site.server.access_key}
    given["AWS_SECRET_ACCESS_KEY"] = site.server.secret_key
    a = await spawn(node_config(site.root / "a", remote), env={**env, **given})
    # Without them the server refuses the daemon's writes: the test can tell.
    b = await spawn(node_config(site.root / "b", remote), env=env)
    try:
        a_remote = await store_and_flush(a, keys)
        assert (a_remote["stores"], a_remote["errors"]) == (len(keys), 0), a_remote
        b_remote = await store_and_flush(b, names("anonymous", 2))
        assert b_remote["stores"] == 0, b_remote
        assert b_remote["errors"] + b_remote["timeouts"] >= 1, b_remote
        assert len(await site.objects()) == len(keys)
    finally:
        await stopped(a, b)


async def test_flush_says_which_writes_did_not_land_and_fails(
    site: Site, spawn: Spawn, s3_proxy: S3FaultProxy
) -> None:
    """Issue 61, item 2: a flush whose S3 writes timed out printed "copied 64 blocks;
    nothing left dirty" and exited 0. The writes it causes are waited for, and those that
    did not land are counted, by cause, and fail the flush."""
    keys = names("unlanded", 8)
    a = await spawn(site.config("a", endpoint=s3_proxy.endpoint, deadline="500ms"))
    try:
        async with await connect(a) as client:
            assert await client.store(keys, [block(k) for k in keys]) == len(keys)
        s3_proxy.set_fault("hang", methods=["PUT"])  # after the write-once check at start
        status, out = await cli("flush", "--socket", a.socket_path)
        assert status == 1, out
        assert "copied 8 blocks; nothing left dirty" in out, out
        assert "8 of 8 blocks sent to the remote level did not land" in out, out
        assert "8 of 8 not written to s3 (8 timeouts)" in out, out
        status, out = await cli("flush", "--socket", a.socket_path, "--json")
        assert status == 1, out
        done = json.loads(out)
        assert (done["remote_sent"], done["remote_missed"]) == (8, 8), done
        assert done["remote_missed_by_level"] == {"s3": {"timeouts": 8}}, done
        assert await site.objects() == []
        s3_proxy.set_fault(None)  # a healthy server: the same flush lands them all
        status, out = await cli("flush", "--socket", a.socket_path)
        assert status == 0, out
        assert "8 blocks sent to the remote level, all landed" in out, out
        assert len(await site.objects()) == len(keys)
    finally:
        await stopped(a)


async def test_a_level_whose_every_write_is_refused_is_unhealthy(
    site: Site, spawn: Spawn, s3_proxy: S3FaultProxy
) -> None:
    """Issue 61, item 3: 0 of 64 blocks reached the bucket while `tierd health` said ok."""
    keys = names("refused", 4)
    a = await spawn(site.config("a", endpoint=s3_proxy.endpoint, breaker_backoff="300ms"))
    try:
        status, out = await cli("health", "--socket", a.socket_path)
        assert status == 0 and "remote       s3: ok" in out, out
        async with await connect(a) as client:
            assert await client.store(keys, [block(k) for k in keys]) == len(keys)
        s3_proxy.set_fault("status:403", methods=["PUT"])
        for _ in range(3):  # breaker_failures flushes, every write of each refused
            status, out = await cli("flush", "--socket", a.socket_path)
            assert status == 1 and "(4 errors)" in out, out
        status, out = await cli("health", "--socket", a.socket_path)
        assert status == 1, out
        assert "status       unhealthy" in out, out
        assert "remote       s3: unhealthy: " in out and "writes refused" in out, out
        status, out = await cli("health", "--socket", a.socket_path, "--json")
        health = json.loads(out)
        assert (health["ok"], health["status"]) == (False, "unhealthy"), health
        assert [level["ok"] for level in health["remote"]] == [False], health
        async with await connect(a) as client:
            remote = (await client.stats())["remote"]
        assert remote["write_state"] == "open" and remote["stores"] == 0, remote
        s3_proxy.set_fault(None)
        await asyncio.sleep(0.35)  # the back-off; then a write goes through and lands
        status, out = await cli("flush", "--socket", a.socket_path)
        assert status == 0, out
        status, out = await cli("health", "--socket", a.socket_path)
        assert status == 0 and "status       ok" in out, out
    finally:
        await stopped(a)
