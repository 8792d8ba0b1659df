"""Configurations that gave a raw traceback (or a daemon no client could reach) get a
one-line error naming the YAML path, from ``tierd config check`` and from ``tierd serve``.

The fixed cases run the real command in a subprocess; the Hypothesis fuzz drives the
loader itself with random documents, bytes and overrides: every input is either a valid
config or a :class:`ConfigError`, never another exception.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierd.cli.config_cmd import describe
from tierd.config import DaemonConfig, TierKind
from tierd.errors import ConfigError
from tierd.preflight import check_machine
from tierd.settings import load_settings
from tierd.testing import short_socket_path

EXIT_CONFIG = 78


def run_tierd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    return subprocess.run(
        [sys.executable, "-m", "tierd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def config_with(tier: dict[str, Any], **top: Any) -> dict[str, Any]:
    socket = top.pop("socket", {"path": short_socket_path()})
    return {"block_bytes": 4096, "tiers": [tier], "socket": socket, **top}


CPU = {"name": "cpu", "kind": "cpu", "capacity": 8}

BAD = {
    "huge-block": (config_with(CPU, block_bytes=int("9" * 400)), "block_bytes"),
    "huge-capacity": (config_with({**CPU, "capacity": 10**30}), "tiers.0.capacity"),
    "memory-2**40": (
        config_with({"name": "m", "kind": "memory", "capacity": 2**40}),
        "tiers.0.capacity",
    ),
    "shm-name": (config_with({**CPU, "shm_name": "../x"}), "tiers.0.shm_name"),
    "gpu-banana": (
        {
            "block_bytes": 4096,
            "socket": {"path": short_socket_path()},
            "tiers": [{"name": "g", "kind": "gpu", "capacity": 8, "device": "banana"}, CPU],
        },
        "tiers.0.device",
    ),
    "socket-path": (
        config_with(CPU, socket={"path": "/tmp/" + "x" * 120 + "/tierd.sock"}),
        "socket.path",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
@pytest.mark.parametrize("command", ["check", "serve"])
def test_bad_values_get_one_clear_line(tmp_path: Path, name: str, command: str) -> None:
    cfg, where = BAD[name]
    path = tmp_path / "tierd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["config", "check", str(path)] if command == "check" else ["serve", "-c", str(path)]
    done = run_tierd(*args)
    assert done.returncode == EXIT_CONFIG, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert where in done.stderr, done.stderr


def test_a_binary_config_file_is_named_not_decoded(tmp_path: Path) -> None:
    path = tmp_path / "tierd.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    for args in (["config", "check", str(path)], ["serve", "-c", str(path)]):
        done = run_tierd(*args)
        assert done.returncode == EXIT_CONFIG, (done.returncode, done.stderr)
        assert "Traceback" not in done.stderr
        assert str(path) in done.stderr and "UTF-8" in done.stderr, done.stderr


def test_a_gpu_tier_without_cuda_is_a_start_error(tmp_path: Path) -> None:
    """``cuda:0`` is a valid device name; on a machine without CUDA, start-up and
    ``config check`` say so."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the tier would start")
    cfg = {
        "block_bytes": 4096,
        "socket": {"path": short_socket_path()},
        "tiers": [{"name": "g", "kind": "gpu", "capacity": 8, "device": "cuda:0"}, CPU],
    }
    path = tmp_path / "tierd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for args in (["serve", "-c", str(path)], ["config", "check", str(path)]):
        done = run_tierd(*args)  # refused before anything is allocated, as config check does
        assert done.returncode == EXIT_CONFIG, done.stderr
        assert "Traceback" not in done.stderr
        assert "gpu tier 'g' asks for cuda:0" in done.stderr and "CUDA" in done.stderr


# -- fuzz ------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.sampled_from(["64GiB", "1e30", "-1", "0o777", "10s", "cuda:7", "../x", "~", "$HOME"])
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_TIER_KEYS = [
    "name",
    "kind",
    "capacity",
    "policy",
    "admission",
    "device",
    "directories",
    "shm_name",
    "o_direct",
    "write_through",
]
_TOP_KEYS = [
    "block_bytes",
    "tiers",
    "socket",
    "limits",
    "namespaces",
    "logging",
    "events",
    "shutdown",
    "entry",
    "transfer",
    "metrics",
]


@st.composite
def documents(draw: st.DrawFn) -> Any:
    """Mostly the real schema's shape with hostile values; sometimes anything at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_values)
    tier = {k: draw(_values) for k in draw(st.lists(st.sampled_from(_TIER_KEYS), max_size=6))}
    tier.setdefault("name", "t")
    tier.setdefault("kind", draw(st.sampled_from(["cpu", "memory", "disk", "gpu", "x"])))
    tier.setdefault("capacity", draw(_values))
    doc: dict[str, Any] = {
        k: draw(_values) for k in draw(st.lists(st.sampled_from(_TOP_KEYS), max_size=4))
    }
    doc["tiers"] = [tier]
    return doc


def _check_loads(tmp_path: Path, text: bytes, sets: list[str], env: dict[str, str]) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text)
    problem = ""
    try:
        cfg = load_settings(path, sets=sets, environ=env)
        describe(cfg)  # every tier's size in blocks, as serve computes it
        if all(tier.kind is not TierKind.DISK for tier in cfg.tiers):
            check_machine(cfg)  # memory and /dev/shm (a disk tier's would make directories)
    except ConfigError as exc:
        problem = str(exc).strip() or "(empty message)"
    if problem:
        assert problem != "(empty message)", "a config error must say something"
    else:
        assert isinstance(cfg, DaemonConfig)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=documents())
def test_fuzzed_documents_are_valid_or_a_config_error(tmp_path: Path, doc: Any) -> None:
    try:
        text = yaml.safe_dump(doc).encode()
    except yaml.YAMLError:
        return
    _check_loads(tmp_path, text, [], {})


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=400))
def test_fuzzed_bytes_are_valid_or_a_config_error(tmp_path: Path, raw: bytes) -> None:
    _check_loads(tmp_path, raw, [], {})


_paths = st.sampled_from(
    [
        "block_bytes",
        "tiers.0.capacity",
        "tiers.0.shm_name",
        "tiers.0.device",
        "socket.path",
        "socket.mode",
        "limits.max_frame_bytes",
        "limits.hello_timeout_s",
        "tiers.9.name",
        "x.y",
    ]
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=_paths, value=st.text(max_size=60), env_value=st.text(max_size=60))
def test_fuzzed_overrides_are_valid_or_a_config_error(
    tmp_path: Path, path: str, value: str, env_value: str
) -> None:
    base = yaml.safe_dump(config_with(CPU)).encode()
    env = {"TIERD_BLOCK_BYTES": env_value} if "\x00" not in env_value else {}
    _check_loads(tmp_path, base, [f"{path}={value}"], env)
