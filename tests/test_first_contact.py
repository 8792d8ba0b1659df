"""What a new user met on a fresh clone (issue 61, item 9), each through the command a
shell runs: ``tierd config check`` warns of a remote level nobody answers at; a start
that fails says why once; ``tierd namespaces`` shows names a terminal can print and
leaves out emptied namespaces; the example client, finding no daemon, says what to do.

Daemons run as child processes (the lifecycle tests' ``spawn`` fixture: stderr to a
file, as under a service manager); ``tierd`` and the example run as child processes too.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import HUGE_DISK, tierd, write_config
from tests.daemon_kit import BLOCK, Spawn
from tierd.client import Client
from tierd.testing import daemon_config, short_socket_path

ROOT = Path(__file__).resolve().parent.parent


# -- config check: an unreachable remote level ------------------------------------------------


@pytest.fixture
def listener() -> Iterator[int]:
    """A loopback port that takes connections (and answers nothing)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def silent_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def remote_config(tmp_path: Path, url: str) -> Path:
    config = daemon_config(tmp_path, block_bytes=BLOCK, remote={"name": "shared", "url": url})
    return write_config(tmp_path, config)


async def test_config_check_warns_of_a_remote_level_nobody_answers_at(tmp_path: Path) -> None:
    port = silent_port()
    path = remote_config(tmp_path, f"redis://127.0.0.1:{port}/0")

    done = await tierd("config", "check", str(path))

    assert done.returncode == 0, done.stderr  # valid: the daemon starts without the level
    assert done.stdout.startswith(f"ok: {path} (")
    (warning,) = done.stderr.splitlines()
    assert warning.startswith(
        f"tierd: warning: remote level 'shared' at 127.0.0.1:{port} is unreachable:"
        " connection refused"
    ), warning
    offline = await tierd("config", "check", str(path), "--offline")
    assert offline.returncode == 0 and offline.stderr == ""  # not this machine: not tried


async def test_config_check_is_quiet_when_the_remote_level_takes_a_connection(
    tmp_path: Path, listener: int
) -> None:
    path = remote_config(tmp_path, f"redis://127.0.0.1:{listener}/0")
    done = await tierd("config", "check", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith(f"ok: {path} (")


# -- a start that fails says why once ---------------------------------------------------------


def unusable_socket(tmp_path: Path, config: dict[str, Any]) -> tuple[str, str]:
    """A socket in a directory that is not there: refused as the daemon binds it."""
    # under a short directory: pytest's tmp_path (longer still under a worker, popen-gw0/)
    # can pass the 107 bytes of a socket path, a refusal of its own
    short = Path(short_socket_path()).parent
    config["socket"]["path"] = str(short / "no-such-dir" / "t.sock")
    return "no-such-dir", "tierd: error: cannot start the daemon: "


def disk_too_large(tmp_path: Path, config: dict[str, Any]) -> tuple[str, str]:
    """A disk tier larger than its file system: refused by the daemon's machine check."""
    config["tiers"][1]["capacity"] = HUGE_DISK
    return "the disk tier 'disk' needs", "tiers.1.capacity: the disk tier 'disk' needs "


@pytest.mark.parametrize("failure", [unusable_socket, disk_too_large])
async def test_a_start_that_fails_says_why_once(tmp_path: Path, spawn: Spawn, failure: Any) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    marker, said = failure(tmp_path, config)
    daemon = await spawn(config, ready=False)  # stderr to a file: not a terminal
    assert await daemon.wait() != 0
    lines = daemon.stderr().splitlines()
    # Once, as the last line; before, a JSON log line ("start failed") said it first.
    assert [line for line in lines if marker in line] == [lines[-1]], lines
    assert lines[-1].startswith(said), lines


# -- tierd namespaces -------------------------------------------------------------------------


async def put(socket_path: str, namespace: str, count: int) -> None:
    async with await Client.connect(socket_path, namespace=namespace) as client:
        keys = [f"{namespace}-{i}".encode() for i in range(count)]
        await client.store(keys, [bytes(BLOCK)] * count)


async def test_namespaces_prints_names_a_terminal_shows_and_leaves_out_emptied_ones(
    tmp_path: Path, spawn: Spawn
) -> None:
    # A permissive pattern lets a name carry a tab and an escape sequence through.
    config = daemon_config(tmp_path, block_bytes=BLOCK, namespaces={"pattern": r"^.{1,64}$"})
    daemon = await spawn(config)
    odd = "odd\tname\x1b[31m"
    for name, count in (("model-a", 3), (odd, 2), ("café", 1), ("retired", 2)):
        await put(daemon.socket_path, name, count)
    gone = await tierd("delete", "--all", "--namespace", "retired", "--socket", daemon.socket_path)
    assert gone.returncode == 0, gone.stderr

    table = await tierd("namespaces", "--socket", daemon.socket_path)
    assert table.returncode == 0, table.stderr
    names = [line.split("  ")[0] for line in table.stdout.splitlines()[1:4]]
    assert sorted(names) == sorted(["model-a", "odd\\tname\\x1b[31m", "café"]), table.stdout
    assert "\x1b" not in table.stdout and "\t" not in table.stdout
    assert "retired" not in table.stdout
    assert table.stdout.splitlines()[-1] == (
        "(left out: 1 namespace that holds no block; --all lists it)"
    )

    everything = await tierd("namespaces", "--all", "--socket", daemon.socket_path)
    retired = [line for line in everything.stdout.splitlines() if line.startswith("retired ")]
    assert len(retired) == 1 and "left out" not in everything.stdout
    listed = await tierd("namespaces", "--json", "--socket", daemon.socket_path)
    assert {row["namespace"] for row in json.loads(listed.stdout)["default"]} == {
        "model-a",
        odd,  # JSON carries the name itself
        "café",
    }
    everything = await tierd("namespaces", "--json", "--all", "--socket", daemon.socket_path)
    assert "retired" in {row["namespace"] for row in json.loads(everything.stdout)["default"]}
    assert await daemon.stop() == 0


# -- the example client without a daemon ------------------------------------------------------


def test_the_example_client_says_no_daemon_runs_there_and_how_to_start_one() -> None:
    path = short_socket_path()
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "client_demo.py"), "--socket", path, "load"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3
    (line,) = done.stderr.splitlines()
    # As much as `tierd stats` says: which socket, that no daemon serves it, what to do.
    assert line.startswith(f"client_demo: cannot reach tierd at {path}: no socket there: ")
    assert "no daemon serves this path" in line
    assert "start one with `tierd serve`" in line
    assert "--socket or $TIERD_SOCKET" in line
