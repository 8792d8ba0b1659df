"""``tierd reload`` (and the unit's ExecReload) through a real daemon: the config file is
read again, what can change live changes (limits, namespace rules, admission rules, lease
bounds), what needs a restart is named and left as it runs, and an invalid file, or one
whose live values do not fit what keeps running, changes nothing. The file is read and
parsed off the event loop (health is answered meanwhile), only if it is a regular file of
at most 1 MiB: a FIFO, a device or a huge file at the config path is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli_kit import config_file, reload, rewrite, tierd
from tests.daemon_kit import BLOCK, DaemonProcess, Spawn, block, keys
from tests.service_unit_kit import UNIT, parse_unit
from tests.wire_kit import replies_from
from tierd.cli import main
from tierd.client import Client, DaemonError
from tierd.control.protocol import PROTOCOL_VERSION, FrameDecoder, encode
from tierd.testing import daemon_config

WAIT_S = 30.0  # a safety net for what a test waits on, never a timed assertion


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
    assert f"{config_file(daemon)}: not valid YAML" in err and "line 1" in err
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


def pipelined(path: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Say hello as an operator, then send ``messages`` in one write (so the daemon reads
    them together) and return their replies in the order they came."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(path)
        decoder = FrameDecoder(1 << 30)
        sock.sendall(encode({"id": 1, "op": "hello", "version": PROTOCOL_VERSION}))
        (hello,) = replies_from(sock, decoder, 1)
        assert hello["ok"], hello
        sock.sendall(b"".join(encode(message) for message in messages))
        return replies_from(sock, decoder, len(messages))


def big_yaml(config: dict[str, Any], padding: int) -> str:
    """``config`` as YAML, followed by ``padding`` bytes of comment lines."""
    line = "# " + "x" * 1021 + "\n"
    return yaml.safe_dump(config) + line * (padding // len(line))


async def test_a_fifo_at_the_config_path_is_refused_and_health_still_answered(
    tmp_path: Path, spawn: Spawn
) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    path = config_file(daemon)
    path.unlink()
    os.mkfifo(path)  # opening it to read would wait for a writer forever
    try:
        async with await Client.connect(daemon.socket_path) as operator:
            async with asyncio.timeout(WAIT_S):  # safety net: an old daemon hangs here
                with pytest.raises(DaemonError) as refused:
                    await operator.reload()
            assert (await operator.health())["status"] == "ok"
    finally:  # a daemon stuck opening the FIFO gets a writer, and so an end of file
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert refused.value.code == "bad_config"
    assert str(path) in str(refused.value) and "not a regular file" in str(refused.value)


async def test_a_config_over_the_size_bound_is_refused_by_reload_and_serve(
    tmp_path: Path, spawn: Spawn
) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    before = await running_config(daemon)
    path = config_file(daemon)
    config = yaml.safe_load(path.read_text())
    config["limits"]["load_wait_s"] = 2.5
    path.write_text(big_yaml(config, 3 << 20))
    status, _, err = await reload(daemon)
    assert status == 1 and "bad_config" in err and "Traceback" not in err
    assert str(path) in err and "1 MiB" in err
    assert await running_config(daemon) == before
    started = await tierd("serve", "-c", str(path))
    assert started.returncode == 78, started.stderr
    assert str(path) in started.stderr and "1 MiB" in started.stderr
    assert "Traceback" not in started.stderr


async def test_health_sent_after_a_reload_is_answered_before_it(
    tmp_path: Path, spawn: Spawn
) -> None:
    # The file is read and parsed in a worker thread: the loop answers the health request
    # that came in the same read while the reload is still under way.
    daemon = await spawn(daemon_config(tmp_path))
    path = config_file(daemon)
    config = yaml.safe_load(path.read_text())
    config["limits"]["load_wait_s"] = 2.5
    path.write_text(big_yaml(config, 900 << 10))
    requests = [{"id": 7, "op": "reload"}, {"id": 8, "op": "health"}]
    replies = await asyncio.to_thread(pipelined, daemon.socket_path, requests)
    assert [reply["id"] for reply in replies] == [8, 7]
    assert replies[0]["status"] == "ok"
    assert replies[1]["ok"] and replies[1]["applied"] == ["limits.load_wait_s"]


async def test_two_reloads_at_once_run_one_after_the_other(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    rewrite(daemon, {"limits": {"load_wait_s": 2.5}})
    requests = [{"id": 7, "op": "reload"}, {"id": 8, "op": "reload"}]
    replies = await asyncio.to_thread(pipelined, daemon.socket_path, requests)
    assert [(r["id"], r["ok"]) for r in replies] == [(7, True), (8, True)]
    assert replies[0]["applied"] == ["limits.load_wait_s"]
    assert replies[1]["applied"] == []  # the second found the first's values running


@pytest.mark.parametrize("case", ["device", "directory", "aliases"])
def test_a_config_that_is_no_plain_bounded_file_is_refused_unread(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bomb = tmp_path / "bomb.yaml"  # nine levels of ten aliases: 10**9 values once walked
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 10)]
    bomb.write_text("\n".join(lines) + "\n")
    path, expected = {
        "device": (Path("/dev/zero"), "not a regular file (a character device)"),
        "directory": (tmp_path, "not a regular file (a directory)"),
        "aliases": (bomb, "the YAML expands to more than"),
    }[case]
    assert main(["config", "check", str(path), "--offline"]) == 78
    err = capsys.readouterr().err
    assert f"{path}: {expected}" in err and "Traceback" not in err
