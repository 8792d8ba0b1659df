"""Raw frames on a daemon's socket: the replies a test reads through a :class:`FrameDecoder`."""

from __future__ import annotations

import socket
from typing import Any

from tierd.control.protocol import FrameDecoder


def replies_from(sock: socket.socket, decoder: FrameDecoder, count: int) -> list[Any]:
    """The next ``count`` messages through ``decoder``, which keeps what arrived past them
    for the next call (fewer if the daemon closes the connection)."""
    out: list[Any] = []
    while len(out) < count:
        data = sock.recv(1 << 20)
        if not data:
            break
        out += decoder.feed(data)
    return out
