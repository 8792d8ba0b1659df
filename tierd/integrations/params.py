"""The checks every engine integration makes of the settings an engine hands it (an
LMCache ``adapter_params``, an SGLang ``extra_config``): no unknown key, the uids as a
tuple, the deadlines positive. Each integration adds its own checks after these."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

__all__ = ["checked_params"]


def checked_params(
    cls: type, given: dict[str, Any], *, owner: str, unknown_what: str, doc: str,
    positive: tuple[str, ...],
) -> dict[str, Any]:  # fmt: skip
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
