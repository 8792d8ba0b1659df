"""Engines on top of tierd's client: each integration is a client of the daemon only.

- :mod:`tierd.integrations.vllm`: a secondary tier of vLLM's KV offloading (needs vLLM).
- :mod:`tierd.integrations.sglang`: SGLang's HiCache L3 storage backend (needs SGLang);
  ``sglang_pages`` (keys, page geometry, namespaces) and ``sglang_jobs`` (page moves under
  deadlines) have no engine imports.
- :mod:`tierd.integrations.link`: the daemon connection an integration keeps on its own
  thread and event loop, reconnecting with backoff (no engine imports).
- :mod:`tierd.integrations.naming`: namespaces derived from what makes KV bytes
  interchangeable (no engine imports).
"""
