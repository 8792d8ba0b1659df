"""Engines on top of tierd's client: each integration is a client of the daemon only.

- :mod:`tierd.integrations.core`: what every engine shares, with no engine imports: the
  link that watches the daemon, each calling thread's blocking connection, every engine
  call down one data path, pool leases, namespaces, the checks of an engine's settings,
  what ``TIERD`` means.
- :mod:`tierd.integrations.vllm`: vLLM's secondary tier, tierd's pool as its CPU tier, the
  connector ``TIERD=1`` names and vLLM's plugin (needs vLLM).
- :mod:`tierd.integrations.sglang`: SGLang's HiCache L3 storage backend (needs SGLang).
- :mod:`tierd.integrations.lmcache`: LMCache's L2 adapter (needs LMCache); its tasks run
  on a link, as LMCache's interface is asynchronous (submit, then an event fd).

An engine package imports no engine itself; the names an engine's config gives
(``tierd.integrations.vllm.TierdSecondaryTier``, ...) are imported on first use.
"""
