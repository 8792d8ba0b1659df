"""The tier chain: demotion on eviction, promotion on hit, events from every medium.

:mod:`tierd.chain.core` holds :class:`TierChain` and its load handle;
:mod:`tierd.chain.values` the values it takes and returns.
"""

from tierd.chain.core import LoadHandle, TierChain
from tierd.chain.values import Admission, ChainStats, Level, LookupResult

__all__ = ["Admission", "ChainStats", "Level", "LoadHandle", "LookupResult", "TierChain"]
