"""A daemon connection on a thread and event loop of its own, for synchronous callers.

:class:`DaemonLink` runs a :class:`~tierd.client.Client` on its own thread and loop;
callers hand it coroutines (:meth:`DaemonLink.submit`) and get a
``concurrent.futures.Future`` back at once. vLLM's tier and SGLang's backend make their
calls elsewhere (:mod:`tierd.integrations.core.engine_calls`, blocking, on their own
threads): for them the link watches the daemon (its :class:`Breaker`'s probe, the lines
logged when the daemon goes and comes back) and follows its events. LMCache's adapter
makes its calls here.

The connection is made on demand. When it is lost (the daemon stopped, was killed or
restarted), :meth:`DaemonLink.client` raises :class:`~tierd.client.Unreachable` at once
until the next attempt is due; attempts back off exponentially up to ``reconnect_max_s``.
The loss is logged once as a warning, the return once as info.

These lines are for the engine's operator, so they go through Python's standard
``logging``, the one engines configure and show (SGLang its root logger, vLLM its
``vllm`` logger), never through structlog, which no engine configures (``tierd.logs``
drops its info lines there, and prints its warnings past the engine's handlers): to the
logger an engine hands the link, else to ``tierd.integrations.core.link`` (whose warnings
reach the root logger's handlers, or Python's last-resort one on stderr).

Calls go through :meth:`DaemonLink.bounded` (on the link's loop), :meth:`DaemonLink.start`
(a future, from any thread) or :meth:`DaemonLink.ask` (blocking, from any thread): each
waits at most its deadline, then fails with :class:`DaemonSilent` and drops the
connection (whatever it held in the daemon, leases included, is released when the
daemon reads the close). The :class:`~tierd.breaker.CircuitBreaker` counts the
failures (the engines' calls too); while it is open every call fails at once with
:class:`BreakerOpen`, unsent, and one probe at a time asks the daemon for ``health``
until it answers.

Threads. The link's own thread runs its event loop and owns what lives there: the
client and its connection, the connect lock and backoff, the lines said of a loss and a
return, the probe and check tasks, and the ``on_connect`` callbacks (called there). Other
threads reach it only through the loop (:meth:`DaemonLink.submit`,
``call_soon_threadsafe``), and read ``connected`` (one reference) without a lock: a
moment's view. The breaker is shared by every thread (engine threads' calls count on it
too) under its own lock; a request of :meth:`DaemonLink.ask` keeps the connections it
began on under a lock of its own, noted on the loop and taken by the asking thread when
it gives up. :meth:`DaemonLink.close` runs on its caller's thread: it marks
the link closed (other threads only read that flag, to stop handing work over) and waits
for the loop to disconnect before stopping it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from tierd.breaker import Backoff, CircuitBreaker
from tierd.client import Client, DaemonError, Unreachable, UntrustedDaemon
from tierd.control.clients.blocking_client import BlockingClient
from tierd.control.clients.handshake import DaemonSilent
from tierd.control.clients.pool import PoolShare
from tierd.errors import TierdError
from tierd.integrations.core.engine_log import EngineLog
from tierd.integrations.core.params import BlockSizeMismatch

__all__ = [
    "BlockSizeMismatch",
    "BreakerOpen",
    "DaemonLink",
    "DaemonSilent",
    "LinkSettings",
    "NotSent",
    "TooLate",
    "log_unanswered",
]

T = TypeVar("T")
# The link's lines, through the standard logging every engine shows (its handlers, its
# format, its level); structlog's calling style (``log.warning("event", key=value)``).
log = EngineLog("tierd.integrations.core.link")

_CLOSE_TIMEOUT_S = 10.0
_DROP_TIMEOUT_S = 1.0  # closing a connection to a silent daemon must not wait on it


def _is_refusal(exc: BaseException) -> bool:
    """A daemon that answers but will not serve this engine (not one that is absent)."""
    if isinstance(exc, BlockSizeMismatch | UntrustedDaemon):
        return True
    return isinstance(exc, DaemonError) and exc.code not in ("busy", "shutting_down")


class BreakerOpen(Unreachable):
    """The breaker is open: the call was not sent (the daemon failed recently)."""


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Where the daemon is and how long an engine may wait on it (docs/vllm.md says why
    these defaults: a lookup is one round trip, well under a scheduler step; a job moves
    up to a few hundred MiB between memory and disk)."""

    socket_path: str
    namespace: str
    block_bytes: int
    reconnect_max_s: float = 10.0
    server_uids: tuple[int, ...] = ()  # besides this user and root: whose daemon to trust
    lookup_deadline_s: float = 0.05
    job_deadline_s: float = 2.0
    load_deadline_s: float = 0.5
    breaker_failures: int = 3  # consecutive failures that open the breaker; 0: never
    probe_interval_s: float = 0.5  # between probes of a daemon that refused connections

    def blocking(
        self,
        deadline: float,
        *,
        map_pool: bool = False,
        pools: PoolShare | None = None,
        retain: bool = False,
    ) -> BlockingClient:
        """A blocking connection of the engine's (this socket, namespace, block size and
        trusted uids), said hello to before ``deadline``
        (:meth:`~tierd.control.clients.blocking_client.BlockingClient.connect`)."""
        return BlockingClient.connect(
            self.socket_path,
            namespace=self.namespace,
            block_bytes=self.block_bytes,
            deadline=deadline,
            server_uids=self.server_uids,
            map_pool=map_pool,
            pools=pools,
            retain=retain,
        )


ASK_LEAST_S = 0.02  # a request with less time left is not sent (its answer could not come)
ASK_LAND_S = 0.02  # the link gives up this long before its caller: its verdict reaches it


class TooLate(DaemonSilent):
    """The caller's deadline passed before the request was sent."""


class NotSent(Exception):
    """A request not sent: its caller gave up waiting for it first, or the lease it names
    went with its connection. Not a :class:`~tierd.errors.TierdError`, so the link
    neither counts it for the breaker nor sends it again on a fresh connection."""


class _Asked:
    """One request a task hands to the link: the connections it began on, until the task
    stops waiting for it (from then on it begins on none)."""

    __slots__ = ("_began", "_gave_up", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._began: list[Client] = []
        self._gave_up = False

    def noted(self, op: Callable[[Client], Awaitable[T]]) -> Callable[[Client], Awaitable[T]]:
        async def begin(client: Client) -> T:
            with self._lock:
                if self._gave_up:
                    raise NotSent("its task stopped waiting before it was sent")
                self._began.append(client)
            return await op(client)

        return begin

    def give_up(self) -> list[Client]:
        """Stop waiting: the connections it began on."""
        with self._lock:
            self._gave_up = True
            return list(self._began)


def _left(expires: float) -> float:
    """The time the link gives a request whose caller waits until ``expires``."""
    left = expires - time.monotonic() - ASK_LAND_S
    if left <= ASK_LEAST_S:
        raise TooLate("the caller's deadline passed before the daemon was asked")
    return left


class DaemonLink:
    """One client connection, owned by a private thread and event loop."""

    def __init__(
        self,
        settings: LinkSettings,
        *,
        name: str = "tierd-link",
        logger: Any = None,
        map_pool: bool = True,
        said_at_start: bool = False,
    ) -> None:
        """``said_at_start``: the engine's start-up says itself that no daemon answers
        (:func:`~tierd.integrations.core.one_flag.missing_daemon`); the link then says nothing
        of a daemon it never reached, and says when one answers."""
        self.settings = settings
        self._map_pool = map_pool
        # The engine's logger, if it has one of its own (vLLM's "vllm.tierd"): a standard
        # logger, or anything called as log.warning("event", k=v) (EngineLog).
        if isinstance(logger, logging.Logger):
            logger = EngineLog(logger.name)
        self.log = logger if logger is not None else log
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._client: Client | None = None
        self._connecting = asyncio.Lock()  # binds to the link's loop on first use
        self._backoff = Backoff(settings.reconnect_max_s)
        self._lost_reported = False
        self._said_at_start = said_at_start
        self._ever_connected = False
        self._closed = False
        self.connects = 0  # successful connections so far (a reconnect adds one)
        self.breaker = CircuitBreaker(settings.breaker_failures, backoff_s=None)
        self._probe: asyncio.Task[None] | None = None
        self._check_task: asyncio.Task[None] | None = None
        # Called on the link's loop with each new connection (subscribe to events, say).
        self.on_connect: list[Callable[[Client], None]] = []
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.close()

    # -- from any thread --------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the link's loop; never blocks."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` and wait for it (start-up and shutdown only)."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Unreachable(f"no answer from the daemon within {timeout_s:g} s") from None

    def start(
        self, op: Callable[[Client], Awaitable[T]], deadline_s: float
    ) -> concurrent.futures.Future[T]:
        """``op(client)`` under ``deadline_s`` on the link's loop; never blocks. While
        the breaker is open the future is already failed with :class:`BreakerOpen`."""
        if not self.breaker.allow():
            failed: concurrent.futures.Future[T] = concurrent.futures.Future()
            failed.set_exception(BreakerOpen("the tierd breaker is open"))
            return failed
        return self.submit(self.bounded(op, deadline_s))

    def ask(self, op: Callable[[Client], Awaitable[T]], expires: float) -> T:
        """``op(client)`` on the link, waited for from the calling thread until ``expires``
        (a ``time.monotonic()`` time), never longer: :class:`DaemonSilent` then.

        The link gives up on its own a moment before (counting the silence, dropping the
        connection), but raises only once it has let the silent connection go (closing
        it, unmapping its pool), which the caller does not wait for; nor for a link whose
        thread is kept from running. A request given up on here that had begun drops its
        connection (the daemon releases whatever it held, leases included) and counts for
        the breaker as a silence; one that had not begun never does."""
        asked = _Asked()
        sent = time.monotonic()
        future = self.start(asked.noted(op), _left(expires))
        try:
            return future.result(max(0.0, expires - time.monotonic()))
        except concurrent.futures.TimeoutError:
            silent = DaemonSilent("no answer from the daemon before the caller's deadline")
            began = asked.give_up()
            if began:  # the link's call ends by itself (never sent again: noted refuses)
                self.report_failure(silent_since=sent)
            else:
                future.cancel()
            self._drop_given_up(began, silent)
            raise silent from None
        except DaemonSilent as exc:
            self._drop_given_up(asked.give_up(), exc)
            raise
        except NotSent as exc:
            raise Unreachable(str(exc)) from None

    def _drop_given_up(self, clients: list[Client], exc: BaseException) -> None:
        """Drop the connections of requests given up on: the daemon then releases what
        they held, an answer that comes later included."""
        for client in clients:
            self.submit(self.failed(client, exc)).add_done_callback(log_unanswered)

    def close(self) -> None:
        """Close the connection, stop the loop and join its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Unreachable):
            self.call(self._disconnect(), _CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_TIMEOUT_S)

    @property
    def connected(self) -> bool:
        return self._client is not None

    # -- on the link's loop -----------------------------------------------------------

    async def client(self) -> Client:
        """The live client, connecting if an attempt is due; else :class:`Unreachable`.

        :class:`BlockSizeMismatch` when the daemon answers with another block size.
        """
        if self._client is not None:
            return self._client
        if self._closed:
            raise Unreachable("the link is closed")
        async with self._connecting:
            if self._client is not None:
                return self._client
            if not self._backoff.due():
                raise Unreachable("the daemon is unreachable; reconnecting with backoff")
            try:
                client = await self._connect()
            except (TierdError, OSError) as exc:
                self._schedule_retry(exc)
                raise
            self._on_connected()
            self._client = client
            for hook in self.on_connect:
                hook(client)
            return client

    async def _connect(self) -> Client:
        s = self.settings
        try:  # the hello names the engine's size: a daemon of several sizes serves it so
            client = await Client.connect(
                s.socket_path,
                namespace=s.namespace,
                block_bytes=s.block_bytes,
                server_uids=s.server_uids,
                map_pool=self._map_pool,
            )
        except DaemonError as exc:
            if exc.code != "block_size_mismatch":
                raise
            raise BlockSizeMismatch(s.block_bytes, s.socket_path, str(exc)) from exc
        if client.block_bytes != s.block_bytes:  # a daemon must serve the size named
            await client.close()
            reason = f"its hello answered blocks of {client.block_bytes} bytes"
            raise BlockSizeMismatch(s.block_bytes, s.socket_path, reason)
        return client

    def _schedule_retry(self, exc: BaseException, *, at_once: bool = False) -> None:
        """After a failed connect, the next attempt waits (longer each time); after a
        lost connection (``at_once``), the next one may be made at once."""
        if at_once:
            self._backoff.at_once()
        else:
            self._backoff.failed()
        if self._lost_reported:
            return
        if _is_refusal(exc) and not self._ever_connected:
            return  # start-up raises it with what to change: "unreachable" would mislead
        self._lost_reported = True
        if self._said_at_start and not self._ever_connected:
            return  # the engine's start-up said it: "reachable again" says the rest
        if _is_refusal(exc):
            self.log.error(
                "tierd daemon refuses this engine",
                socket=self.settings.socket_path,
                error=str(exc),
                consequence="its blocks count as misses until the daemon accepts it",
            )
        else:
            event = "tierd daemon lost" if self._ever_connected else "tierd daemon unreachable"
            self.log.warning(
                event,
                socket=self.settings.socket_path,
                error=str(exc),
                consequence="its blocks count as misses until it is back",
            )

    def _on_connected(self) -> None:
        self.connects += 1
        if self._lost_reported:
            self.log.info("tierd daemon reachable again", socket=self.settings.socket_path)
        self._lost_reported = False
        self._ever_connected = True
        self._backoff.succeeded()

    async def run(self, op: Callable[[Client], Awaitable[T]]) -> T:
        """``await op(client)``; if the connection turns out lost (the daemon restarted
        since the last request, say), once more on a fresh connection."""
        for attempt in range(2):
            client = await self.client()
            try:
                return await op(client)
            except (TierdError, OSError) as exc:
                if not await self.failed(client, exc) or attempt:
                    raise
        raise AssertionError("unreachable: the loop returns or raises")

    async def failed(self, client: Client, exc: BaseException) -> bool:
        """A request on ``client`` failed with ``exc``: drop the connection if it is gone
        (returns whether it did).

        A :class:`DaemonError` is an answer (the connection lives) unless the daemon is
        shutting down; anything else means the connection is lost.
        """
        if isinstance(exc, DaemonError) and exc.code != "shutting_down":
            return False
        if self._client is not client:
            return self._client is None
        self._client = None
        self._schedule_retry(exc, at_once=True)
        with contextlib.suppress(TierdError, OSError):
            await client.close()
        return True

    async def bounded(self, op: Callable[[Client], Awaitable[T]], deadline_s: float) -> T:
        """``await self.run(op)``, waiting at most ``deadline_s``.

        An answer (an error answer too) counts for the breaker; no answer in time
        cancels ``op`` (it stops at its next await: a copy between two awaits is never
        cut), drops the connection and raises :class:`DaemonSilent`.
        """
        if not self.breaker.allow():
            raise BreakerOpen("the tierd breaker is open")
        sent = time.monotonic()
        task = asyncio.get_running_loop().create_task(self.run(op))
        try:
            done, _ = await asyncio.wait({task}, timeout=deadline_s)
        except asyncio.CancelledError:
            task.cancel()  # the caller gave up (a drain): op stops at its next await
            raise
        if not done:
            await asyncio.sleep(0)  # an answer read in the loop's last round lands now
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # op has stopped: nothing of it runs after this
            silent = DaemonSilent(f"no answer from the daemon within {deadline_s:g} s")
            self.count_call(silent, sent)
            await self._drop()
            raise silent
        try:
            result = task.result()
        except BaseException as exc:
            self.count_call(exc, sent)
            raise
        self.count_call(None, sent)
        return result

    def count_call(
        self, exc: BaseException | None, sent: float, *, answered: bool = True, lost: bool = False
    ) -> bool:
        """Count one bounded call's outcome for the breaker, the same whichever way the
        call was made (:meth:`bounded` on the link's loop, an engine thread's
        :class:`~tierd.integrations.core.channel.EngineChannel`). ``exc`` is what it raised
        (None: it returned; ``answered=False``: it only sent, so its return is no
        answer). An answer, an error answer included, is the daemon's; a
        ``shutting_down`` answer, an error answer on a connection found closed
        (``lost``), no answer in time (:class:`DaemonSilent`, counted as a silence since
        ``sent``) and any other failure count against it. Returns whether the call's
        connection must be dropped."""
        if exc is None:
            if answered:
                self.breaker.answered()
            return False
        if isinstance(exc, DaemonError) and exc.code != "shutting_down" and not lost:
            self.breaker.answered()
            return False
        self.report_failure(silent_since=sent if isinstance(exc, DaemonSilent) else None)
        return True

    def report_failure(self, *, silent_since: float | None = None) -> None:
        """A call failed (on any thread; ``silent_since``: when it was sent, if it got no
        answer): count it for the breaker; when that opens it, the link's loop probes
        the daemon until it answers."""
        if self.breaker.failed(silent_since=silent_since):
            self.log.warning(
                "tierd breaker open",
                socket=self.settings.socket_path,
                consequence="lookups miss and jobs fail at once until the daemon answers",
            )
            if not self._closed:
                with contextlib.suppress(RuntimeError):  # the loop has stopped meanwhile
                    self._loop.call_soon_threadsafe(self._start_probe)

    def check_soon(self) -> None:
        """From any thread: have the link's loop ask the daemon for ``health`` (another
        connection found the daemon restarted or gone; this one learns it now, and says
        so, not at its next job)."""
        if not self._closed:
            with contextlib.suppress(RuntimeError):  # the loop has stopped meanwhile
                self._loop.call_soon_threadsafe(self._start_check)

    def _start_check(self) -> None:
        if self._check_task is None or self._check_task.done():  # one check at a time
            self._check_task = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        with contextlib.suppress(TierdError, OSError):
            await self.bounded(lambda c: c.health(), self.settings.job_deadline_s)

    def _start_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_answered())

    async def _probe_until_answered(self) -> None:
        """Ask for ``health`` until the daemon answers, then close the breaker. A
        silent daemon keeps one request waiting (no pile-up); a dead one is retried
        every ``probe_interval_s`` (each connection attempt also backs off)."""
        while self.breaker.is_open and not self._closed:
            try:
                await self.run(lambda c: c.health())
            except DaemonError:
                pass  # an answer: the daemon is there
            except (TierdError, OSError):
                await asyncio.sleep(self.settings.probe_interval_s)
                continue
            if self.breaker.close():
                self.log.info("tierd breaker closed", socket=self.settings.socket_path)
            return

    async def _drop(self) -> None:
        """Forget the connection (the next call reconnects) without waiting on it."""
        client, self._client = self._client, None
        if client is not None:
            self._schedule_retry(DaemonSilent("no answer within the deadline"), at_once=True)
            with contextlib.suppress(TierdError, OSError, TimeoutError):
                async with asyncio.timeout(_DROP_TIMEOUT_S):
                    await client.close()

    async def _disconnect(self) -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # the probe, jobs, stats: nothing outlives the link
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=_DROP_TIMEOUT_S)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(TierdError, OSError, TimeoutError):
                async with asyncio.timeout(_DROP_TIMEOUT_S):
                    await client.close()


def log_unanswered(future: Any) -> None:
    """A done-callback for a request nobody waits on: its failure, said at debug."""
    if not future.cancelled() and future.exception() is not None:
        log.debug("tierd request not answered", error=str(future.exception()))
