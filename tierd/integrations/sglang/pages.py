"""SGLang's host pages as tierd blocks: keys, geometry, namespaces and page copies.

No SGLang or torch imports: everything is read from the objects SGLang hands the backend
(its ``HiCacheStorageConfig`` and host pool) through the methods SGLang's own zero-copy
backends use (``get_page_buffer_meta``, ``kv_buffer``, ``layout``).

- A **key** is SGLang's page hash, a SHA-256 hex string, stored as its 32 raw bytes. Any
  other string (SGLang has none today) becomes ``b"s"`` + the SHA-256 of its UTF-8 bytes:
  33 bytes, so it can never collide with a hex key.
- A **page** of one rank's host pool is the concatenation of the pieces
  ``get_page_buffer_meta`` lists for it, in its order (``page_first``: K then V;
  ``layer_first``: K and V of each layer in turn). That is one tierd block, so the
  daemon's ``block_bytes`` must equal :attr:`PageGeometry.page_bytes`.
- The **namespace** is ``sglang/<model>/<16 hex of a SHA-256>`` over every fact that makes
  two engines' page bytes interchangeable (:func:`page_facts`), the byte order of a block
  among them (``interface_v1``'s pieces or the generic calls' flat page); a user-given
  name is one more fact, never a replacement. The weights are identified as vLLM's are,
  by the one :func:`tierd.integrations.core.naming.weights_identity` (names, sizes, times and
  sampled content of the weight and config files), so weights re-published at the same
  path with the same sizes and times get a new namespace.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tierd.errors import TierdError
from tierd.integrations.core import naming

__all__ = [
    "FlatBlock",
    "PageBlocks",
    "PageGeometry",
    "UnsupportedPool",
    "derive_namespace",
    "gather_page",
    "ignored_allocator",
    "page_facts",
    "page_key",
    "prefix_keys",
    "scatter_page",
]

_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:@+=-]+")
_MODEL_PART_MAX = 64
_DIGEST_HEX = 16
_CONFIG_FIELDS = (
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "attn_cp_rank",
    "attn_cp_size",
    "dcp_rank",
    "dcp_size",
    "tp_lcm_size",
    "should_split_heads",
    "is_page_first_layout",
)
# With MLA every TP rank holds the same latent cache: pages do not depend on the rank.
_RANK_FIELDS = ("tp_rank",)
_POOL_FIELDS = ("page_size", "layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank")


class UnsupportedPool(TierdError):
    """SGLang's host pool has a shape this backend cannot serve byte-exactly."""


def prefix_keys(extra_info: Any) -> list[str] | None:
    """The page hashes SGLang says precede a call's keys, from the sequence's start
    (``HiCacheStorageExtraInfo.prefix_keys``; SGLang passes them only with
    ``"hicache_storage_pass_prefix_keys": true`` in the extra config)."""
    if extra_info is None:
        return None
    keys = getattr(extra_info, "prefix_keys", None)
    return list(keys) if keys is not None else None


def page_key(key: str) -> bytes:
    """tierd's key for one of SGLang's page hashes."""
    if len(key) == 64 and _HEX_KEY.fullmatch(key):
        return bytes.fromhex(key)
    return b"s" + hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """Where one rank's host pages lie: ``pieces`` byte counts per page (the same for
    every page), inside ``nbytes`` bytes of memory at address ``base``."""

    page_tokens: int
    pieces: tuple[int, ...]
    layout: str
    dtype: str
    base: int
    nbytes: int

    @property
    def page_bytes(self) -> int:
        return sum(self.pieces)

    @classmethod
    def of(cls, pool: Any) -> PageGeometry:
        """Read the geometry from SGLang's host pool; :class:`UnsupportedPool` when its
        pages do not all lie, piece by piece, inside its one ``kv_buffer``."""
        buffer = getattr(pool, "kv_buffer", None)
        if buffer is None or isinstance(buffer, list | tuple):
            raise UnsupportedPool(
                f"{type(pool).__name__} keeps its pages in several buffers; tierd serves "
                "host pools with one kv_buffer (MHA and MLA pools)"
            )
        page_tokens = int(pool.page_size)
        base = int(buffer.data_ptr())
        nbytes = int(buffer.numel()) * int(buffer.element_size())
        probe = _IndexList(range(page_tokens))
        try:
            pointers, sizes = pool.get_page_buffer_meta(probe)
        except (NotImplementedError, ValueError, AssertionError) as exc:
            raise UnsupportedPool(
                f"{type(pool).__name__} (layout {pool.layout!r}) cannot describe its pages: {exc}"
            ) from exc
        geometry = cls(
            page_tokens,
            tuple(int(s) for s in sizes),
            str(pool.layout),
            str(pool.dtype),
            base,
            nbytes,
        )
        geometry.offsets(pointers, 1)  # every piece of page 0 inside the buffer
        return geometry

    def offsets(self, pointers: Sequence[int], pages: int) -> npt.NDArray[np.uint64]:
        """``get_page_buffer_meta``'s addresses as byte offsets into the buffer, one row
        per page; :class:`UnsupportedPool` if any piece lies outside it."""
        table = np.asarray(pointers, dtype=np.int64).reshape(pages, len(self.pieces)) - self.base
        ends = table + np.asarray(self.pieces, dtype=np.int64)
        if table.size and (table.min() < 0 or ends.max() > self.nbytes):
            raise UnsupportedPool(
                f"a page piece of the {self.layout} host pool lies outside its kv_buffer"
            )
        return table.astype(np.uint64)

    def memory(self) -> npt.NDArray[np.uint8]:
        """The host pool's bytes, shared (no copy)."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.base))


class _IndexList(list[int]):
    """A list with the ``tolist`` of a tensor: what ``get_page_buffer_meta`` calls."""

    def tolist(self) -> list[int]:
        return list(self)


def gather_page(
    memory: npt.NDArray[np.uint8], offsets: npt.NDArray[np.uint64], pieces: Sequence[int], out: Any
) -> None:
    """Copy one page's pieces, in order, from the host pool into ``out`` (a block)."""
    target = np.frombuffer(out, dtype=np.uint8)
    for in_pool, in_block in _piece_spans(offsets, pieces):
        target[in_block] = memory[in_pool]


def scatter_page(
    memory: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.uint64],
    pieces: Sequence[int],
    block: Any,
) -> None:
    """Copy one block into the pieces of one page of the host pool."""
    source = np.frombuffer(block, dtype=np.uint8)
    for in_pool, in_block in _piece_spans(offsets, pieces):
        memory[in_pool] = source[in_block]


@dataclass(frozen=True, slots=True)
class PageBlocks:
    """One call's pages as blocks (:class:`~tierd.integrations.core.data_paths.Blocks`): page ``i``
    is the pieces at ``offsets[i]`` of the host pool's ``memory``."""

    memory: npt.NDArray[np.uint8]
    offsets: npt.NDArray[np.uint64]
    pieces: tuple[int, ...]

    def fill(self, positions: npt.NDArray[np.intp], source: npt.NDArray[np.uint8]) -> None:
        for position, row in zip(positions.tolist(), source, strict=True):
            scatter_page(self.memory, self.offsets[position], self.pieces, row)

    def gather(self, positions: npt.NDArray[np.intp], out: npt.NDArray[np.uint8]) -> None:
        for position, row in zip(positions.tolist(), out, strict=True):
            gather_page(self.memory, self.offsets[position], self.pieces, row)

    def fill_one(self, position: int, block: memoryview) -> None:
        scatter_page(self.memory, self.offsets[position], self.pieces, block)

    def gather_one(self, position: int, out: memoryview) -> None:
        gather_page(self.memory, self.offsets[position], self.pieces, out)


@dataclass(frozen=True, slots=True)
class FlatBlock:
    """One whole block of a buffer (SGLang's generic get and set)."""

    buffer: npt.NDArray[np.uint8]

    def fill(self, positions: npt.NDArray[np.intp], source: npt.NDArray[np.uint8]) -> None:
        self.buffer[:] = source[0]

    def gather(self, positions: npt.NDArray[np.intp], out: npt.NDArray[np.uint8]) -> None:
        out[0] = self.buffer

    def fill_one(self, position: int, block: memoryview) -> None:
        self.buffer[:] = np.frombuffer(block, dtype=np.uint8)

    def gather_one(self, position: int, out: memoryview) -> None:
        out[:] = self.buffer.data


def _piece_spans(
    offsets: npt.NDArray[np.uint64], pieces: Sequence[int]
) -> Iterator[tuple[slice, slice]]:
    """Where each piece of one page lies: in the host pool, and in the block (the pieces
    one after another, in order)."""
    at = 0
    for offset, size in zip(offsets.tolist(), pieces, strict=True):
        yield slice(offset, offset + size), slice(at, at + size)
        at += size


def ignored_allocator(extra: dict[str, Any] | None, pool: Any) -> bool:
    """Whether the extra config asks for ``"allocator": "shm"`` while SGLang allocated
    the host pool without a memfd (``pool.fd``). SGLang 0.5.23 picks the allocator from
    the extra config only when it is given inline as JSON: from an ``@file`` (JSON, YAML
    or TOML) its choice never sees the key, though the backend does."""
    return (extra or {}).get("allocator") == "shm" and getattr(pool, "fd", None) is None


def _plain(value: Any) -> str | int | float | bool | None:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _model_path(model: str, pool: Any) -> str:
    """The model path in SGLang's ``model_name``: SGLang appends ``-<tag>`` when the host
    pool has a page format of its own (``storage_format_tag``, ``storage_model_name``)."""
    tag = getattr(pool, "storage_format_tag", None)
    if isinstance(tag, str) and tag and model.endswith(f"-{tag}"):
        return model[: -len(tag) - 1]
    return model


def _page_order(config: Any) -> str:
    """How a page's bytes are laid out in its block: ``pieces`` (interface_v1: the pieces
    of ``get_page_buffer_meta`` in turn) or ``flat`` (SGLang's generic calls: its flat data
    page, which for ``layer_first`` puts every layer's K before every layer's V)."""
    extra = getattr(config, "extra_config", None) or {}
    return "pieces" if extra.get("interface_v1") else "flat"


def page_facts(config: Any, pool: Any, geometry: PageGeometry, name: str | None) -> dict[str, Any]:
    """What makes two engines' pages interchangeable (``config``: SGLang's
    ``HiCacheStorageConfig``; ``pool``: its host pool)."""
    mla = bool(getattr(config, "is_mla_model", False))
    model = getattr(config, "model_name", None)
    facts: dict[str, Any] = {
        "model": _plain(model),
        # One weights identity for every engine: the one vLLM's namespace takes.
        "weights": (
            naming.weights_identity(_model_path(model, pool)) if isinstance(model, str) else None
        ),
        "mla": mla,
        "pool": type(pool).__name__,
        "layout": geometry.layout,
        "dtype": geometry.dtype,
        "pieces": list(geometry.pieces),
        "order": _page_order(config),
        "name": name,
    }
    for field in _POOL_FIELDS:
        facts[field] = _plain(getattr(pool, field, None))
    for field in _CONFIG_FIELDS:
        if mla and field in _RANK_FIELDS:
            continue
        facts[field] = _plain(getattr(config, field, None))
    return facts


def derive_namespace(facts: dict[str, Any]) -> str:
    """A short, stable namespace, valid under tierd's default ``namespaces.pattern``."""
    blob = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_HEX]
    model = facts["model"] if isinstance(facts["model"], str) else "unknown"
    base = model.rstrip("/").rsplit("/", 1)[-1] if os.path.isabs(model) else model
    safe = _NAME_CHARS.sub("_", base.replace("/", "_"))[:_MODEL_PART_MAX] or "unknown"
    return f"sglang/{safe}/{digest}"
