"""What an operator meets starting and stopping the daemon, with real processes: ``tierd
stop`` and the ``stop`` operation, the pid file, SIGHUP, sizes checked against the machine
before anything is allocated, and the clear errors of a start that cannot succeed (exit
status, one line, nothing left behind).

Daemons run as child processes through the ``spawn`` fixture of the lifecycle tests; the
``tierd`` command runs as a child process too, so its exit status and output are the
ones a shell would see.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from tests.cli_kit import HUGE_DISK, tierd, write_config
from tests.daemon_kit import (
    BLOCK,
    DaemonProcess,
    Spawn,
    block,
    child_env,
    dead_pid,
    exists,
    keys,
    medium_of,
    memfd_pools,
    store_all,
)
from tierd.client import Client, DaemonError
from tierd.testing import daemon_config, short_socket_path

ROOT = Path(__file__).resolve().parent.parent
HUGE_CPU = "100TiB"  # more than any machine here has memory


def read(path: Path) -> str:
    return path.read_text()


def pid_file(daemon: DaemonProcess) -> Path:
    return Path(f"{daemon.socket_path}.pid")


def start_failures(daemon: DaemonProcess) -> list[str]:
    return [line for line in daemon.stderr().splitlines() if '"start failed"' in line]


# -- tierd stop and the pid file -------------------------------------------------------------


async def test_tierd_stop_drains_writes_back_and_waits_for_the_exit(
    tmp_path: Path, spawn: Spawn
) -> None:
    config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64, block_bytes=BLOCK)
    daemon = await spawn(config)
    assert read(pid_file(daemon)).strip() == str(daemon.pid)
    names = keys("stop", 6)
    async with await daemon.connect() as client:
        await store_all(client, names, 6)  # dirty in the CPU tier: only write-back saves them

    done = await tierd("stop", "--socket", daemon.socket_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"stopped the daemon at {daemon.socket_path} (pid {daemon.pid})"
    ]
    assert daemon.proc.poll() == 0  # gone when the command returned, exit status 0
    assert not exists(daemon.socket_path)
    assert not exists(pid_file(daemon))

    again = await spawn(config)
    async with await again.connect() as client:
        assert [await medium_of(client, key) for key in names] == ["DISK"] * len(names)
        assert await client.load(names) == [block(k) for k in names]
    assert await again.stop() == 0


async def test_stop_is_refused_on_a_namespaced_connection(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    async with await daemon.connect() as client:
        with pytest.raises(DaemonError) as refused:
            await client.request("stop")
        assert refused.value.code == "not_allowed"
        assert (await client.lookup([b"still-serving"])).count == 0
    async with await Client.connect(daemon.socket_path) as operator:
        assert (await operator.request("stop"))["pid"] == daemon.pid
    assert await daemon.wait() == 0


async def test_tierd_stop_without_a_daemon_exits_3(tmp_path: Path) -> None:
    path = short_socket_path()
    done = await tierd("stop", "--socket", path)
    assert done.returncode == 3
    [line] = done.stderr.splitlines()
    assert line.startswith(f"tierd: error: cannot reach the daemon at {path}: no socket there")


async def test_a_stale_pid_file_is_replaced(tmp_path: Path, spawn: Spawn) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    stale = Path(f"{config['socket']['path']}.pid")
    write_config(stale.parent, dead_pid(), stale.name)
    daemon = await spawn(config)
    assert read(stale) == f"{daemon.pid}\n"
    assert await daemon.stop() == 0
    assert not exists(stale)


async def test_a_configured_pid_file(tmp_path: Path, spawn: Spawn) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    config["socket"]["pid_file"] = str(tmp_path / "tierd.pid")
    daemon = await spawn(config)
    assert read(tmp_path / "tierd.pid") == f"{daemon.pid}\n"
    assert not exists(pid_file(daemon))
    assert await daemon.stop() == 0
    assert not exists(tmp_path / "tierd.pid")


async def test_sighup_stops_cleanly(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    assert memfd_pools(daemon.pid)  # its pool: a memfd, gone with the process
    daemon.signal(signal.SIGHUP)
    assert await daemon.wait() == 0
    assert not exists(daemon.socket_path)
    assert not exists(pid_file(daemon))
    assert '"stopped"' in daemon.stderr()


# -- sizes checked against the machine ---------------------------------------------------------


def assert_nothing_left(daemon: DaemonProcess) -> None:
    assert not exists(daemon.socket_path)
    assert not exists(pid_file(daemon))
    assert '"stopped"' not in daemon.stderr()  # it never started
    # The reason is said once, as `tierd: error: ...`: no log line repeats it (issue 61).
    assert start_failures(daemon) == []


async def test_a_disk_tier_larger_than_the_free_space_is_refused(
    tmp_path: Path, spawn: Spawn
) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    directory = tmp_path / "new-disk"
    config["tiers"][1].update(capacity=HUGE_DISK, directories=[str(directory)])
    daemon = await spawn(config, ready=False)
    assert await daemon.wait() == 78
    problem = daemon.stderr().splitlines()[-1]
    assert problem.startswith("tiers.1.capacity: the disk tier 'disk' needs 2 PiB in ")
    assert str(directory) in problem
    assert "free" in problem
    assert "invalid configuration" in daemon.stderr()
    assert_nothing_left(daemon)
    assert not exists(directory)

    done = await tierd("config", "check", str(write_config(tmp_path, config)))
    assert done.returncode == 78
    same = problem.partition(" has ")[0]  # the free space changes as others write
    assert done.stderr.splitlines()[-1].partition(" has ")[0] == same


async def test_a_reused_slab_counts_only_its_growth(tmp_path: Path, spawn: Spawn) -> None:
    slots = 8192  # 8 KiB each on disk (a header page and the block): a 64 MiB slab
    config = daemon_config(tmp_path, block_bytes=BLOCK, disk_blocks=slots)
    daemon = await spawn(config)
    assert await daemon.stop() == 0
    fs = os.statvfs(tmp_path)
    margin = 32 << 20  # room for what other processes write meanwhile
    # As many more slots as the free space less the margin: the tier fits only because
    # the 64 MiB already allocated count (the whole slab would exceed the free space).
    config["tiers"][1]["capacity"] = slots + (fs.f_bavail * fs.f_frsize - margin) // (2 * BLOCK)
    done = await tierd("config", "check", str(write_config(tmp_path, config)))
    assert done.returncode == 0, done.stderr
    config["tiers"][1]["directories"] = [str(tmp_path / "elsewhere")]  # no slab to reuse
    done = await tierd("config", "check", str(write_config(tmp_path, config)))
    assert done.returncode == 78
    assert "tiers.1.capacity: the disk tier 'disk' needs" in done.stderr


async def test_a_cpu_tier_larger_than_memory_is_refused(tmp_path: Path, spawn: Spawn) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    config["tiers"][0]["capacity"] = HUGE_CPU
    daemon = await spawn(config, ready=False)
    assert await daemon.wait() == 78
    problem = daemon.stderr().splitlines()[-1]
    assert problem.startswith("tiers.0.capacity: the cpu tier 'cpu' needs 100 TiB of memory")
    assert "MemAvailable" in problem
    assert_nothing_left(daemon)


async def test_a_file_where_the_disk_directory_should_be(tmp_path: Path, spawn: Spawn) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    config["tiers"][1]["directories"] = [str(in_the_way)]
    daemon = await spawn(config, ready=False)
    assert await daemon.wait() == 78
    assert daemon.stderr().splitlines()[-1] == (
        f"tiers.1.directories: {in_the_way} is not a directory (disk tier 'disk')"
    )
    assert_nothing_left(daemon)
    assert read(in_the_way) == "not a directory"


# -- a start that fails late removes what it created -------------------------------------------


async def test_a_slab_held_by_a_daemon(tmp_path: Path, spawn: Spawn) -> None:
    first = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    held = first.config["tiers"][1]["directories"][0]
    slab = f"{held}/tierd-slab.bin"

    home = tmp_path / "home"
    home.mkdir()
    fresh = home / ".local" / "state" / "tierd"
    second = daemon_config(tmp_path, block_bytes=BLOCK)
    second["tiers"][1]["directories"] = ["~/.local/state/tierd"]  # created, parents too
    second["tiers"].append({**first.config["tiers"][1], "name": "held"})
    daemon = await spawn(second, env=child_env(HOME=str(home)), ready=False)
    assert await daemon.wait() == 1
    message = (
        f"tierd: error: tier 'held' (disk): the slab {slab} is in use by another process"
        " (a running tierd daemon?)"
    )
    assert daemon.stderr().splitlines()[-1] == message
    assert_nothing_left(daemon)
    assert not exists(fresh.parent.parent)  # ~/.local and what the start put in it
    assert exists(slab)

    trace = tmp_path / "trace.jsonl"
    made = await tierd("trace", "generate", "--out", str(trace), "--conversations", "4")
    assert made.returncode == 0, made.stderr
    config_file = write_config(tmp_path, first.config, "first.yaml")
    # A what-if on the live daemon's own config runs cold in a directory of its own: it
    # never opens (or waits on) the daemon's slab.
    done = await tierd("simulate", str(trace), "--config", str(config_file))
    assert done.returncode == 0, done.stderr
    assert "from DISK" in done.stdout
    assert await first.stop() == 0


async def test_the_default_disk_tier_goes_to_the_xdg_state_directory(tmp_path: Path) -> None:
    root = ROOT
    env = child_env(XDG_STATE_HOME=str(tmp_path / "state"))
    done = await tierd("config", "show", "-c", str(root / "config" / "tierd.yaml"), env=env)
    assert done.returncode == 0, done.stderr
    disk = yaml.safe_load(done.stdout)["tiers"][1]
    assert disk["directories"] == [str(tmp_path / "state" / "tierd" / "disk")]
    env = {k: v for k, v in env.items() if k != "XDG_STATE_HOME"} | {"HOME": str(tmp_path)}
    done = await tierd("config", "check", str(root / "config" / "tierd.yaml"), env=env)
    assert done.returncode == 0, done.stderr
    done = await tierd("config", "show", "-c", str(root / "config" / "tierd.yaml"), env=env)
    disk = yaml.safe_load(done.stdout)["tiers"][1]
    assert disk["directories"] == [str(tmp_path / ".local" / "state" / "tierd" / "disk")]


async def test_an_xdg_state_directory_outside_home_is_created_on_a_first_run(
    tmp_path: Path,
) -> None:
    """The default config's directory lies under $XDG_STATE_HOME, which a user may point
    anywhere: its missing parents are created there too, not refused as a missing mount."""
    home, state = tmp_path / "home", tmp_path / "elsewhere" / "state"
    home.mkdir()
    env = child_env(XDG_STATE_HOME=str(state), HOME=str(home))
    done = await tierd("config", "check", str(ROOT / "config" / "tierd.yaml"), env=env)
    assert done.returncode == 0, done.stderr


async def test_a_file_in_the_way_of_a_disk_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    where = f"tiers.disk.directories=[{tmp_path / 'plain' / 'sub'}]"
    done = await tierd("config", "check", str(ROOT / "config" / "tierd.yaml"), "--set", where)
    assert done.returncode == 78
    assert f"{tmp_path / 'plain'} is not a directory (disk tier 'disk')" in done.stderr


# -- misspelt settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "problem"),
    [
        ("TIERD_BLOK_BYTES", "TIERD_BLOK_BYTES: not a setting; did you mean TIERD_BLOCK_BYTES?"),
        (
            "TIERD_SHUTDOWN__GRASE",
            "shutdown.grase (from TIERD_SHUTDOWN__GRASE): not a setting; did you mean"
            " shutdown.grace?",
        ),
    ],
)
async def test_a_misspelt_variable_stops_serve_with_78(
    tmp_path: Path, spawn: Spawn, variable: str, problem: str
) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    daemon = await spawn(config, env=child_env(**{variable: "1"}), ready=False)
    assert await daemon.wait() == 78
    assert daemon.stderr().splitlines() == ["tierd: error: invalid configuration:", problem]
    assert not exists(daemon.socket_path)
