"""``tierd config check`` reports every problem of a file at once, in the config's own
words (no pydantic phrases); it refuses what this machine cannot run (a GPU tier without
CUDA), and ``--offline`` checks only the schema and the cross-field rules, for a config
meant for another machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import tierd.preflight
from tierd.cli import main
from tierd.testing import short_socket_path

EXIT_CONFIG = 78
PYDANTIC_WORDS = (
    "Input should",
    "List should",
    "after validation",
    "Field required",
    "Value error",
)


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "tierd.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def check(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, list[str]]:
    status = main(["config", "check", str(path), *extra])
    captured = capsys.readouterr()
    return status, (captured.err + captured.out).splitlines()


def cpu(name: str = "cpu", capacity: object = 8) -> dict[str, Any]:
    return {"name": name, "kind": "cpu", "capacity": capacity}


def test_every_problem_of_a_file_is_reported_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        {
            "block_bytes": 4096,
            "socket": {"path": short_socket_path()},
            "entry": "nowhere",
            "limits": {"max_connections": -1},
            "tiers": [cpu(capacity="-1GiB"), cpu(), cpu("spare")],
        },
    )
    status, lines = check(path, capsys)

    assert status == EXIT_CONFIG
    assert "limits.max_connections: must be at least 1 (got -1)" in lines
    assert "tiers.0.capacity: capacity must be positive (got '-1GiB')" in lines
    assert "tiers: tier names must be unique: cpu named twice" in lines
    assert "entry: 'nowhere' is not a tier name (cpu, spare)" in lines
    assert not [line for line in lines if any(word in line for word in PYDANTIC_WORDS)]


def test_a_value_the_message_names_is_not_repeated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 61, item 9: "policy 'lur' is not one of: arc, duel, lru (got 'lur')"."""
    tier = {**cpu(), "policy": "lur"}
    data = {"block_bytes": 4096, "socket": {"path": short_socket_path()}, "tiers": [tier]}
    path = write(tmp_path, data)
    status, lines = check(path, capsys, "--offline")
    assert status == EXIT_CONFIG
    (line,) = [line for line in lines if line.startswith("tiers.0.policy")]
    assert line == "tiers.0.policy: policy 'lur' is not one of: arc, duel, lru", line


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"tiers": []}, "tiers: needs at least 1 item"),
        ({"tiers": [cpu(capacity="-1GiB")]}, "tiers.0.capacity: capacity must be positive"),
        ({"block_bytes": "-4KiB", "tiers": [cpu()]}, "block_bytes: a size cannot be negative"),
        ({"tiers": [{"kind": "cpu", "capacity": 8}]}, "tiers.0.name: is required"),
        ({"tiers": [cpu()], "limits": {"hello_timeout_s": "-5s"}}, "a duration must be 0 or more"),
        ({"tiers": [{**cpu(), "kind": "tape"}]}, "tiers.0.kind: must be one of 'memory'"),
        ({"tiers": [cpu()], "remote": {"url": "redis://x", "pool_size": "many"}}, "whole number"),
    ],
)
def test_problems_are_said_in_the_configs_own_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, Any], expected: str
) -> None:
    path = write(tmp_path, {"socket": {"path": short_socket_path()}, **data})
    status, lines = check(path, capsys)

    assert status == EXIT_CONFIG
    assert any(expected in line for line in lines), lines
    assert not [line for line in lines if any(word in line for word in PYDANTIC_WORDS)]


def test_every_tenant_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tenants = [
        {"name": "a", "uids": [5001], "quota": {"cpu": "50%"}},
        {"name": "a", "uids": [5002], "quota": {"cpu": "10%"}},
        {"name": "b", "quota": {"cpu": "10%"}},
    ]
    path = write(
        tmp_path,
        {"socket": {"path": short_socket_path()}, "tiers": [cpu(capacity=64)], "tenants": tenants},
    )
    status, lines = check(path, capsys)

    assert status == EXIT_CONFIG
    assert "tenants.1.name: 'a' is named twice" in lines
    assert "tenants.2: names no uid or gid: nobody could use it" in lines


# -- machine checks (tierd/preflight.py) ---------------------------------------------------


def gpu_config(tmp_path: Path) -> Path:
    gpu = {"name": "gpu", "kind": "gpu", "capacity": 8, "device": "cuda:0"}
    return write(tmp_path, {"socket": {"path": short_socket_path()}, "tiers": [gpu, cpu()]})


def test_a_gpu_tier_is_refused_on_a_machine_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tierd.preflight, "CUDA_LIBRARY", "libcuda-not-here.so.1")
    status, lines = check(gpu_config(tmp_path), capsys)

    assert status == EXIT_CONFIG
    [line] = [line for line in lines if line.startswith("tiers.0.device:")]
    assert "asks for cuda:0, but this machine cannot run CUDA" in line
    assert "libcuda-not-here.so.1 is not installed" in line


@pytest.mark.parametrize("flag", ["--offline", "--no-machine-checks"])
def test_offline_checks_a_config_meant_for_another_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    monkeypatch.setattr(tierd.preflight, "CUDA_LIBRARY", "libcuda-not-here.so.1")
    status, lines = check(gpu_config(tmp_path), capsys, flag)
    assert status == 0
    assert lines[-1].startswith("ok: ") and lines[-1].endswith("machine checks skipped (--offline)")
    # The schema and cross-field rules still hold offline.
    broken = write(tmp_path, {"tiers": [cpu(), cpu()], "entry": "gpu"})
    status, lines = check(broken, capsys, flag)
    assert status == EXIT_CONFIG
    assert "tiers: tier names must be unique: cpu named twice" in lines


def tenant_disk_config(directory: Path, capacity: str) -> dict[str, Any]:
    disk = {"name": "disk", "kind": "disk", "capacity": capacity, "directories": [str(directory)]}
    tenants = [{"name": name, "uids": [6000 + i]} for i, name in enumerate(("a", "b", "c"))]
    return {
        "socket": {"path": short_socket_path()},
        "tiers": [cpu(capacity=64), disk],
        "tenants": tenants,
    }


def test_tenants_on_one_file_system_see_its_real_free_space(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Far more than any disk: each tenant's third alone does not fit either.
    path = write(tmp_path, tenant_disk_config(tmp_path / "slabs", "3072TiB"))
    status, lines = check(path, capsys)

    assert status == EXIT_CONFIG
    [line] = [line for line in lines if line.startswith("tiers.1.capacity:")]
    assert "PiB in" in line and "(3 tenants' slabs)" in line
    assert " 0 bytes free" not in line


def test_a_missing_directory_is_named_once_for_all_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, tenant_disk_config(tmp_path / "no-mount" / "slabs", "1GiB"))
    status, lines = check(path, capsys)

    assert status == EXIT_CONFIG
    named = [line for line in lines if "no-mount does not exist" in line]
    assert len(named) == 1, lines


# -- what the docs say ---------------------------------------------------------------------


def test_the_seconds_keys_take_durations_as_config_md_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    limits = {"hello_timeout_s": "10s", "load_wait_s": "500ms", "store_lease_ttl_s": "2m"}
    path = write(
        tmp_path, {"socket": {"path": short_socket_path()}, "tiers": [cpu()], "limits": limits}
    )
    assert main(["config", "show", "-c", str(path), "--json"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["limits"]
    assert (shown["hello_timeout_s"], shown["load_wait_s"], shown["store_lease_ttl_s"]) == (
        10.0,
        0.5,
        120.0,
    )
    doc = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    assert "do **not** take" not in doc


@pytest.mark.parametrize("command", ["stats", "events", "flush", "health", "stop", "top"])
def test_the_control_commands_take_trust_uid_as_security_md_says(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--trust-uid UID" in capsys.readouterr().out
