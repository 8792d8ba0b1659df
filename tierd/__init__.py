"""tierd: a tiered KV-cache block store for LLM serving (GPU -> CPU -> disk)."""

from tierd.errors import TierdError
from tierd.events import EventKind, TierEvent
from tierd.keys import BlockKey, Medium, block_key
from tierd.policy import CachePolicy, make_policy, policy_names
from tierd.tier import StorePlan, Tier, TierStats

__version__ = "0.1.0"

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
    "policy_names",
]
