"""LMCache's object keys as tierd namespaces and block keys (no LMCache import).

LMCache names an object by ``ObjectKey`` (chunk hash, model name, KV rank, object group,
cache salt). Two objects are interchangeable only when all of these match and the bytes
were made the same way (object size, serde, chunk size): tierd keeps apart what is not.

- **The namespace** (one daemon connection each) is ``<prefix>/<model>/<digest>``: the
  digest is a SHA-256 of the model name, the cache salt (per-user isolation: another salt
  is another namespace, so ``tierd stats`` and ``delete`` see users apart), the block size
  and the adapter's ``namespace`` tag (what the user says the bytes also depend on: serde,
  chunk size, KV dtype). The model part is for people reading ``tierd stats``.
- **The block key** (at most 64 bytes) is the KV rank and object group, packed, then the
  chunk hash (a hash longer than fits is itself hashed, marked so in the key's form byte,
  so the two forms never meet).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass

from tierd.keys import MAX_KEY_BYTES

__all__ = ["SpaceFacts", "block_key", "namespace_of"]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:@+=-]+")
_HEAD = struct.Struct(">IIB")  # kv_rank, object group, form (0: hash as is, 1: hashed)
_ROOM = MAX_KEY_BYTES - _HEAD.size
_NAMESPACE_MAX = 128
_MODEL_PART_MAX = 64
_DIGEST_HEX = 16


@dataclass(frozen=True, slots=True)
class SpaceFacts:
    """What decides the namespace of an object."""

    model_name: str
    cache_salt: str
    block_bytes: int
    tag: str  # the adapter's `namespace` parameter ("" when none)


def namespace_of(facts: SpaceFacts, prefix: str = "lmcache") -> str:
    """``<prefix>/<model>/<16 hex digits>``, within tierd's default namespace pattern."""
    blob = json.dumps(
        {
            "model": facts.model_name,
            "salt": facts.cache_salt,
            "block_bytes": facts.block_bytes,
            "tag": facts.tag,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_HEX]
    room = min(_MODEL_PART_MAX, _NAMESPACE_MAX - len(prefix) - _DIGEST_HEX - 2)
    model = _NAME_CHARS.sub("_", facts.model_name.replace("/", "_"))[: max(room, 1)]
    return f"{prefix}/{model or 'unknown'}/{digest}"


def block_key(chunk_hash: bytes, kv_rank: int, object_group: int) -> bytes:
    """The daemon's key of one object of a namespace."""
    if not 0 <= kv_rank < 1 << 32 or not 0 <= object_group < 1 << 32:
        raise ValueError(f"kv_rank {kv_rank} or object group {object_group} out of range")
    if len(chunk_hash) <= _ROOM and chunk_hash:
        return _HEAD.pack(kv_rank, object_group, 0) + bytes(chunk_hash)
    digest = hashlib.blake2b(bytes(chunk_hash), digest_size=_ROOM).digest()
    return _HEAD.pack(kv_rank, object_group, 1) + digest
