"""The ``tierd`` command line run as a child process, for the operator tests: ``tierd(*argv)``,
a config file written from a mapping, and a running daemon's config rewritten and reloaded."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.daemon_kit import DaemonProcess, child_env

HUGE_DISK = "1024TiB"  # more than any file system here has free


async def tierd(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``tierd ARGV`` as a child process (a safety-net timeout, not a timed assertion)."""
    command = [sys.executable, "-m", "tierd", *argv]
    return await asyncio.to_thread(
        subprocess.run,
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env() if env is None else env,
    )


def write_config(tmp_path: Path, config: Any, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


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
