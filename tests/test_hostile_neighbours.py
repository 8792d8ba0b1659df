"""Neighbours of the daemon on one machine that break it through its configuration and
its limits: tenant names that are directories, a CPU tier larger than the memory cgroup
allows, a socket path that fits while the path actually bound does not.

Each is checked where a user meets it: ``tierd config check`` and ``tierd serve``, real
processes, a real memory cgroup (root only).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import cgroup_kit
import pytest
import yaml
from redis_kit import free_port

from tests.daemon_kit import Spawn, child_env
from tierd.cli import main
from tierd.testing import daemon_config


def write(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "tierd.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_tenant_names_are_refused(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``..`` put its slab, journal and index in the parent of the disk directory; ``.``
    where the untenanted slab lives."""
    config = daemon_config(tmp_path)
    config["tenants"] = [{"name": name, "uids": [os.getuid()], "operator": True}]
    assert main(["config", "check", str(write(tmp_path, config))]) == 78
    err = capsys.readouterr().err
    assert "tenants.0.name" in err and "is not a tenant name" in err


def test_a_socket_path_whose_bound_path_is_too_long_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 100-byte path with a short file name fits sun_path; the path bound first (in a
    fresh directory beside it) does not. ``config check`` says so, as ``serve`` would."""
    directory = tmp_path / ("d" * max(1, 96 - len(str(tmp_path))))
    path = directory / "s"
    assert 90 < len(str(path)) <= 107
    config = daemon_config(tmp_path, socket_path=str(path))
    assert main(["config", "check", str(write(tmp_path, config))]) == 78
    err = capsys.readouterr().err
    assert "socket.path" in err and "before it is renamed" in err


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A fresh memory cgroup (v1 or v2) limited to 450 MiB, removed at the end."""
    if os.getuid() != 0:
        pytest.skip("creating a cgroup needs root")
    with cgroup_kit.memory_cgroup(450 << 20) as group:
        yield group


async def test_a_cpu_tier_over_the_cgroup_limit_is_refused_not_oom_killed(
    tmp_path: Path, memory_cgroup: Path
) -> None:
    """450 MiB of cgroup, a 512 MiB CPU tier: the daemon used to be OOM-killed at start
    (status 137, an empty log), since the checks read only MemAvailable."""
    config = daemon_config(tmp_path, cpu_blocks=512, disk_blocks=None, block_bytes=1 << 20)
    path = write(tmp_path, config)
    join = f'echo $$ > {memory_cgroup / "cgroup.procs"} && exec "$@"'
    command = ["sh", "-c", join, "sh", sys.executable, "-m", "tierd", "serve", "-c", str(path)]
    out = await asyncio.to_thread(
        subprocess.run, command, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 78, (out.returncode, out.stderr)  # a configuration error
    assert "tiers.0.capacity" in out.stderr
    assert f"the memory cgroup /{memory_cgroup.name} is limited to 450 MiB" in out.stderr
    shutil.rmtree(Path(config["socket"]["path"]).parent, ignore_errors=True)


async def test_scrapers_cost_the_loop_one_rendering_per_interval(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Any local user can scrape the metrics port, as often as it likes: within
    ``metrics.cache`` every scrape gets the same rendering (the request counts do not
    move however many requests the socket answers meanwhile), while the operator's
    ``metrics`` request over the socket renders afresh."""
    port = free_port()
    config = daemon_config(tmp_path, metrics={"http_port": port, "cache": "10m"})
    daemon = await spawn(config)
    first = await asyncio.to_thread(_scrape, port)
    async with await daemon.connect() as client:
        for i in range(20):
            await client.lookup([b"k%d" % i])
        fresh = await client.metrics()
    scrapes = await asyncio.gather(*(asyncio.to_thread(_scrape, port) for _ in range(6)))
    assert scrapes == [first] * 6
    assert 'op="lookup"' in fresh and 'op="lookup"' not in first
    assert await daemon.stop() == 0


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return str(reply.read().decode())
