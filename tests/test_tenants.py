"""Tenants sharing one daemon, attacked from real processes of other users.

Each test starts a real ``tierd serve`` (as root) with three tenants: ``ops`` (root, the
operator), ``alpha`` and ``beta`` (two users created with ``useradd``), and runs clients
as those users (``tests/tenant_child.py`` drops to their uid before it connects). Each
reproduces an attack that worked when a namespace was only a label and the pool a file in
/dev/shm: reading or overwriting another tenant's blocks through the API or the pool,
evicting them by storing fast, and running operator commands.
"""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_kit import DaemonProcess
from tests.tenants_kit import NEEDS_ROOT, QUOTA, as_user, connect, system_users
from tierd.client import Client
from tierd.testing import short_socket_path

pytestmark = NEEDS_ROOT


def test_the_users_the_tests_create_are_removed() -> None:
    name = f"tierd-test-{secrets.token_hex(3)}"
    with system_users([name]) as found:
        assert pwd.getpwnam(name).pw_uid == found[name][0]
        group = grp.getgrgid(found[name][1]).gr_name
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    with pytest.raises(KeyError):
        grp.getgrnam(group)


def maps_of(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


async def operator(daemon: DaemonProcess) -> Client:
    return await Client.connect(daemon.socket_path)


# -- who may connect -------------------------------------------------------------------------


async def test_a_peer_of_no_tenant_is_refused(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    (refused,) = await as_user(daemon, users["stranger"], connect())
    assert refused["error"] == "not_allowed"
    assert str(users["stranger"][0]) in refused["message"]
    hello, _ = await as_user(daemon, users["alpha"], connect(), {"do": "lookup", "keys": ["k"]})
    assert hello == {"tenant": "alpha", "pool": True}


async def test_a_namespace_outside_the_tenants_patterns_is_refused(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    (refused,) = await as_user(daemon, users["alpha"], connect("team-b/llama"))
    assert refused["error"] == "bad_namespace"
    assert "tenant 'alpha'" in refused["message"] and "model-*" in refused["message"]


# -- blocks ---------------------------------------------------------------------------------


async def test_tenants_never_see_each_others_blocks_through_the_api(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    names = ["prompt-0", "prompt-1"]
    _, stored = await as_user(
        daemon, users["alpha"], connect(), {"do": "store", "keys": names, "fill": 0xA1}
    )
    assert stored == 2
    # Beta names the same namespace and the same keys: nothing of alpha's is there.
    _, found, got, loaded, written = await as_user(
        daemon,
        users["beta"],
        connect(),
        {"do": "lookup", "keys": names},
        {"do": "get", "keys": names},
        {"do": "load", "keys": names},
        {"do": "store", "keys": names, "fill": 0xB2},
    )
    assert (found, got, loaded, written) == (0, 0, [], 2)
    _, mine = await as_user(daemon, users["alpha"], connect(), {"do": "load", "keys": names})
    _, theirs = await as_user(daemon, users["beta"], connect(), {"do": "load", "keys": names})
    assert (mine, theirs) == (["a1", "a1"], ["b2", "b2"])


async def test_a_tenant_cannot_reach_another_tenants_pool_or_disk_files(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    names = ["secret-0", "secret-1"]
    await as_user(daemon, users["alpha"], connect(), {"do": "store", "keys": names, "fill": 0xA1})
    async with await operator(daemon) as ops:
        assert (await ops.flush()).dirty == 0  # alpha's blocks are on disk too now
    disk = Path(daemon.config["tiers"][1]["directories"][0])
    files = [str(p) for p in (disk / "alpha").iterdir()]
    assert files
    # Beta writes over every byte it can map, and tries every way to the daemon's memory
    # and to alpha's files.
    _, inode_beta, peek = await as_user(
        daemon,
        users["beta"],
        connect(),
        {"do": "scribble"},
        {"do": "peek", "pid": daemon.pid, "paths": files},
    )
    assert peek["opened"] == [] and peek["listing_denied"], peek
    # No pool has a name anyone could open: the daemon maps memfds, nothing in /dev/shm.
    maps = maps_of(daemon.pid)
    assert "/memfd:tierd-alpha" in maps and "/memfd:tierd-beta" in maps
    assert "/dev/shm/" not in maps
    _, inode_alpha, mine = await as_user(
        daemon, users["alpha"], connect(), {"do": "scribble"}, {"do": "load", "keys": names}
    )
    assert inode_alpha != inode_beta  # two pools, not two views of one
    assert mine == ["ee", "ee"]  # alpha's own scribble: its pool is its own to write
    _, theirs = await as_user(daemon, users["beta"], connect(), {"do": "load", "keys": names})
    assert theirs == []
    for tenant in ("alpha", "beta", "ops"):
        directory = disk / tenant
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for path in directory.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


# -- operator commands -------------------------------------------------------------------------


async def test_operator_commands_need_an_operator(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    ops = ["clear", "flush", "stop", "config", "metrics"]
    steps = [
        connect(None),
        *({"do": "op", "name": op} for op in ops),
        {"do": "op", "name": "stats"},
    ]
    _, *refused, stats = await as_user(daemon, users["beta"], *steps)
    assert [r.get("error") for r in refused] == ["not_allowed"] * len(ops), refused
    own = stats["stats"]
    assert own["tenant"] == "beta" and "tenants" not in own
    assert [t["capacity"] for t in own["tiers"]] == [QUOTA["cpu"], QUOTA["disk"]]
    async with await operator(daemon) as client:
        everyone = await client.stats()
        assert set(everyone["tenants"]) == {"ops", "alpha", "beta"}
        assert [t["capacity"] for t in everyone["tiers"]] == [24, 96]
        assert (await client.health())["status"] == "ok"
    assert daemon.proc.poll() is None  # beta's stop did nothing
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tierd", "stats", "--socket", daemon.socket_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split()[1:] for line in shown.stdout.splitlines() if line}
    assert rows["tenant"] == ["cpu", "disk", "leased", "expired"]
    assert rows["beta"][:2] == ["0/8", "0/32"]


# -- quotas ---------------------------------------------------------------------------------


async def test_quotas_hold_against_a_tenant_that_stores_as_fast_as_it_can(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    mine = [f"kept-{i}" for i in range(QUOTA["cpu"])]
    _, stored = await as_user(
        daemon, users["alpha"], connect(), {"do": "store", "keys": mine, "fill": 0xA1}
    )
    assert stored == len(mine)
    flood = {"do": "flood", "count": 400, "batch": 4, "fill": 0xB2}
    _, flooded = await as_user(daemon, users["beta"], connect(), flood)
    assert flooded["stored"] > 4 * QUOTA["disk"]  # far past what beta may keep
    # Alpha's blocks are all still in its CPU tier: beta's stores evicted only beta's.
    async with await Client.connect(daemon.socket_path) as client:
        tenants = (await client.stats())["tenants"]
    alpha = {t["name"]: t for t in tenants["alpha"]["tiers"]}
    beta = {t["name"]: t for t in tenants["beta"]["tiers"]}
    assert alpha["cpu"]["used"] == len(mine) and alpha["cpu"]["evictions"] == 0
    assert beta["cpu"]["used"] <= QUOTA["cpu"] and beta["disk"]["used"] <= QUOTA["disk"]
    assert beta["cpu"]["evictions"] > 0
    _, loaded = await as_user(daemon, users["alpha"], connect(), {"do": "load", "keys": mine})
    assert loaded == ["a1"] * len(mine)


# -- the shipped config -------------------------------------------------------------------


def test_the_shipped_config_keeps_other_users_out_of_its_blocks(
    tmp_path: Path, users: dict[str, tuple[int, int]]
) -> None:
    """config/tierd.yaml, opened to another user the way the attacks needed it
    (``socket.mode: 0o666``, that user in ``allow_uids``): the pool is no file anyone can
    open, a user not allowed is refused, an allowed one is a member, not an operator."""
    from tests.daemon_kit import serve_shipped

    socket_path = short_socket_path()
    disk = tmp_path / "disk"
    served = serve_shipped(
        [
            f"socket.path={socket_path}",
            "socket.mode=0o666",
            f"socket.allow_uids=[{users['alpha'][0]}]",
            "tiers.cpu.capacity=16MiB",
            "tiers.disk.capacity=64MiB",
            f"tiers.disk.directories=[{disk}]",
            "logging.level=warning",
        ],
        tmp_path,
    )
    try:
        os.chmod(os.path.dirname(socket_path), 0o711)
        running = DaemonProcess(served, {"socket": {"path": socket_path}})
        (refused,) = asyncio.run(as_user(running, users["stranger"], connect()))
        assert refused["error"] == "not_allowed"
        hello, stored, *ops = asyncio.run(
            as_user(
                running,
                users["alpha"],
                connect(),
                {"do": "store", "keys": ["a", "b"], "fill": 0xA1},
                connect(None),
                {"do": "op", "name": "clear"},
                {"do": "op", "name": "flush"},
                {"do": "op", "name": "stop"},
            )
        )
        assert (hello, stored) == ({"tenant": "default", "pool": True}, 2)
        assert [r.get("error") for r in ops[1:]] == ["not_allowed"] * 3, ops
        maps = maps_of(served.pid)
        assert "/memfd:" in maps and "/dev/shm/" not in maps
        assert stat.S_IMODE(disk.stat().st_mode) == 0o700
        assert served.returncode is None
    finally:
        status = served.stop()
    assert status == 0
