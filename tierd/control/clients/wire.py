"""The client's end of the control socket as an asyncio protocol: bytes in, messages out.

This module owns :class:`ClientWire`: it decodes the frames the daemon sends
(:class:`~tierd.control.protocol.FrameDecoder`, bounded by ``max_frame_bytes``), hands
each message to the client, says when the connection is lost (a frame it cannot decode
closes it), and resolves :attr:`ClientWire.lost` once the transport is gone. What a
message means (a reply, a push) is :class:`~tierd.control.clients.client.Client`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from tierd.control.protocol import FrameDecoder
from tierd.errors import ProtocolError

__all__ = ["ClientWire"]


class ClientWire(asyncio.Protocol):
    """Feeds ``dispatch`` each decoded message and ``lost`` the end of the connection."""

    def __init__(
        self,
        max_frame_bytes: int,
        dispatch: Callable[[Any], None],
        lost: Callable[[BaseException | None], None],
    ) -> None:
        self.decoder = FrameDecoder(max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()
        self._dispatch = dispatch
        self._on_lost = lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as exc:
            self._on_lost(exc)
            if self.transport is not None:
                self.transport.close()
            return
        for message in messages:
            self._dispatch(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)
        if not self.lost.done():
            self.lost.set_result(None)
