"""Who reads a tenant's KV events, and whose blocks its descriptions credit (issue 59,
items 5 and 6), with a real daemon and clients of real other users (tests/tenants_kit.py).

Token ids are prompts. With ``kv_events`` on and its defaults, the daemon published every
tenant's events on one loopback TCP port: any local user read them all. Now each tenant
has a stream of its own on ipc sockets the daemon's user may connect to, and the group
``readers`` names for that tenant; a tcp:// endpoint is an explicit opt-in.

A tenant that described its blocks with another tenant's hashes made ``blocks_held``
(asked by the operator for every tenant at once) answer 8 of 8 for hashes the other
tenant never stored; a tenant's descriptions now credit only its own stream, and the
operator names the tenant it asks about.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.daemon_kit import Spawn
from tests.tenants_kit import as_user, tenants_config
from tierd.client import Client, DaemonError
from tierd.testing import config_check

pytestmark = pytest.mark.skipif(
    os.getuid() != 0, reason="clients of other users (useradd, os.setuid) need root"
)

HASHES = [7000 + i for i in range(8)]


def _config(tmp_path: Path, users: dict[str, tuple[int, int]]) -> dict[str, Any]:
    cfg = tenants_config(tmp_path, users)
    # alpha's stream may be read by the stranger's group too; beta's by the operator only.
    cfg["kv_events"] = {
        "enabled": True,
        "batch_s": 0.001,
        "readers": {"alpha": users["stranger"][1]},
    }
    return cfg


def _store(prefix: str, hashes: list[int]) -> list[dict[str, Any]]:
    keys = [f"{prefix}-{h}" for h in hashes]
    return [
        {"do": "connect", "namespace": "model-x"},
        {"do": "store", "keys": keys, "fill": 1},
        {"do": "describe", "keys": keys, "hashes": hashes},
    ]


async def test_a_tenants_events_reach_only_the_operator_and_the_readers_it_names(
    tmp_path: Path, spawn: Spawn, users: dict[str, tuple[int, int]]
) -> None:
    daemon = await spawn(_config(tmp_path, users))
    os.chmod(os.path.dirname(daemon.socket_path), 0o711)  # others may reach the sockets
    async with await Client.connect(daemon.socket_path) as operator:
        streams = (await operator.stats())["kv_events"]["streams"]
    alpha, beta = streams["alpha"]["endpoint"], streams["beta"]["endpoint"]
    assert alpha.startswith("ipc://") and beta.startswith("ipc://")

    listen = {"do": "events", "wait_ms": 4000}
    stranger = asyncio.create_task(
        as_user(daemon, users["stranger"], {**listen, "endpoint": alpha})
    )
    beta_reads_alpha = asyncio.create_task(
        as_user(daemon, users["beta"], {**listen, "endpoint": alpha})
    )
    alpha_reads_beta = asyncio.create_task(
        as_user(daemon, users["alpha"], {**listen, "endpoint": beta})
    )
    await asyncio.sleep(1.5)  # the stranger's subscription is in
    assert (await as_user(daemon, users["alpha"], *_store("a", HASHES)))[1:] == [8, 8]
    assert (await stranger)[0] == {"stored": HASHES}  # alpha's readers' group
    assert (await beta_reads_alpha)[0] == {"error": "EACCES"}
    assert (await alpha_reads_beta)[0] == {"error": "EACCES"}
    said = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tierd", "stats", "--socket", daemon.socket_path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "kv events on 3 streams, one a tenant (ops, alpha, beta)" in said.stdout, said
    assert await daemon.stop() == 0


async def test_a_tenants_descriptions_credit_only_its_own_stream_and_blocks_held(
    tmp_path: Path, spawn: Spawn, users: dict[str, tuple[int, int]]
) -> None:
    daemon = await spawn(_config(tmp_path, users))
    os.chmod(os.path.dirname(daemon.socket_path), 0o711)
    async with await Client.connect(daemon.socket_path) as operator:
        streams = (await operator.stats())["kv_events"]["streams"]
        # the operator (root) listens to alpha's stream while beta describes alpha's hashes
        listening = asyncio.create_task(
            as_user(
                daemon,
                (0, 0),
                {"do": "events", "wait_ms": 4000, "endpoint": streams["alpha"]["endpoint"]},
            )
        )
        await asyncio.sleep(1.5)
        assert (await as_user(daemon, users["beta"], *_store("b", HASHES)))[1:] == [8, 8]
        assert (await listening)[0] == {"stored": []}  # nothing of beta's in alpha's stream
        with pytest.raises(DaemonError, match="name the tenant"):
            await operator.blocks_held([HASHES])
        assert await operator.blocks_held([HASHES], tenant="alpha") == [[]]
        for _ in range(100):  # bounded: the feed follows beta's chain within a batch
            held = await operator.blocks_held([HASHES], tenant="beta")
            if len(held[0]) == 8:
                break
            await asyncio.sleep(0.05)
        assert len(held[0]) == 8
    alpha_asks = await as_user(
        daemon,
        users["alpha"],
        {"do": "connect", "namespace": "model-x"},
        {"do": "op", "name": "blocks_held", "fields": {"hashes": HASHES, "lengths": [8]}},
    )
    assert alpha_asks[1]["held"] == [0]
    assert await daemon.stop() == 0


@pytest.mark.parametrize(
    ("section", "said"),
    [
        (
            {"endpoint": "tcp://127.0.0.1:5557"},
            "kv_events.endpoint: a tcp:// endpoint lets every local user",
        ),
        (
            {"endpoint": "ipc:///tmp/x", "replay_endpoint": "tcp://127.0.0.1:5558"},
            "kv_events.replay_endpoint: a tcp://",
        ),
        ({"replay_endpoint": "ipc:///tmp/x"}, "kv_events.replay_endpoint: goes with endpoint"),
        (
            {"readers": {"nobody-here": 0}},
            "kv_events.readers: 'nobody-here' is not a published tenant",
        ),
        ({"readers": {"default": "no-such-group-anywhere"}}, "no group named"),
    ],
)
def test_config_check_refuses_events_open_to_all_unless_opted_in(
    tmp_path: Path, section: dict[str, Any], said: str
) -> None:
    path = tmp_path / "c.yaml"
    socket = {"path": str(tmp_path / "s" / "tierd.sock")}
    path.write_text(yaml.safe_dump({"socket": socket, "kv_events": {"enabled": True, **section}}))
    out = config_check(path)
    assert out.returncode == 78, out
    assert said in out.stderr, out.stderr
    opted = {"enabled": True, **section, "anyone_may_read": True}
    if "tcp://" in str(section):
        path.write_text(yaml.safe_dump({"socket": socket, "kv_events": opted}))
        again = config_check(path)
        assert again.returncode == 0, again.stderr


def test_one_endpoint_carries_one_tenants_events(
    tmp_path: Path, users: dict[str, tuple[int, int]]
) -> None:
    cfg = tenants_config(tmp_path, users)
    cfg["kv_events"] = {"enabled": True, "endpoint": f"ipc://{tmp_path}/all.pub"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = config_check(path)
    assert out.returncode == 78 and "carries one tenant's events, and 3 are published" in out.stderr
