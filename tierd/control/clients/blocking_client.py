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

One call at a time, from one thread; the connection names one namespace and maps the
tenant's pool only when asked (``map_pool``: leases; else region requests move the
bytes). The daemon is checked as :func:`check_server` does before a byte is sent. A
request whose answer nobody waits for (a lease's release, a touch: :meth:`post`) goes out
at once, and its reply is read and dropped with a later call's.

Requests sent together (a lookup split at the daemon's per-request key limit) are
answered in whatever order the daemon finishes them: each reply is matched to its
request by id. A caller that must not wait (an engine's scheduler step) *starts*
requests (:meth:`BlockingClient.start`) and *collects* what has come later
(:meth:`BlockingClient.collect`, waiting up to a deadline or not at all); replies it
gives up on go to a handler of its own when they come (:meth:`BlockingClient.forget`),
so a grant that came too late is still seen (and its lease ended). Such a wait that
runs out leaves the connection usable.

``retain``: a connection that holds leases whose memory its engine may still be
copying keeps its socket when it breaks (a timeout, a lost frame): the daemon ends a
connection's leases when its socket closes, so the owner closes it only once those
copies are done (:meth:`BlockingClient.close`).

A region load larger than one request (the per-request key limit, or the blocks one
connection may hold in leases, ``max_lease_blocks``) sends its requests one after the
other: sent together, the later ones would find the lease bound taken by the first and
fail their keys. A load within one request, the common case, is one round trip.
"""

from __future__ import annotations

import os
import socket
import time
from array import array
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from tierd.control.clients.handshake import (
    HANGS_UP,
    HELLO_ID,
    DaemonError,
    DaemonSilent,
    Unreachable,
    check_server,
    hello_reply,
    hello_request,
    recv_with_fds,
)
from tierd.control.clients.pool import PoolMap, PoolShare
from tierd.control.clients.regions import region_requests
from tierd.control.clients.requests import key_parts, lookup_count, present, touch_requests
from tierd.control.protocol import FrameDecoder, encode
from tierd.errors import ProtocolError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["MAX_REPLY_BYTES", "BlockingClient"]

MAX_REPLY_BYTES = 16 << 20  # mostly flags and counts; an inline get stays under it


class BlockingClient:
    """One connection, used from one thread; build it with :meth:`connect`."""

    def __init__(
        self,
        sock: socket.socket,
        info: dict[str, Any],
        decoder: FrameDecoder,
        *,
        retain: bool = False,
    ) -> None:
        self._sock = sock
        self.info = info
        self._decoder = decoder
        self._ready: list[Any] = []  # decoded, not yet read
        self._next_id = HELLO_ID
        # Requests whose replies nobody waits for: dropped (posted), or handed to a
        # handler (given up by :meth:`forget`).
        self._unawaited: dict[int, Callable[[Any], None] | None] = {}
        self._started: set[int] = set()  # started, not yet collected (:meth:`start`)
        self._arrived: dict[int, Any] = {}  # their replies, come and not collected
        self.pool: PoolMap | None = None
        self._owns_pool = True
        self.retain = retain  # broken, keep the socket until close() (the leases it holds)
        self.closed = False  # no request can be sent (broken or closed)
        self._sock_closed = False

    @classmethod
    def connect(
        cls,
        path: str,
        *,
        namespace: str | None,
        block_bytes: int | None,
        deadline: float,
        server_uids: Collection[int] = (),
        map_pool: bool = False,
        pools: PoolShare | None = None,
        retain: bool = False,
    ) -> BlockingClient:
        """Connect, check who serves ``path``, and say hello, all before ``deadline``;
        with ``map_pool``, map the tenant's pool the daemon passes (for leases), or take
        the mapping ``pools`` already has of it (the pool is then ``pools``' to close).
        ``retain``: see the module's docstring."""
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
        client = cls(sock, {}, FrameDecoder(MAX_REPLY_BYTES), retain=retain)
        fds: list[int] = []
        try:
            check_server(sock, path, server_uids)
            hello = hello_request(namespace, block_bytes, pool_fd=map_pool)
            client._send([encode(hello)], deadline)
            client.info = hello_reply(client._next_message(deadline, fds))
            named = client.info.get("pool")
            if map_pool and named is not None:
                if not fds:
                    raise ProtocolError("the daemon named a pool but did not pass it")
                if pools is None:
                    client.pool = PoolMap(fds[0], block_bytes=client.block_bytes, **named)
                else:
                    client.pool = pools.mapping(fds[0], client.block_bytes, named)
                    client._owns_pool = False
        except BaseException:
            client.close()  # nothing is leased yet: the socket goes whatever ``retain`` says
            raise
        finally:
            for fd in fds:
                os.close(fd)  # mapped (the mapping keeps the memory) or not wanted
        return client

    @property
    def block_bytes(self) -> int:
        return int(self.info["block_bytes"])

    def close(self) -> None:
        """Close the socket (the daemon then ends every lease of this connection)."""
        self.closed = True
        if not self._sock_closed:
            self._sock_closed = True
            self._sock.close()
            if self.pool is not None and self._owns_pool:
                self.pool.close()

    def _broken(self) -> None:
        """No request can be sent any more; the socket goes too, unless ``retain``."""
        if self.retain:
            self.closed = True
        else:
            self.close()

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

    def request(self, op: str, deadline: float, **fields: Any) -> dict[str, Any]:
        """One ``op`` request and its reply."""
        (reply,) = self.requests(op, [fields], deadline)
        return dict(reply)

    def post(self, op: str, deadline: float, **fields: Any) -> None:
        """Send one ``op`` request and go on: nobody waits for its reply (dropped when a
        later call reads past it; an error in it changes nothing of this connection's)."""
        if self.closed:
            raise Unreachable("the connection is closed")
        self._read_waiting()
        self._next_id += 1
        self._unawaited[self._next_id] = None
        self._send([encode({"id": self._next_id, "op": op, **fields})], deadline)

    def start(self, op: str, each: Sequence[dict[str, Any]], deadline: float) -> list[int]:
        """Send one ``op`` request per item of ``each`` and go on; their replies are for
        :meth:`collect` (or, given up, :meth:`forget`'s handler). Their ids, in order."""
        if self.closed:
            raise Unreachable("the connection is closed")
        self._read_waiting()
        first = self._next_id + 1
        self._next_id += len(each)
        ids = list(range(first, first + len(each)))
        self._started.update(ids)
        frames = [encode({"id": i, "op": op, **f}) for i, f in zip(ids, each, strict=True)]
        self._send(frames, deadline)
        return ids

    def collect(self, ids: Collection[int], deadline: float | None = None) -> dict[int, Any]:
        """The replies come so far to the started requests ``ids``, by id (an error reply
        as it came: ``ok`` false), each handed out once; with ``deadline``, after waiting
        until every one has come or it passes (the connection stays usable either way).
        Raises only for a broken connection (:class:`Unreachable`, a protocol error)."""
        if not self.closed:
            self._read_waiting()
            while deadline is not None and any(i not in self._arrived for i in ids):
                try:
                    data = self._io(lambda: self._sock.recv(1 << 16), deadline, wait=True)
                except DaemonSilent:
                    break
                self._take(data)
        out = {i: self._arrived.pop(i) for i in ids if i in self._arrived}
        self._started.difference_update(out)
        return out

    def forget(self, ids: Collection[int], handler: Callable[[Any], None]) -> None:
        """Stop waiting for the started requests ``ids``: each reply goes to ``handler``
        when it comes (at once for one come already), read along with later calls."""
        for request_id in ids:
            self._started.discard(request_id)
            if request_id in self._arrived:
                handler(self._arrived.pop(request_id))
            else:
                self._unawaited[request_id] = handler

    def lookup(self, keys: Sequence[bytes], deadline: float) -> int:
        """How many leading keys the daemon holds ready (as :meth:`Client.lookup`); more
        keys than one request takes go as several, sent together."""
        if not keys:
            return 0
        parts = key_parts(self.info, keys)
        replies = self.requests("lookup", [{"keys": part} for part in parts], deadline)
        return lookup_count(parts, replies)

    def touch(self, keys: Sequence[bytes], deadline: float, *, uses: bool = True) -> None:
        """Mark ``keys`` used (as :meth:`Client.touch`: ``keys[0]`` ends up the most
        recent, the tail's request first), without waiting for the answers."""
        for fields in touch_requests(self.info, keys, uses):
            self.post("touch", deadline, **fields)

    def require_pool(self) -> PoolMap:
        if self.pool is None:
            raise ProtocolError("the pool is not mapped: connect with map_pool", code="no_pool")
        return self.pool

    def lookup_each(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """Per key, whether the daemon holds it ready (as :meth:`Client.lookup_each`)."""
        if not keys:
            return []
        parts = [{"keys": part} for part in key_parts(self.info, keys)]
        return present(self.requests("lookup_each", parts, deadline))

    def region_load(
        self, region: int, keys: Sequence[bytes], offsets: npt.ArrayLike, deadline: float
    ) -> list[bool]:
        """Copy the blocks of ``keys`` into the region at ``offsets``; per key, whether it
        was copied. The daemon starts no copy past ``deadline`` (its ``expires``). A job
        past one request's bounds goes as several requests, each sent once the one
        before is answered (each holds up to the connection's lease bound)."""
        return self.move("region_load", region, keys, offsets, None, deadline)

    def move(
        self,
        op: str,
        region: int,
        keys: Sequence[bytes],
        offsets: npt.ArrayLike,
        piece_bytes: Sequence[int] | None,
        deadline: float,
    ) -> list[bool]:
        """``region_load`` or ``region_store`` (as :meth:`Client.region_store`), the
        daemon told ``deadline`` as the job's ``expires``."""
        each = region_requests(
            self.info, self.block_bytes, region, keys, offsets, piece_bytes, deadline
        )
        done: list[bool] = []
        for fields in each:
            (reply,) = self.requests(op, [fields], deadline)
            done.extend(bool(flag) for flag in reply["done"])
        return done

    def register_region(self, fd: int, size: int, deadline: float) -> int:
        """Hand the daemon ``fd`` (``size`` bytes, a memfd); the region's id."""
        if self.closed:
            raise Unreachable("the connection is closed")
        self._next_id += 1
        request_id = self._next_id
        self._send([encode({"id": request_id, "op": "register_region", "size": size})], deadline)
        message = self._next_reply(deadline)
        if isinstance(message, dict) and message.get("push") == "send_fd":
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [fd]))]
            self._io(lambda: self._sock.sendmsg([b"\0"], rights), deadline)
            message = self._next_reply(deadline)
        return int(self._answer(request_id, message)["region"])

    # -- the wire ---------------------------------------------------------------------

    def _replies(self, wanted: set[int], deadline: float) -> dict[int, Any]:
        """The replies to the requests ``wanted`` (by id), in whatever order they come."""
        got: dict[int, Any] = {}
        while len(got) < len(wanted):
            message = self._next_reply(deadline)
            if isinstance(message, dict) and "push" in message:
                continue  # not subscribed: nothing else is pushed to this connection
            request_id = message.get("id") if isinstance(message, dict) else None
            if isinstance(message, dict) and message.get("error") in HANGS_UP:
                self._broken()  # the daemon hangs up after this (id 0: a frame it refused)
                raise DaemonError.of(message)
            if request_id in self._started:  # started by another call: kept for it
                self._arrived[request_id] = message
                continue
            if request_id not in wanted or request_id in got:
                self._broken()
                raise ProtocolError(f"the daemon answered no request of ours: {message!r:.200}")
            got[request_id] = message
        return got

    def _answer(self, request_id: int, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict) or message.get("id") != request_id:
            self._broken()
            raise ProtocolError(f"the daemon answered another request: {message!r:.200}")
        if message.get("ok"):
            return message
        error = DaemonError.of(message)
        if error.hangs_up:
            self._broken()
        raise error

    def _next_reply(self, deadline: float) -> Any:
        """The next message that is not the reply to a posted request."""
        while True:
            message = self._next_message(deadline)
            if not self._posted(message):
                return message

    def _posted(self, message: Any) -> bool:
        """Whether ``message`` answers a request nobody waits for (posted: dropped; given
        up: handed to its handler). One the daemon hangs up after still breaks the
        connection."""
        request_id = message.get("id") if isinstance(message, dict) else None
        if request_id not in self._unawaited:
            return False
        handler = self._unawaited.pop(request_id)
        if handler is not None:
            handler(message)
        if message.get("error") in HANGS_UP:
            self._broken()
            raise DaemonError.of(message)
        return True

    def _next_message(self, deadline: float, fds: list[int] | None = None) -> Any:
        """The next message; ``fds`` collects the descriptors passed with it (the
        hello's pool)."""
        while not self._ready:
            if fds is None:
                data = self._io(lambda: self._sock.recv(1 << 16), deadline)
            else:
                data = self._io(lambda: recv_with_fds(self._sock, fds), deadline)
            self._take(data)
        return self._ready.pop(0)

    def _read_waiting(self) -> None:
        """Read what has come (without waiting): replies to posted requests are dropped
        (or handed to their handlers), those to started ones kept for :meth:`collect`; a
        thread that only posts for a while does not leave them piling up."""
        self._sock.settimeout(0.0)  # non-blocking: each call sets its own timeout again
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                self._broken()
                raise Unreachable(f"the connection was lost: {exc.strerror or exc}") from exc
            self._take(data)
        if self._ready:
            self._route()

    def _take(self, data: bytes) -> None:
        """Decode ``data`` read from the socket and route what it completes."""
        if not data:
            self._broken()
            raise Unreachable("the daemon closed the connection")
        try:
            self._ready.extend(self._decoder.feed(data))
        except ProtocolError:
            self._broken()
            raise
        self._route()

    def _route(self) -> None:
        """Take the replies to posted and started requests out of the decoded messages."""
        kept = []
        for message in self._ready:
            if self._posted(message):
                continue
            request_id = message.get("id") if isinstance(message, dict) else None
            if request_id in self._started:
                self._arrived[request_id] = message
            else:
                kept.append(message)
        self._ready = kept

    def _send(self, frames: list[bytes], deadline: float) -> None:
        data = b"".join(frames)
        self._io(lambda: self._sock.sendall(data), deadline)

    def _io(self, call: Any, deadline: float, *, wait: bool = False) -> Any:
        """``call()`` on the socket with what is left of ``deadline`` as its timeout; a
        timeout or a socket error breaks the client, except a timeout of a ``wait``
        (a read between whole frames, for :meth:`collect`: the connection stays usable)."""
        try:
            self._sock.settimeout(_left(deadline))
            return call()
        except TimeoutError:
            if not wait:
                self._broken()
            raise DaemonSilent("no answer from the daemon within the deadline") from None
        except OSError as exc:
            self._broken()
            raise Unreachable(f"the connection was lost: {exc.strerror or exc}") from exc


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; a timeout at once when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
