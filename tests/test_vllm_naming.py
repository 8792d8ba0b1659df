"""Namespaces never lie (issue 24, point 4): weights, a user's namespace, parallel layout.

Two engines share a namespace, and so each other's KV bytes, only when those bytes are
interchangeable. The old names came from the model's path alone (a checkpoint re-published
at that path got the old model's KV), and a user-given ``namespace`` replaced the derived
digest (two model shapes under one tenant name got each other's blocks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm_kit import ROW, offloading_spec

from tierd.integrations.core.naming import derive_namespace, weights_identity


def checkpoint(directory: Path, weights: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"num_hidden_layers": 2}')
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "README.md").write_text("not part of the model")
    return directory


def test_a_checkpoint_republished_at_the_same_path_gets_a_new_namespace(tmp_path) -> None:
    model = checkpoint(tmp_path / "llama", b"weights, first release")
    first = derive_namespace(offloading_spec(str(model)), ROW)
    assert derive_namespace(offloading_spec(str(model)), ROW) == first  # stable
    (model / "README.md").write_text("edited")  # not a model file: the same model
    assert derive_namespace(offloading_spec(str(model)), ROW) == first

    checkpoint(model, b"weights, second release")  # same path, same size, new bytes
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = derive_namespace(offloading_spec(str(model)), ROW)
    assert second != first
    assert first.rsplit("/", 1)[0] == second.rsplit("/", 1)[0]  # only the digest moved


def safetensors(path: Path, header: dict, size: int, patches: dict[int, bytes]) -> None:
    """A safetensors-shaped file of ``size`` bytes (sparse): its header, then zeros but
    for ``patches`` (offset -> bytes)."""
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(size)
        for offset, data in patches.items():
            f.seek(offset)
            f.write(data)


def test_weights_replaced_keeping_size_and_times_get_a_new_namespace(tmp_path) -> None:
    # Issue 35, 3: `cp -p`, `rsync -t` or an image build that normalises times keeps the
    # size and the modification time; the bytes are another model's all the same.
    model = checkpoint(tmp_path / "llama", b"")
    weights = model / "model.safetensors"
    header = {"w": {"dtype": "BF16", "shape": [1 << 21], "data_offsets": [0, 4 << 20]}}
    size = 8 << 20
    tensors = random.Random(1).randbytes(4 << 20)
    safetensors(weights, header, size, {4096: tensors})
    stat = weights.stat()

    def republished(header: dict, patches: dict[int, bytes]) -> str:
        safetensors(weights, header, size, patches)  # the same size
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old times
        return derive_namespace(offloading_spec(str(model)), ROW)

    first = derive_namespace(offloading_spec(str(model)), ROW)
    assert republished(header, {4096: tensors}) == first  # the same bytes: the same name
    fine_tuned = random.Random(2).randbytes(4 << 20)  # every weight moved a little
    assert republished(header, {4096: fine_tuned}) != first
    assert republished(header, {4096: tensors, size - 1: b"x"}) != first  # its last byte
    other = dict(header, __metadata__={"format": "pt"})  # only the header differs
    assert republished(other, {4096: tensors}) != first


def test_a_gguf_file_and_a_hub_revision_identify_their_weights(tmp_path, monkeypatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"q4")
    one = derive_namespace(offloading_spec(str(gguf)), ROW)
    gguf.write_bytes(b"q4 but longer")
    assert derive_namespace(offloading_spec(str(gguf)), ROW) != one

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    refs = tmp_path / "hub" / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    assert weights_identity("org/model") == {"hub_refs": {"main": "a" * 40}}
    old = derive_namespace(offloading_spec("org/model"), ROW)
    (refs / "main").write_text("b" * 40)  # a new revision was downloaded
    assert derive_namespace(offloading_spec("org/model"), ROW) != old
    assert weights_identity("org/not-downloaded") is None


def test_a_user_namespace_adds_to_the_digest(tmp_path) -> None:
    spec_a = offloading_spec()
    spec_b = offloading_spec()  # another shape: four layers where spec_a has two
    groups = (dataclasses.replace(spec_b.config.groups[0], layer_names=tuple("abcd")),)
    spec_b.config = dataclasses.replace(spec_b.config, groups=groups)
    a = derive_namespace(spec_a, ROW, "tenant-a")
    b = derive_namespace(spec_b, ROW, "tenant-a")
    assert a.startswith("tenant-a/tiny-llama/") and b.startswith("tenant-a/tiny-llama/")
    assert a != b  # the same user namespace, two shapes: never one namespace
    assert derive_namespace(spec_a, ROW, "tenant-b") != a
    assert a.split("/")[-1] == derive_namespace(spec_a, ROW).split("/")[-1]
    long = derive_namespace(offloading_spec("m" * 200), ROW, "t" * 60)
    assert len(long) <= 128 and long.startswith("t" * 60 + "/")


@pytest.mark.parametrize(
    ("agnostic", "replicated", "shared"),
    [(False, False, False), (True, False, True), (False, True, True)],
)
def test_parallel_layouts_share_as_vllm_s_own_rule_says(
    agnostic: bool, replicated: bool, shared: bool
) -> None:
    """vLLM's FileMapper shares a folder across TP sizes when the bytes are
    parallelism-agnostic or replicated on every worker; tierd's namespaces do the same."""
    names = []
    for tp in (1, 2):
        spec = offloading_spec(tp=tp)
        parallel = dataclasses.replace(spec.config.parallel, is_parallelism_agnostic=agnostic)
        spec.config = dataclasses.replace(
            spec.config,
            parallel=parallel,
            replicated_layout=replicated,
            worker_kv_bytes_per_block=ROW,  # the same bytes per block on every worker
        )
        names.append(derive_namespace(spec, ROW))
    assert (names[0] == names[1]) is shared
