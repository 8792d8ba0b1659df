"""A blocking client of the daemon's socket, for a thread that must not hop to a loop.

An engine's scheduler thread that needs an answer now (which of these keys are held?
copy these blocks into my rows) gains nothing from handing the request to an event loop
on another thread: every hand-over waits for the interpreter lock, which a busy engine
holds for its whole switch interval (5 ms by default). :class:`BlockingClient` sends from
the calling thread and waits for the reply in ``recv``, which releases the lock, so the
answer costs one round trip and nothing else.

Every call takes a ``deadline`` (a ``time.monotonic()`` second): the socket's timeout is
what is left of it, connecting included, so a stopped daemon costs at most the deadline.
A call that fails for want of an answer (:class:`DaemonSilent`) or a lost connection
(:class:`Unreachable`) leaves the client closed: a late reply could not be told from the
next one. An error reply (:class:`DaemonError`) leaves it usable, unless the daemon hangs
up after it.

One call at a time, from one thread; the connection names one namespace and maps no
pool (region requests move the bytes). The daemon is checked as :func:`check_server`
does before a byte is sent.

Requests sent together (a lookup split at the daemon's per-request key limit) are
answered in whatever order the daemon finishes them: each reply is matched to its
request by id. A region load larger than one request (the per-request key limit, or the
blocks one connection may hold in leases, ``max_lease_blocks``) sends its requests one
after the other: sent together, the later ones would find the lease bound taken by the
first and fail their keys. A load within one request, the common case, is one round trip.
"""

from __future__ import annotations

import socket
import time
from array import array
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from tierd.control.client_regions import region_requests
from tierd.control.handshake import (
    HELLO_ID,
    DaemonError,
    DaemonSilent,
    Unreachable,
    check_server,
    hello_reply,
    hello_request,
)
from tierd.control.protocol import FrameDecoder, encode
from tierd.errors import ProtocolError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["BlockingClient"]

_MAX_REPLY_BYTES = 16 << 20  # replies of this client are flags and counts
_HANGS_UP = frozenset({"not_allowed", "busy", "shutting_down", "frame_too_large"})


class BlockingClient:
    """One connection, used from one thread; build it with :meth:`connect`."""

    def __init__(self, sock: socket.socket, info: dict[str, Any], decoder: FrameDecoder) -> None:
        self._sock = sock
        self.info = info
        self._decoder = decoder
        self._ready: list[Any] = []  # decoded, not yet read
        self._next_id = HELLO_ID
        self.closed = False

    @classmethod
    def connect(
        cls,
        path: str,
        *,
        namespace: str,
        block_bytes: int | None,
        deadline: float,
        server_uids: Collection[int] = (),
    ) -> BlockingClient:
        """Connect, check who serves ``path``, and say hello, all before ``deadline``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(_left(deadline))
            sock.connect(path)
        except TimeoutError:
            sock.close()
            raise DaemonSilent(f"no answer from {path} within the deadline") from None
        except OSError as exc:
            sock.close()
            raise Unreachable(f"cannot connect to {path}: {exc.strerror or exc}") from exc
        client = cls(sock, {}, FrameDecoder(_MAX_REPLY_BYTES))
        try:
            check_server(sock, path, server_uids)
            client._send([encode(hello_request(namespace, block_bytes, pool_fd=False))], deadline)
            client.info = hello_reply(client._next_message(deadline))
        except BaseException:
            client.close()
            raise
        return client

    @property
    def block_bytes(self) -> int:
        return int(self.info["block_bytes"])

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()

    # -- requests ---------------------------------------------------------------------

    def requests(self, op: str, each: Sequence[dict[str, Any]], deadline: float) -> list[Any]:
        """Send one ``op`` request per item of ``each`` (all at once), and return their
        replies in the order of ``each``, whatever order they come in; the first error
        reply raises :class:`DaemonError` once every reply is read."""
        if self.closed:
            raise Unreachable("the connection is closed")
        first = self._next_id + 1
        self._next_id += len(each)
        ids = range(first, first + len(each))
        frames = [
            encode({"id": i, "op": op, **fields}) for i, fields in zip(ids, each, strict=True)
        ]
        self._send(frames, deadline)
        got = self._replies(set(ids), deadline)
        replies: list[Any] = []
        refused: DaemonError | None = None
        for request_id in ids:
            try:
                replies.append(self._answer(request_id, got[request_id]))
            except DaemonError as exc:
                if self.closed:
                    raise
                refused = refused or exc
        if refused is not None:
            raise refused
        return replies

    def lookup_each(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """Per key, whether the daemon holds it ready (as :meth:`Client.lookup_each`)."""
        if not keys:
            return []
        step = int(self.info.get("max_keys_per_request") or len(keys))
        parts = [{"keys": list(keys[i : i + step])} for i in range(0, len(keys), step)]
        replies = self.requests("lookup_each", parts, deadline)
        return [bool(flag) for reply in replies for flag in reply["present"]]

    def region_load(
        self, region: int, keys: Sequence[bytes], offsets: npt.ArrayLike, deadline: float
    ) -> list[bool]:
        """Copy the blocks of ``keys`` into the region at ``offsets``; per key, whether it
        was copied. The daemon starts no copy past ``deadline`` (its ``expires``). A job
        past one request's bounds goes as several requests, each sent once the one
        before is answered (each holds up to the connection's lease bound)."""
        each = region_requests(self.info, self.block_bytes, region, keys, offsets, None, deadline)
        done: list[bool] = []
        for fields in each:
            (reply,) = self.requests("region_load", [fields], deadline)
            done.extend(bool(flag) for flag in reply["done"])
        return done

    def register_region(self, fd: int, size: int, deadline: float) -> int:
        """Hand the daemon ``fd`` (``size`` bytes, a memfd); the region's id."""
        if self.closed:
            raise Unreachable("the connection is closed")
        self._next_id += 1
        request_id = self._next_id
        self._send([encode({"id": request_id, "op": "register_region", "size": size})], deadline)
        message = self._next_message(deadline)
        if isinstance(message, dict) and message.get("push") == "send_fd":
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [fd]))]
            self._io(lambda: self._sock.sendmsg([b"\0"], rights), deadline)
            message = self._next_message(deadline)
        return int(self._answer(request_id, message)["region"])

    # -- the wire ---------------------------------------------------------------------

    def _replies(self, wanted: set[int], deadline: float) -> dict[int, Any]:
        """The replies to the requests ``wanted`` (by id), in whatever order they come."""
        got: dict[int, Any] = {}
        while len(got) < len(wanted):
            message = self._next_message(deadline)
            if isinstance(message, dict) and "push" in message:
                continue  # not subscribed: nothing else is pushed to this connection
            request_id = message.get("id") if isinstance(message, dict) else None
            if isinstance(message, dict) and message.get("error") in _HANGS_UP:
                self.close()  # the daemon hangs up after this (id 0: a frame it refused)
                raise DaemonError(str(message["error"]), str(message.get("message")))
            if request_id not in wanted or request_id in got:
                self.close()
                raise ProtocolError(f"the daemon answered no request of ours: {message!r:.200}")
            got[request_id] = message
        return got

    def _answer(self, request_id: int, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict) or message.get("id") != request_id:
            self.close()
            raise ProtocolError(f"the daemon answered another request: {message!r:.200}")
        if message.get("ok"):
            return message
        code = str(message.get("error"))
        if code in _HANGS_UP:
            self.close()
        raise DaemonError(code, str(message.get("message")))

    def _next_message(self, deadline: float) -> Any:
        while not self._ready:
            data = self._io(lambda: self._sock.recv(1 << 16), deadline)
            if not data:
                self.close()
                raise Unreachable("the daemon closed the connection")
            try:
                self._ready.extend(self._decoder.feed(data))
            except ProtocolError:
                self.close()
                raise
        return self._ready.pop(0)

    def _send(self, frames: list[bytes], deadline: float) -> None:
        data = b"".join(frames)
        self._io(lambda: self._sock.sendall(data), deadline)

    def _io(self, call: Any, deadline: float) -> Any:
        """``call()`` on the socket with what is left of ``deadline`` as its timeout; a
        timeout or a socket error closes the client."""
        try:
            self._sock.settimeout(_left(deadline))
            return call()
        except TimeoutError:
            self.close()
            raise DaemonSilent("no answer from the daemon within the deadline") from None
        except OSError as exc:
            self.close()
            raise Unreachable(f"the connection was lost: {exc.strerror or exc}") from exc


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; a timeout at once when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
