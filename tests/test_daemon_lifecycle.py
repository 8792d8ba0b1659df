"""The daemon's lifecycle, with real processes: start-up, serving, SIGTERM, restart.

Most tests run the daemon as a child process from a YAML file (the ``spawn`` fixture, over
:func:`tierd.testing.start_daemon`) and talk to it with :class:`tierd.client.Client` over
its real Unix socket; its stderr goes to a file, so a chatty daemon never blocks on a full
pipe. Start-up is awaited on the daemon's own ``READY=1`` (sd_notify) under a 30 s
deadline; everything after that waits on replies, datagrams and exits. The ``spawn``
fixture kills whatever is still running at the end of a test and removes its socket's
directory.

The forced exit on a second signal is tested in this test's event loop instead, where the
drain can be held open deterministically (a gated ``chain.flush``).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_kit import (
    BLOCK,
    DEADLINE_S,
    EXIT_DEADLINE_S,
    NAMESPACE,
    DaemonProcess,
    Spawn,
    block,
    child_env,
    exists,
    http_get,
    keys,
    medium_of,
    store_all,
)
from port_kit import free_port

from tierd.chain import FlushResult
from tierd.client import Client, DaemonError, Unreachable
from tierd.config import DaemonConfig
from tierd.daemon import Daemon
from tierd.testing import daemon_config, short_socket_path

TESTS = Path(__file__).resolve().parent
# The fixture is conftest's; test_sglang.py, test_engine_call_faults.py and
# e2e_vllm/test_vllm_node_events.py still take it from here.


def shm_pools() -> set[str]:
    """tierd's files in /dev/shm (a daemon makes none: its pools are memfds)."""
    return {os.path.basename(p) for p in glob.glob("/dev/shm/tierd-*")}


async def load_all(client: Client, names: list[bytes], batch: int) -> list[bytes]:
    """Load ``names`` in batches that fit the CPU tier."""
    out: list[bytes] = []
    for i in range(0, len(names), batch):
        out += await client.load(names[i : i + batch])
    return out


# -- 1. serving ----------------------------------------------------------------------------


async def test_subprocess_serves_stored_blocks(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=8, block_bytes=BLOCK))
    names = keys("serve", 6)
    async with await daemon.connect() as client:
        assert client.pool is not None  # the zero-copy path, through the mapped pool
        assert await client.store(names, [block(k) for k in names]) == 6
        assert (await client.lookup(names)).count == 6
        assert await client.load(names) == [block(k) for k in names]
    assert await daemon.stop() == 0


# -- 2. SIGTERM while loads run ------------------------------------------------------------


async def _load_checked(client: Client, names: list[bytes]) -> str:
    """Load ``names``: ``"ok"`` when they came back intact, else the error code of the
    daemon's refusal or ``"unreachable"`` (the connection closed under the request)."""
    try:
        got = await client.load(names)
    except DaemonError as exc:
        return exc.code
    except Unreachable:
        return "unreachable"
    assert got == [block(k) for k in names]
    return "ok"


async def test_sigterm_during_loads_exits_cleanly_and_keeps_blocks(
    tmp_path: Path, spawn: Spawn
) -> None:
    config = daemon_config(
        tmp_path, cpu_blocks=64, disk_blocks=512, block_bytes=BLOCK, shutdown={"grace": 30}
    )
    daemon = await spawn(config)
    names = keys("term", 256)
    async with await daemon.connect() as client:
        await store_all(client, names, 32)
        cpu_used = (await client.stats())["tiers"][0]["used"]
    assert cpu_used == 64  # so the first 192 blocks live on disk only

    clients = [await daemon.connect() for _ in range(4)]
    try:
        # 24 loads of 2 blocks, each needing a promotion from disk: together they fit
        # the CPU tier (none is refused for room) and leave 16 dirty blocks to flush.
        loads = [
            asyncio.create_task(_load_checked(clients[i % 4], names[2 * i : 2 * i + 2]))
            for i in range(24)
        ]
        # SIGTERM once the daemon is serving them: when the first load has come back.
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.wait(loads, return_when=asyncio.FIRST_COMPLETED)
        daemon.signal(signal.SIGTERM)
        async with asyncio.timeout(EXIT_DEADLINE_S):
            results = await asyncio.gather(*loads)
    finally:
        for client in clients:
            await client.close()
    assert "ok" in results
    assert set(results) <= {"ok", "shutting_down", "unreachable"}, results
    assert await daemon.wait() == 0
    stderr = daemon.stderr()
    assert "grace period over" not in stderr, stderr
    assert not exists(daemon.socket_path)

    again = await spawn(config)
    async with await again.connect() as client:
        assert (await client.lookup(names)).count == len(names)
        assert await load_all(client, names, 64) == [block(k) for k in names]
    assert await again.stop() == 0


# -- 3. restart and write-back ------------------------------------------------------------


@pytest.mark.parametrize("write_back", ["flush", "none"])
async def test_restart_keeps_the_disk_tier(tmp_path: Path, spawn: Spawn, write_back: str) -> None:
    config = daemon_config(
        tmp_path, cpu_blocks=8, disk_blocks=64, shutdown={"write_back": write_back}
    )
    daemon = await spawn(config)
    names = keys("restart", 12)
    async with await daemon.connect() as client:
        await store_all(client, names, 4)
        media = {key: await medium_of(client, key) for key in names}
        tiers = (await client.stats())["tiers"]
    on_disk = [k for k in names if media[k] == "DISK"]
    cpu_only = [k for k in names if media[k] == "CPU"]
    # Nothing was written through, so every CPU block is dirty: on no disk.
    assert (len(cpu_only), len(on_disk)) == (8, 4)
    assert (tiers[0]["used"], tiers[1]["used"]) == (8, 4)
    assert await daemon.stop() == 0

    again = await spawn(config)
    async with await again.connect() as client:
        for key in on_disk:
            assert await medium_of(client, key) == "DISK"
        for key in cpu_only:
            expected = "DISK" if write_back == "flush" else None
            assert await medium_of(client, key) == expected
        kept = names if write_back == "flush" else on_disk
        assert await load_all(client, kept, 8) == [block(k) for k in kept]
    assert await again.stop() == 0


# -- 4. a second stop request forces the exit (in this loop) -------------------------------


async def _start_in_loop(cfg: DaemonConfig) -> tuple[Daemon, asyncio.Task[int]]:
    daemon = Daemon(cfg, handle_signals=False)
    task = asyncio.create_task(daemon.run())
    ready = asyncio.create_task(daemon.ready.wait())
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        raise AssertionError(f"the daemon exited before it was ready: {task.result()}")
    return daemon, task


@contextlib.asynccontextmanager
async def _gated_flush(daemon: Daemon) -> AsyncIterator[tuple[asyncio.Event, asyncio.Event]]:
    """Replace the chain's flush (the shutdown write-back) with one that waits at a gate:
    yields ``(entered, gate)``."""
    chain = daemon.chain
    assert chain is not None
    entered, gate = asyncio.Event(), asyncio.Event()
    flush = chain.flush

    async def gated() -> FlushResult:
        entered.set()
        await gate.wait()
        return await flush()

    chain.flush = gated  # type: ignore[method-assign]
    try:
        yield entered, gate
    finally:
        gate.set()


async def _store_dirty(cfg: DaemonConfig, names: list[bytes]) -> None:
    async with await Client.connect(str(cfg.socket.path), namespace=NAMESPACE) as client:
        assert client.pool is not None
        await store_all(client, names, 4)


async def _forced_exit(daemon: Daemon, task: asyncio.Task[int], cfg: DaemonConfig) -> None:
    """One more stop request ends the daemon at once: exit status 1, its socket removed."""
    daemon.request_stop()
    async with asyncio.timeout(DEADLINE_S):
        assert await task == 1
    assert not exists(cfg.socket.path)


async def test_second_stop_during_drain_forces_exit_status_1(tmp_path: Path) -> None:
    cfg = DaemonConfig.model_validate(daemon_config(tmp_path, cpu_blocks=8))
    daemon, task = await _start_in_loop(cfg)
    names = keys("forced", 12)
    await _store_dirty(cfg, names)
    async with await Client.connect(str(cfg.socket.path), namespace=NAMESPACE) as client:
        on_disk = [k for k in names if await medium_of(client, k) == "DISK"]
    assert len(on_disk) == 4  # and 8 dirty blocks in the CPU tier only
    async with _gated_flush(daemon) as (entered, gate):
        daemon.request_stop()
        async with asyncio.timeout(DEADLINE_S):
            await entered.wait()  # the drain is now writing back, held at the gate
        await _forced_exit(daemon, task, cfg)
        assert not gate.is_set()

    # The write-back was skipped: only what was on disk survived (and its index did).
    daemon, task = await _start_in_loop(cfg)
    async with await Client.connect(str(cfg.socket.path), namespace=NAMESPACE) as client:
        for key in names:
            assert await medium_of(client, key) == ("DISK" if key in on_disk else None)
        assert await client.load(on_disk) == [block(k) for k in on_disk]
    daemon.request_stop()
    async with asyncio.timeout(DEADLINE_S):
        assert await task == 0


async def test_two_stop_requests_before_the_drain_skip_it(tmp_path: Path) -> None:
    """Regression: two signals handled in one loop turn (before the drain task started)
    ran the whole drain and write-back anyway."""
    cfg = DaemonConfig.model_validate(daemon_config(tmp_path, cpu_blocks=8))
    daemon, task = await _start_in_loop(cfg)
    await _store_dirty(cfg, keys("twice", 4))
    async with _gated_flush(daemon) as (entered, _gate):
        daemon.request_stop()
        await _forced_exit(daemon, task, cfg)
        assert not entered.is_set()


async def test_cancelling_the_daemon_during_the_drain_propagates(tmp_path: Path) -> None:
    """Regression: cancelling ``Daemon.run()`` while it drained was swallowed and the run
    returned 0 as if it had stopped normally."""
    cfg = DaemonConfig.model_validate(daemon_config(tmp_path, cpu_blocks=8))
    daemon, task = await _start_in_loop(cfg)
    await _store_dirty(cfg, keys("cancel", 4))
    async with _gated_flush(daemon) as (entered, _gate):
        daemon.request_stop()
        async with asyncio.timeout(DEADLINE_S):
            await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(DEADLINE_S):
                await task
    assert task.cancelled()
    assert not exists(cfg.socket.path)


# -- 5. the socket path: stale and live ----------------------------------------------------


async def test_stale_socket_is_replaced_and_live_one_is_kept(tmp_path: Path, spawn: Spawn) -> None:
    path = short_socket_path()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, and nobody listens on it
    assert exists(path)

    config = daemon_config(tmp_path, cpu_blocks=8, socket_path=path)
    first = await spawn(config)
    inode = os.stat(path).st_ino
    async with await first.connect() as client:
        await client.store([b"live"], [block(b"live")])

    second = await spawn(config, ready=False)
    status = await second.wait()
    assert status != 0
    assert "already running" in second.stderr()
    assert os.stat(path).st_ino == inode
    async with await first.connect() as client:
        assert await client.load([b"live"]) == [block(b"live")]
    assert await first.stop() == 0


# -- 6. sd_notify --------------------------------------------------------------------------


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket for ``NOTIFY_SOCKET``: ``(the variable's value, the socket)``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    directory = tempfile.mkdtemp(prefix="tierd-notify-", dir="/tmp")
    try:
        if request.param == "path":
            value = os.path.join(directory, "notify")
            sock.bind(value)
        else:
            value = f"@tierd-test-notify-{secrets.token_hex(8)}"
            sock.bind("\0" + value[1:])
        yield value, sock
    finally:
        sock.close()
        shutil.rmtree(directory, ignore_errors=True)


async def _notification(sock: socket.socket, daemon: DaemonProcess) -> bytes:
    try:
        async with asyncio.timeout(DEADLINE_S):
            return await asyncio.get_running_loop().sock_recv(sock, 256)
    except TimeoutError:
        raise AssertionError(f"no notification:\n{daemon.stderr()}") from None


async def test_sd_notify_ready_and_stopping(
    tmp_path: Path, spawn: Spawn, notify_socket: tuple[str, socket.socket]
) -> None:
    value, sock = notify_socket
    daemon = await spawn(daemon_config(tmp_path), env=child_env(NOTIFY_SOCKET=value), ready=False)
    # Before READY=1, each step of allocating the CPU pool extends systemd's start timeout
    # (a pool of 128 GiB takes minutes to allocate and pin; TimeoutStartSec= is 90 s).
    first = await _notification(sock, daemon)
    assert first.startswith(b"EXTEND_TIMEOUT_USEC=60000000\nSTATUS=allocating the CPU pool")
    while (message := await _notification(sock, daemon)).startswith(b"EXTEND_TIMEOUT_USEC="):
        pass
    assert message == b"READY=1"
    # READY=1 comes after the socket accepts: a hello is answered at once, no polling.
    async with await daemon.connect() as client:
        assert (await client.health())["status"] == "ok"
    daemon.signal(signal.SIGTERM)
    assert await _notification(sock, daemon) == b"STOPPING=1"
    assert await daemon.wait() == 0


# -- 7. permissions ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, 0o660])
async def test_socket_mode_and_a_pool_with_no_path(
    tmp_path: Path, spawn: Spawn, mode: int | None
) -> None:
    sections: dict[str, Any] = {} if mode is None else {"socket": {"mode": f"0o{mode:o}"}}
    before = shm_pools()
    daemon = await spawn(daemon_config(tmp_path, **sections))
    expected = 0o600 if mode is None else mode
    assert os.stat(daemon.socket_path).st_mode & 0o777 == expected
    async with await daemon.connect() as client:
        assert client.pool is not None  # mapped from the descriptor passed with hello
        assert "path" not in client.info["pool"]
    assert shm_pools() == before  # nothing another user could open by name
    assert await daemon.stop() == 0


# -- 8. no pool to reap -------------------------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="a PID namespace (unshare --pid) needs root")
async def test_daemons_in_separate_pid_namespaces_leave_each_other_alone(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Two containers of one pod share /dev/shm but not their PID namespace: a daemon
    starting in one took the other's pool file for a dead daemon's (its pid is not
    visible there) and deleted it, so the live daemon's next client could not map it.
    Pools are memfds now: nothing in /dev/shm to judge, and nothing is reaped."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = await spawn(daemon_config(tmp_path / "a", cpu_blocks=8))
    names = keys("pidns", 6)
    async with await first.connect() as client:
        await store_all(client, names, 6)
    before = shm_pools()
    second = await spawn(
        daemon_config(tmp_path / "b", cpu_blocks=8),
        wrap=["unshare", "--pid", "--fork", "--kill-child=SIGTERM"],
    )
    async with await second.connect() as client:  # the second daemon serves, in its own
        assert client.pool is not None
        await store_all(client, names[:2], 2)
    assert shm_pools() == before
    async with await first.connect() as client:  # a new client of the first one
        assert client.pool is not None
        assert await load_all(client, names, 6) == [block(k) for k in names]
    assert await first.stop() == 0


# -- 9. a client killed holding leases -----------------------------------------------------


async def _leases(client: Client) -> tuple[int, int, int]:
    stats = await client.stats()
    cpu = stats["tiers"][0]
    return cpu["pinned"], cpu["writing"], stats["server"]["leases"]


async def test_killed_client_releases_its_leases(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64))
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(TESTS / "daemon_client_child.py"),
        daemon.socket_path,
        NAMESPACE,
        str(BLOCK),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(DEADLINE_S):
            line = await child.stdout.readline() if child.stdout else b""
        assert line == b"ready\n"
        async with await daemon.connect() as client:
            assert await _leases(client) == (1, 2, 2)
            child.kill()
            await child.wait()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE_S
            # The daemon learns of the death on its own schedule: ask until it has.
            while (held := await _leases(client)) != (0, 0, 0):
                assert loop.time() < deadline, f"still held: {held}"
                await asyncio.sleep(0.02)
            # Every CPU slot is usable again: a batch as large as the tier fits.
            fresh = keys("after-kill", 8)
            assert await client.store(fresh, [block(k) for k in fresh]) == 8
            assert await client.load(fresh) == [block(k) for k in fresh]
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert await daemon.stop() == 0


# -- 10. metrics over HTTP -----------------------------------------------------------------


async def test_metrics_over_http(tmp_path: Path, spawn: Spawn) -> None:
    port = free_port()
    daemon = await spawn(daemon_config(tmp_path, metrics={"http_port": port}))
    # Right after the first hello: the endpoint is up before clients are answered.
    status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert 'tierd_tier_used_blocks{medium="CPU",tier="cpu"} 0.0' in text
    assert 'tierd_tier_used_blocks{medium="DISK",tier="disk"} 0.0' in text
    status, _ = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/other")
    assert status == 404
    assert await daemon.stop() == 0


# -- 11. logging ---------------------------------------------------------------------------


async def test_json_logs(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, logging={"format": "json"}))
    assert await daemon.stop() == 0
    lines = [line for line in daemon.stderr().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) and "event" in r and "level" in r for r in records)
    events = [r["event"] for r in records]
    assert "ready" in events
    assert "stopped" in events


# -- 12. configuration errors --------------------------------------------------------------


async def test_config_errors_exit_78_naming_every_yaml_path(tmp_path: Path, spawn: Spawn) -> None:
    config = daemon_config(tmp_path, bogus_key=1)
    config["tiers"][0]["policy"] = "no-such-policy"
    daemon = await spawn(config, ready=False)
    assert await daemon.wait() == 78
    stderr = daemon.stderr()
    assert "bogus_key" in stderr
    assert "tiers.0.policy" in stderr
    assert not exists(daemon.socket_path)  # it stopped before binding anything
