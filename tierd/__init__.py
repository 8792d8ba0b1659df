"""tierd: a tiered KV-cache block store for LLM serving (GPU -> CPU -> disk)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from tierd.errors import TierdError
from tierd.events import EventKind, TierEvent
from tierd.keys import BlockKey, Medium, block_key
from tierd.policy import CachePolicy, make_policy, policy_names
from tierd.tier import StorePlan, Tier, TierStats
from tierd.version import __version__


def open(config: Any) -> AbstractAsyncContextManager[TierChain]:
    """Open a tier chain in-process from a config model, a YAML path or a mapping:
    ``async with tierd.open("tierd.yaml") as chain: ...``."""
    from tierd.library import open_chain

    return open_chain(config)


if TYPE_CHECKING:
    from tierd.chain import TierChain

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
