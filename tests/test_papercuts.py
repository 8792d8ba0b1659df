"""Small things an operator hit, each through the public interface: a paced replay that
falls behind says so; a subcommand's unknown option shows that subcommand's usage; a
missing socket is told apart from a dead one; counts are spelled right; ``tier opened``
names its tenant; the remote level's last error says when, and whether calls were
answered since; ``--out`` is a directory for every command; the editable install is
found from the checkout's parent; setup_vllm's expected pip message says it is expected.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from redis_kit import RedisServer, free_port

import tierd
from tests.daemon_kit import Spawn
from tierd.cli import main
from tierd.cli.replay_report import describe
from tierd.keys import BlockKey
from tierd.remote.calls import RemoteSettings
from tierd.remote.redis_level import RedisLevel
from tierd.testing import daemon_config, running_daemon, short_socket_path
from tierd.workload.backends import ChainBackend
from tierd.workload.replayer import replay
from tierd.workload.trace import TraceRecord, read_trace, write_trace

ROOT = Path(__file__).resolve().parent.parent
SLOW_S = 0.05  # a lookup of the slow backend takes at least this long


class SlowBackend(ChainBackend):
    """A chain whose every lookup takes at least ``SLOW_S``: it cannot keep any pace."""

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        await asyncio.sleep(SLOW_S)  # the cost of the call, not a synchronisation
        return await super().lookup(keys)


async def test_a_paced_replay_that_falls_behind_says_so(tmp_path: Path) -> None:
    # Three requests due at once: the second and third start after the first's lookup.
    write_trace(tmp_path / "t.jsonl", [TraceRecord(0, 64, 8, (i, i + 1)) for i in range(3)])
    trace = read_trace(tmp_path / "t.jsonl")
    memory = {"block_bytes": 4096, "tiers": [{"name": "m", "kind": "memory", "capacity": 16}]}
    async with tierd.open(memory) as chain:
        paced = await replay(trace, [SlowBackend(chain)], speed=1.0)
        unpaced = await replay(trace, [SlowBackend(chain)], speed=None)

    assert paced.late_requests == 2
    assert paced.behind_s >= SLOW_S  # started at least one slow lookup after it was due
    assert "fell behind     2 requests started late" in describe(paced, "t.jsonl")
    assert paced.to_dict()["late_requests"] == 2
    assert unpaced.late_requests == 0  # no clock to fall behind
    assert "fell behind" not in describe(unpaced, "t.jsonl")


def test_an_unknown_option_shows_the_subcommands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["stats", "--bogus"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("usage: tierd stats ")
    assert "tierd stats: error: unrecognized arguments: --bogus" in err


def test_a_missing_socket_is_told_apart_from_a_dead_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = short_socket_path()
    assert main(["stats", "--socket", missing]) == 3
    err = capsys.readouterr().err
    assert f"cannot reach the daemon at {missing}: no socket there" in err
    assert "`tierd serve`" in err and "--socket" in err

    dead = short_socket_path()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(dead)  # bound, never listening: what a killed daemon leaves
    assert main(["stats", "--socket", dead]) == 3
    assert "the socket is there but no daemon listens on it" in capsys.readouterr().err


async def test_one_connection_is_spelled_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None)
    async with running_daemon(cfg):
        status = await asyncio.to_thread(main, ["stats", "--socket", cfg["socket"]["path"]])
    out = capsys.readouterr().out
    assert status == 0
    assert "server: 1 connection, 0 leases," in out  # its own connection


async def test_tier_opened_names_the_tenant(tmp_path: Path, spawn: Spawn) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=16)
    cfg["logging"] = {"level": "info", "format": "json"}
    cfg["tenants"] = [{"name": "ops", "uids": [os.getuid()], "operator": True}]
    daemon = await spawn(cfg)
    assert await daemon.stop() == 0
    opened = [
        json.loads(line)
        for line in daemon.stderr().splitlines()
        if line.startswith("{") and '"tier opened"' in line
    ]
    assert [(e["tenant"], e["tier"]) for e in opened] == [("ops", "cpu"), ("ops", "disk")]


async def test_the_remote_last_error_says_when_and_whether_calls_succeed_since(
    tmp_path: Path,
) -> None:
    port = free_port()
    settings = RemoteSettings(name="remote", block_bytes=4096, url=f"redis://127.0.0.1:{port}/0")
    level = await RedisLevel(settings).open()
    try:
        assert await level.exists([BlockKey(b"k")]) == 0  # nobody listens yet
        failed = level.stats()
        assert failed["last_error"].startswith("unreachable")
        assert failed["last_error_at"] > 0 and failed["recovered"] is False
        server = RedisServer(tmp_path / "redis", port=port).start()
        try:
            assert await level.exists([BlockKey(b"k")]) == 0  # answered: not there
        finally:
            server.stop()
        recovered = level.stats()
    finally:
        await level.close()
    assert recovered["recovered"] is True
    assert recovered["last_error_at"] == failed["last_error_at"]  # kept, with its time

    from tierd.cli.control_text import last_error_text

    text = last_error_text(recovered, now=recovered["last_error_at"] + 42)
    assert text.startswith("last error 42.0 s ago, answered since: unreachable")


def test_out_is_a_directory_for_the_curve_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    write_trace(tmp_path / "t.jsonl", [TraceRecord(0, 64, 8, (1, 2, 3, 1, 2))] * 3)
    out = tmp_path / "plots"
    assert main(["simulate", str(tmp_path / "t.jsonl"), "--curve", "--out", str(out)]) == 0
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    status = main(["replay", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "x.png")])
    assert status == 2
    assert "--out names a directory" in capsys.readouterr().err


def test_the_editable_install_is_found_from_the_checkouts_parent(tmp_path: Path) -> None:
    # scripts/setup installs in setuptools' compat mode: a .pth line naming the checkout.
    # A finder-mode install loses to a directory named tierd in the current directory
    # (the checkout itself, seen from its parent), imported as an empty namespace package.
    setup = (ROOT / "scripts" / "setup").read_text()
    assert 'pip install --config-settings editable_mode=compat -e ".[$EXTRAS]"' in setup
    site = tmp_path / "site"
    site.mkdir()
    (site / "__editable__.tierd.pth").write_text(f"{ROOT}\n")
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "tierd").symlink_to(ROOT)  # the checkout, as `git clone` names it
    probe = (
        f"import site; site.addsitedir({str(site)!r}); import tierd;"
        " print(tierd.__file__, hasattr(tierd, 'open'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=parent, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "tierd" / "__init__.py"), "True"]


def test_setup_vllm_says_pips_conflict_message_is_expected(tmp_path: Path) -> None:
    script = (ROOT / "scripts" / "setup_vllm").read_text()
    assert script.count("| expected_conflicts >&2") == 2  # both pip installs
    start = script.index("expected_conflicts() {")
    function = script[start : script.index("\n}\n", start) + 3]
    line = "ERROR: pip's dependency resolver does not currently take into account all"
    done = subprocess.run(
        ["bash", "-c", f"{function}\nexpected_conflicts"],
        input=f"{line}\nvllm 0.33.0 requires x, which is not installed.\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert not done.stdout.startswith("ERROR")
    assert done.stdout.startswith("note (expected: vllm is installed --no-deps")
