"""A daemon in a child process, started and awaited one way for every test and benchmark.

:func:`start_daemon` runs ``python -m tierd serve`` (or the ``tierd`` console script, or
any command that runs a :class:`~tierd.daemon.Daemon`) with ``NOTIFY_SOCKET`` pointing at a
datagram socket of its own, and returns once the daemon sent ``READY=1`` there (sd_notify:
sent after its socket accepts, so the first hello is answered at once). Nothing polls:
the wait is one ``select`` on that socket and on a pidfd of the child, so a daemon that
exits before it is ready fails the start at once, with the end of its log in the error.
:class:`DaemonProcess` stops it by PID (SIGTERM, then SIGKILL after a bound), as a
context manager too, and starts it again from the same command (:meth:`restart`).
Every wait has an ``_async`` twin that runs it in a thread, for callers in an event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ParamSpec, TypeVar

import yaml

__all__ = [
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "DaemonNotReady",
    "DaemonProcess",
    "DaemonSpec",
    "serve_command",
    "start_daemon",
    "start_daemon_async",
]

START_TIMEOUT_S = 60.0  # a bound on the start, not a timed assertion: a loaded machine is slow
STOP_TIMEOUT_S = 60.0  # SIGTERM's grace: the daemon's drain and write-back, then SIGKILL
LOG_TAIL = 4000  # characters of the daemon's log quoted in an error

_P = ParamSpec("_P")
_R = TypeVar("_R")


class DaemonNotReady(RuntimeError):
    """The daemon exited, or sent no ``READY=1`` in time; the message ends with its log."""


def config_check(config: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """``tierd config check CONFIG`` run to its end (60 s at most): its status and output."""
    return subprocess.run(
        [sys.executable, "-m", "tierd", "config", "check", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def serve_command(
    config: str | os.PathLike[str] | None = None,
    *,
    sets: Sequence[str] = (),
    script: bool = False,
) -> list[str]:
    """``tierd serve -c CONFIG --set ...``: under this interpreter (``python -m tierd``),
    or the ``tierd`` console script installed beside it when ``script``."""
    if script:
        launcher = [str(Path(sys.executable).with_name("tierd"))]
    else:
        launcher = [sys.executable, "-m", "tierd"]
    command = [*launcher, "serve"]
    if config is not None:
        command += ["-c", str(config)]
    for item in sets:
        command += ["--set", item]
    return command


@dataclass(frozen=True, slots=True)
class DaemonSpec:
    """How to start a daemon: the command, its environment (``None``: this process's),
    where its output goes (``stdout``: a file object or ``subprocess`` constant, else the
    log too), its working directory, and its socket (for the caller, ``None`` if unknown)."""

    command: tuple[str, ...]
    env: Mapping[str, str] | None
    log: Path
    stdout: int | IO[Any] | None = None
    cwd: Path | None = None
    socket: str | None = None
    notify: bool = True


class DaemonProcess:
    """One started daemon: :attr:`pid`, :attr:`socket`, its log, waits and a stop."""

    def __init__(self, spec: DaemonSpec) -> None:
        self.spec = spec
        self.ready_s: float | None = None  # seconds from the spawn to READY=1
        self.notices: list[bytes] = []  # what it sent to the notify socket, READY=1 last
        self._notify: socket.socket | None = None
        env = dict(os.environ if spec.env is None else spec.env)
        if spec.notify:
            self._notify, env["NOTIFY_SOCKET"] = _notify_socket()
        self.started_at = time.monotonic()
        try:
            with spec.log.open("wb") as log:
                stdout = log if spec.stdout is None else spec.stdout
                self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                    list(spec.command),
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=log,
                    env=env,
                    cwd=spec.cwd,
                )
        except BaseException:
            self._close_notify()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> str | None:
        return self.spec.socket

    @property
    def returncode(self) -> int | None:
        """The exit status, ``None`` while it runs."""
        return self.proc.poll()

    def log_text(self) -> str:
        """Everything the daemon wrote to its log so far."""
        return self.spec.log.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to this PID, unless it has been reaped already."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``READY=1``; :class:`DaemonNotReady` (with the process killed) when it
        exits first or ``timeout_s`` passes."""
        if self._notify is None:
            raise DaemonNotReady("this daemon was started without a notify socket")
        pidfd = os.pidfd_open(self.proc.pid)
        try:
            deadline = time.monotonic() + timeout_s
            ready = _await_ready(self._notify, pidfd, deadline, self.notices)
        finally:
            os.close(pidfd)
        if ready:
            self.ready_s = time.monotonic() - self.started_at
            return
        if self.proc.poll() is None:
            self.kill()
            why = f"sent no READY=1 within {timeout_s:g} s (killed)"
        else:
            why = f"exited with status {self.wait()} before it was ready"
        raise DaemonNotReady(f"tierd ({' '.join(self.spec.command)}) {why}:\n{self._tail()}")

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """The exit status; :class:`subprocess.TimeoutExpired` past ``timeout_s``."""
        status = self.proc.wait(timeout_s)
        self._close_notify()
        return status

    def kill(self) -> int:
        """SIGKILL (if it still runs); the exit status."""
        self.signal(signal.SIGKILL)
        return self.wait()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def restart(self, **changes: Any) -> DaemonProcess:
        """Start the same command again (``changes``: fields of :class:`DaemonSpec` to
        replace, such as ``log``) and wait for it; this one must have exited."""
        if self.proc.poll() is None:
            raise RuntimeError(f"daemon {self.pid} still runs: stop it before a restart")
        return _start(dataclasses.replace(self.spec, **changes), START_TIMEOUT_S, True)

    async def wait_ready_async(self, timeout_s: float = START_TIMEOUT_S) -> None:
        await asyncio.to_thread(self.wait_ready, timeout_s)

    async def wait_async(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return await asyncio.to_thread(self.wait, timeout_s)

    async def stop_async(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return await asyncio.to_thread(self.stop, timeout_s)

    async def kill_async(self) -> int:
        return await asyncio.to_thread(self.kill)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> DaemonProcess:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop_async()

    def _tail(self) -> str:
        try:
            return self.log_text()[-LOG_TAIL:]
        except OSError as exc:
            return f"(no log: {exc})"

    def _close_notify(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None


def start_daemon(
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    sets: Sequence[str] = (),
    command: Sequence[str] | None = None,
    wrap: Sequence[str] = (),
    script: bool = False,
    env: Mapping[str, str] | None = None,
    log: str | os.PathLike[str] | None = None,
    stdout: int | IO[Any] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    socket_path: str | None = None,
    wait: bool = True,
    notify: bool = True,
    timeout_s: float = START_TIMEOUT_S,
) -> DaemonProcess:
    """Start ``tierd serve`` from ``config`` (a file, or a mapping written as YAML beside
    the log) with ``sets``, or ``command`` instead; under ``wrap`` (e.g. ``unshare``).
    With ``wait``, return once it is ready (:meth:`DaemonProcess.wait_ready`); without,
    at once (a start expected to fail, or one awaited later). ``notify=False`` leaves
    ``NOTIFY_SOCKET`` to ``env``. Output goes to ``log`` (default: a private file)."""
    log_path = Path(log) if log is not None else Path(_private_directory()) / "tierd.log"
    if isinstance(config, Mapping):
        config_file = log_path.with_name(f"{log_path.stem}.yaml")
        config_file.write_text(yaml.safe_dump(dict(config)))
        socket_path = socket_path or _socket_of(config)
        config = config_file
    elif socket_path is None and command is None:
        socket_path = _resolved_socket(config, sets, env)
    argv = list(command) if command is not None else serve_command(config, sets=sets, script=script)
    spec = DaemonSpec(
        command=(*wrap, *argv),
        env=env,
        log=log_path,
        stdout=stdout,
        cwd=Path(cwd) if cwd is not None else None,
        socket=socket_path,
        notify=notify,
    )
    return _start(spec, timeout_s, wait)


def _in_thread(function: Callable[_P, _R]) -> Callable[_P, Awaitable[_R]]:
    async def threaded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await asyncio.to_thread(function, *args, **kwargs)

    return threaded


start_daemon_async = _in_thread(start_daemon)
start_daemon_async.__doc__ = "start_daemon, waited for in a thread: for callers in an event loop."


def _start(spec: DaemonSpec, timeout_s: float, wait: bool) -> DaemonProcess:
    daemon = DaemonProcess(spec)
    if wait:
        daemon.wait_ready(timeout_s)
    return daemon


def _socket_of(config: Mapping[str, Any]) -> str | None:
    section = config.get("socket")
    path = section.get("path") if isinstance(section, Mapping) else None
    return str(path) if path is not None else None


def _resolved_socket(
    config: str | os.PathLike[str] | None, sets: Sequence[str], env: Mapping[str, str] | None
) -> str | None:
    """The socket ``tierd serve`` will bind for this file, ``sets`` and environment;
    ``None`` for a config it will refuse (the daemon says why, in its log)."""
    from tierd.errors import ConfigError
    from tierd.settings import CONFIG_ENV, load_settings
    from tierd.share import shipped

    environ = os.environ if env is None else env
    if config is None and not environ.get(CONFIG_ENV):
        config = shipped("tierd.yaml")  # what `tierd serve` runs with no -c
    try:
        cfg = load_settings(None if config is None else Path(config), sets=sets, environ=environ)
    except (ConfigError, OSError):
        return None
    return str(cfg.socket.path)


def _await_ready(notify: socket.socket, pidfd: int, deadline: float, seen: list[bytes]) -> bool:
    """Read ``notify`` into ``seen`` until a ``READY=1`` line (True), or until the child
    exits or the deadline passes (False). Start-up progress (``EXTEND_TIMEOUT_USEC``)
    comes before it."""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([notify.fileno(), pidfd], [], [], left)
        if notify.fileno() in readable:
            seen.append(notify.recv(4096))
            if b"READY=1" in seen[-1].split(b"\n"):
                return True
            continue  # read every message sent before the exit first
        if pidfd in readable:
            return False
    return False


def _notify_socket() -> tuple[socket.socket, str]:
    """A bound datagram socket in a private directory under /tmp (a short path: a Unix
    socket's is at most 107 bytes) and the ``NOTIFY_SOCKET`` value that names it."""
    path = str(Path(_private_directory()) / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    return sock, path


def _private_directory() -> str:
    """A fresh 0700 directory under /tmp, removed when this process exits."""
    directory = tempfile.mkdtemp(prefix="tierd-proc-", dir="/tmp")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory
