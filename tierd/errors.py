"""The tierd exception tree.

Every error tierd raises on purpose derives from :class:`TierdError`. Errors are named
after the state they report and carry the tier, medium and key where they apply. A cache
miss is never an exception: it is a return value.

::

    TierdError
    ├── ConfigError                 a configuration value is invalid
    ├── UnknownPolicy               a policy name is not in the registry
    ├── BlockStateError             an operation does not fit a block's state
    │   ├── BlockMissing            the tier does not hold the key
    │   ├── BlockNotReady           the block is still being written
    │   ├── BlockNotPinned          complete_load without a matching prepare_load
    │   └── BlockBusy               the block is pinned or in flight
    ├── CapacityError               not enough room, even after eviction
    ├── ResourceClosed              the object was closed
    │   ├── TierClosed
    │   └── StoreClosed
    ├── SlotError                   a slot index or buffer does not fit the store
    ├── StoreIOError                an OS-level I/O failure (path, errno)
    │   └── SlabInUse               another process holds the disk slab's lock
    ├── TransferError               a copy between stores failed
    ├── ProtocolError               a malformed request on the control socket
    ├── AlreadyRunning              another daemon serves the configured socket
    └── TraceError                  a workload trace file is missing or malformed (path, line)
"""

from __future__ import annotations

import errno as _errno
from typing import Any

__all__ = [
    "AlreadyRunning",
    "BlockBusy",
    "BlockMissing",
    "BlockNotPinned",
    "BlockNotReady",
    "BlockStateError",
    "CapacityError",
    "ConfigError",
    "ProtocolError",
    "ResourceClosed",
    "SlabInUse",
    "SlotError",
    "StoreClosed",
    "StoreIOError",
    "TierClosed",
    "TierdError",
    "TraceError",
    "TransferError",
    "UnknownPolicy",
]


class TierdError(Exception):
    """Base of every error tierd raises on purpose."""


class ConfigError(TierdError):
    """A configuration value is invalid; ``path`` is where it sits (``tiers.1.policy``)."""

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class UnknownPolicy(TierdError, ValueError):
    """A cache policy name that is not registered; the message lists the valid names."""

    def __init__(self, name: str, valid: list[str]) -> None:
        super().__init__(f"unknown cache policy {name!r}; valid policies: {', '.join(valid)}")
        self.name = name
        self.valid = valid


class BlockStateError(TierdError):
    """An operation that does not fit the state of a block."""

    def __init__(self, message: str, *, tier: str, medium: str, key: Any) -> None:
        super().__init__(f"{message} (tier={tier}, medium={medium}, key={_show(key)})")
        self.tier = tier
        self.medium = medium
        self.key = key


class BlockMissing(BlockStateError):
    """The tier holds no block under this key."""


class BlockNotReady(BlockStateError):
    """The block is still being written and cannot be read yet."""


class BlockNotPinned(BlockStateError):
    """``complete_load`` for a block that no ``prepare_load`` pinned."""


class BlockBusy(BlockStateError):
    """The block is pinned or in flight, so the operation cannot touch it now."""


class CapacityError(TierdError):
    """Not enough room in a tier, even after evicting everything evictable."""

    def __init__(self, message: str, *, tier: str = "", medium: str = "") -> None:
        super().__init__(f"{message} (tier={tier}, medium={medium})" if tier else message)
        self.tier = tier
        self.medium = medium


class ResourceClosed(TierdError):
    """The object was closed and can no longer be used."""


class TierClosed(ResourceClosed):
    """The tier was closed."""


class StoreClosed(ResourceClosed):
    """The block store was closed (or never opened)."""


class SlotError(TierdError, IndexError):
    """A slot index out of range, or a buffer whose size does not match the store."""


class StoreIOError(TierdError, OSError):
    """An operating-system I/O failure at a store boundary, with the path and errno."""

    def __init__(self, message: str, *, path: str, errno: int | None, medium: str = "") -> None:
        name = _errno.errorcode.get(errno, str(errno)) if errno is not None else "?"
        TierdError.__init__(self, f"{message}: {path} [{name}]")
        self.path = path
        self.errno = errno
        self.medium = medium

    def __str__(self) -> str:
        return str(self.args[0])


class SlabInUse(StoreIOError):
    """Another process (a running daemon, most likely) holds the lock of a disk slab."""

    def __init__(self, path: str, errno: int | None) -> None:
        super().__init__("slab in use", path=path, errno=errno, medium="DISK")
        self.args = (f"the slab {path} is in use by another process (a running tierd daemon?)",)


class TransferError(TierdError):
    """A copy between two stores failed."""


class ProtocolError(TierdError):
    """A request on the control socket is malformed; ``code`` is the wire error code."""

    def __init__(self, message: str, *, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


class AlreadyRunning(TierdError):
    """Another process accepts connections on the configured socket path."""


class TraceError(TierdError):
    """A workload trace that cannot be read: ``path`` and, for a bad line, ``line`` (1-based)."""

    def __init__(self, message: str, *, path: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


def _show(key: Any) -> str:
    if isinstance(key, bytes | bytearray):
        return bytes(key[:16]).hex() + ("..." if len(key) > 16 else "")
    return repr(key)
