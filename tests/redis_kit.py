"""Real redis-server processes for the tests: one node or a cluster, on loopback ports,
each stopped (or paused, or killed) by the PID this kit started.

``scripts/setup`` installs redis-server from the system packages when it is missing; where
it cannot (no root, no apt), :func:`require_redis` skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from port_kit import free_port_pairs, running

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def require_redis() -> str:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server is not installed (scripts/setup installs it with apt as root)")
    return REDIS_SERVER


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node, one whose bus port (+10000) is free too
    (redis refuses a cluster port above 55535)."""
    if not cluster:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    return free_port_pairs(1, offset=10000, below=55535)[0]


class RedisServer:
    """One redis-server on 127.0.0.1:``port``, no persistence, in ``workdir``."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None) -> None:
        self.binary = require_redis()
        self.workdir = workdir
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / f"redis-{self.port}.log"),
            *self.args,
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if self.cli("PING", check=False).strip() == "PONG":
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in 10 s")

    def cli(self, *args: str, check: bool = True) -> str:
        assert REDIS_CLI is not None
        done = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            timeout=10,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"redis-cli {args}: {done.stderr.decode()}")
        return done.stdout.decode()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, by the PID this kit started."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


@contextmanager
def redis_server(workdir: Path, *args: str) -> Iterator[RedisServer]:
    with running(RedisServer(workdir, *args)) as server:
        yield server


@contextmanager
def redis_cluster(workdir: Path, nodes: int = 3) -> Iterator[Sequence[RedisServer]]:
    """``nodes`` masters, no replicas, every slot covered; stopped on exit."""
    servers: list[RedisServer] = []
    try:
        for index in range(nodes):
            port = free_port(cluster=True)
            servers.append(
                RedisServer(
                    workdir / f"node{index}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "2000",
                    port=port,
                ).start()
            )
        servers[0].cli("--cluster", "create", *(s.node for s in servers), "--cluster-yes")
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in servers):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok in 20 s")
            time.sleep(0.1)
        yield servers
    finally:
        for server in servers:
            server.stop()
