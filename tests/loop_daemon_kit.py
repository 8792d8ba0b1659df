"""A whole daemon in the test's own event loop (:func:`serve`, over
:func:`tierd.testing.running_daemon`) or in a thread of its own (:func:`serve_in_thread`),
and the clients and watched connections the tests of its API use."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

import tierd.control.serving.server as server_module
from tierd.client import Client
from tierd.daemon import Daemon
from tierd.testing import daemon_config, running_daemon

BLOCK = 4096
NS = "tenant-a"
T = TypeVar("T")


class _WatchedConnection(server_module.Connection):
    """The daemon's connection, plus an event set once the daemon has handled the close
    (leases released) and the requests that were still running at that moment."""

    def __init__(self, server: server_module.Server) -> None:
        super().__init__(server)
        self.gone = asyncio.Event()
        self.running_at_close: set[asyncio.Task[None]] = set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.running_at_close = set(self.session.tasks)
        super().connection_lost(exc)
        self.gone.set()


@pytest.fixture
def _watch_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection the daemon makes is a :class:`_WatchedConnection` (a module uses it
    with ``pytestmark = pytest.mark.usefixtures("_watch_connections")``)."""
    # The server builds each connection from the module's ``Connection`` when a client
    # connects, so replacing the name is enough.
    monkeypatch.setattr(server_module, "Connection", _WatchedConnection)


@asynccontextmanager
async def serve(
    tmp_path: Path, *, timeout_s: float = 60.0, watch_loop: bool = True, **options: Any
) -> AsyncIterator[Daemon]:
    """The in-loop daemon of every module that runs one: a daemon of
    ``daemon_config(tmp_path, **options)`` (logging at ``warning`` unless ``options`` say)
    run in this loop by :func:`tierd.testing.running_daemon`, under a ``timeout_s`` safety
    net. With ``watch_loop``, nothing may have reached the loop's exception handler
    meanwhile (an exception that escaped a protocol callback or a task: asyncio would only
    log it, and drop the connection)."""
    options.setdefault("logging", {"level": "warning"})
    loop = asyncio.get_running_loop()
    errors: list[str] = []
    previous = loop.get_exception_handler()
    if watch_loop:
        loop.set_exception_handler(
            lambda loop, context: errors.append(
                f"{context.get('message')}: {context.get('exception')!r}"
            )
        )
    try:
        async with (
            asyncio.timeout(timeout_s),
            running_daemon(daemon_config(tmp_path, **options)) as daemon,
        ):
            yield daemon
    finally:
        if watch_loop:
            loop.set_exception_handler(previous)
    assert not errors, errors


@dataclass
class ThreadDaemon:
    """A daemon serving in another thread's event loop (:func:`serve_in_thread`)."""

    config: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event

    @property
    def path(self) -> str:
        return str(self.config["socket"]["path"])

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` in the daemon's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)


@contextmanager
def serve_in_thread(
    config: dict[str, Any],
    *,
    start_s: float = 60.0,
    stop_s: float = 60.0,
    name: str = "tierd-test-daemon",
) -> Iterator[ThreadDaemon]:
    """The same daemon for a test that drives it from synchronous code (a command in this
    thread): :func:`tierd.testing.running_daemon` in a thread and event loop of its own,
    ready within ``start_s``, stopped on exit within ``stop_s``; an exception it raised is
    raised here."""
    started = threading.Event()
    outcome: dict[str, Any] = {}

    async def run() -> None:
        stop = asyncio.Event()
        async with running_daemon(config):
            outcome["daemon"] = ThreadDaemon(config, asyncio.get_running_loop(), stop)
            started.set()
            await stop.wait()

    def thread_main() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=thread_main, name=name, daemon=True)
    thread.start()
    assert started.wait(start_s), "the daemon did not start"
    if "error" in outcome:
        raise outcome["error"]
    daemon: ThreadDaemon = outcome["daemon"]
    try:
        yield daemon
    finally:
        daemon.loop.call_soon_threadsafe(daemon.stop.set)
        thread.join(stop_s)
        assert not thread.is_alive(), "the daemon did not stop"
        if "error" in outcome:
            raise outcome["error"]


def socket_of(daemon: Daemon) -> str:
    return str(daemon.config.socket.path)


async def connect(daemon: Daemon, namespace: str | None = NS, **options: Any) -> Client:
    return await Client.connect(socket_of(daemon), namespace=namespace, **options)


async def connect_watched(
    daemon: Daemon, namespace: str | None = NS, **options: Any
) -> tuple[Client, _WatchedConnection]:
    """A client and the daemon's side of its connection."""
    server = daemon.server
    assert server is not None
    before = set(server.connections)
    client = await connect(daemon, namespace, **options)
    (conn,) = server.connections - before
    assert isinstance(conn, _WatchedConnection)
    return client, conn


async def daemon_noticed_close(conn: _WatchedConnection) -> None:
    """Wait until the daemon handled the close and every request that was running then ended."""
    async with asyncio.timeout(30):
        await conn.gone.wait()
        if conn.running_at_close:
            await asyncio.wait(conn.running_at_close)


def chain_of(daemon: Daemon) -> Any:
    assert daemon.chain is not None
    return daemon.chain


async def assert_idle(daemon: Daemon, client: Client) -> None:
    """No pin, no reservation, no lease left; the chain's invariants hold."""
    stats = await client.stats()
    for tier in stats["tiers"]:
        assert (tier["name"], tier["pinned"], tier["writing"]) == (tier["name"], 0, 0)
    assert stats["server"]["leases"] == 0
    chain_of(daemon).check_invariants(idle=True)
