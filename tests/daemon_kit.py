"""Daemons as child processes for tests: the ``spawn`` fixture (over
:func:`tierd.testing.start_daemon`), :class:`DaemonProcess` with this suite's async waits,
the shipped config served as the README serves it (:func:`serve_shipped`), and the helpers
the daemon tests share (blocks, keys, a child's environment, HTTP GETs)."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierd.client import Client
from tierd.testing import DaemonProcess as ChildDaemon
from tierd.testing import start_daemon

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "tierd.yaml"  # the shipped config
NAMESPACE = "lifecycle"
BLOCK = 4096
DEADLINE_S = 30.0  # safety net for anything a test waits on
EXIT_DEADLINE_S = 60.0  # a daemon's exit: its grace period plus room for a loaded machine


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would configure the daemon."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("TIERD_") and k != "NOTIFY_SOCKET"
    }
    return {**env, **extra}


def block(key: bytes) -> bytes:
    """The deterministic content stored under ``key``."""
    return random.Random(key).randbytes(BLOCK)


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


def exists(path: str | os.PathLike[str]) -> bool:
    return os.path.exists(path)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    return proc.pid


def memfd_pools(pid: int) -> set[str]:
    """The memfd pools process ``pid`` maps (none once it is gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {
        line.split("/memfd:", 1)[1].split(" ")[0]
        for line in maps.splitlines()
        if "/memfd:tierd" in line
    }


class DaemonProcess:
    """A daemon started by the ``spawn`` fixture (:func:`tierd.testing.start_daemon`), with
    this suite's async waits and a client of :data:`NAMESPACE`."""

    def __init__(self, process: ChildDaemon, config: dict[str, Any]) -> None:
        self.process = process
        self.proc = process.proc
        self.config = config

    @property
    def socket_path(self) -> str:
        return str(self.config["socket"]["path"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr(self) -> str:
        return self.process.log_text()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.signal(sig)

    async def wait(self) -> int:
        """The exit status (a safety-net deadline, not a timed assertion)."""
        return await self.process.wait_async(EXIT_DEADLINE_S)

    async def stop(self) -> int:
        """SIGTERM; the exit status (SIGKILL past the safety net)."""
        return await self.process.stop_async(EXIT_DEADLINE_S)

    async def connect(self) -> Client:
        return await Client.connect(self.socket_path, namespace=NAMESPACE, block_bytes=BLOCK)

    async def wait_ready(self) -> None:
        """Until the daemon's READY=1; fails at once, with its log, if it exits first."""
        await self.process.wait_ready_async(DEADLINE_S)


Spawn = Callable[..., Awaitable[DaemonProcess]]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """``await spawn(config, env=..., ready=True, wrap=None)`` starts a daemon from
    ``config`` (a mapping written as YAML; ``None``: ``tierd serve`` with no file, its
    socket from ``env``; ``wrap``: a command to run it under, such as ``unshare``); an
    ``env`` with its own ``NOTIFY_SOCKET`` keeps it. At the end every daemon still
    running is killed."""
    started: list[DaemonProcess] = []
    numbers = itertools.count()

    async def start(
        config: dict[str, Any] | None,
        *,
        env: dict[str, str] | None = None,
        ready: bool = True,
        wrap: list[str] | None = None,
    ) -> DaemonProcess:
        env = child_env() if env is None else env
        process = start_daemon(
            config,
            wrap=wrap or (),
            env=env,
            log=tmp_path / f"tierd-{next(numbers)}.stderr",
            notify="NOTIFY_SOCKET" not in env,
            wait=False,
        )
        known = config if config is not None else {"socket": {"path": process.socket}}
        daemon = DaemonProcess(process, known)
        started.append(daemon)
        if ready:
            await daemon.wait_ready()
        return daemon

    yield start
    for daemon in started:
        daemon.process.kill()
        shutil.rmtree(os.path.dirname(daemon.socket_path), ignore_errors=True)


async def store_all(client: Client, names: list[bytes], batch: int) -> None:
    """Store ``names`` in batches that fit the CPU tier."""
    for i in range(0, len(names), batch):
        part = names[i : i + batch]
        assert await client.store(part, [block(k) for k in part]) == len(part)


async def medium_of(client: Client, key: bytes) -> str | None:
    found = await client.lookup([key])
    return found.media[0] if found.count else None


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=DEADLINE_S) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def raw_get(port: int, path: str, host: str) -> tuple[str, bytes]:
    """The status line and body of ``GET path`` sent with the given ``Host`` header."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


def serve_shipped(sets: list[str], tmp: Path) -> ChildDaemon:
    """`tierd serve -c config/tierd.yaml --set ...` in a child process, ready once it said
    so (READY=1) to a notify socket; its output in ``tmp``."""
    return start_daemon(DEFAULT_CONFIG, sets=sets, log=tmp / "serve.log", cwd=tmp)
