"""Who may hold a connection to an events socket: at most ``max_peers`` at a time.

ZMQ accepts every connection its listener sees, and each one holds a descriptor of the
daemon's process: 1,081 idle TCP connections to the events port once held the daemon at
its descriptor limit, and no client could reach the control socket. A :class:`PeerBound`
follows one socket's monitor (accepted, disconnected, closed) and shuts a connection down
as soon as it is one too many; ZMQ then closes it itself. Its descriptor is shut down only
while it is still a connection to that socket's own address (a descriptor number closed
and reused meanwhile is someone else's). A connection that never completes the ZMTP
greeting is closed by ZMQ after ``HANDSHAKE_MS``, and one that sends more than
:data:`MAX_MESSAGES` messages (subscriptions) is shut down too: ZMQ keeps each
subscription a peer sends until it goes, some 19 KB apiece for a 400-byte one.

Everything here runs on the publisher's thread.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["HANDSHAKE_MS", "MAX_MESSAGES", "PeerBound"]

HANDSHAKE_MS = 5_000  # a peer that has not said it speaks ZMTP by then is closed
MAX_MESSAGES = 16  # messages one connection may send to the PUB side (a router sends one)
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class PeerBound:
    """Keeps one ZMQ socket's accepted connections at ``max_peers`` or fewer."""

    def __init__(self, sock: zmq.Socket[bytes], max_peers: int) -> None:
        self.max_peers = max_peers
        self.refused = 0  # connections shut down for being one too many
        self.live: set[int] = set()  # descriptors of the accepted connections
        self._sent: dict[int, int] = {}  # descriptor -> messages it sent
        self._address: Any = None  # the listener's own address (getsockname)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self.monitor = sock.get_monitor_socket(_WATCHED)

    def bound_to(self, endpoint: str) -> None:
        """The address the socket listens on (its ``LAST_ENDPOINT``)."""
        if endpoint.startswith("ipc://"):
            self._address = endpoint[len("ipc://") :]
        else:
            host, _, port = endpoint[len("tcp://") :].rpartition(":")
            self._address = (host.strip("[]"), int(port))

    def take(self) -> None:
        """Read every monitor event waiting; shut down what is over the bound."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = event["value"]
            self._sent.pop(fd, None)
            if event["event"] == zmq.EVENT_ACCEPTED:
                if len(self.live) >= self.max_peers and self._shut(fd):
                    self.refused += 1
                else:
                    self.live.add(fd)
            else:
                self.live.discard(fd)

    def sent_one(self, fd: int) -> bool:
        """Connection ``fd`` sent a message: False when that was one too many (it is
        shut down, the message to be ignored)."""
        count = self._sent.get(fd, 0) + 1
        self._sent[fd] = count
        if count <= MAX_MESSAGES:
            return True
        if count == MAX_MESSAGES + 1 and self._shut(fd):
            self.refused += 1
        return False

    def _shut(self, fd: int) -> bool:
        """Shut connection ``fd`` down if it is still one to this socket's address."""
        try:
            peer = socket.socket(fileno=fd)
        except OSError:
            return False  # closed already
        try:
            local = peer.getsockname()
            if isinstance(self._address, tuple) and isinstance(local, tuple):
                ours = bool(local[1] == self._address[1])
            else:
                ours = bool(local == self._address)
            if ours:
                with contextlib.suppress(OSError):
                    peer.shutdown(socket.SHUT_RDWR)
            return ours
        except OSError:
            return False
        finally:
            peer.detach()  # the descriptor stays ZMQ's: it closes it

    def close(self) -> None:
        self.monitor.close(linger=0)
