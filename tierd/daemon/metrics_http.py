"""The Prometheus endpoint: a minimal HTTP server on a loopback address that answers
``GET /metrics`` with the daemon's figures (:meth:`ServerContext.metrics`) and anything
else with 404. It is off unless ``metrics.http_port`` is set.
"""

from __future__ import annotations

import asyncio

import structlog

from tierd.config import MetricsConfig
from tierd.control.context import ServerContext

__all__ = ["start_metrics_http"]

log = structlog.get_logger("tierd")


async def start_metrics_http(cfg: MetricsConfig, ctx: ServerContext) -> asyncio.Server | None:
    """Serve ``ctx``'s metrics at ``http://HOST:PORT/metrics`` (HTTP/1.0, one request per
    connection), when ``cfg.http_port`` is set; ``None`` when it is not."""
    port = cfg.http_port
    if port is None:
        return None
    host = cfg.http_host

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
