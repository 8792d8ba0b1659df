"""A router that stays connected across daemon restarts ends up with what the node holds
(issue 59, item 1), read by SMG's own relay run as its gateway runs it
(tests/smg_gateway.py). Dynamo's indexer across the same restarts:
tests/test_kv_events_dynamo.py.

Before, the new incarnation's ``AllBlocksCleared`` and its re-announcement of the disk's
blocks went out before any subscriber was back, and its sequence started again at 0: SMG
ended the stream (``DATA_LOSS``), cleared the worker and, subscribed again, never heard
of the blocks the node still held. Now a batch is numbered past every earlier
incarnation's, and a subscriber that comes back is sent a snapshot of what the node
holds. The daemon is a process of its own, restarted by SIGTERM and by SIGKILL, its disk
tier kept and then wiped.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kv_events_kit import SMG_PYTHON
from tests.port_kit import free_port
from tierd.client import Client
from tierd.testing import daemon_config, start_daemon

ROOT = Path(__file__).resolve().parents[1]
NS = "model-a"
CHAIN = 6  # described blocks; a CPU tier of 2 leaves 4 on disk only
WAIT_S = 30.0  # liveness bound on the gateway catching up


def _descriptions(first: int, n: int) -> tuple[list[bytes], list[dict[str, Any]]]:
    keys = [f"block-{first + i}".encode() for i in range(n)]
    descs = [
        {
            "hashes": [7000 + first + i],
            "parent": None if i == 0 else 7000 + first + i - 1,
            "tokens": [first * 10 + i * 4 + t for t in range(4)],
            "block_size": 4,
        }
        for i in range(n)
    ]
    return keys, descs


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[dict[str, Any], Path]]:
    """The daemon's config (fixed loopback ports: a restart binds them again) and the
    file where the gateway, connected to them throughout, says what it holds."""
    if not SMG_PYTHON.is_file():
        pytest.skip(f"SMG's relay is not installed ({SMG_PYTHON} missing): run scripts/setup_smg")
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    kv = {
        "enabled": True,
        "endpoint": pub,
        "replay_endpoint": replay,
        "anyone_may_read": True,  # the gateway dials tcp, as it would from another host
        "batch_s": 0.001,
    }
    config = daemon_config(tmp_path, cpu_blocks=2, disk_blocks=16, kv_events=kv)
    state = tmp_path / "gateway.json"
    proc = subprocess.Popen(
        [str(SMG_PYTHON), str(ROOT / "tests" / "smg_gateway.py"), pub, replay, str(state)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "gateway.log").open("wb"),
        cwd="/",
    )
    try:
        yield config, state
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _gateway_holds(state: Path, want: set[int], log: Path) -> dict[str, Any]:
    """Wait (bounded) until the gateway holds exactly ``want``; its last state."""
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if state.exists():
            seen = json.loads(state.read_text())
            if set(seen["held"]) == want:
                return seen
        time.sleep(0.1)
    raise AssertionError(f"the gateway holds {seen}, not {sorted(want)}\n{log.read_text()[-3000:]}")


async def _store(sock: str, first: int, n: int) -> list[int]:
    keys, descs = _descriptions(first, n)
    async with await Client.connect(sock, namespace=NS) as client:
        await client.describe(keys, descs)
        for key in keys:  # one at a time: the CPU tier of 2 demotes the oldest to disk
            await client.put([key], [key.ljust(4096, b".")])
    return [d["hashes"][0] for d in descs]


async def _held(sock: str, hashes: list[int]) -> set[int]:
    """The hashes the node holds, once its kept blocks are adopted (the answer is steady)."""
    last: set[int] | None = None
    async with await Client.connect(sock) as operator:
        for _ in range(100):  # bounded: adoption is a moment for 16 blocks
            media = await operator.blocks_held([[h] for h in hashes])
            now = {h for h, m in zip(hashes, media, strict=True) if m}
            if now == last:
                return now
            last = now
            await asyncio.sleep(0.2)
    raise AssertionError(f"the blocks held never settled: {last}")


@pytest.mark.parametrize(
    ("how", "wipe"),
    [
        (signal.SIGTERM, False),
        (signal.SIGKILL, False),
        (signal.SIGTERM, True),
        (signal.SIGKILL, True),
    ],
    ids=["SIGTERM", "SIGKILL", "SIGTERM-wiped", "SIGKILL-wiped"],
)
async def test_after_a_restart_smg_holds_what_the_node_holds(
    tmp_path: Path, gateway: tuple[dict[str, Any], Path], how: int, wipe: bool
) -> None:
    config, state = gateway
    log = tmp_path / "gateway.log"
    daemon = start_daemon(config, log=tmp_path / "tierd-0.log")
    try:
        sock = str(daemon.socket)
        chain = await _store(sock, 0, CHAIN)
        _gateway_holds(state, set(chain), log)
        if how == signal.SIGKILL:
            daemon.kill()
        else:
            assert daemon.stop() == 0
        if wipe:
            shutil.rmtree(tmp_path / "disk")
        daemon = start_daemon(config, log=tmp_path / "tierd-1.log")
        held = await _held(sock, chain)
        # kept: the four the CPU tier demoted, at least (SIGKILL may lose the two above)
        assert held == set() if wipe else set(chain[:4]) <= held <= set(chain)
        _gateway_holds(state, held, log)
        fresh = await _store(sock, 100, 2)  # stored after the restart
        # the old incarnation's blocks still held and the new ones, nothing else
        _gateway_holds(state, held | set(fresh), log)
    finally:
        daemon.kill()
