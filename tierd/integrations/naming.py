"""Namespaces from what makes KV bytes interchangeable.

Two engines must share blocks exactly when their bytes are interchangeable: the same
model and KV dtype, the same tokens per block hash and blocks per chunk, the same KV
groups (layers, tokens per block), the same parallel layout unless the engine says its
bytes do not depend on it, the same host layout, and the same row size. The namespace is
``vllm/<model>/<16 hex digits of a SHA-256 of those facts>``: the model part is for
people reading ``tierd stats``, the digest is what keeps engines apart.

Everything is read defensively with ``getattr``: a fact an engine does not supply (or a
test's mock) counts as absent, never as part of the name.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = ["derive_namespace", "kv_layout_facts"]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:@+=-]+")
_MODEL_PART_MAX = 64
_DIGEST_HEX = 16
_PARALLEL_FIELDS = ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size")


def _plain(value: Any) -> str | int | float | bool | None:
    """``value`` when it is a plain scalar (so mocks and objects never leak in)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return None


def _groups(config: Any) -> list[dict[str, Any]] | None:
    groups = getattr(config, "groups", None)
    if not isinstance(groups, tuple | list):
        return None
    out = []
    for group in groups:
        names = getattr(group, "layer_names", None)
        layers = [str(n) for n in names] if isinstance(names, tuple | list) else None
        out.append(
            {
                "group_id": _plain(getattr(group, "group_id", None)),
                "tokens_per_block": _plain(getattr(group, "tokens_per_block", None)),
                "window_chunks": _plain(getattr(group, "sliding_window_size_in_chunks", None)),
                "layers": layers,
            }
        )
    return out


def kv_layout_facts(offloading_spec: Any, row_bytes: int) -> dict[str, Any]:
    """The facts that decide whether two engines' offloaded bytes are interchangeable."""
    config = getattr(offloading_spec, "config", None)
    model = getattr(config, "model", None)
    cache = getattr(config, "cache", None)
    parallel = getattr(config, "parallel", None)
    facts: dict[str, Any] = {
        "row_bytes": row_bytes,
        "model": _plain(getattr(model, "name", None)),
        "dtype": _plain(getattr(model, "dtype", None)),
        "tokens_per_hash": _plain(getattr(cache, "tokens_per_hash", None)),
        "blocks_per_chunk": _plain(getattr(cache, "blocks_per_chunk", None)),
        "worker_kv_bytes_per_block": _plain(getattr(config, "worker_kv_bytes_per_block", None)),
        "replicated_layout": _plain(getattr(config, "replicated_layout", None)),
        "canonical_layout": _plain(getattr(config, "canonical_layout", None)),
        "kv_cache_layout": _plain(getattr(config, "kv_cache_layout", None)),
        "groups": _groups(config),
    }
    if getattr(parallel, "is_parallelism_agnostic", None) is not True:
        facts["parallel"] = {f: _plain(getattr(parallel, f, None)) for f in _PARALLEL_FIELDS}
    return facts


def derive_namespace(offloading_spec: Any, row_bytes: int) -> str:
    """A short, stable namespace valid under tierd's default ``namespaces.pattern``."""
    facts = kv_layout_facts(offloading_spec, row_bytes)
    blob = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_HEX]
    model = facts["model"] if isinstance(facts["model"], str) else "unknown"
    safe = _NAME_CHARS.sub("_", model.replace("/", "_"))[:_MODEL_PART_MAX] or "unknown"
    return f"vllm/{safe}/{digest}"
