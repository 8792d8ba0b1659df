"""A ``tierd`` command that talks to the daemon starts in a fraction of a second: it
imports the client and its own command module, never the config models, the daemon, the
tiers, the stores, numpy or structlog (issue 61, item 10; figures in docs/BENCHMARKS.md).
``tierd --help`` lists the commands without importing any of their modules.

What a command imports is read from ``python -X importtime``, run against a real daemon:
an assertion on what is loaded, never on how long it took.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_kit import Spawn, child_env
from tierd.cli import FAMILY_OF, build_parser
from tierd.testing import daemon_config

# What no command that only talks to the daemon needs: the config models (pydantic,
# YAML), the daemon and what it is built of, numpy, structlog (and rich, which it loads
# where installed), and the daemon's own event loop and metrics.
HEAVY = (
    "numpy",
    "prometheus_client",
    "pydantic",
    "rich",
    "structlog",
    "torch",
    "uvloop",
    "xxhash",
    "yaml",
    "tierd.chain",
    "tierd.config",
    "tierd.daemon",
    "tierd.policy",
    "tierd.preflight",
    "tierd.settings",
    "tierd.stores",
    "tierd.tier",
    "tierd.workload",
)
_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$")


def imports_of(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``tierd ARGV`` run under ``-X importtime``, and every module it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tierd", *argv],
        capture_output=True,
        text=True,
        timeout=120,  # a safety net, not a timed assertion
        env=child_env(COLUMNS="80"),  # help text wrapped as the test's own parser wraps it
        check=False,
    )
    lines = done.stderr.splitlines()
    modules = {m.group(1) for line in lines if (m := _IMPORTED.match(line))}
    assert "tierd.cli" in modules, done.stderr  # the importtime lines were read
    done.stderr = "\n".join(line for line in lines if not _IMPORTED.match(line))
    return done, modules


def heavy(modules: set[str]) -> list[str]:
    """The modules of :data:`HEAVY`, and their submodules, among ``modules``."""
    return sorted(m for m in modules if m in HEAVY or m.startswith(_HEAVY_PACKAGES))


_HEAVY_PACKAGES = tuple(f"{name}." for name in HEAVY)


async def test_client_commands_import_no_heavy_module(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    where = ("--socket", daemon.socket_path)
    commands = [
        ("stats",),
        ("stats", "--json"),
        ("health",),
        ("namespaces",),
        ("flush",),
        ("record", "status"),
        ("config", "show", "--json"),
        ("engine-config", "vllm"),
        ("stop",),  # last: the daemon is gone after it
    ]
    for argv in commands:
        done, modules = await asyncio.to_thread(imports_of, *argv, *where)
        assert done.returncode == 0, (argv, done.stderr)
        assert heavy(modules) == [], argv
        # (The command's own module is imported with importlib, which -X importtime does
        # not list; modules it imports in turn are listed.)
        others = {f"tierd.cli.{family}" for family in FAMILY_OF.values()} - {
            f"tierd.cli.{FAMILY_OF[argv[0]]}",
            "tierd.cli.serve_cmd",  # config show's fallback: what `tierd serve` would run
        }
        assert sorted(modules & others) == [], argv
    assert await daemon.wait() == 0


def test_config_show_in_yaml_loads_yaml_only() -> None:
    """The check above is not vacuous: a command that needs a heavy module still has it
    (``config show`` prints YAML), and only that one."""
    done, modules = imports_of("config", "show", "--socket", "/nonexistent/tierd.sock")
    assert done.returncode == 3, done.stderr  # --socket named: no fallback to a file
    assert heavy(modules) == []
    done, modules = imports_of("config", "show", "-c", "/nonexistent/tierd.yaml")
    assert done.returncode == 78, done.stderr
    assert {"pydantic", "tierd.settings"} <= set(heavy(modules))


def test_help_imports_no_command_module_and_says_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    done, modules = imports_of("--help")
    assert done.returncode == 0, done.stderr
    assert heavy(modules) == []
    families = {f"tierd.cli.{family}" for family in FAMILY_OF.values()}
    assert sorted(modules & families) == []
    assert done.stdout == build_parser().format_help()  # as with every module loaded
