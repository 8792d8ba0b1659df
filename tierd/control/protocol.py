"""The wire protocol of the control socket: framing, error codes, field checks.

Every message is one *frame*: a 4-byte big-endian unsigned length, then that many bytes
of msgpack encoding one map. Requests carry ``id`` (an unsigned integer chosen by the
client, echoed in the reply, so a client can pipeline) and ``op``; replies carry ``id``
and ``ok``, and either the op's fields or ``error`` (a code from :class:`ErrorCode`)
and ``message``. Pushes (event batches) carry ``push`` instead of ``id``. Keys and block
bytes are msgpack ``bin``; names are ``str``. ``docs/protocol.md`` lists every operation.

This module owns no socket: :class:`FrameDecoder` turns received bytes into messages,
:func:`encode` turns a message into a frame, and the ``*_field`` helpers validate request
fields, raising :class:`~tierd.errors.ProtocolError` with the code the reply will carry.
A frame encoded already, in pieces (:mod:`tierd.control.requests.frame_pieces`: a ``get`` of
64 MiB of blocks), is written a piece at a time, each as a message of the one field
:data:`FRAME_PIECE`, which :func:`encode` returns as it is.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

from tierd.errors import (
    CapacityError,
    ProtocolError,
    ResourceClosed,
    StoreIOError,
    TierdError,
    TransferError,
)
from tierd.keys import BlockKey

__all__ = [
    "FRAME_PIECE",
    "HEADER",
    "error_code_of",
    "NAMESPACE_ID_BYTES",
    "OPERATIONS",
    "PASS_FDS",
    "prefixed_keys",
    "PROTOCOL_VERSION",
    "DecodeLimits",
    "ErrorCode",
    "FrameDecoder",
    "FrameTooLarge",
    "bool_list_field",
    "bytes_list_field",
    "encode",
    "error_reply",
    "int_field",
    "keys_field",
    "opt_str_field",
]

# 2: pools are passed as file descriptors (hello's ``pool_fd``), never named by a path.
PROTOCOL_VERSION = 2
# A reply field the session sets and the connection takes out: descriptors to pass with
# that reply's frame (SCM_RIGHTS). Never sent as a field.
PASS_FDS = "_pass_fds"
# A message of this one field is bytes of a frame encoded already (a piece of a big
# reply, :mod:`tierd.control.requests.frame_pieces`): :func:`encode` returns them as they are.
FRAME_PIECE = "_frame_piece"
# Every operation a session answers (docs/protocol.md, section 5).
OPERATIONS = (
    "hello",
    "lookup",
    "touch",
    "prepare_store",
    "complete_store",
    "abort_store",
    "prepare_load",
    "complete_load",
    "put",
    "get",
    "subscribe",
    "unsubscribe",
    "stats",
    "health",
    "config",
    "metrics",
    "flush",
    "clear",
    "stop",
    "lookup_each",
    "register_region",
    "unregister_region",
    "region_store",
    "region_load",
    "namespaces",
    "inspect",
    "delete",
    "reload",
    "trace",
    "describe",
    "blocks_held",
    "sizes",
)
HEADER = struct.Struct(">I")
# A namespaced key is an 8-byte namespace id followed by the client's key, so a client
# key may be at most MAX_KEY_BYTES - 8 = 56 bytes.
NAMESPACE_ID_BYTES = 8
_MAX_ID = (1 << 64) - 1


class ErrorCode(StrEnum):
    """The ``error`` field of a failed reply. Closed set: clients may switch on it."""

    BAD_FRAME = "bad_frame"  # the frame is not msgpack
    FRAME_TOO_LARGE = "frame_too_large"  # over limits.max_frame_bytes; connection closed
    BAD_REQUEST = "bad_request"  # not a map, a missing or mistyped field
    UNKNOWN_OP = "unknown_op"
    HELLO_REQUIRED = "hello_required"  # the first request must be hello
    VERSION_MISMATCH = "version_mismatch"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    BAD_NAMESPACE = "bad_namespace"
    TOO_MANY_NAMESPACES = "too_many_namespaces"  # a new name past namespaces_per_tenant
    NAMESPACE_REQUIRED = "namespace_required"  # data ops need a namespace in hello
    TOO_MANY_KEYS = "too_many_keys"  # over limits.max_keys_per_request
    BAD_KEY = "bad_key"  # empty, too long or not bytes
    UNKNOWN_LEASE = "unknown_lease"  # not a lease of this connection (finished, or expired)
    UNKNOWN_TIER = "unknown_tier"
    NO_POOL = "no_pool"  # the entry tier is not a shared-memory pool: use put/get
    CAPACITY = "capacity"  # no room even after eviction, or past a lease bound
    IO_ERROR = "io_error"
    NOT_ALLOWED = "not_allowed"  # peer in no tenant (id 0, closed), or an operator's op
    BUSY = "busy"  # too many connections; connection closed
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"  # a bug: logged with a traceback, state untouched
    UNKNOWN_REGION = "unknown_region"  # not a region of this connection (or unregistered)
    # reload: the config file is invalid; trace: its directory is not private. Nothing changed.
    BAD_CONFIG = "bad_config"


def encode(message: Mapping[str, Any]) -> bytes:
    """One frame: length prefix plus msgpack body (a :data:`FRAME_PIECE`: its bytes)."""
    if type(message) is dict:  # (a test encodes what is not a map, too)
        piece: bytes | None = message.get(FRAME_PIECE)
        if piece is not None:
            return piece
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def error_code_of(exc: Exception) -> ErrorCode:
    """The code a failed request is answered with, by what went wrong."""
    if isinstance(exc, ProtocolError):
        codes = {str(code): code for code in ErrorCode}
        return codes.get(exc.code, ErrorCode.BAD_REQUEST)
    if isinstance(exc, CapacityError):
        return ErrorCode.CAPACITY
    if isinstance(exc, StoreIOError | TransferError):
        return ErrorCode.IO_ERROR
    if isinstance(exc, ResourceClosed):
        return ErrorCode.SHUTTING_DOWN
    if isinstance(exc, TierdError):
        return ErrorCode.BAD_REQUEST
    return ErrorCode.INTERNAL


def error_reply(request_id: int, code: ErrorCode | str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": str(code), "message": message}


class FrameTooLarge(ProtocolError):
    """A length header over the limit: framing is lost from there on. ``before`` holds
    the messages of the whole frames that came before it in the same ``feed``: they were
    sent in good order and still deserve an answer."""

    def __init__(self, message: str, *, before: list[Any]) -> None:
        super().__init__(message, code=ErrorCode.FRAME_TOO_LARGE)
        self.before = before


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """What one frame may decode into. A request is a map of a few fields, at most two of
    them lists (keys and data): these bounds make the cost of decoding any frame a small
    multiple of the largest valid request, whatever its bytes say. ``containers`` counts
    every list and map in the frame, nested or not."""

    items: int  # elements of one list (keys, data)
    bin_bytes: int  # one bin value (a block)
    str_chars: int = 4096  # one string
    map_entries: int = 64  # one map (a request's fields)
    containers: int = 16  # lists and maps in one frame

    @classmethod
    def for_requests(cls, max_keys: int, max_frame_bytes: int) -> DecodeLimits:
        # Twice the key limit, so an over-long key list still decodes and is answered
        # too_many_keys rather than bad_frame.
        return cls(items=2 * max_keys + 16, bin_bytes=max_frame_bytes)


class _TooManyContainers(Exception):
    pass


class FrameDecoder:
    """Reassembles frames from a byte stream; ``feed`` returns the complete messages.

    A frame longer than ``max_frame_bytes`` raises :class:`FrameTooLarge` before its body
    is buffered (framing is lost: the caller closes the connection). A
    body that is not msgpack, or that breaks ``limits``, yields a :class:`ProtocolError`
    in place of its message, so the caller can answer it and go on (framing is intact).
    The server decodes with limits; a client trusts its daemon and decodes without."""

    def __init__(self, max_frame_bytes: int, limits: DecodeLimits | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.limits = limits
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        buf = self._buf
        buf += data
        out: list[Any] = []
        pos, end = 0, len(buf)
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.max_frame_bytes:
                del buf[:]
                raise FrameTooLarge(
                    f"frame of {size} bytes is over the limit of {self.max_frame_bytes}",
                    before=out,
                )
            if end - pos - HEADER.size < size:
                break
            start = pos + HEADER.size
            out.append(_unpack(buf[start : start + size], self.limits))
            pos = start + size
        if pos:
            del buf[:pos]
        return out


def _unpack(body: bytes | bytearray, limits: DecodeLimits | None) -> Any:
    if limits is None:
        options: dict[str, Any] = {}
    else:
        seen = 0

        def count(container: Any) -> Any:
            nonlocal seen
            seen += 1
            if seen > limits.containers:
                raise _TooManyContainers
            return container

        options = {
            "list_hook": count,
            "object_hook": count,
            "max_array_len": limits.items,
            "max_map_len": limits.map_entries,
            "max_str_len": limits.str_chars,
            "max_bin_len": limits.bin_bytes,
            "max_ext_len": 0,
        }
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, **options)
    except _TooManyContainers:
        return ProtocolError(
            f"the frame holds more than {limits.containers if limits else 0} lists and maps:"
            " no request needs that many",
            code=ErrorCode.BAD_FRAME,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        # msgpack's errors for bad bytes and broken limits are ValueError subclasses.
        return ProtocolError(
            "the frame is not a msgpack message within limits", code=ErrorCode.BAD_FRAME
        )


# -- field checks ------------------------------------------------------------------------


def int_field(msg: Mapping[str, Any], name: str, *, default: int | None = None) -> int:
    value = msg.get(name, default)
    if value is None:
        raise ProtocolError(f"missing field {name!r}", code=ErrorCode.BAD_REQUEST)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_ID:
        raise ProtocolError(
            f"field {name!r} must be an unsigned integer, got {value!r:.40}",
            code=ErrorCode.BAD_REQUEST,
        )
    return value


def opt_seconds_field(msg: Mapping[str, Any], name: str) -> float | None:
    """An optional non-negative number of seconds (None: absent)."""
    value = msg.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ProtocolError(
            f"field {name!r} must be a non-negative number of seconds, got {value!r:.40}",
            code=ErrorCode.BAD_REQUEST,
        )
    return float(value)


def opt_str_field(msg: Mapping[str, Any], name: str, *, max_len: int = 256) -> str | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(
            f"field {name!r} must be a string of at most {max_len} characters",
            code=ErrorCode.BAD_REQUEST,
        )
    return value


def keys_field(
    msg: Mapping[str, Any], *, max_keys: int, max_key_bytes: int, name: str = "keys"
) -> list[bytes]:
    """A non-empty list of at most ``max_keys`` keys of 1..``max_key_bytes`` bytes each."""
    keys = msg.get(name)
    if not isinstance(keys, list) or not keys:
        raise ProtocolError(
            f"field {name!r} must be a non-empty list of bin", code=ErrorCode.BAD_REQUEST
        )
    if len(keys) > max_keys:
        raise ProtocolError(
            f"{len(keys)} keys in one request, the limit is {max_keys}",
            code=ErrorCode.TOO_MANY_KEYS,
        )
    for i, key in enumerate(keys):
        if type(key) is not bytes or not 0 < len(key) <= max_key_bytes:
            raise ProtocolError(
                f"{name}[{i}] must be bin of 1 to {max_key_bytes} bytes",
                code=ErrorCode.BAD_KEY,
            )
    return keys


def prefixed_keys(
    prefix: bytes, msg: Mapping[str, Any], name: str, max_keys: int, max_key_bytes: int
) -> list[BlockKey]:
    """The keys of ``msg``'s field ``name`` (as :func:`keys_field` checks them), each
    with ``prefix`` (a namespace's id) in front."""
    keys = msg.get(name)
    if type(keys) is list and 0 < len(keys) <= max_keys:
        # The hot path, at C speed: prefixing fails for anything but bin, then lengths.
        try:
            out: list[BlockKey] = list(map(prefix.__add__, keys))  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if min(map(len, keys)) > 0 and max(map(len, out)) <= len(prefix) + max_key_bytes:
                return out
    # Something is wrong: let the field check name it.
    keys_field(msg, name=name, max_keys=max_keys, max_key_bytes=max_key_bytes)
    raise ProtocolError(f"field {name!r} is not a list of keys", code=ErrorCode.BAD_KEY)


def bytes_list_field(msg: Mapping[str, Any], name: str, *, count: int, size: int) -> list[bytes]:
    """Exactly ``count`` bin values of exactly ``size`` bytes each."""
    values = msg.get(name)
    if not isinstance(values, list) or len(values) != count:
        raise ProtocolError(
            f"field {name!r} must be a list of {count} bin values", code=ErrorCode.BAD_REQUEST
        )
    for i, value in enumerate(values):
        if type(value) is not bytes or len(value) != size:
            raise ProtocolError(
                f"{name}[{i}] must be bin of exactly {size} bytes (the block size)",
                code=ErrorCode.BAD_REQUEST,
            )
    return values


def bool_field(msg: Mapping[str, Any], name: str, default: bool) -> bool:
    """An optional boolean field (``default`` when absent); anything else is refused."""
    value = msg.get(name, default)
    if type(value) is not bool:
        raise ProtocolError(f"field {name!r} must be a boolean", code=ErrorCode.BAD_REQUEST)
    return value


def bool_list_field(msg: Mapping[str, Any], name: str, *, count: int) -> list[bool]:
    """``count`` booleans, or one boolean meaning all of them (default: all true)."""
    value = msg.get(name, True)
    if isinstance(value, bool):
        return [value] * count
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(isinstance(v, bool) for v in value)
    ):
        raise ProtocolError(
            f"field {name!r} must be a boolean or a list of {count} booleans",
            code=ErrorCode.BAD_REQUEST,
        )
    return value
