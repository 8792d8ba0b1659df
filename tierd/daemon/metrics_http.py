"""The metrics endpoint: a minimal HTTP server on a loopback address that answers
``GET /metrics`` with the daemon's Prometheus text (:meth:`ServerContext.metrics`),
``GET /`` (or ``/status``) with the status page (``tierd/share/status.html``: one
self-contained file, no external URL) and ``GET /status.json`` with the figures the page
polls (:mod:`tierd.daemon.status_page`); anything else with 404. It is off unless
``metrics.http_port`` is set.

Any local user can connect to a loopback port, so what a request costs the event loop is
bounded, not left to the clients: the metrics text and the status figures are each made
at most once per ``metrics.cache`` seconds (later requests in the interval get the same
bytes; requests that come while they are made wait for that one), in a thread (with
1,000 tenants the text is about 0.4 MB and 70 ms: on the loop it held every client), from
a snapshot of the figures read on the loop, and at most :data:`MAX_SCRAPES` connections
are served at once (the others are closed at once).

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

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from tierd.config import MetricsConfig
from tierd.control.context import ServerContext
from tierd.control.prometheus import render_prometheus
from tierd.daemon import status_page
from tierd.daemon.status_page import Peer, StatusFigures
from tierd.share import shipped

__all__ = ["MAX_SCRAPES", "start_metrics_http"]

MAX_SCRAPES = 8

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


class _Cached:
    """Bytes made by ``make`` at most once per ``interval`` seconds: requests within the
    interval get the last bytes, requests that come while they are made wait for them."""

    def __init__(self, make: Callable[[], Awaitable[bytes]], interval: float) -> None:
        self._make = make
        self._interval = interval
        self._when = float("-inf")
        self._bytes = b""
        self._making: asyncio.Future[bytes] | None = None  # shared by the waiting requests

    async def get(self) -> bytes:
        loop = asyncio.get_running_loop()
        if loop.time() - self._when < self._interval:
            return self._bytes
        if self._making is None:
            self._making = asyncio.ensure_future(self._make())
        making = self._making
        try:
            made = await asyncio.shield(making)
        finally:
            if making.done() and self._making is making:
                self._making = None
        self._when, self._bytes = loop.time(), made
        return made


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
    server = await asyncio.start_server(endpoint.answer, cfg.http_host, cfg.http_port)
    log.info("metrics over HTTP", url=f"http://{cfg.http_host}:{cfg.http_port}/metrics")
    return server


class _Endpoint:
    """The routes, their cached bodies and the bound on open connections."""

    def __init__(
        self, cfg: MetricsConfig, ctx: ServerContext, connections: Collection[Peer]
    ) -> None:
        self.page = shipped("status.html").read_bytes()
        figures = StatusFigures(ctx, connections)
        self.metrics = _Cached(lambda: _render(ctx), cfg.cache)
        self.status = _Cached(lambda: _render_status(figures), cfg.cache)
        self.open = 0

    async def route(self, path: bytes, local_host: bool) -> _Reply:
        if path == b"/metrics":
            return _Reply("200 OK", _PROMETHEUS, await self.metrics.get())
        if path not in (b"/", b"/status", b"/status.json"):
            return _Reply("404 Not Found", "text/plain", _NOT_FOUND)
        if not local_host:
            text = b"the status page answers only a loopback Host (127.0.0.1, [::1], localhost)\n"
            return _Reply("403 Forbidden", "text/plain", text)
        if path == b"/status.json":
            return _Reply("200 OK", "application/json", await self.status.get(), page=True)
        return _Reply("200 OK", "text/html; charset=utf-8", self.page, page=True)

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= MAX_SCRAPES:
            writer.close()
            return
        self.open += 1
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            reply = await self.route(_path(request), _local_host(request))
            writer.write(_head(reply) + reply.body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except OSError:
            pass  # the client went away
        finally:
            self.open -= 1
            writer.close()


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


async def _render(ctx: ServerContext) -> bytes:
    """The exposition text: the figures are read on the loop (a snapshot costing the
    number of tenants and namespaces, not blocks), the text is made in a thread."""
    snapshot = ctx.stats(namespaces=True)
    histograms = _Frozen([m for c in ctx.timing.collectors() for m in c.collect()])
    text = await asyncio.to_thread(
        render_prometheus, snapshot, [histograms], top=ctx.namespaces_top
    )
    return text.encode()


async def _render_status(figures: StatusFigures) -> bytes:
    """The status page's JSON: a snapshot on the loop, the JSON made in a thread."""
    return await asyncio.to_thread(status_page.render, figures.take())


class _Frozen(Collector):
    """Metric families collected on the loop, rendered later elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
