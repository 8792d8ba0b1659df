"""Cache policies: the :class:`CachePolicy` seam, its implementations and their registry."""

from tierd.policy.base import CachePolicy
from tierd.policy.registry import make_policy, policy_class, policy_names, register_policy

# Importing the implementations registers them.
from tierd.policy.lru import LRUPolicy  # isort: skip
from tierd.policy.arc import ARCPolicy  # isort: skip
from tierd.policy.duel import DuelPolicy  # isort: skip

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "DuelPolicy",
    "LRUPolicy",
    "make_policy",
    "policy_class",
    "policy_names",
    "register_policy",
]
