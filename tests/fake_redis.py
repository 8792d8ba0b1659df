"""A hostile Redis-protocol server for the tests and the soak: it speaks enough RESP for
redis-py to connect and pipeline, says every key exists, and answers ``MGET`` the way
its ``mode`` says:

- ``huge``: an array declared 2**31 long, then ``$-1`` elements streamed for as long as
  the connection stays open (``streamed`` counts the connections it did this to);
- ``short``: an array one element shorter than the keys asked for;
- ``integer``: an integer instead of an array;
- ``slow``: nothing until ``release`` is set (a full, wedged server);
- ``huge_all``: every data command (``EXISTS``, ``SET``, ``MGET``...) gets the ``huge``
  reply: the soak points its daemon's remote level here for the whole run.

It listens on a loopback port, one thread per connection, and stops when its context
ends. Nothing here is a real Redis: it is the server an attacker would run.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

__all__ = ["FakeRedis", "fake_redis"]

_HUGE = b"*2147483648\r\n"
_NIL_RUN = b"$-1\r\n" * 4096
_HANDSHAKE = frozenset({b"CLIENT", b"HELLO", b"SELECT", b"PING", b"AUTH"})


class FakeRedis:
    """A hostile server on 127.0.0.1; ``start()``, then ``stop()`` (or :func:`fake_redis`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.streamed = 0  # connections sent a huge array header
        self.mgets = 0
        self.release = threading.Event()  # ends the ``slow`` wait and every stream
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> FakeRedis:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self.release.set()
        self.listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()
        for thread in self._threads:
            thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed by stop()
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._conns.append(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self.release.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                self._answer(conn, command)
        except (OSError, ValueError):
            return  # the daemon hung up: what a refused reply should make it do
        finally:
            reader.close()
            conn.close()

    def _answer(self, conn: socket.socket, command: list[bytes]) -> None:
        name = command[0].upper()
        if self.mode == "huge_all" and name not in _HANDSHAKE:
            self._stream_huge(conn)
        elif name == b"EXISTS":
            conn.sendall(b":1\r\n")
        elif name == b"MGET":
            with self._lock:
                self.mgets += 1
            self._mget(conn, len(command) - 1)
        elif name == b"GET":
            conn.sendall(b"$-1\r\n")
        else:
            conn.sendall(b"+OK\r\n")

    def _mget(self, conn: socket.socket, keys: int) -> None:
        if self.mode == "short":
            conn.sendall(f"*{keys - 1}\r\n".encode() + b"$-1\r\n" * (keys - 1))
        elif self.mode == "integer":
            conn.sendall(b":7\r\n")
        elif self.mode == "slow":
            self.release.wait(60)
        elif self.mode == "huge":
            self._stream_huge(conn)
        else:
            raise ValueError(f"no mode {self.mode!r}")

    def _stream_huge(self, conn: socket.socket) -> None:
        with self._lock:
            self.streamed += 1
        conn.sendall(_HUGE)
        for _ in range(1 << 16):  # bounded: about 1.3 GB, or until the daemon hangs up
            if self.release.is_set():
                return
            conn.sendall(_NIL_RUN)


def _read_command(reader: BinaryIO) -> list[bytes] | None:
    """One RESP array of bulk strings (what redis-py sends), or None at end of stream."""
    header = reader.readline()
    if not header:
        return None
    if not header.startswith(b"*"):
        return [header.strip()]  # an inline command
    parts = []
    for _ in range(int(header[1:])):
        size = int(reader.readline()[1:])
        parts.append(reader.read(size + 2)[:-2])
    return parts


@contextmanager
def fake_redis(mode: str) -> Iterator[FakeRedis]:
    """A started :class:`FakeRedis`, stopped on exit."""
    server = FakeRedis(mode).start()
    try:
        yield server
    finally:
        server.stop()
