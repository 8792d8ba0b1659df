"""SGLang's side of tierd: its HiCache storage backend
(:mod:`~tierd.integrations.sglang.backend`: ``TierdHiCache``, which SGLang's extra config
names with this package as its module, imported from there on first use), its pages'
keys, geometry and namespaces (:mod:`~tierd.integrations.sglang.pages`), their loads and
stores under deadlines (:mod:`~tierd.integrations.sglang.page_jobs`) and SGLang's storage
metrics (:mod:`~tierd.integrations.sglang.storage_metrics`). The package imports no SGLang.
"""

from typing import Any

from tierd.lazy import lazy_attribute

__all__ = ["SglangSettings", "TierdHiCache", "UnsupportedPool"]

_HOMES = dict.fromkeys(__all__, "tierd.integrations.sglang.backend")


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, name, _HOMES)
