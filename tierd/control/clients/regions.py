"""The client's side of engine host regions (``docs/protocol.md``, section 5.19).

An engine registers a file descriptor of its own host KV memory once
(:func:`register_region`); then a store or a load is one request of keys and byte offsets
into that memory, and the daemon moves the bytes itself. The engine's thread only waits.

Registering is an exchange of its own: the daemon reads the descriptor from the socket
itself, so nothing else may be written behind the request until the daemon asks for it
(a ``send_fd`` push). :func:`register_region` holds back every request sent meanwhile on
this client (they go out, in order, once the registration is answered), sends one byte
with the descriptor (``SCM_RIGHTS``) when asked, and returns the region's id.

A job larger than the daemon's per-request key limit (``max_keys_per_request``), or than
the blocks one connection may hold (``max_lease_blocks``), is sent as several requests,
one after the other, and the answers are joined: callers see one list of flags.
"""

from __future__ import annotations

import asyncio
import os
import socket
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tierd.control.clients.handshake import Unreachable

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "Registration",
    "RegionLink",
    "job_keys",
    "move_blocks",
    "region_requests",
    "register_region",
]


class RegionLink(Protocol):
    """What region calls use of the client."""

    info: dict[str, Any]

    @property
    def block_bytes(self) -> int: ...

    def send(self, op: str, **fields: Any) -> asyncio.Future[dict[str, Any]]: ...

    async def request(self, op: str, **fields: Any) -> dict[str, Any]: ...


class Registration:
    """A client's registration state: one at a time (``lock``); while one is under way,
    frames sent are ``held`` back, and the daemon's call for the descriptor resolves
    ``wanted``."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.held: list[bytes] | None = None
        self.wanted: asyncio.Future[Any] | None = None

    def hold(self, frame: bytes) -> bool:
        """Keep ``frame`` back if a registration is under way; whether it was."""
        if self.held is None:
            return False
        self.held.append(frame)
        return True

    def asked(self) -> None:
        """The daemon called for the descriptor (its ``send_fd`` push)."""
        if self.wanted is not None and not self.wanted.done():
            self.wanted.set_result(None)


async def register_region(
    link: RegionLink,
    state: Registration,
    transport_of: Callable[[], asyncio.Transport | None],
    fd: int,
    size: int,
) -> int:
    """Hand ``fd`` (``size`` bytes of the engine's memory) to the daemon; its region id."""
    async with state.lock:
        wanted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        state.wanted, state.held = wanted, []
        try:
            reply = link.send("register_region", size=size)
            await asyncio.wait({wanted, reply}, return_when=asyncio.FIRST_COMPLETED)
            if wanted.done() and not reply.done():
                _send_fd(transport_of(), fd)
            return int((await reply)["region"])
        finally:
            state.wanted = None
            held, state.held = state.held, None
            transport = transport_of()
            if held and transport is not None and not transport.is_closing():
                transport.writelines(held)
            if not wanted.done():
                wanted.cancel()


def _send_fd(transport: asyncio.Transport | None, fd: int) -> None:
    """One byte with ``fd`` attached, on the connection's socket."""
    if transport is None or transport.is_closing():
        raise Unreachable("the connection closed during register_region")
    if transport.get_write_buffer_size():
        raise Unreachable("register_region: earlier requests are still unsent")
    own = transport.get_extra_info("socket").fileno()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(own)) as sock:
        try:
            sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [fd]))])
        except OSError as exc:
            transport.close()
            raise Unreachable(f"cannot send the region's descriptor: {exc}") from exc


def job_keys(info: dict[str, Any], total: int) -> int:
    """Keys per request of a region job: the daemon's per-request limit (``info``: the
    hello reply), and at most the blocks this connection may hold at once."""
    step = int(info.get("max_keys_per_request") or total)
    held = int(info.get("max_lease_blocks") or 0)
    if held > 0:
        step = min(step, held)
    return max(1, min(step, total))


def region_requests(
    info: dict[str, Any],
    block_bytes: int,
    region: int,
    keys: Sequence[bytes],
    offsets: npt.ArrayLike,
    piece_bytes: Sequence[int] | None,
    expires: float | None = None,
) -> list[dict[str, Any]]:
    """The fields of each ``region_store`` / ``region_load`` request that moves ``keys``
    at ``offsets`` (keys x pieces), in order (a blocking client sends them too)."""
    count = len(keys)
    if not count:
        return []
    pieces = [block_bytes] if piece_bytes is None else [int(p) for p in piece_bytes]
    import numpy as np  # only where regions are used: client commands never need it

    table = np.ascontiguousarray(offsets, dtype="<u8")
    if table.size != count * len(pieces):
        raise ValueError(
            f"offsets must hold {count} x {len(pieces)} values (keys x pieces),"
            f" not {table.size} (shape {table.shape})"
        )
    table = table.reshape(count, len(pieces))
    step = job_keys(info, count)
    requests = []
    for start in range(0, count, step):
        fields: dict[str, Any] = {
            "region": region,
            "keys": list(keys[start : start + step]),
            "offsets": table[start : start + step].tobytes(),
        }
        if piece_bytes is not None:
            fields["pieces"] = pieces
        if expires is not None:
            fields["expires"] = float(expires)
        requests.append(fields)
    return requests


async def move_blocks(
    client: RegionLink,
    op: str,
    region: int,
    keys: Sequence[bytes],
    offsets: npt.ArrayLike,
    piece_bytes: Sequence[int] | None,
    expires: float | None = None,
) -> list[bool]:
    """``region_store`` or ``region_load`` of ``keys`` at ``offsets`` (keys x pieces);
    ``expires`` (``time.monotonic()``) is when the caller gives the job up."""
    done: list[bool] = []
    requests = region_requests(
        client.info, client.block_bytes, region, keys, offsets, piece_bytes, expires
    )
    for fields in requests:
        reply = await client.request(op, **fields)
        done.extend(bool(flag) for flag in reply["done"])
    return done
