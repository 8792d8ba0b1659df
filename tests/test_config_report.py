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
