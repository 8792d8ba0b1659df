"""One name for the socket, and a suite that never reaches the user's daemon (issue 61,
item 5).

- ``TIERD_SOCKET__PATH`` moves the daemon's socket (a setting, as ``socket.path``) and
  the client commands follow it: a ``tierd serve`` and a ``tierd stats`` run with the same
  environment meet, with no ``--socket``.
- Under this suite (``tests/conftest.py``) a command or a client that names no socket
  finds no daemon, even where the user's environment names theirs in every way it can
  (``XDG_RUNTIME_DIR``, ``TIERD_SOCKET``, ``TIERD_SOCKET__PATH``, ``TIERD_CONFIG``): a
  pytest run of its own, in that environment, shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.cli_kit import tierd
from tests.daemon_kit import Spawn, child_env
from tierd.cli.connection import socket_path
from tierd.control.socketfile import default_socket_path, socket_path_setting
from tierd.integrations.core.one_flag import resolve_socket
from tierd.testing import daemon_config, short_socket_path

ROOT = Path(__file__).resolve().parent.parent


def no_options() -> argparse.Namespace:
    return argparse.Namespace(socket=None, config=None)


# -- TIERD_SOCKET__PATH ---------------------------------------------------------------------


async def test_serve_and_stats_meet_at_the_socket_the_variable_names(
    tmp_path: Path, spawn: Spawn
) -> None:
    path = short_socket_path()
    env = child_env(
        XDG_STATE_HOME=str(tmp_path / "state"),
        TIERD_SOCKET__PATH=path,
        TIERD_TIERS__0__CAPACITY="8MiB",  # small sizes for a test; the rest as shipped
        TIERD_TIERS__1__CAPACITY="16MiB",
    )
    daemon = await spawn(None, env=env)  # `tierd serve`, no -c: the shipped config
    assert daemon.socket_path == path
    assert path != str(default_socket_path(env))

    done = await tierd("stats", "--json", env=env)  # no --socket

    assert done.returncode == 0, done.stderr
    assert [tier["name"] for tier in json.loads(done.stdout)["tiers"]] == ["cpu", "disk"]
    # The engines' switch (TIERD=1) and `tierd engine-config` find the same socket.
    assert resolve_socket(env) == (path, "TIERD_SOCKET__PATH")
    done = await tierd("engine-config", "vllm", env=env)
    assert done.returncode == 0, done.stderr
    assert path in done.stdout
    # Without the variable, the same command looks at the default path, where no one is.
    done = await tierd("stats", env=child_env())
    assert done.returncode == 3
    assert str(default_socket_path(child_env())) in done.stderr
    assert await daemon.stop() == 0, daemon.stderr()


def test_the_variable_takes_its_place_among_the_ways_to_name_the_socket(
    tmp_path: Path,
) -> None:
    """``--socket`` > ``TIERD_SOCKET`` > the config's (``TIERD_SOCKET__PATH`` overriding
    the file's, as for the daemon) > ``TIERD_SOCKET__PATH`` > the default path."""
    config = tmp_path / "tierd.yaml"
    config.write_text(yaml.safe_dump({"socket": {"path": "/from/file.sock"}}))
    base = {"XDG_RUNTIME_DIR": "/run/user/7"}
    moved = {**base, "TIERD_SOCKET__PATH": "/moved/tierd.sock"}
    assert socket_path(no_options(), base) == "/run/user/7/tierd/tierd.sock"
    assert socket_path(no_options(), moved) == "/moved/tierd.sock"
    assert socket_path(no_options(), {**moved, "TIERD_SOCKET": "/client.sock"}) == "/client.sock"
    assert socket_path(no_options(), {**base, "TIERD_CONFIG": str(config)}) == "/from/file.sock"
    assert socket_path(no_options(), {**moved, "TIERD_CONFIG": str(config)}) == (
        "/moved/tierd.sock"
    )
    named = argparse.Namespace(socket=Path("/named.sock"), config=None)
    assert socket_path(named, moved) == "/named.sock"
    # The name's segments in any case, as the daemon's settings read it; empty is unset.
    assert socket_path_setting({"TIERD_socket__Path": "/any/case.sock"}) == "/any/case.sock"
    assert socket_path_setting({"TIERD_SOCKET__PATH": ""}) is None
    assert socket_path_setting({"tierd_socket__path": "/x.sock"}) is None  # not TIERD_


# -- the suite's own environment ------------------------------------------------------------

INNER_TESTS = """
import asyncio, os, subprocess, sys

import pytest

from tierd.cli import main
from tierd.client import Client, Unreachable
from tierd.control.socketfile import default_socket_path


def test_a_command_without_socket_finds_no_daemon():
    assert main(["health"]) == 3


def test_a_child_command_without_socket_finds_no_daemon():
    done = subprocess.run([sys.executable, "-m", "tierd", "stats"], capture_output=True)
    assert done.returncode == 3, done.stdout


def test_a_client_at_the_default_path_finds_no_daemon():
    with pytest.raises(Unreachable):
        asyncio.run(Client.connect(str(default_socket_path())))
"""


async def test_a_forgotten_socket_never_reaches_the_users_daemon(
    tmp_path: Path, spawn: Spawn
) -> None:
    """A daemon at the default path of a user's environment that names it every way,
    then this suite's set-up (its conftest) run in that environment: tests that name no
    socket find no daemon."""
    runtime = Path(os.path.dirname(short_socket_path()))
    (runtime / "tierd").mkdir(mode=0o700)
    users = str(default_socket_path({"XDG_RUNTIME_DIR": str(runtime)}))
    daemon = await spawn(daemon_config(tmp_path, socket_path=users))
    config = tmp_path / "users.yaml"
    config.write_text(yaml.safe_dump(daemon.config))
    users_env = child_env(
        XDG_RUNTIME_DIR=str(runtime),
        TIERD_SOCKET=users,
        TIERD_SOCKET__PATH=users,
        TIERD_CONFIG=str(config),
        TIERD="1",
        PYTHONPATH=str(ROOT / "tests"),  # for -p conftest
    )
    done = await tierd("health", env=users_env)
    assert done.returncode == 0, done.stderr  # this environment does reach the daemon
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_forgotten_socket.py").write_text(textwrap.dedent(INNER_TESTS))

    ran = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q"],
        cwd=inner,
        env=users_env,
        capture_output=True,
        text=True,
        timeout=300,  # a safety net, not a timed assertion
        check=False,
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "3 passed" in ran.stdout
    assert await daemon.stop() == 0, daemon.stderr()


@pytest.mark.parametrize("name", ["TIERD_SOCKET", "TIERD_SOCKET__PATH", "TIERD_CONFIG"])
def test_this_suite_names_no_socket(name: str) -> None:
    assert name not in os.environ
    assert Path(os.environ["XDG_RUNTIME_DIR"]).name == "run"
    assert str(default_socket_path()).startswith("/tmp/tierd-tests-")
