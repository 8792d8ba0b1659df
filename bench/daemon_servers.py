"""The server processes of ``scripts/bench daemon``: the echo server and tierd as
children (:class:`Servers`: started until ready, stopped with SIGTERM, then SIGKILL), the
daemon's config, and tierd run under cProfile with its summary."""

from __future__ import annotations

import argparse
import re
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from bench.daemon_data import store_lookup_keys
from bench.daemon_wire import START_TIMEOUT_S, ClientPlan, Phase, run_clients
from tierd.testing import DaemonProcess as Daemon
from tierd.testing import start_daemon

ROOT = Path(__file__).resolve().parent.parent

_DAEMON = """
import sys
from tierd.daemon import run_daemon
from tierd.settings import load_settings
config = load_settings(sys.argv[1])
if len(sys.argv) > 2:
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    try:
        status = run_daemon(config)
    finally:
        profile.disable()
        profile.dump_stats(sys.argv[2])
else:
    status = run_daemon(config)
sys.exit(status)
"""


@dataclass
class Servers:
    """The child processes; :meth:`stop_all` ends them (SIGTERM, then SIGKILL)."""

    workdir: Path
    children: list[subprocess.Popen[bytes] | Daemon] = field(default_factory=list)

    def start_echo(self, path: str) -> None:
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.daemon", "--echo-server", path], stdout=subprocess.PIPE
        )
        self.children.append(child)
        ready, _, _ = select.select([child.stdout], [], [], START_TIMEOUT_S)
        line = child.stdout.readline() if ready and child.stdout else b""
        if line.strip() != b"ready":
            raise RuntimeError(f"the echo server did not start (exit status {child.poll()})")

    def start_daemon(self, config: Path, launcher: str, profile: Path | None = None) -> Daemon:
        """Start tierd and wait for its READY=1 (:func:`tierd.testing.start_daemon`)."""
        command = None  # `python -m tierd serve -c CONFIG`
        if launcher != "serve" or profile is not None:
            command = [sys.executable, "-c", _DAEMON, str(config)]
            command += [str(profile)] if profile is not None else []
        log = self.workdir / f"daemon-{len(self.children)}.log"
        daemon = start_daemon(config, command=command, log=log, timeout_s=START_TIMEOUT_S)
        self.children.append(daemon)
        return daemon

    def stop(self, child: subprocess.Popen[bytes] | Daemon) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; the exit status."""
        if isinstance(child, Daemon):
            status: int | None = child.stop(timeout_s=30)
        else:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            status = child.returncode
        if child in self.children:
            self.children.remove(child)
        return status

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)


def daemon_yaml(path: Path, socket_path: str, cpu_capacity: str, block_bytes: str) -> Path:
    path.write_text(
        f"""block_bytes: {block_bytes}
tiers:
  - {{name: cpu, kind: cpu, capacity: {cpu_capacity}, policy: lru}}
socket: {{path: {socket_path}}}
logging: {{level: warning, format: json}}
shutdown: {{grace: 5s, write_back: none}}
"""
    )
    return path


def serve_launcher() -> str:
    from tierd.cli import FAMILY_OF

    return "serve" if "serve" in FAMILY_OF else "python -c"


# -- the server-side profile -------------------------------------------------------------


def profile_summary(path: Path, top: int) -> tuple[list[tuple[str, int, float, float]], float]:
    """The ``top`` functions by own time: (name, calls, own s, cumulative s); total s."""
    import pstats

    stats = pstats.Stats(str(path))
    rows = []
    entries: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, line, name), (_, calls, own, cum, _) in entries.items():
        short = filename.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        short = re.sub(r"^.*/lib/python3\.\d+/", "", short)  # the standard library
        where = f"{short}:{line}({name})" if line else name
        rows.append((where, calls, own, cum))
    rows.sort(key=lambda r: r[2], reverse=True)
    return rows[:top], stats.total_tt  # type: ignore[attr-defined]


def profile_daemon(
    servers: Servers, args: argparse.Namespace, config: Path
) -> tuple[list[tuple[str, int, float, float]], float, int]:
    """Run tierd under cProfile through one client's round trips and pipelined lookups."""
    prof = servers.workdir / "daemon.prof"
    child = servers.start_daemon(config, "python -c", profile=prof)
    path = str(config.with_suffix(".sock"))
    uvloop.run(store_lookup_keys(path, args.keys))
    phases = (Phase("rt", args.n, 1, True), Phase("pipe", args.pipe, args.window, False))
    run_clients(ClientPlan(path, 1, args.keys, args.warmup, phases), 1)
    status = servers.stop(child)
    if status != 0 or not prof.exists():
        raise RuntimeError(f"the profiled daemon exited with status {status}")
    rows, total = profile_summary(prof, args.profile_top)
    return rows, total, args.n + args.pipe + args.warmup
