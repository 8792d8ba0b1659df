"""Keys, namespaces and page offsets of tierd.integrations.sglang_pages (no SGLang needed:
SGLang's own objects drive them in tests/test_sglang.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from tierd.integrations.sglang_pages import (
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


def test_offsets_outside_the_host_pool_are_refused() -> None:
    table = GEOMETRY.offsets([0x1000, 0x1000 + 4096, 0x1000 + 384, 0x1000 + 8192], 2)
    assert table.tolist() == [[0, 4096], [384, 8192]] and table.dtype == np.uint64
    with pytest.raises(UnsupportedPool):
        GEOMETRY.offsets([0x1000, 0x1000 + (1 << 20) - 100], 1)
    with pytest.raises(UnsupportedPool):
        GEOMETRY.offsets([0x0FFF, 0x1000], 1)
