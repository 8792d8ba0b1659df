"""``tierd reload`` (and the unit's ExecReload) through a real daemon: the config file is
read again, what can change live changes (limits, namespace rules, admission rules, lease
bounds), what needs a restart is named and left as it runs, and an invalid file, or one
whose live values do not fit what keeps running, changes nothing.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_daemon_lifecycle import BLOCK, DaemonProcess, Spawn, block, keys, spawn
from tests.test_operator import tierd
from tests.test_service_unit import UNIT, parse_unit
from tierd.client import Client, DaemonError
from tierd.testing import daemon_config

__all__ = ["spawn"]  # the fixture, imported for the tests below


def config_file(daemon: DaemonProcess) -> Path:
    """The file the spawn fixture wrote for ``daemon`` (its command line's ``-c``)."""
    args = daemon.proc.args
    assert isinstance(args, list)
    return Path(args[args.index("-c") + 1])


def rewrite(daemon: DaemonProcess, change: dict[str, Any]) -> None:
    """Write ``change`` (a nested mapping) over the daemon's config file."""
    path = config_file(daemon)
    data = yaml.safe_load(path.read_text())
    merge(data, change)
    path.write_text(yaml.safe_dump(data))


def merge(base: dict[str, Any], top: dict[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value


async def reload(daemon: DaemonProcess) -> tuple[int, str, str]:
    done = await tierd("reload", "--socket", daemon.socket_path, "--json")
    return done.returncode, done.stdout, done.stderr


async def running_config(daemon: DaemonProcess) -> dict[str, Any]:
    async with await Client.connect(daemon.socket_path) as operator:
        return await operator.config()


async def test_reload_applies_live_values_and_names_what_needs_a_restart(
    tmp_path: Path, spawn: Spawn
) -> None:
    daemon = await spawn(daemon_config(tmp_path, namespaces={"allowed": ["old", "new"]}))
    async with await Client.connect(
        daemon.socket_path, namespace="old", block_bytes=BLOCK
    ) as client:
        assert await client.put([b"k"], [block(b"k")]) == 1
    tiers = yaml.safe_load(config_file(daemon).read_text())["tiers"]
    tiers[0]["capacity"] = 16  # a resize: needs a restart
    tiers[1]["admission"] = "reuse>=2"
    rewrite(
        daemon,
        {
            "namespaces": {"allowed": ["new"]},
            "limits": {"load_wait_s": 2.5, "lease_blocks_per_connection": 2},
            "tiers": tiers,
        },
    )
    status, out, err = await reload(daemon)
    assert status == 0, err
    done = json.loads(out)
    assert set(done["applied"]) == {
        "namespaces.allowed",
        "limits.load_wait_s",
        "limits.lease_blocks_per_connection",
        "tiers.disk.admission",
    }
    assert done["restart_needed"] == ["tiers.cpu.capacity"]
    cfg = await running_config(daemon)
    assert cfg["limits"]["load_wait_s"] == 2.5 and cfg["tiers"][1]["admission"] == "reuse>=2"
    assert cfg["tiers"][0]["capacity"] == 8  # still running as it was
    # The namespace rule holds for hellos from now on; the lease bound at once.
    with pytest.raises(DaemonError) as refused:
        await Client.connect(daemon.socket_path, namespace="old", block_bytes=BLOCK)
    assert refused.value.code == "bad_namespace"
    async with await Client.connect(
        daemon.socket_path, namespace="new", block_bytes=BLOCK
    ) as client:
        with pytest.raises(DaemonError) as bounded:
            await client.prepare_store(keys("n", 3))
        assert bounded.value.code == "capacity"
        # Admission below the CPU tier now wants a second use: 12 blocks used once each
        # go through a CPU tier of 8 and none is admitted to the disk tier.
        for name in keys("once", 12):
            assert await client.put([name], [block(name)]) == 1
        stats = await client.stats()
    disk = next(t for t in stats["tiers"] if t["name"] == "disk")
    assert disk["refused"] >= 4 and disk["used"] == 0
    text = await tierd("reload", "--socket", daemon.socket_path)
    assert text.returncode == 0
    assert "needs a restart" in text.stdout and "tiers.cpu.capacity" in text.stdout


async def test_an_invalid_file_changes_nothing(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    before = await running_config(daemon)
    # One good value and one bad one: all or nothing.
    rewrite(daemon, {"limits": {"load_wait_s": 1.0, "max_keys_per_request": -1}})
    status, _, err = await reload(daemon)
    assert status == 1
    assert "bad_config" in err and "limits.max_keys_per_request" in err
    assert "Traceback" not in err
    assert await running_config(daemon) == before
    config_file(daemon).write_text("limits: [this is not a mapping")
    status, _, err = await reload(daemon)
    assert status == 1 and "bad_config" in err
    assert await running_config(daemon) == before


async def test_live_values_that_do_not_fit_the_running_config_change_nothing(
    tmp_path: Path, spawn: Spawn
) -> None:
    # The file asks for 4 KiB blocks (a restart) and frames of 100,000 bytes (live): fine
    # for 4 KiB blocks, too small for the 256 KiB blocks that keep running.
    big = 256 << 10
    daemon = await spawn(daemon_config(tmp_path, block_bytes=big))
    before = await running_config(daemon)
    rewrite(daemon, {"block_bytes": 4096, "limits": {"max_frame_bytes": 100_000}})
    status, _, err = await reload(daemon)
    assert status == 1 and "bad_config" in err and "max_frame_bytes" in err
    assert await running_config(daemon) == before


async def test_only_an_operator_without_a_namespace_reloads(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    async with await Client.connect(
        daemon.socket_path, namespace="ns", block_bytes=BLOCK
    ) as client:
        with pytest.raises(DaemonError) as refused:
            await client.reload()
    assert refused.value.code == "not_allowed"
    async with await Client.connect(daemon.socket_path) as operator:
        assert await operator.reload() == {"applied": [], "restart_needed": []}


def test_the_unit_reloads_through_tierd_reload_on_its_socket() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    (reload_line,) = service["ExecReload"]
    (start_line,) = service["ExecStart"]
    argv, start = shlex.split(reload_line), shlex.split(start_line)
    assert argv[:2] == [start[0], "reload"]
    socket = next(s.split("=", 1)[1] for s in start if s.startswith("socket.path="))
    assert argv[argv.index("--socket") + 1] == socket
