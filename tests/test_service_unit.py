"""config/tierd.service: systemd accepts it, it is hardened, and its ExecStart runs a
config that tierd accepts, with the socket and the disk tier in the directories systemd
creates for the service."""

from __future__ import annotations

import itertools
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from service_unit_kit import ROOT, UNIT, parse_unit

from tierd.config import DaemonConfig

CONFIG = ROOT / "config" / "tierd.yaml"  # what the unit's install notes put in /etc/tierd
DEADLINE_S = 60.0
TIERD = [sys.executable, "-m", "tierd"]


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def one(service: dict[str, list[str]], key: str) -> str:
    (value,) = service[key]
    return value


def exec_start(service: dict[str, list[str]]) -> list[str]:
    return shlex.split(one(service, "ExecStart"))


def test_unit_keeps_notify_and_no_restart_on_a_bad_config(service: dict[str, list[str]]) -> None:
    assert one(service, "Type") == "notify"
    assert one(service, "RestartPreventExitStatus") == "78"
    assert one(service, "User") not in ("", "root")
    # systemd must wait for the drain and the write-back before it kills the daemon.
    assert float(one(service, "TimeoutStopSec")) > DaemonConfig().shutdown.grace


def test_unit_is_hardened(service: dict[str, list[str]]) -> None:
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "LimitMEMLOCK": "infinity",  # the pinned CPU pool
        "StateDirectory": "tierd",
        "RuntimeDirectory": "tierd",
        "CapabilityBoundingSet": "",
    }
    assert {key: one(service, key) for key in expected} == expected
    assert set(one(service, "RestrictAddressFamilies").split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
    }
    writable = [path for value in service.get("ReadWritePaths", []) for path in value.split()]
    assert "/dev/shm" not in writable  # pools are memfds passed over the socket
    assert "PrivateDevices" not in service  # it would hide /dev/nvidia* from the GPU tier


def test_exec_start_puts_socket_and_disk_tier_in_the_service_directories(
    service: dict[str, list[str]],
) -> None:
    argv = exec_start(service)
    assert argv[0].startswith("/") and argv[1] == "serve"
    # The unit reads /etc/tierd/tierd.yaml, installed from config/tierd.yaml.
    assert argv[argv.index("-c") + 1] == "/etc/tierd/tierd.yaml"
    local = [str(CONFIG) if arg == "/etc/tierd/tierd.yaml" else arg for arg in argv[2:]]
    shown = subprocess.run(
        [*TIERD, "config", "show", *local, "--json"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=True,
        cwd=ROOT,
    )
    config = json.loads(shown.stdout)
    runtime = f"/run/{one(service, 'RuntimeDirectory')}/"
    state = f"/var/lib/{one(service, 'StateDirectory')}/"
    assert config["socket"]["path"].startswith(runtime)
    disk_tiers = [tier for tier in config["tiers"] if tier["kind"] == "disk"]
    disk_dirs = [directory for tier in disk_tiers for directory in tier["directories"]]
    assert disk_dirs
    assert all(d.startswith(state) for d in disk_dirs)
    assert one(service, "WorkingDirectory") == state.rstrip("/")


def test_exec_start_flags_pass_config_check(service: dict[str, list[str]], tmp_path: Path) -> None:
    """``tierd config check`` with the unit's own --set values, the service directories
    (which systemd would create) standing in tmp_path, exits 0."""
    argv = exec_start(service)
    run_dir, state_dir = tmp_path / "run", tmp_path / "state"
    run_dir.mkdir()
    state_dir.mkdir()
    sets = []
    for flag, value in itertools.pairwise(argv):
        if flag == "--set":
            value = value.replace("/run/tierd", str(run_dir))
            sets += ["--set", value.replace("/var/lib/tierd", str(state_dir))]
    assert len(sets) >= 4
    checked = subprocess.run(
        [*TIERD, "config", "check", str(CONFIG), *sets],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
        cwd=ROOT,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    serve_help = subprocess.run(
        [*TIERD, "serve", "--help"], capture_output=True, text=True, timeout=DEADLINE_S, check=True
    ).stdout
    options = {arg for arg in argv[2:] if arg.startswith("-")}
    assert options <= {"-c", "--set"}
    assert all(option in serve_help for option in options)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at this checkout's tierd.
    program = shutil.which("tierd", path=str(Path(sys.executable).parent))
    if program is None:
        pytest.skip("no tierd entry point next to this Python (the package is not installed)")
    unit = tmp_path / "tierd.service"
    unit.write_text(UNIT.read_text().replace("/opt/tierd/bin/tierd", program))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    # verify exits 0 on unknown keys and unparsable values too, with a warning naming the
    # file: any line about the unit is a failure.
    about_unit = [line for line in (done.stdout + done.stderr).splitlines() if "tierd" in line]
    assert done.returncode == 0, done.stderr
    assert about_unit == []
