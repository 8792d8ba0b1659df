"""One run of the daemon, from config to exit status: :class:`Daemon`, :func:`run_daemon`.

Start-up, in order: configure logging; check the tiers' sizes against the machine
(:mod:`tierd.preflight`: nothing is allocated for a config that cannot fit); claim the
socket path (so a second daemon fails with "already running" before it touches the pool or
the disk tier) and write the pid file beside it (``<socket>.pid``, or ``socket.pid_file``);
create the disk tiers' missing directories; open each tenant's chain
(:mod:`tierd.daemon.tenant_chains`; a disk tier reloads its index or rebuilds it); start the
metrics endpoint (:mod:`tierd.daemon.metrics_http`) and serving; tell systemd
``READY=1`` (:mod:`tierd.daemon.service`). A start that fails removes what it created
(the socket, the pid file, the directories) and raises, for its caller to report: ``tierd
serve`` prints the reason once, as ``tierd: error: ...``, with no log line beside it.

The ``reload`` operation (``tierd reload``, systemd's ``ExecReload``) reads the config
again and applies what can change live (:mod:`tierd.daemon.reload`); SIGHUP is not a
reload: it stops the daemon, as a closed terminal should.

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
import gc
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import structlog

from tierd.chain import FlushResult, TierChain
from tierd.config import DaemonConfig, default_socket_path
from tierd.config.daemon import TraceConfig
from tierd.control.figures.recorder import RecorderSettings, TraceRecorder
from tierd.control.serving.server import Server, bind_unix_socket
from tierd.control.socketfile import check_directory, prepare_socket_directory
from tierd.control.state.context import Limits, ServerContext
from tierd.control.state.tenant_table import TenantTable
from tierd.daemon.kv_events import open_kv_events
from tierd.daemon.metrics_http import start_metrics_http
from tierd.daemon.reload import ReloadPlan, plan_reload
from tierd.daemon.service import (
    configure_logging,
    remove_pid_file,
    sd_notify,
    start_progress,
    write_pid_file,
)
from tierd.daemon.tenant_chains import apply_tenant_rules, open_tenants
from tierd.errors import ConfigError
from tierd.preflight import check_machine, directories_to_create, private_directory_problem
from tierd.settings import effective_config_dict

__all__ = ["EXIT_FORCED", "Daemon", "run_daemon"]

log = structlog.get_logger("tierd")

EXIT_FORCED = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _claim_socket(path: str, mode: int) -> socket.socket:
    """Bind the socket, in a directory nobody else controls (the per-user default one is
    created when missing)."""
    directory = os.path.dirname(os.path.abspath(path))
    own = Path(directory) == default_socket_path().parent
    prepare_socket_directory(directory, create=own, socket_mode=mode)
    return bind_unix_socket(path, mode)


class Daemon:
    """One run of the service. ``run()`` returns the exit status."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        handle_signals: bool = True,
        load: Callable[[], DaemonConfig] | None = None,
    ) -> None:
        self.config = config
        self.handle_signals = handle_signals
        self._load = load  # reads the config again (the ``reload`` operation); None: refused
        self.ready = asyncio.Event()  # set once clients can connect
        self.server: Server | None = None
        self.chains: dict[str, TierChain] = {}  # by tenant, once open
        self._stop = asyncio.Event()
        self._forced = False
        self._shutdown: asyncio.Task[None] | None = None
        self._signals = 0
        self._reloading = asyncio.Lock()  # one reload at a time

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
        # A start that fails raises, unlogged: its caller reports it once (``tierd serve``
        # as ``tierd: error: ...``); a log line as well said it twice on the same stderr.
        try:
            return await self._run()
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
            check_directory(str(pid_file.absolute().parent), "pid file")
            write_pid_file(pid_file)
            own = {d.absolute() for tier in cfg.tiers for d in tier.directories}
            for directory in directories_to_create(cfg):
                # A tier's own directory holds its tenants' data: 0700. Parents (such as
                # ~/.local/state) get the usual mode.
                directory.mkdir(mode=0o700 if directory in own else 0o777)
                created.append(directory)
            async with AsyncExitStack() as stack:
                table = await open_tenants(cfg, stack, self.chains, start_progress())
                created = []  # the chains opened: their directories are the daemon's now
                context = self._context(table)
                context.kv_feed = await open_kv_events(cfg, table, stack)
                self.server = server = Server(context)
                server.adopt(sock, path)
                return await self._serve(server)
        finally:
            if server is not None:
                await server.close()
                if server.ctx.recorder is not None:
                    server.ctx.recorder.close()  # the buffered lines reach the file
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
            metrics = await start_metrics_http(self.config.metrics, server.ctx, server.connections)
            await server.start()
            log.info("ready", socket=str(self.config.socket.path), pid=os.getpid())
            # Every object made so far (modules, config, tiers) lives as long as the
            # daemon, and a full collection, which churn (a flood of connections) triggers,
            # would walk them all on the loop each time. Frozen, they are never walked
            # again (until the stop: a daemon run in a test's process gives them back).
            gc.freeze()
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
            gc.unfreeze()
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
                if done.not_landed:
                    log.warning(
                        "blocks sent to the remote level did not land at shutdown",
                        sent=done.remote_sent,
                        not_landed=done.not_landed,
                        reason=done.remote_reason,
                    )
            except TimeoutError:
                log.warning("grace period over before every dirty block was written down")

    async def reload(self) -> dict[str, Any]:
        """The ``reload`` operation: read the config again and apply what can change live
        (:mod:`tierd.daemon.reload`); :class:`ConfigError`, and nothing changed, when the
        new config is invalid. The file is read, parsed and checked in a worker thread,
        never on the loop; one reload runs at a time (a second waits for the first)."""
        load = self._load
        if load is None or self.server is None:
            raise ConfigError("this daemon was not started from a config it can read again")
        async with self._reloading:
            running = self.config
            plan = await asyncio.to_thread(lambda: plan_reload(running, load()))
            return self._apply(plan)

    def _apply(self, plan: ReloadPlan) -> dict[str, Any]:
        """Put a checked plan in place, on the loop (nothing in it can fail)."""
        if self.server is None:
            raise ConfigError("the daemon stopped serving while its config was read")
        cfg, ctx = plan.config, self.server.ctx
        # From here on nothing can fail: every value was checked by plan_reload.
        if any(path.startswith("logging.") for path in plan.applied):
            configure_logging(cfg.logging)
            ctx.timing.refresh_log_level()  # the per-request lines check a cached flag
        ctx.limits = _limits(cfg)
        ctx.check_namespace = cfg.namespaces.check
        ctx.namespaces_top = cfg.metrics.namespaces_top
        for tenant in ctx.tenants.every():  # at every block size
            tenant.chain.set_admissions(plan.admissions, plan.remote_admission)
            for level, tier in zip(tenant.chain.levels, cfg.tiers, strict=True):
                level.write_through = tier.write_through
                level.write_behind = tier.write_behind
        apply_tenant_rules(cfg, ctx.tenants)
        ctx.config = effective_config_dict(cfg)
        self.config = cfg
        log.info("reloaded", applied=list(plan.applied), restart_needed=list(plan.restart))
        return plan.reply()

    # -- wiring -----------------------------------------------------------------------

    def _context(self, table: TenantTable) -> ServerContext:
        cfg = self.config
        return ServerContext(
            tenants=table,
            limits=_limits(cfg),
            config=effective_config_dict(cfg),
            check_namespace=cfg.namespaces.check,
            request_stop=self.stop_once,
            reload=self.reload if self._load is not None else None,
            namespaces_top=cfg.metrics.namespaces_top,
            recorder=_recorder(cfg.trace),
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


def _limits(cfg: DaemonConfig) -> Limits:
    return Limits(
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
        region_jobs_per_tenant=cfg.limits.region_jobs_per_tenant,
    )


def _recorder(cfg: TraceConfig) -> TraceRecorder | None:
    """The trace recorder of the ``trace:`` section; None when it names no directory."""
    if cfg.directory is None:
        return None
    settings = RecorderSettings(cfg.directory, cfg.sample, cfg.max_bytes, cfg.keep)
    return TraceRecorder(settings, enabled=cfg.enabled, check_directory=private_directory_problem)


def _remove_created(created: list[Path]) -> None:
    """Remove the directories a failed start created (parents first in ``created``), with
    what it put in them (a slab, say): they did not exist a moment ago."""
    for directory in created:
        if directory.parent not in created:
            shutil.rmtree(directory, ignore_errors=True)


def run_daemon(config: DaemonConfig, load: Callable[[], DaemonConfig] | None = None) -> int:
    """Run the daemon under uvloop until it stops; returns the exit status; ``load`` reads
    the config again, for the ``reload`` operation (None: refused). A stop signal
    that comes during start-up, before the daemon's own handlers are in place, raises
    KeyboardInterrupt as Ctrl-C does, so the start unwinds and removes what it created."""
    import uvloop

    configure_logging(config.logging)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    return uvloop.run(Daemon(config, load=load).run())
