"""The metrics endpoint: a minimal HTTP server on a loopback address that answers
``GET /metrics`` with the daemon's Prometheus text (:meth:`ServerContext.metrics`),
``GET /`` (or ``/status``) with the status page (``tierd/share/status.html``: one
self-contained file, no external URL) and ``GET /status.json`` with the figures the page
polls (:mod:`tierd.daemon.status_page`); anything else with 404. It is off unless
``metrics.http_port`` is set.

Any local user can connect to a loopback port, so what each is shown depends on who it
is: the kernel's uid of the client's socket, decided as the control socket decides it
(:mod:`tierd.daemon.http_peer`): an operator gets every tenant's details (namespace names
and the processes connected: pid, uid, command name), a tenant's member its own tenant's
and the other tenants as totals under a name of no meaning, anyone else totals only. The
Prometheus text follows the same rule (its tenant and namespace labels).

What a request costs the event loop is bounded, not left to the clients: the figures
are read on the loop at most once per ``metrics.cache`` seconds (one snapshot for the
metrics, one for the page), and each view's text and JSON made from them at most once
per interval, in a thread (the text grows with the tenants: made on the loop, it would
hold every client); later requests in the interval get the same bytes, and
requests that come while they are made wait for them. A request is routed and rendered
in one of :data:`MAX_SCRAPES` slots (the others wait their turn). A connection holds no
slot while it sends its request (whole within :data:`HEAD_DEADLINE_S`, at most
:data:`MAX_HEAD_BYTES`, or it is closed) nor while its answer is taken (a piece of
``_PIECE`` bytes at a time, whole within :data:`WRITE_DEADLINE_S`, or it is cut off):
slow or silent clients, and clients that do not read, make scrapes wait for no one. At
most :data:`MAX_CONNECTIONS` are open; a new one past it closes the oldest not being
served (a client still sending its request, or one not taking its answer), or is closed
at once when all are being served.

A web page could make a browser on this machine send requests here under a name of its
own that resolves to 127.0.0.1 (DNS rebinding) and read the answers; the page and its
figures are therefore served only to a request whose ``Host`` is a loopback address or
``localhost``, as a browser pointed at the endpoint itself sends (403 otherwise).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from tierd.config import MetricsConfig
from tierd.control.figures.prometheus import render_prometheus
from tierd.control.state.context import ServerContext
from tierd.daemon import status_page
from tierd.daemon.http_peer import View, asker, shown_stats
from tierd.daemon.status_page import Peer, StatusFigures
from tierd.share import shipped

__all__ = [
    "HEAD_DEADLINE_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "MAX_SCRAPES",
    "WRITE_DEADLINE_S",
    "start_metrics_http",
]

MAX_SCRAPES = 8  # requests routed and rendered at once; the others wait their turn
MAX_CONNECTIONS = 256  # open at once; past it, the oldest not being served is closed
MAX_HEAD_BYTES = 16 << 10  # a request head longer than this is closed unanswered
HEAD_DEADLINE_S = 2.0  # a request head not whole by then is closed unanswered
WRITE_DEADLINE_S = 10.0  # an answer not taken whole by then is cut off
_PIECE = 64 << 10  # bytes of an answer handed to the kernel at a time

T = TypeVar("T")

log = structlog.get_logger("tierd")

# What a browser may do with the page: its own inline script and style, fetch from its
# own origin, nothing else (no external URL, no frame around it).
_PAGE_HEADERS = (
    "Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n"
    "X-Frame-Options: DENY\r\nReferrer-Policy: no-referrer\r\n"
)
_COMMON_HEADERS = "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
_PROMETHEUS = "text/plain; version=0.0.4"
_NOT_FOUND = b"not found: try /metrics, / (the status page) or /status.json\n"


class _Cached(Generic[T]):
    """A value made by ``make`` at most once per ``interval`` seconds: requests within
    the interval get the last one, requests that come while it is made wait for it."""

    def __init__(self, make: Callable[[], Awaitable[T]], interval: float) -> None:
        self._make = make
        self._interval = interval
        self._when = float("-inf")
        self._value: T | None = None
        self._making: asyncio.Future[T] | None = None  # shared by the waiting requests

    async def get(self) -> T:
        loop = asyncio.get_running_loop()
        if self._value is not None and loop.time() - self._when < self._interval:
            return self._value
        if self._making is None:
            self._making = asyncio.ensure_future(self._make())
        making = self._making
        try:
            made = await asyncio.shield(making)
        finally:
            if making.done() and self._making is making:
                self._making = None
        self._when, self._value = loop.time(), made
        return made


class _PerView(Generic[T]):
    """One route's bytes for each :class:`View` (operator, a tenant's member, anyone
    else: at most the number of tenants + 2), each made at most once per ``interval``
    (in a thread, by ``render``) from one snapshot, itself taken at most once per
    ``interval`` (on the loop, by ``take``)."""

    def __init__(
        self,
        take: Callable[[], T],
        render: Callable[[T, View], bytes],
        interval: float,
    ) -> None:
        self._snapshot = _Cached(self._take, interval)
        self._take_now = take
        self._render = render
        self._interval = interval
        self._views: dict[str, _Cached[bytes]] = {}

    async def get(self, view: View) -> bytes:
        cached = self._views.get(view.key)
        if cached is None:
            cached = self._views[view.key] = _Cached(lambda: self._build(view), self._interval)
        return await cached.get()

    async def _take(self) -> T:
        return self._take_now()

    async def _build(self, view: View) -> bytes:
        snapshot = await self._snapshot.get()
        return await asyncio.to_thread(self._render, snapshot, view)


@dataclass(frozen=True, slots=True)
class _Reply:
    status: str
    content_type: str
    body: bytes
    page: bool = False  # the status page's headers (a browser reads it)


async def start_metrics_http(
    cfg: MetricsConfig, ctx: ServerContext, connections: Collection[Peer] = ()
) -> asyncio.Server | None:
    """Serve ``ctx``'s metrics at ``http://HOST:PORT/metrics`` and the status page at
    ``/`` (HTTP/1.0, one request per connection), when ``cfg.http_port`` is set; ``None``
    when it is not. ``connections``: the control socket's open connections (read by the
    page, never changed)."""
    if cfg.http_port is None:
        return None
    endpoint = _Endpoint(cfg, ctx, connections)
    server = await asyncio.start_server(
        endpoint.answer, cfg.http_host, cfg.http_port, limit=MAX_HEAD_BYTES
    )
    log.info("metrics over HTTP", url=f"http://{cfg.http_host}:{cfg.http_port}/metrics")
    return server


class _Endpoint:
    """The routes, their cached bodies and the bounds on connections."""

    def __init__(
        self, cfg: MetricsConfig, ctx: ServerContext, connections: Collection[Peer]
    ) -> None:
        self.ctx = ctx
        self.page = shipped("status.html").read_bytes()
        figures = StatusFigures(ctx, connections)
        self.metrics = _PerView(lambda: _metrics_snapshot(ctx), _render, cfg.cache)
        self.status = _PerView(figures.take, _render_status, cfg.cache)
        self.serving = asyncio.Semaphore(MAX_SCRAPES)
        self.open: dict[asyncio.StreamWriter, None] = {}  # every open connection
        # Those not being served (reading their request, or their answer being taken),
        # oldest first: the ones closed to make room.
        self.idle: dict[asyncio.StreamWriter, None] = {}

    async def route(self, request: bytes, writer: asyncio.StreamWriter) -> _Reply:
        path = _path(request)
        if path == b"/metrics":
            return _Reply("200 OK", _PROMETHEUS, await self.metrics.get(await self.view(writer)))
        if path not in (b"/", b"/status", b"/status.json"):
            return _Reply("404 Not Found", "text/plain", _NOT_FOUND)
        if not _local_host(request):
            text = b"the status page answers only a loopback Host (127.0.0.1, [::1], localhost)\n"
            return _Reply("403 Forbidden", "text/plain", text)
        if path == b"/status.json":
            body = await self.status.get(await self.view(writer))
            return _Reply("200 OK", "application/json", body, page=True)
        return _Reply("200 OK", "text/html; charset=utf-8", self.page, page=True)

    async def view(self, writer: asyncio.StreamWriter) -> View:
        """What the asker is shown: its uid (from the kernel) is a tenant's member, an
        operator, or nobody (the control socket's decision for the same uid)."""
        ids = await asker(writer.get_extra_info("peername"), writer.get_extra_info("sockname"))
        return View.of(self.ctx.tenants.identify(*ids) if ids is not None else None)

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.open) >= MAX_CONNECTIONS and not self._make_room():
            writer.transport.abort()
            return
        self.open[writer] = self.idle[writer] = None
        try:
            async with asyncio.timeout(HEAD_DEADLINE_S):
                request = await reader.readuntil(b"\r\n\r\n")
            if writer not in self.idle:
                return  # closed to make room while its request came
            del self.idle[writer]
            async with self.serving:
                reply = await self.route(request, writer)
            self.idle[writer] = None
            async with asyncio.timeout(WRITE_DEADLINE_S):
                await _send(writer, _head(reply), reply.body)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.transport.abort()  # late, too long, or gone: nothing more is sent
        finally:
            self.open.pop(writer, None)
            self.idle.pop(writer, None)
            writer.close()

    def _make_room(self) -> bool:
        """Close the oldest connection not being served; False if there is none."""
        for oldest in self.idle:
            del self.idle[oldest]
            self.open.pop(oldest, None)
            oldest.transport.abort()
            return True
        return False


async def _send(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> None:
    """Write the answer a piece at a time, each handed to the kernel before the next: a
    client that does not read holds one piece of memory here, not the whole answer."""
    writer.transport.set_write_buffer_limits(high=0)  # drain() waits for an empty buffer
    writer.write(head)
    whole = memoryview(body)
    for start in range(0, len(whole), _PIECE):
        writer.write(whole[start : start + _PIECE])
        await writer.drain()
    await writer.drain()


def _path(request: bytes) -> bytes:
    """The request line's path, without its query string."""
    parts = request.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].split(b"?", 1)[0] if len(parts) >= 3 else b""


def _local_host(request: bytes) -> bool:
    """Whether the request's ``Host`` names a loopback address or ``localhost`` (a
    request without one, not from a browser, passes)."""
    for line in request.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"host":
            continue
        host = value.strip().decode("latin-1").lower()
        if host.startswith("["):  # [::1]:9400
            host = host[1:].partition("]")[0]
        elif host.count(":") == 1:
            host = host.partition(":")[0]
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    return True


def _head(reply: _Reply) -> bytes:
    extra = _COMMON_HEADERS + (_PAGE_HEADERS if reply.page else "")
    return (
        f"HTTP/1.0 {reply.status}\r\nContent-Type: {reply.content_type}\r\n"
        f"Content-Length: {len(reply.body)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode()


def _metrics_snapshot(ctx: ServerContext) -> tuple[dict[str, Any], _Frozen, int]:
    """The figures the exposition text is made of, read on the loop: a snapshot costing
    the number of tenants and namespaces, not blocks."""
    histograms = _Frozen([m for c in ctx.timing.collectors() for m in c.collect()])
    return ctx.stats(namespaces=True), histograms, ctx.namespaces_top


def _render(snapshot: tuple[dict[str, Any], _Frozen, int], view: View) -> bytes:
    """One view's exposition text (in a thread: it grows with the tenants)."""
    stats, histograms, top = snapshot
    return render_prometheus(shown_stats(stats, view), [histograms], top=top).encode()


def _render_status(snapshot: dict[str, Any], view: View) -> bytes:
    """One view's status JSON (in a thread)."""
    return status_page.render(snapshot, view)


class _Frozen(Collector):
    """Metric families collected on the loop, rendered later elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
