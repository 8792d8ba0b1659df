"""Socket squatting: another user binds the socket path first.

The client checks who serves the socket (``SO_PEERCRED``) before it sends a byte: a
process of another user (here ``nobody``, dropped to from root) is refused with
:class:`~tierd.client.UntrustedDaemon`, and the impostor receives nothing, so no KV bytes
reach it and none of its bytes are loaded as the client's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from squatting_kit import Impostor
from users_kit import Attacker, as_user

from tierd.client import Client, UntrustedDaemon
from tierd.testing import DaemonProcess, start_daemon, start_daemon_async

NOBODY = 65534
pytestmark = pytest.mark.skipif(
    os.getuid() != 0, reason="running an impostor as another uid (os.setuid) needs root"
)


async def test_a_socket_served_by_another_user_is_refused_before_a_byte(
    impostor: Impostor,
) -> None:
    with pytest.raises(UntrustedDaemon) as refused:
        await Client.connect(impostor.path, namespace="victim", block_bytes=4096)
    message = str(refused.value)
    assert f"served by uid {NOBODY}" in message and str(impostor.path) in message
    assert await impostor.received() == 0  # not even the hello reached it


async def test_a_trusted_server_uid_is_accepted(impostor: Impostor) -> None:
    """A daemon run as a service user is trusted when the client names its uid."""
    client = await Client.connect(impostor.path, server_uids=[NOBODY], map_pool=False)
    assert client.info["server"] == "tierd 0"
    await client.close()
    assert await impostor.received() > 0  # the hello went out


async def test_the_command_line_refuses_an_impostor_unless_told_to_trust_it(
    impostor: Impostor,
) -> None:
    tierd = [sys.executable, "-m", "tierd", "health", "--socket", str(impostor.path)]
    refused = await asyncio.to_thread(
        subprocess.run, tierd, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 3, refused.stderr
    assert f"served by uid {NOBODY}" in refused.stderr
    assert await impostor.received() == 0


async def test_the_command_line_trusts_a_service_users_daemon_when_told(
    impostor: Impostor,
) -> None:
    """``--trust-uid`` names a daemon's service user: the hello goes out. (The impostor
    never answers the request that follows: the command is stopped after a moment.)"""
    tierd = [sys.executable, "-m", "tierd", "health", "--socket", str(impostor.path)]
    trusting = await asyncio.create_subprocess_exec(
        *tierd, "--trust-uid", str(NOBODY), stderr=asyncio.subprocess.PIPE
    )
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                await trusting.wait()
    finally:
        if trusting.returncode is None:
            trusting.kill()
        await trusting.communicate()
    assert await impostor.received() > 0


def _serve(runtime: Path, config: Path, *, wait: bool) -> DaemonProcess:
    """``tierd serve`` of ``config`` with ``runtime`` as XDG_RUNTIME_DIR; with ``wait``,
    once it sent READY=1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    return start_daemon(config, env=env, log=runtime / "serve.log", wait=wait)


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """An XDG_RUNTIME_DIR of the test's own (short: socket paths are limited)."""
    directory = Path(tempfile.mkdtemp(prefix="tierd-rt-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def cpu_only(tmp_path: Path) -> Path:
    config = tmp_path / "tierd.yaml"
    config.write_text("block_bytes: 4096\ntiers: [{name: cpu, kind: cpu, capacity: 8}]\n")
    return config


async def test_the_daemon_refuses_a_socket_directory_another_user_owns(
    runtime_dir: Path, cpu_only: Path
) -> None:
    squatted = runtime_dir / "tierd"
    squatted.mkdir()
    os.chown(squatted, NOBODY, NOBODY)
    daemon = _serve(runtime_dir, cpu_only, wait=False)
    assert await daemon.wait_async(60) == 1
    out = daemon.log_text()
    assert f"the socket directory {squatted} belongs to uid {NOBODY}" in out
    assert "Traceback" not in out
    assert list(squatted.iterdir()) == []


async def test_the_daemon_makes_its_socket_directory_private(
    runtime_dir: Path, cpu_only: Path
) -> None:
    daemon = await asyncio.to_thread(_serve, runtime_dir, cpu_only, wait=True)
    try:
        path = runtime_dir / "tierd" / "tierd.sock"
        assert daemon.socket == str(path)
        client = await Client.connect(path)  # READY=1 came after the socket accepts
        await client.close()
        st = os.stat(runtime_dir / "tierd")
        assert (st.st_uid, st.st_mode & 0o777) == (os.getuid(), 0o700)
    finally:
        await daemon.stop_async(60)


# -- files planted in a shared directory --------------------------------------------------


async def test_links_planted_for_the_pid_file_are_never_written_through(
    attacker: Attacker, tmp_path: Path
) -> None:
    """A directory root owns and the attacker's group may write (sticky, so the kernel's
    protection of links in world-writable directories does not apply): the attacker links
    every name the pid file could be written through to a root file. The daemon runs in a
    new PID namespace, so its pid, and the old temporary name ``.tierd.sock.pid.1``, are
    known in advance. The root file is left intact and the pid file is the daemon's."""
    shared = Path(tempfile.mkdtemp(prefix="tierd-pid-", dir="/tmp"))
    victim = tmp_path / "precious"
    victim.write_text("root's data\n")
    try:
        os.chown(shared, 0, attacker.gid)
        os.chmod(shared, 0o1775)
        names = [f".tierd.sock.pid.{pid}" for pid in range(1, 8)] + ["tierd.sock.pid"]
        plant = "import os, sys\nfor n in sys.argv[2:]: os.symlink(sys.argv[1], n)"
        planted = as_user(attacker, sys.executable, "-c", plant, str(victim), *names, cwd=shared)
        assert planted.returncode == 0, planted.stderr
        config = tmp_path / "tierd.yaml"
        config.write_text(
            "block_bytes: 4096\ntiers: [{name: cpu, kind: cpu, capacity: 8}]\n"
            f"socket: {{path: {shared}/tierd.sock}}\n"
        )
        unshare = shutil.which("unshare")
        if unshare is None:
            pytest.skip("unshare is not installed")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
        wrap = [unshare, "--pid", "--fork", "--kill-child=SIGTERM"]
        daemon = await start_daemon_async(config, wrap=wrap, env=env, log=tmp_path / "serve.log")
        try:
            client = await Client.connect(shared / "tierd.sock")  # ready: READY=1 came
            await client.close()
            pid_file = shared / "tierd.sock.pid"
            assert not pid_file.is_symlink() and pid_file.read_text().strip().isdigit()
        finally:
            # unshare does not pass SIGTERM on: kill its child (the daemon) by its PID.
            listing = Path(f"/proc/{daemon.pid}/task/{daemon.pid}/children")
            children = await asyncio.to_thread(listing.read_text)
            for child in children.split():
                os.kill(int(child), signal.SIGKILL)
            await daemon.wait_async(60)
        assert victim.read_text() == "root's data\n"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


async def test_a_world_writable_directory_of_another_user_is_refused(
    attacker: Attacker, tmp_path: Path
) -> None:
    """/tmp-like (root's, sticky, writable by everyone): the attacker's daemon refuses to
    put its socket and pid file there, where anyone may plant files."""
    shared = Path(tempfile.mkdtemp(prefix="tierd-tmp-", dir="/tmp"))
    os.chmod(shared, 0o1777)
    home = Path(tempfile.mkdtemp(prefix="tierd-cfg-", dir="/tmp"))
    try:
        config = home / "tierd.yaml"
        config.write_text(
            "block_bytes: 4096\ntiers: [{name: cpu, kind: cpu, capacity: 8}]\n"
            f"socket: {{path: {shared}/tierd.sock}}\n"
        )
        os.chmod(home, 0o755)
        os.chmod(config, 0o644)
        # Imports as root (the interpreter's packages may sit under /root), then serves
        # as the attacker.
        serve = (
            "import os, sys\nimport tierd.daemon\n"
            "from tierd.cli import commands, main\ncommands()\n"
            f"os.setgroups([]); os.setgid({attacker.gid}); os.setuid({attacker.uid})\n"
            "sys.exit(main(['serve', '-c', sys.argv[1]]))"
        )
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", serve, str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"the socket directory {shared} is writable by everyone" in out.stderr
        assert "Traceback" not in out.stderr
        assert os.listdir(shared) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
