"""The Prometheus endpoint: a minimal HTTP server on a loopback address that answers
``GET /metrics`` with the daemon's figures (:meth:`ServerContext.metrics`) and anything
else with 404. It is off unless ``metrics.http_port`` is set.

Any local user can connect to a loopback port, so what a scrape costs the event loop is
bounded, not left to the scrapers: the text is rendered at most once per
``metrics.cache`` seconds (with 1,000 tenants a rendering is about 0.4 MB and 70 ms of
the loop; later scrapes in the interval get the same bytes), and at most
:data:`MAX_SCRAPES` connections are served at once (the others are closed at once).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from tierd.config import MetricsConfig
from tierd.control.context import ServerContext

__all__ = ["MAX_SCRAPES", "start_metrics_http"]

MAX_SCRAPES = 8

log = structlog.get_logger("tierd")


async def start_metrics_http(cfg: MetricsConfig, ctx: ServerContext) -> asyncio.Server | None:
    """Serve ``ctx``'s metrics at ``http://HOST:PORT/metrics`` (HTTP/1.0, one request per
    connection), when ``cfg.http_port`` is set; ``None`` when it is not."""
    port = cfg.http_port
    if port is None:
        return None
    host = cfg.http_host
    loop = asyncio.get_running_loop()
    rendered: list[Any] = [float("-inf"), b""]  # when, what
    open_scrapes = 0

    def body() -> bytes:
        if loop.time() - rendered[0] >= cfg.cache:
            rendered[:] = [loop.time(), ctx.metrics().encode()]
        return rendered[1]  # type: ignore[no-any-return]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_scrapes
        if open_scrapes >= MAX_SCRAPES:
            writer.close()
            return
        open_scrapes += 1
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
            status, text = (
                ("200 OK", body()) if path == b"/metrics" else ("404 Not Found", b"try /metrics\n")
            )
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode()
                + text
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except OSError:
            pass  # the scraper went away
        finally:
            open_scrapes -= 1
            writer.close()

    server = await asyncio.start_server(answer, host, port)
    log.info("metrics over HTTP", url=f"http://{host}:{port}/metrics")
    return server
