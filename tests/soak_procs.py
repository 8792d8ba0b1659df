"""The soak's child processes: the daemon under test (:class:`DaemonProcess`, one
*incarnation* per start, each with its own log), the lease-holding clients the campaign
SIGKILLs (:func:`spawn_holder`), and waiting on the daemon's own word that it is idle
(:func:`wait_idle`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from soak_daemon import FaultControl
from soak_settings import DEADLINE_S, NAMESPACE, RUNNER, START_DEADLINE_S

from tierd.client import Client
from tierd.testing import DaemonNotReady, start_daemon_async
from tierd.testing import DaemonProcess as ChildDaemon


def child_env() -> dict[str, str]:
    """This environment without anything that would configure the daemon."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("TIERD_") and k != "NOTIFY_SOCKET"
    }


class DaemonFailed(RuntimeError):
    """The daemon did not start (the message holds the end of its log)."""


class DaemonProcess:
    """The daemon of ``config`` as a child process (``soak_daemon.py serve``); each start
    is a new *incarnation* with its own log file in ``workdir``."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir
        self.config = config
        self.config_file = workdir / "tierd.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.fault_file = workdir / "faults.bin"
        self.control = FaultControl(self.fault_file, create=True)
        self.proc: ChildDaemon | None = None
        self.incarnation = 0
        self.started_at = 0.0
        self.pids: list[int] = []

    @property
    def socket_path(self) -> str:
        return str(self.config["socket"]["path"])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_path(self, incarnation: int | None = None) -> Path:
        return self.workdir / f"daemon-{incarnation or self.incarnation}.log"

    async def start(self) -> None:
        """A new incarnation, awaited on its READY=1 (:func:`tierd.testing.start_daemon`)."""
        self.incarnation += 1
        command = [
            sys.executable,
            str(RUNNER),
            "serve",
            str(self.config_file),
            str(self.fault_file),
        ]
        try:
            self.proc = await start_daemon_async(
                command=command,
                env=child_env(),
                log=self.log_path(),
                socket_path=self.socket_path,
                timeout_s=START_DEADLINE_S,
            )
        except DaemonNotReady as exc:
            raise DaemonFailed(f"the daemon did not start: {exc}") from None
        self.started_at = time.monotonic()
        self.pids.append(self.proc.pid)

    async def kill(self) -> None:
        if self.proc is not None:
            await self.proc.kill_async()

    async def stop(self) -> int:
        """SIGTERM; the exit status (-9 when it had to be killed after the deadline)."""
        if self.proc is None:
            return 0
        return await self.proc.stop_async(START_DEADLINE_S)

    def rss_kib(self) -> int | None:
        if not self.alive or self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def cleanup(self) -> None:
        """Close the control connection (killed incarnations leave no pool behind: a
        pool is a memfd, gone with its last descriptor)."""
        self.control.close()


async def spawn_holder(path: str, mode: str, keys: Sequence[bytes], log: Path) -> tuple[Any, str]:
    """Start a ``soak_daemon.py hold`` child and wait until it holds its lease: returns
    the process and its first line (``ready N``, ``refused CODE`` or ``""``)."""
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(RUNNER),
            "hold",
            path,
            NAMESPACE,
            mode,
            *(k.hex() for k in keys),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=child_env(),
        )
    line = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DEADLINE_S):
            line = await proc.stdout.readline() if proc.stdout else b""
    return proc, line.decode().strip()


async def wait_idle(client: Client, connections: Callable[[], int]) -> dict[str, Any] | None:
    """Poll the daemon's stats until no block is pinned or in flight, no lease is open and
    at most ``connections()`` clients are connected; the stats then, or ``None`` after
    :data:`DEADLINE_S`. (The daemon learns that a peer went away on its own schedule:
    there is nothing to wait on but its own answer.)"""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while True:
        stats = await client.stats()
        busy = any(t["pinned"] or t["writing"] for t in stats["tiers"])
        server = stats["server"]
        if not busy and not server["leases"] and server["connections"] <= connections():
            return stats
        if loop.time() > deadline:
            return None
        await asyncio.sleep(0.05)


def idle_figures(stats: dict[str, Any]) -> dict[str, int]:
    tiers = stats["tiers"]
    return {
        "pinned": sum(t["pinned"] for t in tiers),
        "writing": sum(t["writing"] for t in tiers),
        "leases": stats["server"]["leases"],
        "connections": stats["server"]["connections"],
    }
