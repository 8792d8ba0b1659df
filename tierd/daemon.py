"""The composition root: ``tierd serve``'s process, from config to exit status.

Start-up, in order: configure logging; check the tiers' sizes against the machine
(:mod:`tierd.preflight`: nothing is allocated for a config that cannot fit); claim the
socket path (so a second daemon fails with "already running" before it touches the pool or
the disk tier) and write the pid file beside it (``<socket>.pid``, or ``socket.pid_file``);
remove shared-memory pools left by crashed daemons; create the disk tiers' missing
directories; open the chain (a disk tier reloads its index or rebuilds it); start serving;
tell systemd ``READY=1``. A start that fails logs ``start failed`` with the reason and
removes what it created: the socket, the pid file, the pool, the directories.

Shutdown on SIGTERM, SIGINT, SIGHUP (a closed terminal) or the ``stop`` operation (``tierd
stop``): ``STOPPING=1``; stop accepting and refuse new work; wait
for running requests up to ``shutdown.grace`` seconds (then cancel them: their pins and
slots are released); write dirty blocks down per ``shutdown.write_back`` within what is
left of the grace; close every connection; close the stores in reverse order (the disk
tier persists its index); remove the socket file and the pid file. Exit status 0. A
second signal skips what is left of the draining and the write-back and exits with
status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from tierd.chain import TierChain
from tierd.config import DaemonConfig, LoggingConfig, default_socket_path
from tierd.control.context import Limits, PoolInfo, ServerContext
from tierd.control.server import Server, bind_unix_socket
from tierd.control.socketfile import prepare_socket_directory
from tierd.library import open_chain
from tierd.preflight import check_machine, directories_to_create
from tierd.settings import effective_config_dict
from tierd.stores.cpu import CpuStore

__all__ = [
    "Daemon",
    "configure_logging",
    "reap_stale_pools",
    "remove_pid_file",
    "run_daemon",
    "sd_notify",
    "write_pid_file",
]

log = structlog.get_logger("tierd")

EXIT_FORCED = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POOL_NAME = re.compile(r"^tierd-(\d+)-[0-9a-f]+$")


def sd_notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``) to systemd's notify socket, if the
    service runs under one (``NOTIFY_SOCKET``); returns whether it was sent."""
    target = (os.environ if environ is None else environ).get("NOTIFY_SOCKET")
    if not target:
        return False
    address = "\0" + target[1:] if target.startswith("@") else target
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError as exc:
            log.warning("cannot notify systemd", socket=target, error=exc.strerror)
            return False
    return True


def configure_logging(cfg: LoggingConfig, stream: Any = None) -> None:
    """structlog to stderr: JSON under a service manager (or ``format: json``), key-value
    on a terminal."""
    stream = sys.stderr if stream is None else stream
    as_json = cfg.format == "json" or (cfg.format == "auto" and not stream.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(stream),
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        cache_logger_on_first_use=False,
    )


def _claim_socket(path: str, mode: int) -> socket.socket:
    """Bind the socket, in a directory nobody else controls (the per-user default one is
    created when missing)."""
    directory = os.path.dirname(os.path.abspath(path))
    own = Path(directory) == default_socket_path().parent
    prepare_socket_directory(directory, create=own, socket_mode=mode)
    return bind_unix_socket(path, mode)


def reap_stale_pools(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove pool files (``tierd-<pid>-<hex>``) whose daemon is gone: a SIGKILLed daemon
    cannot unlink its pool, and every restart would otherwise leak one. Returns them."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_dir):
            match = _POOL_NAME.match(name)
            if match is None or _alive(int(match.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    if removed:
        log.warning("removed shared-memory pools of dead daemons", pools=removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Daemon:
    """One run of the service. ``run()`` returns the exit status."""

    def __init__(self, config: DaemonConfig, *, handle_signals: bool = True) -> None:
        self.config = config
        self.handle_signals = handle_signals
        self.ready = asyncio.Event()  # set once clients can connect
        self.server: Server | None = None
        self.chain: TierChain | None = None
        self._stop = asyncio.Event()
        self._forced = False
        self._shutdown: asyncio.Task[None] | None = None
        self._signals = 0

    def stop_once(self) -> None:
        """What the ``stop`` operation does: start a graceful stop, never force one."""
        if self._signals == 0:
            self.request_stop()

    def request_stop(self) -> None:
        """What SIGTERM does: the first call drains and stops, a second forces."""
        self._signals += 1
        if self._signals == 1:
            log.info("stopping: draining requests", grace_s=self.config.shutdown.grace)
            self._stop.set()
        else:
            log.warning("second signal: exiting without draining or writing back")
            self._forced = True
            if self._shutdown is not None:
                self._shutdown.cancel()

    async def run(self) -> int:
        try:
            return await self._run()
        except BaseException as exc:
            if not self.ready.is_set():
                log.error("start failed", reason=str(exc) or type(exc).__name__)
            raise
        finally:
            if self.ready.is_set():
                log.info("stopped", forced=self._forced)

    async def _run(self) -> int:
        cfg = self.config
        path = str(cfg.socket.path)
        check_machine(cfg)
        # Claim the socket first: a second daemon must fail before it opens the pool or
        # the disk tier that the first one is using.
        sock = _claim_socket(path, cfg.socket.mode)
        server: Server | None = None
        pid_file = cfg.socket.pid_file or Path(f"{path}.pid")
        created: list[Path] = []
        try:
            write_pid_file(pid_file)
            reap_stale_pools()
            own = {d.absolute() for tier in cfg.tiers for d in tier.directories}
            for directory in directories_to_create(cfg):
                # A tier's own directory holds its tenants' data: 0700. Parents (such as
                # ~/.local/state) get the usual mode.
                directory.mkdir(mode=0o700 if directory in own else 0o777)
                created.append(directory)
            async with open_chain(cfg, pool_mode=cfg.socket.mode) as chain:
                created = []  # the chain opened: its directories are the daemon's now
                self.chain = chain
                self.server = server = Server(self._context(chain))
                server.adopt(sock, path)
                return await self._serve(server)
        finally:
            if server is not None:
                await server.close()
            else:
                sock.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            _remove_created(created)
            remove_pid_file(pid_file)

    async def _serve(self, server: Server) -> int:
        # Signal handlers and the metrics endpoint come before the first client is
        # accepted: whoever got a hello answered can scrape, and SIGTERM is graceful.
        restore = self._install_signals()
        metrics: asyncio.Server | None = None
        try:
            metrics = await self._start_metrics_http(server.ctx)
            await server.start()
            log.info("ready", socket=str(self.config.socket.path), pid=os.getpid())
            self.ready.set()
            sd_notify("READY=1")
            await self._stop.wait()
            sd_notify("STOPPING=1")
            if not self._forced:  # both signals may have come in before this turn
                self._shutdown = asyncio.create_task(self._drain(server))
                try:
                    await self._shutdown
                except asyncio.CancelledError:
                    # The second signal cancels the drain; a cancellation of this task
                    # itself must go on.
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
            if self._forced:
                await server.drain(0)
        finally:
            if metrics is not None:
                metrics.close()
            restore()
        return EXIT_FORCED if self._forced else 0

    async def _drain(self, server: Server) -> None:
        """Stop taking work, finish what runs, and write back within the grace period."""
        deadline = time.monotonic() + self.config.shutdown.grace
        server.stop_accepting()
        finished = await server.drain(self.config.shutdown.grace)
        if not finished:
            log.warning("grace period over: cancelled the requests still running")
        if self.config.shutdown.write_back == "flush" and self.chain is not None:
            left = max(0.0, deadline - time.monotonic())
            try:
                async with asyncio.timeout(left):
                    done = await self.chain.flush()
                if done.dirty:
                    log.warning(
                        "blocks stayed dirty at shutdown",
                        copied=done.copied,
                        dirty=done.left_dirty,
                        reason=done.reason,
                    )
                else:
                    log.info("wrote dirty blocks down", blocks=done.copied)
            except TimeoutError:
                log.warning("grace period over before every dirty block was written down")

    # -- wiring -----------------------------------------------------------------------

    def _context(self, chain: TierChain) -> ServerContext:
        cfg = self.config
        entry = chain.levels[chain.entry].store
        pool = None
        if isinstance(entry, CpuStore):
            pool = PoolInfo(entry.path, entry.size, entry.stride, entry.num_blocks)
        limits = Limits(
            max_frame_bytes=cfg.limits.max_frame_bytes,
            max_keys_per_request=cfg.limits.max_keys_per_request,
            max_connections=cfg.limits.max_connections,
            max_requests_in_flight=cfg.limits.max_requests_in_flight,
            event_queue_batches=cfg.events.queue_batches,
            hello_timeout_s=cfg.limits.hello_timeout_s,
            frame_deadline_s=cfg.limits.frame_deadline_s,
            partial_frame_bytes=cfg.limits.partial_frame_bytes,
            output_buffer_bytes=cfg.limits.output_buffer_bytes,
            output_stall_s=cfg.limits.output_stall_s,
        )
        return ServerContext(
            chain=chain,
            limits=limits,
            pool=pool,
            config=effective_config_dict(cfg),
            check_namespace=cfg.namespaces.check,
            request_stop=self.stop_once,
            allow_uids=frozenset(cfg.socket.allow_uids),
            allow_gids=frozenset(cfg.socket.allow_gids),
        )

    def _install_signals(self) -> Callable[[], None]:
        if not self.handle_signals:
            return lambda: None
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.request_stop)

        def restore() -> None:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)

        return restore

    async def _start_metrics_http(self, ctx: ServerContext) -> asyncio.Server | None:
        port = self.config.metrics.http_port
        if port is None:
            return None
        host = self.config.metrics.http_host

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
                status, body = (
                    ("200 OK", ctx.metrics().encode())
                    if path == b"/metrics"
                    else ("404 Not Found", b"try /metrics\n")
                )
                writer.write(
                    f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass
            except OSError:
                pass  # the scraper went away
            finally:
                writer.close()

        server = await asyncio.start_server(answer, host, port)
        log.info("metrics over HTTP", url=f"http://{host}:{port}/metrics")
        return server


def _remove_created(created: list[Path]) -> None:
    """Remove the directories a failed start created (parents first in ``created``), with
    what it put in them (a slab, say): they did not exist a moment ago."""
    for directory in created:
        if directory.parent not in created:
            shutil.rmtree(directory, ignore_errors=True)


def write_pid_file(path: Path) -> None:
    """Write this process's pid to ``path`` (atomically, replacing a stale one: the caller
    holds the socket, so no live daemon owns it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(f"{os.getpid()}\n")
    os.replace(temporary, path)


def remove_pid_file(path: Path) -> None:
    """Remove ``path`` if it still names this process."""
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except (OSError, ValueError):
        pass  # gone already, or another daemon's now


def run_daemon(config: DaemonConfig) -> int:
    """Run the daemon under uvloop until it stops; returns the exit status. A stop signal
    that comes during start-up, before the daemon's own handlers are in place, raises
    KeyboardInterrupt as Ctrl-C does, so the start unwinds and removes what it created."""
    import uvloop

    configure_logging(config.logging)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    return uvloop.run(Daemon(config).run())
