"""Engines on top of tierd's client: each integration is a client of the daemon only.

- :mod:`tierd.integrations.vllm`: a secondary tier of vLLM's KV offloading (needs vLLM).
- :mod:`tierd.integrations.sglang`: SGLang's HiCache L3 storage backend (needs SGLang);
  ``sglang_pages`` (keys, page geometry, namespaces) and ``sglang_jobs`` (page moves under
  deadlines) have no engine imports.
- :mod:`tierd.integrations.lmcache`: LMCache's L2 adapter (needs LMCache); its tasks run
  on a link, as LMCache's interface is asynchronous (submit, then an event fd).
- :mod:`tierd.integrations.core.engine_calls`: every call of vLLM's tier and SGLang's backend,
  on the calling thread's own blocking connection (``channel``), down the data path
  ``route`` picks (``moves``) (no engine imports).
- :mod:`tierd.integrations.core.link`: a daemon connection on a thread and event loop of its
  own, reconnecting with backoff; it watches the daemon for the engines (the breaker's
  probe) and carries LMCache's tasks and the events vLLM's tier follows (no engine imports).
- :mod:`tierd.integrations.core.naming`: namespaces derived from what makes KV bytes
  interchangeable (no engine imports).
"""
