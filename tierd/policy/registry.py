"""Cache policies by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierd.errors import UnknownPolicy

if TYPE_CHECKING:
    from tierd.policy.base import CachePolicy

__all__ = ["make_policy", "policy_class", "policy_names", "register_policy"]

_REGISTRY: dict[str, type[CachePolicy]] = {}


def register_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"cache policy {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[CachePolicy]:
    """The policy class registered as ``name``; :class:`UnknownPolicy` lists the valid ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(name, policy_names()) from None


def make_policy(name: str, capacity: int) -> CachePolicy:
    """A new policy ``name`` for a tier of ``capacity`` blocks."""
    return policy_class(name)(capacity)
