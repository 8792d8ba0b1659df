"""The processes of ``scripts/bench remote``: a redis-server on 127.0.0.1 without
persistence (:class:`RedisServer`, with its memory figures) and ``tierd serve`` daemons
(:class:`Daemon`, :func:`daemons`), each in a directory of its own, each waited on until it
answers (a daemon: its READY=1) and stopped by its PID (SIGTERM, then SIGKILL past a
deadline). Parts (a), (b) and (c) all run on these."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from tierd.testing import start_daemon

START_DEADLINE_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], deadline: float = 60.0) -> int:
    """SIGTERM by PID, wait; SIGKILL only past the deadline."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(deadline)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(deadline)
    return proc.returncode


class RedisServer:
    """redis-server on 127.0.0.1, no persistence, in a directory of its own."""

    def __init__(self, workdir: Path, maxmemory: str, policy: str = "allkeys-lru") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (scripts/setup installs it)")
        self.port = _free_port()
        self.maxmemory, self.policy = maxmemory, policy
        workdir.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            policy,
            "--dir",
            str(workdir),
            "--logfile",
            str(workdir / "redis.log"),
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.sync = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sync.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)  # start-up: nothing to wait on but the port
        self.version = str(self.sync.info("server")["redis_version"])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def memory(self) -> dict[str, Any]:
        info = self.sync.info()
        return {
            "keys": int(self.sync.dbsize()),
            "used_memory": int(info["used_memory"]),
            "evicted_keys": int(info["evicted_keys"]),
        }

    def stop(self) -> None:
        self.sync.close()
        _stop(self.proc)


class Daemon:
    """``tierd serve`` from a config mapping, in a directory of its own under /tmp
    (:func:`tierd.testing.start_daemon`; :meth:`ready` waits for its READY=1)."""

    def __init__(self, config: dict[str, Any], home: Path) -> None:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.socket = str(home / "tierd.sock")
        self.config = {
            **config,
            "socket": {"path": self.socket},
            "logging": {"level": "warning"},
        }
        self.log = home / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
        self.process = start_daemon(self.config, env=env, log=self.log, wait=False)

    async def ready(self) -> None:
        await self.process.wait_ready_async(START_DEADLINE_S)

    def stop(self) -> int:
        return self.process.stop()


@contextlib.contextmanager
def daemons(configs: Sequence[dict[str, Any]], base: Path) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    try:
        for index, config in enumerate(configs):
            started.append(Daemon(config, Path(tempfile.mkdtemp(prefix=f"d{index}-", dir=base))))
        yield started
    finally:
        for daemon in started:
            daemon.stop()
