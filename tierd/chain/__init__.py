"""The tier chain: demotion on eviction, promotion on hit, events from every medium.

:mod:`tierd.chain.core` holds :class:`TierChain`; :mod:`tierd.chain.handles` the load
and store handles it gives out;
:mod:`tierd.chain.values` the values it takes and returns; :mod:`tierd.chain.census` the
blocks per key prefix, kept from the chain's events.
"""

from tierd.chain.census import PrefixCensus
from tierd.chain.core import TierChain
from tierd.chain.handles import LoadHandle, StoreHandle
from tierd.chain.values import Admission, ChainStats, Deleted, FlushResult, Level, LookupResult

__all__ = [
    "Admission",
    "ChainStats",
    "Deleted",
    "FlushResult",
    "Level",
    "LoadHandle",
    "LookupResult",
    "PrefixCensus",
    "StoreHandle",
    "TierChain",
]
