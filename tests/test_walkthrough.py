"""The README's first session, end to end, with real processes: the shipped default config,
`tierd serve`, `tierd events` waiting in the background while the example client stores
from a second process, `tierd stats`, SIGTERM, a restart, and the blocks loaded back
byte-identical from the disk tier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tierd.testing import short_socket_path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "tierd.yaml"
EXAMPLE = ROOT / "examples" / "client_demo.py"


def demo(*args: str) -> str:
    """examples/client_demo.py, run as a second process; its stdout."""
    return run(sys.executable, str(EXAMPLE), *args).stdout


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


class Serve:
    """`tierd serve` in a child process, ready once it said so to a notify socket."""

    def __init__(self, sets: list[str], tmp: Path) -> None:
        import socket

        self.notify_path = str(Path(short_socket_path()).with_name("notify"))
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.notify.settimeout(60)
        argv = [sys.executable, "-m", "tierd", "serve", "-c", str(DEFAULT_CONFIG)]
        for item in sets:
            argv += ["--set", item]
        self.log = (tmp / "serve.log").open("a")
        env = {**os.environ, "NOTIFY_SOCKET": self.notify_path}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env=env, cwd=tmp)
        # Start-up progress (EXTEND_TIMEOUT_USEC, per GiB of the CPU pool) comes first.
        while (message := self.notify.recv(256)).startswith(b"EXTEND_TIMEOUT_USEC="):
            pass
        assert message == b"READY=1"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout=60)
        self.notify.close()
        self.log.close()
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def settings(tmp_path: Path) -> tuple[list[str], str]:
    socket_path = short_socket_path()
    sets = [
        f"socket.path={socket_path}",
        "tiers.cpu.capacity=16MiB",
        "tiers.disk.capacity=64MiB",
        f"tiers.disk.directories=[{tmp_path / 'disk'}]",
        "logging.level=warning",
    ]
    return sets, socket_path


def test_first_session_from_the_readme(tmp_path: Path, settings: tuple[list[str], str]) -> None:
    sets, socket_path = settings
    serve = Serve(sets, tmp_path)
    tierd = [sys.executable, "-m", "tierd"]
    events = subprocess.Popen(
        [*tierd, "events", "--count", "1", "--socket", socket_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # `tierd events --count 1 &`: it says so once it listens (or exits, failing).
        assert events.stderr is not None
        announced = events.stderr.readline()
        assert announced.startswith("tierd: following events"), announced
        assert "stored 64 new blocks" in demo("store", "--count", "64", "--socket", socket_path)
        out, err = events.communicate(timeout=60)  # the store's first batch ends it
        assert events.returncode == 0, err
        header, event = out.splitlines()  # one batch of one event: 16 blocks stored
        assert header == "batch 1 (1 event)"
        assert event.startswith("stored CPU cpu 16 keys: ")
        stats = json.loads(run(*tierd, "stats", "--json", "--socket", socket_path).stdout)
        cpu = next(t for t in stats["tiers"] if t["name"] == "cpu")
        assert cpu["used"] == 64  # 64 blocks of 256 KiB fit in the 16 MiB CPU tier
        loaded = demo("load", "--count", "64", "--socket", socket_path)
        assert "loaded 64 blocks byte-identical, 0 wrong" in loaded
        assert serve.stop() == 0  # SIGTERM: drain, write the CPU blocks down, exit 0
    finally:
        if events.poll() is None:
            events.kill()
            events.communicate()
        serve.kill()
    assert not os.path.exists(socket_path)

    serve = Serve(sets, tmp_path)  # the same command again
    try:
        loaded = demo("load", "--count", "64", "--socket", socket_path)
        assert "lookup: 64 of 64 cached {'DISK': 64}" in loaded
        assert "loaded 64 blocks byte-identical, 0 wrong" in loaded
        assert serve.stop() == 0
    finally:
        serve.kill()
