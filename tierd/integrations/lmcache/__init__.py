"""LMCache's side of tierd: its L2 adapter for the MP server
(:mod:`~tierd.integrations.lmcache.adapter`: ``TierdL2Adapter`` and its config, which
LMCache's plugin spec names with this package as its module, imported from there on
first use), over its tasks (:mod:`~tierd.integrations.lmcache.tasks`), one namespace's
leases and pins (:mod:`~tierd.integrations.lmcache.space`), its keys
(:mod:`~tierd.integrations.lmcache.object_keys`) and its task book
(:mod:`~tierd.integrations.lmcache.task_book`). The package imports no LMCache.
"""

from typing import Any

from tierd.lazy import lazy_attribute

__all__ = ["LmcacheSettings", "TierdL2Adapter", "TierdL2AdapterConfig"]

_HOMES = dict.fromkeys(__all__, "tierd.integrations.lmcache.adapter")


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, name, _HOMES)
