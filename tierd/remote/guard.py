"""A bound on what the remote server may make the daemon parse: every reply header is
read before the parser sees it, and one that declares more than the level could ever
have asked for ends the connection.

hiredis allocates an array reply's list when it reads the header: ``*2147483648`` is a
list of two billion slots, and freeing it (when the reader is replaced at the next
connect) walks every slot on the event loop, for seconds, for every tenant. The deadline
of a call cannot help, since the cost lands after it. So the bytes of a reply go through
:class:`ReplyGuard` first, which follows the RESP framing with a few Python steps per
header (a bulk string's body is skipped in one step, whatever its size) and refuses an
array longer than ``max_elements`` or a string longer than ``max_bulk``, with
``InvalidResponse``: a failed call like a lost connection, counted against the server.

:func:`guarded_parser` is redis-py's hiredis parser with the guard in front; the
connection takes it as its ``parser_class``.
"""

from __future__ import annotations

from typing import Any

from redis._parsers import _AsyncHiredisParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse

__all__ = ["ReplyGuard", "guarded_parser"]

_MAX_LINE = 64 << 10  # a header, a status or an error message, at most
_COUNTED = frozenset(b"*%~>")  # aggregates: array, map, set, push
_SIZED = frozenset(b"$=!")  # bulk string, verbatim string, bulk error


class ReplyGuard:
    """Follows the framing of a RESP stream, chunk by chunk; raises ``InvalidResponse``
    on a header over the bounds or a line longer than a header may be."""

    __slots__ = ("_line", "_skip", "max_bulk", "max_elements")

    def __init__(self, max_elements: int, max_bulk: int) -> None:
        self.max_elements = max_elements
        self.max_bulk = max_bulk
        self._skip = 0  # bytes of a bulk body (and its CRLF) still to come
        self._line = b""  # the start of a header line cut by a chunk boundary

    def feed(self, chunk: bytes) -> None:
        pos, end = 0, len(chunk)
        while pos < end:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            newline = chunk.find(b"\n", pos)
            if newline < 0:
                self._line += chunk[pos:]
                if len(self._line) > _MAX_LINE:
                    raise InvalidResponse(f"a reply line longer than {_MAX_LINE} bytes")
                return
            line, self._line = self._line + chunk[pos:newline], b""
            pos = newline + 1
            self._header(line)

    def _header(self, line: bytes) -> None:
        if not line or (line[0] not in _COUNTED and line[0] not in _SIZED):
            return  # a status, an error, an integer...: one line, nothing follows
        try:
            count = int(line[1:].rstrip(b"\r"))
        except ValueError:
            raise InvalidResponse(f"a reply header that is not a length: {line[:32]!r}") from None
        if line[0] in _COUNTED:
            if count > self.max_elements:
                raise InvalidResponse(
                    f"a reply of {count} elements, over the bound of {self.max_elements}"
                )
        elif count > self.max_bulk:
            raise InvalidResponse(f"a value of {count} bytes, over the bound of {self.max_bulk}")
        elif count >= 0:
            self._skip = count + 2


def guarded_parser(max_elements: int, max_bulk: int) -> type[Any]:
    """redis-py's hiredis parser, with a :class:`ReplyGuard` of these bounds reading every
    chunk before hiredis does (a fresh guard per connection)."""

    class GuardedParser(_AsyncHiredisParser):
        __slots__ = ("_guard",)

        def on_connect(self, connection: Any) -> None:
            self._guard = ReplyGuard(max_elements, max_bulk)
            super().on_connect(connection)  # type: ignore[no-untyped-call]

        async def read_from_socket(self) -> bool:
            stream, reader = self._stream, self._reader
            if stream is None or reader is None:
                raise RedisConnectionError("the connection is closed")
            chunk = await stream.read(self._read_size)
            if not chunk or not isinstance(chunk, bytes):
                raise RedisConnectionError("the server closed the connection")
            self._guard.feed(chunk)  # before hiredis allocates anything for it
            reader.feed(chunk)
            return True

    return GuardedParser
