"""tierd.testing.start_daemon: the one way tests and benchmarks start a daemon in a child
process and wait for it (its ``READY=1`` on a notify socket of the helper's), fail with the
daemon's log when it exits first, and stop it by PID."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tierd.client import Client
from tierd.testing import DaemonNotReady, daemon_config, start_daemon, start_daemon_async

DEADLINE_S = 60.0  # safety net for a start on a loaded machine

# A child that says READY=1 the way the daemon does, then ignores SIGTERM.
STUBBORN = """
import os, signal, socket, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
    sock.sendto(b"STATUS=starting", os.environ["NOTIFY_SOCKET"])
    sock.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
signal.pause()
"""


async def test_returns_once_ready_and_the_socket_answers_at_once(tmp_path: Path) -> None:
    config = daemon_config(tmp_path, cpu_blocks=8)
    daemon = await start_daemon_async(config, log=tmp_path / "tierd.log", timeout_s=DEADLINE_S)
    try:
        assert daemon.socket == config["socket"]["path"]
        assert daemon.ready_s is not None and daemon.returncode is None
        assert daemon.notices[-1] == b"READY=1"  # after the CPU pool's progress, if any
        # READY=1 comes after the socket accepts: the first connection is answered.
        async with await Client.connect(daemon.socket) as client:
            assert (await client.health())["status"] == "ok"
    finally:
        status = await daemon.stop_async()
    assert status == 0
    assert "ready" in daemon.log_text()
    assert (tmp_path / "tierd.yaml").exists()  # the mapping, written beside the log


def test_a_daemon_that_exits_before_ready_fails_with_its_log(tmp_path: Path) -> None:
    config = daemon_config(tmp_path, bogus_key=1)
    with pytest.raises(DaemonNotReady) as failed:
        start_daemon(config, log=tmp_path / "bad.log", timeout_s=DEADLINE_S)
    assert "exited with status 78 before it was ready" in str(failed.value)
    assert "bogus_key" in str(failed.value)  # the daemon's own words, from its log


def test_a_child_that_never_says_ready_is_killed_at_the_bound(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import signal; signal.pause()"]
    with pytest.raises(DaemonNotReady, match=r"sent no READY=1 within 0\.5 s \(killed\)"):
        start_daemon(command=command, log=tmp_path / "mute.log", timeout_s=0.5)


def test_stop_kills_by_pid_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    daemon = start_daemon(command=[sys.executable, "-c", STUBBORN], log=tmp_path / "s.log")
    assert daemon.notices == [b"STATUS=starting", b"READY=1"]
    assert daemon.returncode is None
    assert daemon.stop(timeout_s=0.5) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(daemon.pid, 0)


def test_restart_runs_the_same_command_again(tmp_path: Path) -> None:
    """The console script (``tierd serve``) as launcher, a restart from the same config
    with a log per start, used as context managers (stopped by SIGTERM on exit)."""
    config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64)
    with start_daemon(config, script=True, log=tmp_path / "one.log") as first:
        assert Path(first.spec.command[0]).name == "tierd"
    assert first.returncode == 0
    with first.restart(log=tmp_path / "two.log") as second:
        assert second.pid != first.pid and second.socket == first.socket
        assert second.returncode is None
    assert second.returncode == 0
    assert (tmp_path / "two.log").read_text() != ""
    running = start_daemon(command=[sys.executable, "-c", STUBBORN], log=tmp_path / "r.log")
    try:
        with pytest.raises(RuntimeError, match="still runs"):
            running.restart()
    finally:
        running.kill()
