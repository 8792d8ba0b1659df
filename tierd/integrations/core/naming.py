"""Namespaces from what makes KV bytes interchangeable.

Two engines must share blocks exactly when their bytes are interchangeable: the same
weights (not only the same model name: :func:`weights_identity`) and KV dtype, the same
tokens per block hash and blocks per chunk, the same KV groups (layers, tokens per block),
the same parallel layout unless vLLM's own rule says the bytes do not depend on it (its
``FileMapper``: parallelism-agnostic bytes or a replicated layout), the same host layout,
and the same row size. The namespace is ``<prefix>/<model>/<16 hex digits of a SHA-256 of
those facts>``, where the prefix is ``vllm`` or the user's ``namespace`` (which adds to the
digest, never replaces it): the model part is for people reading ``tierd stats``, the
digest is what keeps engines apart.

Everything is read defensively with ``getattr``: a fact an engine does not supply (or a
test's mock) counts as absent, never as part of the name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["derive_namespace", "kv_layout_facts", "weights_identity"]

# Files whose bytes make the model: weights in every format vLLM loads, and the config
# (an architecture change at the same path is another model too).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_MODEL_FILES = ("config.json", "params.json")
_NAMESPACE_MAX = 128  # the daemon's default namespaces.pattern

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:@+=-]+")
_MODEL_PART_MAX = 64
_DIGEST_HEX = 16
_PARALLEL_FIELDS = ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size")
# A weight file's sampled content: its header (a safetensors header whole, up to
# _HEADER_MAX; else its first _HEAD_BYTES) and _SAMPLES slices of _SAMPLE_BYTES spread
# evenly from its first byte to its last: a fixed cost per file, whatever its size.
_HEAD_BYTES = 64 << 10
_HEADER_MAX = 16 << 20
_SAMPLES = 64
_SAMPLE_BYTES = 4096


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


def _hub_cache() -> Path:
    """Hugging Face's hub cache, found the way its library finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "huggingface" / "hub"


def _file_facts(paths: list[Path]) -> list[list[str | int]]:
    """Name, size, modification time (ns) and a digest of sampled content of each file:
    a checkpoint written again at the same path changes at least its times, or (copied
    keeping them: ``cp -p``, ``rsync -t``) its sampled bytes."""
    facts: list[list[str | int]] = []
    for path in sorted(paths):
        try:
            st = path.stat()  # follows a hub snapshot's links to the blobs
            sampled = _sampled_digest(path, st.st_size)
        except OSError:
            continue
        facts.append([path.name, st.st_size, st.st_mtime_ns, sampled])
    return facts


def _sampled_digest(path: Path, size: int) -> str:
    """SHA-256 (hex) of the file's header and of :data:`_SAMPLES` fixed slices, read
    with positional reads (one small file is read whole)."""
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        fd = f.fileno()
        for offset, length in _sample_ranges(fd, size):
            digest.update(os.pread(fd, length, offset))
    return digest.hexdigest()


def _sample_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of what :func:`_sampled_digest` reads of a file of ``size``."""
    whole = _HEAD_BYTES + _SAMPLES * _SAMPLE_BYTES
    if size <= whole:
        return [(0, size)]
    head = _HEAD_BYTES
    prefix = os.pread(fd, 8, 0)  # safetensors: a little-endian u64 header length first
    if len(prefix) == 8:
        header = 8 + int.from_bytes(prefix, "little")
        if header <= min(size, _HEADER_MAX):
            head = max(head, header)
    last = size - _SAMPLE_BYTES
    slices = [(last * i // (_SAMPLES - 1), _SAMPLE_BYTES) for i in range(_SAMPLES)]
    return [(0, head), *slices]


def weights_identity(model: str | None) -> dict[str, Any] | None:
    """What identifies the weights behind ``model`` (an engine's model: a local path or a
    hub id) at a cost that does not grow with the model's size: per file a ``stat`` and
    a fixed number of small reads (:func:`_sampled_digest`). Every engine's namespace
    takes its weights' identity from here (vLLM's :func:`kv_layout_facts`, SGLang's
    :func:`tierd.integrations.sglang.pages.page_facts`), so they tell weights apart alike.

    A local directory: its weight and config files' names, sizes, times and sampled
    content. A file (a GGUF): its own. A hub id: the commit every ref of its cache entry
    points to (a new revision downloaded moves ``refs/main``). None when nothing can be
    found: the name alone then stands for the model (said in the docs).
    """
    if not model:
        return None
    local = Path(model).expanduser()
    if local.is_file():
        return {"files": _file_facts([local])}
    if local.is_dir():
        try:
            files = [
                p
                for p in local.iterdir()
                if p.name.endswith(_WEIGHT_SUFFIXES) or p.name in _MODEL_FILES
            ]
        except OSError:
            return None
        return {"files": _file_facts(files)} if files else None
    refs = _hub_cache() / f"models--{model.replace('/', '--')}" / "refs"
    try:
        commits = {p.name: p.read_text().strip() for p in sorted(refs.iterdir()) if p.is_file()}
    except OSError:
        return None
    return {"hub_refs": commits} if commits else None


def _parallelism_agnostic(config: Any) -> bool:
    """vLLM's own rule (``FileMapper.from_offloading_spec``): the bytes do not depend on
    the parallel layout when vLLM says so, or when every worker holds the same bytes."""
    parallel = getattr(config, "parallel", None)
    return (
        getattr(parallel, "is_parallelism_agnostic", None) is True
        or getattr(config, "replicated_layout", None) is True
    )


def kv_layout_facts(offloading_spec: Any, row_bytes: int) -> dict[str, Any]:
    """The facts that decide whether two engines' offloaded bytes are interchangeable."""
    config = getattr(offloading_spec, "config", None)
    model = getattr(config, "model", None)
    cache = getattr(config, "cache", None)
    parallel = getattr(config, "parallel", None)
    name = _plain(getattr(model, "name", None))
    facts: dict[str, Any] = {
        "row_bytes": row_bytes,
        "model": name,
        "weights": weights_identity(name) if isinstance(name, str) else None,
        "dtype": _plain(getattr(model, "dtype", None)),
        "tokens_per_hash": _plain(getattr(cache, "tokens_per_hash", None)),
        "blocks_per_chunk": _plain(getattr(cache, "blocks_per_chunk", None)),
        "worker_kv_bytes_per_block": _plain(getattr(config, "worker_kv_bytes_per_block", None)),
        "replicated_layout": _plain(getattr(config, "replicated_layout", None)),
        "canonical_layout": _plain(getattr(config, "canonical_layout", None)),
        "kv_cache_layout": _plain(getattr(config, "kv_cache_layout", None)),
        "groups": _groups(config),
    }
    if not _parallelism_agnostic(config):
        facts["parallel"] = {f: _plain(getattr(parallel, f, None)) for f in _PARALLEL_FIELDS}
    return facts


def derive_namespace(offloading_spec: Any, row_bytes: int, prefix: str | None = None) -> str:
    """``<prefix>/<model>/<digest>`` (``prefix``: the user's namespace, default ``vllm``);
    valid under tierd's default ``namespaces.pattern`` when ``prefix`` is (the model part
    shrinks to keep the whole within 128 characters)."""
    facts = kv_layout_facts(offloading_spec, row_bytes)
    blob = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_HEX]
    head = prefix if prefix else "vllm"
    room = min(_MODEL_PART_MAX, _NAMESPACE_MAX - len(head) - _DIGEST_HEX - 2)
    model = facts["model"] if isinstance(facts["model"], str) else "unknown"
    safe = _NAME_CHARS.sub("_", model.replace("/", "_"))[: max(room, 1)] or "unknown"
    return f"{head}/{safe}/{digest}"
