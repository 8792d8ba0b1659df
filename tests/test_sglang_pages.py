"""Keys, namespaces and page offsets of tierd.integrations.sglang.pages (no SGLang needed:
SGLang's own objects drive them in tests/test_sglang.py)."""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tierd.integrations.core import naming
from tierd.integrations.sglang.pages import (
    PageGeometry,
    UnsupportedPool,
    derive_namespace,
    page_facts,
    page_key,
)


@dataclass(frozen=True)
class StorageConfig:
    """The fields of SGLang's HiCacheStorageConfig the namespace reads."""

    model_name: str | None = "org/model"
    tp_rank: int = 0
    tp_size: int = 2
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = True
    extra_config: dict[str, int] | None = None


class Pool:
    page_size = 4
    layer_num = 3
    head_num = 2
    head_dim = 8


GEOMETRY = PageGeometry(4, (384, 384), "page_first", "torch.float16", 0x1000, 1 << 20)


def name(config: StorageConfig, geometry: PageGeometry = GEOMETRY, user: str | None = None) -> str:
    return derive_namespace(page_facts(config, Pool(), geometry, user))


def test_page_hashes_are_their_32_raw_bytes_and_other_strings_cannot_collide() -> None:
    digest = hashlib.sha256(b"page").hexdigest()
    assert page_key(digest) == bytes.fromhex(digest)
    assert page_key(digest.upper()) == bytes.fromhex(digest)
    other = page_key("not-a-hash")
    assert len(other) == 33 and other[:1] == b"s"
    assert page_key("not-a-hash") == other != page_key("not-a-hash2")


def test_the_namespace_changes_with_every_fact_that_changes_page_bytes() -> None:
    base = StorageConfig()
    first = name(base)
    assert first.startswith("sglang/org_model/") and len(first) <= 128
    assert name(base) == first  # stable
    changed = [
        name(replace(base, model_name="org/other")),
        name(replace(base, tp_rank=1)),
        name(replace(base, tp_size=4)),
        name(replace(base, pp_rank=1, pp_size=2)),
        name(replace(base, attn_cp_rank=1, attn_cp_size=2)),
        name(base, replace(GEOMETRY, layout="layer_first")),
        name(base, replace(GEOMETRY, dtype="torch.bfloat16")),
        name(base, replace(GEOMETRY, page_tokens=8, pieces=(768, 768))),
        name(base, user="team-a"),
        name(replace(base, extra_config={"interface_v1": 1})),
    ]
    assert len({first, *changed}) == len(changed) + 1


def test_a_user_name_adds_to_the_digest_and_mla_ranks_share_pages() -> None:
    named = name(StorageConfig(), user="team-a")
    assert named.startswith("sglang/org_model/") and "team-a" not in named
    mla = StorageConfig(is_mla_model=True)
    assert name(mla) == name(replace(mla, tp_rank=1)) != name(StorageConfig())


def test_a_local_model_directory_names_its_weights_not_only_its_path(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    config = StorageConfig(model_name=str(model))
    first = name(config)
    assert first.startswith("sglang/model/")
    (model / "model.safetensors").write_bytes(b"x" * 11)  # other weights, same path
    assert name(config) != first


def weights_file(path: Path, size: int, patches: dict[int, bytes]) -> None:
    """A sparse weights file of ``size`` zero bytes but for ``patches`` (offset -> bytes)."""
    with path.open("wb") as f:
        f.truncate(size)
        for offset, data in patches.items():
            f.seek(offset)
            f.write(data)


def test_weights_replaced_keeping_sizes_and_times_get_a_new_namespace(tmp_path: Path) -> None:
    # Issue 60, 14: re-published weights of the same sizes and times (`cp -p`, `rsync -t`)
    # are another model all the same; SGLang's namespace told them apart by size alone.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights = model / "model.safetensors"
    size = 4 << 20  # sampled, not read whole
    first_bytes = random.Random(1).randbytes(4096)
    weights_file(weights, size, {0: first_bytes})
    stat = weights.stat()
    config = StorageConfig(model_name=str(model))

    def republished(patches: dict[int, bytes]) -> str:
        weights_file(weights, size, patches)  # the same size
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old times
        assert weights.stat().st_size == stat.st_size
        return name(config)

    first = name(config)
    assert republished({0: first_bytes}) == first  # the same weights: the same namespace
    assert republished({0: random.Random(2).randbytes(4096)}) != first  # other weights
    assert republished({0: first_bytes, size - 1: b"x"}) != first  # only its last byte
    assert republished({0: first_bytes}) == first


def test_sglang_and_vllm_take_the_weights_identity_from_one_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights_file(model / "model.safetensors", 1 << 20, {100: b"weights"})
    spec = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(name=str(model))))
    sglang = page_facts(StorageConfig(model_name=str(model)), Pool(), GEOMETRY, None)
    vllm = naming.kv_layout_facts(spec, 4096)
    identity = naming.weights_identity(str(model))
    assert identity is not None and sglang["weights"] == vllm["weights"] == identity

    asked: list[str | None] = []

    def spy(model: str | None) -> dict[str, str]:
        asked.append(model)
        return {"spy": str(model)}

    monkeypatch.setattr(naming, "weights_identity", spy)
    sglang = page_facts(StorageConfig(model_name=str(model)), Pool(), GEOMETRY, None)
    vllm = naming.kv_layout_facts(spec, 4096)
    assert sglang["weights"] == vllm["weights"] == {"spy": str(model)}
    assert asked == [str(model), str(model)]


def test_a_pool_s_storage_tag_is_not_part_of_the_model_path(tmp_path: Path) -> None:
    # SGLang appends the host pool's storage_format_tag to the model path it hands the
    # backend; the weights are still the ones at the path.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"weights")

    class TaggedPool(Pool):
        storage_format_tag = "unified-token-major"

    config = StorageConfig(model_name=f"{model}-unified-token-major")
    facts = page_facts(config, TaggedPool(), GEOMETRY, None)
    assert facts["weights"] == naming.weights_identity(str(model)) is not None
    assert facts["model"] == f"{model}-unified-token-major"  # the name SGLang gave
    untagged = page_facts(config, Pool(), GEOMETRY, None)  # no tag: a path that is not there
    assert untagged["weights"] is None


def test_offsets_outside_the_host_pool_are_refused() -> None:
    table = GEOMETRY.offsets([0x1000, 0x1000 + 4096, 0x1000 + 384, 0x1000 + 8192], 2)
    assert table.tolist() == [[0, 4096], [384, 8192]] and table.dtype == np.uint64
    with pytest.raises(UnsupportedPool):
        GEOMETRY.offsets([0x1000, 0x1000 + (1 << 20) - 100], 1)
    with pytest.raises(UnsupportedPool):
        GEOMETRY.offsets([0x0FFF, 0x1000], 1)
