"""vLLM's side of tierd, one module per part; the package itself imports no vLLM.

- :mod:`~tierd.integrations.vllm.secondary_tier`: tierd as a secondary tier of vLLM's KV
  offloading (``TierdSecondaryTier``, which vLLM's config names with this package as its
  module: it is imported from there on first use), with its jobs
  (:mod:`~tierd.integrations.vllm.tier_jobs`) and figures
  (:mod:`~tierd.integrations.vllm.tier_report`);
- :mod:`~tierd.integrations.vllm.cpu_spec`: the tiering spec of vLLM's CPU build;
- :mod:`~tierd.integrations.vllm.pool_spec`, :mod:`~tierd.integrations.vllm.pool_manager`,
  :mod:`~tierd.integrations.vllm.pool_worker`: tierd's pool as every engine's CPU tier;
- :mod:`~tierd.integrations.vllm.connector`: the connector ``TIERD=1`` names, whose KV
  events carry the node's blocks; :mod:`~tierd.integrations.vllm.block_descriptions`:
  what the engine's blocks are, for routers;
- :mod:`~tierd.integrations.vllm.plugin`: vLLM's general plugin behind ``TIERD=1``, with
  :mod:`~tierd.integrations.vllm.block_size` (the engine's block size, before any weight
  loads).
"""

from typing import Any

from tierd.lazy import lazy_attribute

__all__ = ["BlockSizeMismatch", "TierdSecondaryTier", "Unreachable", "live_tiers"]

_HOMES = dict.fromkeys(__all__, "tierd.integrations.vllm.secondary_tier")


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, name, _HOMES)
