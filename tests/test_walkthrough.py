"""The README's first session, end to end, with real processes: the shipped default config,
`tierd serve`, `tierd events` waiting in the background while the example client stores
from a second process, `tierd stats`, SIGTERM, a restart, and the blocks loaded back
byte-identical from the disk tier; then the README's `tierd trace generate` and `tierd
replay` commands as written (a fresh clone has no ../shared/data)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_kit import ROOT, serve_shipped

from tierd.testing import short_socket_path

README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "client_demo.py"


def demo(*args: str) -> str:
    """examples/client_demo.py, run as a second process; its stdout."""
    return run(sys.executable, str(EXAMPLE), *args).stdout


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture
def settings(tmp_path: Path) -> tuple[list[str], str]:
    socket_path = short_socket_path()
    sets = [
        f"socket.path={socket_path}",
        "tiers.cpu.capacity=32MiB",  # the configured size's share (of two): 16 MiB
        "tiers.disk.capacity=64MiB",
        f"tiers.disk.directories=[{tmp_path / 'disk'}]",
        "logging.level=warning",
    ]
    return sets, socket_path


def test_first_session_from_the_readme(tmp_path: Path, settings: tuple[list[str], str]) -> None:
    sets, socket_path = settings
    daemon = serve_shipped(sets, tmp_path)
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
        assert cpu["used"] == 64  # 64 blocks of 256 KiB fit in the 16 MiB CPU share
        loaded = demo("load", "--count", "64", "--socket", socket_path)
        assert "loaded 64 blocks byte-identical, 0 wrong" in loaded
        assert daemon.stop() == 0  # SIGTERM: drain, write the CPU blocks down, exit 0
    finally:
        if events.poll() is None:
            events.kill()
            events.communicate()
        daemon.kill()
    assert not os.path.exists(socket_path)

    again = daemon.restart(log=tmp_path / "serve-again.log")  # the same command again
    try:
        loaded = demo("load", "--count", "64", "--socket", socket_path)
        assert "lookup: 64 of 64 cached {'DISK': 64}" in loaded
        assert "loaded 64 blocks byte-identical, 0 wrong" in loaded
        assert again.stop() == 0
    finally:
        again.kill()


def readme_commands(program: str, readme: Path = README) -> list[list[str]]:
    """The shell lines of ``readme`` (in ```bash blocks) that run ``program``, as argv
    lists, comments dropped."""
    commands, fenced = [], False
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            fenced = line.strip() == "```bash"
            continue
        if fenced and line.startswith(f"{program} "):
            commands.append(shlex.split(line, comments=True))
    return commands


def test_the_readme_replays_a_trace_it_makes(
    tmp_path: Path, settings: tuple[list[str], str]
) -> None:
    """Issue 61, item 8: the walkthrough replayed ../shared/data/..., which a fresh clone
    does not have. It makes its trace with the seeded generator, then replays that file:
    both commands run as written (their files moved into ``tmp_path``)."""
    (generate,) = readme_commands("tierd trace generate")
    (replay,) = readme_commands("tierd replay")
    written = generate[generate.index("--out") + 1]
    assert replay[2] == written, f"the README replays {replay[2]}, not the trace it made"
    trace = tmp_path / "chat.jsonl"
    argv = generate[1:]
    argv[argv.index("--out") + 1] = str(trace)
    run(sys.executable, "-m", "tierd", *argv)
    out = tmp_path / "replay"
    argv = replay[1:]
    argv[1] = str(trace)
    argv[argv.index("--out") + 1] = str(out)
    sets, socket_path = settings
    daemon = serve_shipped(sets, tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tierd", *argv, "--socket", socket_path],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,  # the README's commands run in the checkout
        )
        assert done.returncode == 0, done.stderr
        assert "wrong bytes     0" in done.stdout
        assert "requests        203 " in done.stdout  # every request of the trace made
        summary = json.loads((out / "summary.json").read_text())
        assert summary["requests"] == 203
        assert daemon.stop() == 0
    finally:
        daemon.kill()
