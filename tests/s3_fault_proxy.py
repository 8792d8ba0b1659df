"""An HTTP/1.1 proxy in front of an S3 server that injects faults, for the tests.

It owns a thread with its own event loop, listening on a free 127.0.0.1 port, so that a
daemon in another process can use it as its S3 endpoint. Each request is read whole
(request line, headers, a Content-Length or chunked body), forwarded byte for byte (the Host
header is part of the SigV4 signature) over a fresh upstream connection, and the response
written back, keeping the client's connection alive. ``fault`` (settable from any thread)
decides what happens to requests whose method is in ``methods`` (``None``: all):

- ``None``: pass through;
- ``"status:NNN"``: answer NNN with a small XML error body, not forwarded;
- ``"hang"``: read the request, never answer; the connection closes, unanswered and never
  forwarded, when the fault changes or the proxy stops;
- ``"slow"``: forward, send the response head at once, the body at ``slow_bytes_per_s``;
- ``"truncate"``: the response head (true Content-Length), half its body, then close;
- ``"flip"``: a 200 response's body with its middle byte inverted (same length);
- ``"refuse"``: close the connection at once, unanswered (for every method: before reading
  the request; for some methods: after reading its head, which names the method);
- ``"ignore-condition"``: forward the request without its ``If-None-Match`` header, as a
  server that ignores the condition would see it (the header is signed, so this works in
  front of a server that does not check signatures only: moto's, ``s3_kit.MotoServer``).

``"status:501"`` answers ``NotImplemented``, as S3 servers do for a header they do not
implement.
"""

from __future__ import annotations

import asyncio
import http
import threading
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

MODES = ("hang", "slow", "truncate", "flip", "refuse", "ignore-condition")
CODES = {
    501: ("NotImplemented", "A header you provided implies functionality that is not implemented")
}
HEAD_LIMIT = 64 * 1024
TIMEOUT_S = 10.0


def check_fault(fault: str | None) -> str | None:
    """``fault`` if it is a mode this proxy knows, else ValueError."""
    if fault is None or fault in MODES:
        return fault
    code = fault.removeprefix("status:")
    if fault.startswith("status:") and code.isdigit() and 200 <= int(code) <= 599:
        return fault
    raise ValueError(f"unknown fault {fault!r}: None, 'status:NNN' (200-599) or one of {MODES}")


@dataclass(frozen=True, slots=True)
class Message:
    """One request or response: its head as received, parsed, and its body as received."""

    head: bytes
    start: list[str]
    headers: dict[str, str]
    body: bytes = b""
    to_eof: bool = False  # a response framed by the server closing the connection

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def wants_close(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


async def read_head(reader: asyncio.StreamReader) -> Message | None:
    """The next message head, or None at a clean end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("the peer closed inside a message head") from exc
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Message(head, lines[0].split(" ", 2), headers)


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body exactly as sent: chunk lines, data and trailers."""
    raw = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        raw += line
        size = int(line.split(b";", 1)[0].strip() or b"x", 16)
        if size == 0:
            break
        raw += await reader.readexactly(size + 2)
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        raw += line
    return bytes(raw + b"\r\n")


async def read_body(reader: asyncio.StreamReader, message: Message, *, to_eof: bool) -> Message:
    """``message`` with its body: chunked, Content-Length, else (a response) to the end."""
    if message.chunked:
        body = await read_chunked(reader)
    elif "content-length" in message.headers:
        body = await reader.readexactly(int(message.headers["content-length"]))
    elif to_eof:
        return Message(message.head, message.start, message.headers, await reader.read(), True)
    else:
        body = b""
    return Message(message.head, message.start, message.headers, body)


def without_header(message: Message, name: str) -> Message:
    """``message`` with every ``name`` header line taken out of its head."""
    lines = message.head.split(b"\r\n")
    kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() != name.encode()]
    headers = {k: v for k, v in message.headers.items() if k != name}
    return Message(b"\r\n".join(kept), message.start, headers, message.body, message.to_eof)


def error_response(status: int, code: str, message: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    ).encode()
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Injected"
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class S3FaultProxy:
    """A fault-injecting HTTP/1.1 proxy from 127.0.0.1:``port`` to 127.0.0.1:``upstream``."""

    def __init__(self, upstream: int, *, slow_bytes_per_s: int = 64 * 1024) -> None:
        self.upstream = upstream
        self.slow_bytes_per_s = slow_bytes_per_s
        self.port = 0
        self._lock = threading.Condition()
        self._fault: tuple[str | None, frozenset[str] | None, str | None] = (None, None, None)
        self._counts: dict[str, Counter[str]] = {
            "requests": Counter(),
            "forwarded": Counter(),
            "faulted": Counter(),
        }
        self._errors: list[BaseException] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed: asyncio.Event | None = None
        self._closing = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- the test thread's view --------------------------------------------------------

    @property
    def fault(self) -> str | None:
        with self._lock:
            return self._fault[0]

    @fault.setter
    def fault(self, fault: str | None) -> None:
        self.set_fault(fault, methods=self.methods, header=self.header)

    @property
    def methods(self) -> frozenset[str] | None:
        with self._lock:
            return self._fault[1]

    @methods.setter
    def methods(self, methods: Collection[str] | None) -> None:
        self.set_fault(self.fault, methods=methods, header=self.header)

    @property
    def header(self) -> str | None:
        with self._lock:
            return self._fault[2]

    def set_fault(
        self,
        fault: str | None,
        *,
        methods: Collection[str] | None = None,
        header: str | None = None,
    ) -> None:
        """Change the fault, the methods it applies to (None: all) and the header a
        request must carry for it to apply (None: any request), together."""
        chosen = None if methods is None else frozenset(m.upper() for m in methods)
        with self._lock:
            self._fault = (check_fault(fault), chosen, None if header is None else header.lower())
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_held)

    def _count(self, kind: str, key: str) -> None:
        with self._lock:
            self._counts[kind][key] += 1
            self._lock.notify_all()

    def _counter(self, kind: str) -> Counter[str]:
        with self._lock:
            return Counter(self._counts[kind])

    @property
    def requests(self) -> Counter[str]:
        """Requests read from clients, by method."""
        return self._counter("requests")

    @property
    def forwarded(self) -> Counter[str]:
        """Requests that reached the server, by method."""
        return self._counter("forwarded")

    @property
    def faulted(self) -> Counter[str]:
        """Requests a fault applied to, by fault ('status:500', 'hang', ...)."""
        return self._counter("faulted")

    @property
    def errors(self) -> list[BaseException]:
        """Unexpected errors inside the proxy (a test may assert there are none)."""
        with self._lock:
            return list(self._errors)

    def wait_until(self, done: Callable[[S3FaultProxy], bool], timeout: float = TIMEOUT_S) -> None:
        """Block until ``done(self)`` holds after some request was counted; bounded."""
        with self._lock:
            if not self._lock.wait_for(lambda: done(self), timeout=timeout):
                raise TimeoutError(f"proxy condition not reached in {timeout} s")

    # -- start and stop ----------------------------------------------------------------

    def start(self) -> S3FaultProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(TIMEOUT_S) or self._server is None:
            raise RuntimeError(f"the S3 fault proxy did not start: {self.errors}")
        return self

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._listen())
        except OSError as exc:
            with self._lock:
                self._errors.append(exc)
        ready.set()
        if self._server is not None:
            loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    async def _listen(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Close the listener and every connection; bounded."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT_S)
        if thread.is_alive():
            raise RuntimeError("the S3 fault proxy's thread did not end")

    async def _shutdown(self) -> None:
        if self._server is None:
            raise RuntimeError("the S3 fault proxy never listened")
        self._closing = True
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    # -- the proxy's loop --------------------------------------------------------------

    def _wake_held(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a connection handler outside a task")
        self._tasks.add(task)
        try:
            while await self._exchange(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the peer went away: this connection is over
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # stop() ends it: finish quietly (3.11's stream callback logs a cancelled task)
        except Exception as exc:  # kept for the test to see, never silent
            with self._lock:
                self._errors.append(exc)
        finally:
            self._tasks.discard(task)
            writer.close()

    def _applies(self, method: str | None, headers: dict[str, str] | None = None) -> str | None:
        with self._lock:
            fault, methods, header = self._fault
        if header is not None and (headers is None or header not in headers):
            return None
        if fault is None or methods is None or method in methods:
            return fault
        return None

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its answer; False when the connection is to close."""
        if self.methods is None and self.header is None and self._applies(None) == "refuse":
            self._count("faulted", "refuse")
            return False
        request = await read_head(reader)
        if request is None:
            return False
        method = request.start[0].upper()
        self._count("requests", method)
        fault = self._applies(method, request.headers)
        if fault == "refuse":
            self._count("faulted", fault)
            return False
        if request.headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the server's own 100 is skipped
        request = await read_body(reader, request, to_eof=False)
        if fault is not None:
            self._count("faulted", fault)
        if fault == "hang":
            await self._hold(method, request.headers)
            return False
        if fault is not None and fault.startswith("status:"):
            status = int(fault.removeprefix("status:"))
            code, text = CODES.get(status, ("InjectedFault", f"injected {fault}"))
            writer.write(error_response(status, code, text))
            await writer.drain()
            return not request.wants_close
        if fault == "ignore-condition":
            request = without_header(request, "if-none-match")
        response = await self._forward(request, method)
        return await self._answer(writer, response, fault) and not request.wants_close

    async def _hold(self, method: str, headers: dict[str, str]) -> None:
        while True:
            changed = self._changed
            if changed is None:
                raise RuntimeError("the S3 fault proxy is not listening")
            if self._applies(method, headers) != "hang":
                return
            await changed.wait()

    async def _forward(self, request: Message, method: str) -> Message | None:
        """The server's answer, or None when it cannot be reached."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            return None
        try:
            writer.write(request.head + request.body)
            await writer.drain()
            self._count("forwarded", method)
            response = await read_head(reader)
            while response is not None and response.start[1:2] and response.start[1][0] == "1":
                response = await read_head(reader)  # an interim 1xx answer: skip it
            if response is None:
                raise ConnectionError("the server closed without answering")
            bodiless = method == "HEAD" or response.start[1] in ("204", "304")
            if bodiless:
                return response
            return await read_body(reader, response, to_eof=True)
        finally:
            writer.close()

    async def _answer(
        self, writer: asyncio.StreamWriter, response: Message | None, fault: str | None
    ) -> bool:
        """Write ``response`` back as ``fault`` says; False when the connection is to close."""
        if response is None:
            writer.write(error_response(502, "BadGateway", "the S3 server cannot be reached"))
            await writer.drain()
            return True
        body = response.body
        if fault == "flip" and response.start[1] == "200" and body and not response.chunked:
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
        if fault == "truncate":
            writer.write(response.head + body[: len(body) // 2])
            await writer.drain()
            return False
        if fault == "slow":
            await self._trickle(writer, response.head, body)
        else:
            writer.write(response.head + body)
            await writer.drain()
        return not response.to_eof and not response.wants_close

    async def _trickle(self, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> None:
        writer.write(head)
        await writer.drain()
        step = max(1, self.slow_bytes_per_s // 20)
        for offset in range(0, len(body), step):
            await asyncio.sleep(0.05)
            writer.write(body[offset : offset + step])
            await writer.drain()
