"""The composition root: ``tierd serve``'s process, from config to exit status.

Start-up, in order: configure logging; check the tiers' sizes against the machine
(:mod:`tierd.preflight`: nothing is allocated for a config that cannot fit); claim the
socket path (so a second daemon fails with "already running" before it touches the pool or
the disk tier) and write the pid file beside it (``<socket>.pid``, or ``socket.pid_file``);
create the disk tiers' missing directories; open each tenant's chain (a disk tier reloads
its index or rebuilds it); start serving;
tell systemd ``READY=1``. A start that fails logs ``start failed`` with the reason and
removes what it created: the socket, the pid file, the directories.

Tenants (:mod:`tierd.tenancy`): one chain is opened per tenant, each with its quota of
every tier, its own memfd pool (handed to its clients as a descriptor: nothing of it is
in /dev/shm, so there is nothing to reap after a crash and nothing another daemon, in
another PID namespace or not, could remove) and its own disk slab under
``<directory>/<tenant>``. Without a ``tenants:`` section there is one tenant,
``default``, with whole tiers and the disk directories themselves.

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
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import structlog

from tierd.chain import FlushResult, TierChain
from tierd.config import DaemonConfig, LoggingConfig, default_socket_path
from tierd.control.context import Limits, ServerContext
from tierd.control.server import Server, bind_unix_socket
from tierd.control.socketfile import prepare_socket_directory
from tierd.control.tenants import Grant, PoolInfo, Tenant, TenantTable
from tierd.errors import TierdError
from tierd.library import open_chain
from tierd.preflight import check_machine, directories_to_create
from tierd.settings import effective_config_dict
from tierd.stores.cpu import CpuStore
from tierd.stores.disk_slab import SLAB_FILE
from tierd.units import share_parts

__all__ = [
    "Daemon",
    "configure_logging",
    "remove_pid_file",
    "run_daemon",
    "sd_notify",
    "write_pid_file",
]

log = structlog.get_logger("tierd")

EXIT_FORCED = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


class Daemon:
    """One run of the service. ``run()`` returns the exit status."""

    def __init__(self, config: DaemonConfig, *, handle_signals: bool = True) -> None:
        self.config = config
        self.handle_signals = handle_signals
        self.ready = asyncio.Event()  # set once clients can connect
        self.server: Server | None = None
        self.chains: dict[str, TierChain] = {}  # by tenant, once open
        self._stop = asyncio.Event()
        self._forced = False
        self._shutdown: asyncio.Task[None] | None = None
        self._signals = 0

    @property
    def chain(self) -> TierChain | None:
        """The first tenant's chain: the only one without a ``tenants:`` section."""
        return next(iter(self.chains.values()), None)

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
            own = {d.absolute() for tier in cfg.tiers for d in tier.directories}
            for directory in directories_to_create(cfg):
                # A tier's own directory holds its tenants' data: 0700. Parents (such as
                # ~/.local/state) get the usual mode.
                directory.mkdir(mode=0o700 if directory in own else 0o777)
                created.append(directory)
            async with AsyncExitStack() as stack:
                table = await self._open_tenants(stack)
                created = []  # the chains opened: their directories are the daemon's now
                self.server = server = Server(self._context(table))
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
        if self.config.shutdown.write_back == "flush" and self.chains:
            left = max(0.0, deadline - time.monotonic())
            try:
                async with asyncio.timeout(left):
                    done = FlushResult(0)
                    for chain in self.chains.values():
                        done = done.plus(await chain.flush())
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

    async def _open_tenants(self, stack: AsyncExitStack) -> TenantTable:
        """Open one chain per tenant (see :mod:`tierd.tenancy`) and say who is which."""
        cfg = self.config
        table = TenantTable()
        _warn_of_untenanted_slabs(cfg)
        for spec, chain_cfg in cfg.tenant_chains():
            try:
                chain = await stack.enter_async_context(open_chain(chain_cfg))
            except TierdError as exc:
                if cfg.tenants:  # name the tenant: each has tiers of the same names
                    exc.args = (f"tenant {spec.name!r}: {exc}", *exc.args[1:])
                raise
            self.chains[spec.name] = chain
            entry = chain.levels[chain.entry].store
            pool = None
            if isinstance(entry, CpuStore) and entry.fd is not None:
                pool = PoolInfo(entry.fd, entry.name, entry.size, entry.stride, entry.num_blocks)
            blocks = entry.num_blocks
            table.tenants.append(
                Tenant(
                    spec.name,
                    chain,
                    pool,
                    namespaces=tuple(spec.namespaces),
                    max_held=_lease_bound(cfg.limits.lease_blocks_per_tenant, blocks),
                    max_held_per_connection=_lease_bound(
                        cfg.limits.lease_blocks_per_connection, blocks
                    ),
                )
            )
        table.grants = _grants(cfg, table)
        if cfg.tenants:
            log.info(
                "tenants",
                tenants={
                    t.name: [lv.tier.num_blocks for lv in t.chain.levels] for t in table.tenants
                },
            )
        return table

    def _context(self, table: TenantTable) -> ServerContext:
        cfg = self.config
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
            store_lease_ttl_s=cfg.limits.store_lease_ttl_s,
            load_wait_s=cfg.limits.load_wait_s,
        )
        return ServerContext(
            tenants=table,
            limits=limits,
            config=effective_config_dict(cfg),
            check_namespace=cfg.namespaces.check,
            request_stop=self.stop_once,
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


def _warn_of_untenanted_slabs(cfg: DaemonConfig) -> None:
    """With tenants, each tenant's slab is in ``<directory>/<tenant>/``: a slab left in a
    directory itself by a daemon without tenants serves nobody, and still takes its space."""
    if not cfg.tenants:
        return
    for tier in cfg.tiers:
        for directory in tier.directories:
            left = directory / SLAB_FILE
            if left.exists():
                log.warning(
                    "a slab of a daemon without tenants is left here: no tenant is served"
                    " its blocks; remove it to free its space",
                    tier=tier.name,
                    path=str(left),
                    bytes=left.stat().st_size,
                )


def _grants(cfg: DaemonConfig, table: TenantTable) -> list[Grant]:
    """Who is which tenant. Without ``tenants:``, the daemon's own user is the default
    tenant's operator and ``socket.allow_uids``/``allow_gids`` are its members; with it,
    the daemon's own user, when no tenant lists it, may run operator commands only."""
    me = os.getuid()
    if not cfg.tenants:
        tenant = table.tenants[0]
        return [
            Grant(tenant, True, frozenset({me})),
            Grant(
                tenant, False, frozenset(cfg.socket.allow_uids), frozenset(cfg.socket.allow_gids)
            ),
        ]
    grants = [
        Grant(tenant, spec.operator, frozenset(spec.uids), frozenset(spec.gids))
        for tenant, spec in zip(table.tenants, cfg.tenants, strict=True)
    ]
    if not any(me in spec.uids for spec in cfg.tenants):
        grants.append(Grant(None, True, frozenset({me})))
    return grants


def _lease_bound(value: int | str, entry_blocks: int) -> int:
    """A lease bound in blocks: a count, or a share of the tenant's entry tier."""
    amount, is_share = share_parts(value)
    return max(1, int(amount * entry_blocks)) if is_share else int(amount)


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
