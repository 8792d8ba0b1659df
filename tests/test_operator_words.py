"""What the operator commands say is what happens, with real daemons and the ``tierd``
command as child processes:

- ``tierd reload`` that names ``logging.level`` as applied really changes the level: the
  per-request debug lines appear from then on;
- ``tierd config show`` prints the config the running daemon runs (asked over its socket),
  and, with no daemon answering, the config ``tierd serve`` would run, saying which; a
  daemon served with no file (the shipped config) reloads that file;
- ``tierd replay`` whose daemon stops under it prints the results it has, marked cut
  short, and exits 3;
- ``tierd top`` says when the daemon went away, waits for it, and goes on when it is back;
- ``tierd config check`` and ``tierd serve`` name the disk tier and the directory the
  daemon cannot write (a read-only file system: unwritable for root too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import reload, rewrite, tierd, write_config
from tests.daemon_kit import DaemonProcess, Spawn, child_env
from tierd.client import Client
from tierd.share import shipped
from tierd.testing import daemon_config, short_socket_path
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import write_trace

WAIT_S = 60.0  # a safety net for what a test waits on, never a timed assertion
NAMESPACE = "words"


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# -- reload: logging.level ------------------------------------------------------------------


async def one_lookup(daemon: DaemonProcess, key: bytes) -> None:
    async with await Client.connect(daemon.socket_path, namespace=NAMESPACE) as client:
        await client.lookup([key])


async def test_a_reload_to_debug_writes_the_debug_lines_from_then_on(
    tmp_path: Path, spawn: Spawn
) -> None:
    daemon = await spawn(daemon_config(tmp_path, logging={"level": "warning", "format": "json"}))
    await one_lookup(daemon, b"before")
    rewrite(daemon, {"logging": {"level": "debug"}})
    status, out, err = await reload(daemon)
    assert status == 0, err
    assert json.loads(out)["applied"] == ["logging.level"]
    await one_lookup(daemon, b"after")
    assert await daemon.stop() == 0  # every line written and flushed
    lines = json_lines(daemon.stderr())
    events = [line["event"] for line in lines]
    assert "reloaded" in events, daemon.stderr()
    requests = [line for line in lines if line["event"] == "request"]
    assert [line["key"] for line in requests if line["op"] == "lookup"] == [b"after".hex()]
    assert all(line["level"] == "debug" for line in requests)
    assert events.index("reloaded") < events.index("request")


# -- config show --------------------------------------------------------------------------


async def test_config_show_prints_what_the_running_daemon_runs(
    tmp_path: Path, spawn: Spawn
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=24, block_bytes=8192, logging={"level": "warning"})
    daemon = await spawn(cfg)
    env = child_env(TIERD_SOCKET=daemon.socket_path)
    for argv in (["--json"], ["--json", "--socket", daemon.socket_path]):
        done = await tierd("config", "show", *argv, env=env if "--socket" not in argv else None)
        assert done.returncode == 0, done.stderr
        shown = json.loads(done.stdout)
        async with await Client.connect(daemon.socket_path) as operator:
            assert shown == await operator.config()
        assert shown["block_bytes"] == 8192
        assert [tier["name"] for tier in shown["tiers"]] == ["cpu", "disk"]
        assert f"the running daemon's config (at {daemon.socket_path})" in done.stderr


async def test_config_show_without_a_daemon_prints_what_serve_would_run(
    tmp_path: Path, spawn: Spawn
) -> None:
    env = child_env(TIERD_SOCKET=str(tmp_path / "nobody.sock"), XDG_STATE_HOME=str(tmp_path))
    done = await tierd("config", "show", "--json", env=env)
    assert done.returncode == 0, done.stderr
    served = await tierd("config", "show", "--json", "-c", str(shipped("tierd.yaml")), env=env)
    assert json.loads(done.stdout) == json.loads(served.stdout)
    assert json.loads(done.stdout)["block_bytes"] == 256 << 10  # the shipped file's, not 2MiB
    assert f"no daemon answers at {tmp_path / 'nobody.sock'}" in done.stderr
    assert f"showing what `tierd serve` would run ({shipped('tierd.yaml')})" in done.stderr
    # --socket names the daemon to ask: none there is exit status 3, not a fallback.
    done = await tierd("config", "show", "--socket", str(tmp_path / "nobody.sock"), env=env)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout == ""
    # -c FILE: that file's config, no daemon asked.
    path = write_config(tmp_path, daemon_config(tmp_path, block_bytes=16384))
    done = await tierd("config", "show", "--json", "-c", str(path), env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["block_bytes"] == 16384


async def test_a_daemon_served_from_the_shipped_config_reloads_that_config(
    tmp_path: Path, spawn: Spawn
) -> None:
    """``tierd serve`` with no file runs the shipped config; a reload reads it again (it
    read the built-in defaults, which have no disk tier, and refused)."""
    path = short_socket_path()
    env = child_env(
        XDG_STATE_HOME=str(tmp_path / "state"),
        TIERD_SOCKET__PATH=path,
        TIERD_TIERS__0__CAPACITY="8MiB",  # small sizes for a test; the rest as shipped
        TIERD_TIERS__1__CAPACITY="16MiB",
    )
    daemon = await spawn(None, env=env)  # no -c
    assert daemon.socket_path == path
    done = await tierd("reload", "--socket", path, "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"applied": [], "restart_needed": []}
    done = await tierd("config", "show", "--json", env=env)
    assert json.loads(done.stdout)["tiers"][1]["directories"] == [
        str(tmp_path / "state" / "tierd" / "disk")
    ]
    assert await daemon.stop() == 0, daemon.stderr()


# -- replay: the daemon stops under it ------------------------------------------------------


async def test_a_replay_whose_daemon_stops_prints_what_it_has_cut_short(
    tmp_path: Path, spawn: Spawn
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate(GeneratorConfig(seed=5, conversations=4000)))
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=512, disk_blocks=None))
    argv = ["replay", str(trace), "--socket", daemon.socket_path, "--max-rate", "--json"]
    async with await Client.connect(daemon.socket_path) as watcher:
        await watcher.subscribe()  # before the replay starts: its first stores are seen
        replay = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "tierd", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
        )
        try:
            async with asyncio.timeout(WAIT_S):
                # The replay's first stores: several, so that some of its requests are
                # done (an ordered replay ends a request once its stores are settled).
                pushes = aiter(watcher.events())
                for _ in range(20):
                    await anext(pushes)
            daemon.signal(signal.SIGTERM)  # by its pid, mid-replay
            assert await daemon.wait() == 0
            async with asyncio.timeout(WAIT_S):
                out, err = await replay.communicate()
        finally:
            if replay.returncode is None:
                replay.kill()
                await replay.wait()
    assert replay.returncode == 3, err.decode()
    summary = json.loads(out)
    assert 0 < summary["requests"] < summary["planned_requests"]
    assert summary["cut_short"].startswith("the daemon went away")
    assert summary["interrupted"] is True
    assert "cut short after" in err.decode()


# -- top: the daemon restarts under it ------------------------------------------------------


class Output:
    """A child's output, read line by line as it comes for as long as the child writes
    (so a child printing every 0.1 s never blocks on a full pipe, and a Ctrl-C reaches it
    in the loop rather than in a blocked write); :meth:`until` waits for a line after the
    last one it matched."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self._read = 0
        self._more = asyncio.Event()
        self.task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while line := (await stream.readline()).decode():
            self.lines.append(line)
            self._more.set()
        self._more.set()

    async def until(self, text: str) -> None:
        async with asyncio.timeout(WAIT_S):
            while True:
                while self._read < len(self.lines):
                    self._read += 1
                    if text in self.lines[self._read - 1]:
                        return
                if self.task.done():
                    raise AssertionError(f"top ended before {text!r}:\n{self.text()}")
                self._more.clear()
                await self._more.wait()

    def text(self) -> str:
        return "".join(self.lines)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_top_waits_for_a_restarted_daemon_and_goes_on(tmp_path: Path, spawn: Spawn) -> None:
    cfg = daemon_config(tmp_path)
    daemon = await spawn(cfg)
    top = await asyncio.create_subprocess_exec(
        sys.executable,
        *["-m", "tierd", "top", "--socket", daemon.socket_path, "--plain", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env(),
        # Ctrl-C as a terminal's foreground job gets it: a suite started in the background
        # by a shell runs with SIGINT ignored, which its children would inherit.
        preexec_fn=_default_sigint,
    )
    assert top.stdout is not None
    out = Output(top.stdout)
    try:
        await out.until("tierd top at")
        assert await daemon.stop() == 0
        await out.until(f"the daemon at {daemon.socket_path} went away")
        again = await spawn(cfg)
        await out.until("the daemon is back")
        await out.until("tierd top at")
        assert await again.stop() == 0
        top.send_signal(signal.SIGINT)
        async with asyncio.timeout(WAIT_S):
            assert await top.wait() == 0, out.text()
            await out.task
    finally:
        if top.returncode is None:
            top.kill()
            await top.wait()
        out.task.cancel()
    seen = out.lines
    assert any("waiting for it to come back" in line for line in seen), "".join(seen)


# -- config check / serve: a disk directory the daemon cannot write -------------------------


@contextlib.contextmanager
def read_only_mount() -> Iterator[Path]:
    """An empty read-only tmpfs (mode 0700, root's): nobody, root included, writes it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    point = Path(tempfile.mkdtemp(prefix="tierd-ro-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs", str(point)],
        check=False,
        capture_output=True,
    )
    if mounted.returncode != 0:
        point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


@pytest.mark.parametrize("below", [False, True], ids=["the-directory", "its-parent"])
async def test_an_unwritable_disk_directory_is_named_by_check_and_serve(
    tmp_path: Path, spawn: Spawn, below: bool
) -> None:
    with read_only_mount() as point:
        directory = point / "disk" if below else point
        cfg = daemon_config(tmp_path)
        cfg["tiers"][1]["directories"] = [str(directory)]
        path = write_config(tmp_path, cfg)
        done = await tierd("config", "check", str(path))
        assert done.returncode == 78, done.stdout + done.stderr
        where = point if below else directory
        assert "tiers.1.directories" in done.stderr
        assert f"the daemon cannot write {where} (disk tier 'disk'" in done.stderr
        daemon = await spawn(cfg, ready=False)
        assert await daemon.wait() != 0
        err = daemon.stderr()
        assert "Traceback" not in err
        assert f"the daemon cannot write {where} (disk tier 'disk'" in err, err
