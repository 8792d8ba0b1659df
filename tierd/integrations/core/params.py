"""The checks every engine integration makes of the settings an engine hands it (an
LMCache ``adapter_params``, an SGLang ``extra_config``): no unknown key, the uids as a
tuple, the deadlines positive. Each integration adds its own checks after these. And
what to tell a user whose engine's block size the daemon does not serve
(:func:`size_advice`, :class:`BlockSizeMismatch`), and what an engine's start makes of
the daemon's first answer (:func:`start_refusal`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tierd.control.clients.handshake import DaemonError, UntrustedDaemon
from tierd.errors import TierdError

__all__ = ["BlockSizeMismatch", "checked_params", "size_advice", "start_refusal"]

# Answers a daemon gives only for now: the start goes on (blocks miss until it serves).
_TRANSIENT = frozenset({"busy", "shutting_down"})


def checked_params(
    cls: type,
    given: dict[str, Any],
    *,
    owner: str,
    unknown_what: str,
    doc: str,
    positive: tuple[str, ...],
) -> dict[str, Any]:
    """``given`` for the dataclass ``cls``; ``ValueError`` naming ``owner`` for a key
    ``cls`` lacks (listing what it has, and ``doc``) or a field of ``positive`` <= 0."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{unknown_what}: {unknown} (known: {sorted(known)}; see {doc})")
    if "server_uids" in given:
        given["server_uids"] = tuple(int(uid) for uid in given["server_uids"])
    for name in positive:
        if name in given and not float(given[name]) > 0:
            raise ValueError(f"{owner}: {name} must be > 0")
    return given


def start_refusal(
    exc: BaseException, socket: str, *, config: str, engine: str
) -> ValueError | None:
    """What an engine's start makes of ``exc``, raised by its first hello to the daemon at
    ``socket``: a refusal to raise (the socket served by another user; an error the
    daemon will keep answering: a namespace or uid it does not admit), naming ``config``
    (the engine's tierd settings) and ``engine``; or None, when the daemon is only absent,
    busy or stopping (the engine starts, its blocks miss until the daemon serves)."""
    if isinstance(exc, UntrustedDaemon):
        return ValueError(f"{exc} ({config}: server_uids)")
    if isinstance(exc, DaemonError) and exc.code not in _TRANSIENT:
        return ValueError(f"tierd at {socket} refused {engine}: {exc}")
    return None


def size_advice(block_bytes: int) -> str:
    """What to change in tierd's config for an engine whose blocks are ``block_bytes``."""
    return (
        f"set `block_bytes: {block_bytes}` in tierd's config and restart it, or"
        " `block_sizes: 2` (or more) so that it serves several sizes"
    )


class BlockSizeMismatch(TierdError):
    """The daemon does not serve the engine's block size (``reason``: the daemon's words)."""

    def __init__(self, wanted_bytes: int, socket_path: str, reason: str) -> None:
        super().__init__(
            f"the tierd daemon at {socket_path} does not serve this engine's blocks of"
            f" {wanted_bytes} bytes ({reason}): {size_advice(wanted_bytes)}"
        )
        self.wanted_bytes = wanted_bytes
        self.reason = reason
