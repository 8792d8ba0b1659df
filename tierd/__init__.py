"""tierd: a tiered KV-cache block store for LLM serving (GPU -> CPU -> disk).

The public names below are imported on first use (:mod:`tierd.lazy`): every ``tierd``
command imports this package, and one that only talks to the daemon (``tierd stats``)
needs none of the tiers and policies.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from tierd.lazy import lazy_attribute
from tierd.version import __version__

if TYPE_CHECKING:
    from tierd.chain import TierChain
    from tierd.errors import TierdError
    from tierd.events import EventKind, TierEvent
    from tierd.keys import BlockKey, Medium, block_key
    from tierd.policy import CachePolicy, make_policy, policy_names
    from tierd.tier import StorePlan, Tier, TierStats

__all__ = [
    "BlockKey",
    "CachePolicy",
    "EventKind",
    "Medium",
    "StorePlan",
    "Tier",
    "TierEvent",
    "TierStats",
    "TierdError",
    "__version__",
    "block_key",
    "make_policy",
    "open",
    "policy_names",
]

_HOMES = {
    "BlockKey": "tierd.keys",
    "CachePolicy": "tierd.policy",
    "EventKind": "tierd.events",
    "Medium": "tierd.keys",
    "StorePlan": "tierd.tier",
    "Tier": "tierd.tier",
    "TierEvent": "tierd.events",
    "TierStats": "tierd.tier",
    "TierdError": "tierd.errors",
    "block_key": "tierd.keys",
    "make_policy": "tierd.policy",
    "policy_names": "tierd.policy",
}


def open(config: Any) -> AbstractAsyncContextManager[TierChain]:
    """Open a tier chain in-process from a config model, a YAML path or a mapping:
    ``async with tierd.open("tierd.yaml") as chain: ...``."""
    from tierd.library import open_chain

    return open_chain(config)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, name, _HOMES)
