"""The cache by namespace, through a real daemon and the ``tierd`` command: figures per
namespace in ``stats`` and the metrics (top N, then ``other``), ``namespaces``,
``inspect``, and ``delete`` by key, by prefix and by namespace, with its events, its
pinned blocks (kept whole and reported busy), its effect on the disk tier across a
restart, and who may delete what.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import tierd
from tests.daemon_kit import BLOCK, DaemonProcess, Spawn, block, keys
from tierd.client import Client, DaemonError
from tierd.testing import daemon_config

NS_A, NS_B, NS_C = "model-a", "model-b", "model-c"


async def connect(daemon: DaemonProcess, namespace: str | None) -> Client:
    return await Client.connect(daemon.socket_path, namespace=namespace, block_bytes=BLOCK)


async def put(daemon: DaemonProcess, namespace: str, names: list[bytes]) -> None:
    async with await connect(daemon, namespace) as client:
        for name in names:  # one at a time: a CPU tier of 8 blocks demotes to the disk
            assert await client.put([name], [block(name)]) == 1


async def cli_json(daemon: DaemonProcess, *argv: str) -> Any:
    done = await tierd(*argv, "--socket", daemon.socket_path, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def rows_by_name(rows: list[dict[str, Any]]) -> dict[str | None, dict[str, Any]]:
    return {row["namespace"]: row for row in rows}


@pytest.fixture
async def daemon(tmp_path: Path, spawn: Spawn) -> DaemonProcess:
    """A daemon (8 CPU blocks over 64 disk blocks) holding 12 blocks of model-a, 3 of
    model-b and 1 of model-c; model-a was looked up (4 of 5 found)."""
    running = await spawn(daemon_config(tmp_path, metrics={"namespaces_top": 2}))
    await put(running, NS_A, keys("a", 12))
    await put(running, NS_B, keys("b", 3))
    await put(running, NS_C, keys("c", 1))
    async with await connect(running, NS_A) as client:
        assert (await client.lookup([*keys("a", 4), b"absent"])).count == 4
    return running


async def test_stats_and_namespaces_give_figures_per_namespace(daemon: DaemonProcess) -> None:
    stats = await cli_json(daemon, "stats")
    tenant = stats["tenants"]["default"]
    rows = rows_by_name(tenant["namespaces"])
    assert set(rows) == {NS_A, NS_B, NS_C}
    a = rows[NS_A]
    assert a["stored_blocks"] == 12 and a["lookups"] == 1
    assert (a["hit_blocks"], a["miss_blocks"]) == (4, 1)
    assert a["last_used"] is not None
    # Every block of a tier belongs to one namespace: the namespaces add up to the tier.
    for tier in tenant["tiers"]:
        assert sum(row["blocks"][tier["name"]] for row in rows.values()) == tier["used"]
    assert a["blocks"]["disk"] >= 4  # 12 blocks through a CPU tier of 8
    assert a["bytes"] == BLOCK * sum(a["blocks"].values())
    assert rows[NS_B]["stored_blocks"] == 3 and rows[NS_B]["lookups"] == 0
    listed = await cli_json(daemon, "namespaces")
    assert {r["namespace"]: r["blocks"] for r in listed["default"]} == {
        name: row["blocks"] for name, row in rows.items()
    }
    text = await tierd("stats", "--socket", daemon.socket_path)
    assert text.returncode == 0 and NS_A in text.stdout and "hit ratio" in text.stdout


async def test_metrics_label_the_top_namespaces_and_add_up_the_rest(
    daemon: DaemonProcess,
) -> None:
    async with await connect(daemon, None) as operator:
        text = await operator.metrics()
        rows = rows_by_name((await operator.namespaces())["default"])
    held = dict(
        re.findall(
            r'^tierd_namespace_bytes\{namespace="([^"]+)",tenant="default"\} (\S+)$', text, re.M
        )
    )
    # namespaces_top is 2: model-a and model-b (most bytes), then model-c in "other".
    assert set(held) == {NS_A, NS_B, "other"}
    assert float(held["other"]) == rows[NS_C]["bytes"]
    assert sum(map(float, held.values())) == sum(row["bytes"] for row in rows.values())
    assert 'tierd_namespaces{tenant="default"} 3.0' in text
    assert re.search(
        r'tierd_namespace_hit_blocks_total\{namespace="model-a",tenant="default"\} 4\.0', text
    )


async def test_inspect_says_where_a_key_lives(daemon: DaemonProcess) -> None:
    found = await cli_json(daemon, "inspect", "a-11", "--namespace", NS_A)
    assert found["namespace"] == NS_A and found["bytes"] == BLOCK
    assert [(t["tier"], t["state"]) for t in found["tiers"]] == [("cpu", "ready")]
    oldest = await cli_json(daemon, "inspect", "a-0", "--namespace", NS_A)
    assert [t["tier"] for t in oldest["tiers"]] == ["disk"]  # demoted
    missing = await cli_json(daemon, "inspect", "nothing", "--namespace", NS_A)
    assert missing["tiers"] == [] and missing["bytes"] == 0
    text = await tierd("inspect", "a-11", "--namespace", NS_A, "--socket", daemon.socket_path)
    assert text.returncode == 0 and "cpu (CPU)  ready" in text.stdout


async def test_delete_by_key_prefix_and_namespace_with_removed_events(
    daemon: DaemonProcess,
) -> None:
    async with await connect(daemon, NS_A) as watcher:
        await watcher.subscribe()
        by_key = await cli_json(
            daemon, "delete", "--namespace", NS_A, "--key", "a-11", "--key", "a-0"
        )
        assert (by_key["removed"], by_key["busy"]) == (2, 0)
        removed = await removed_keys(watcher, 2)
        assert removed == {b"a-11", b"a-0"}
        by_prefix = await cli_json(daemon, "delete", "--namespace", NS_A, "--prefix", "a-1")
        assert by_prefix["removed"] == 2  # a-1 and a-10 (a-11 is gone already)
        assert await removed_keys(watcher, 2) == {b"a-1", b"a-10"}
        assert (await watcher.lookup([b"a-2", b"a-3"])).count == 2
        everything = await cli_json(daemon, "delete", "--namespace", NS_A, "--all")
        assert everything["removed"] == 8
        assert (await watcher.lookup([b"a-2"])).count == 0
    rows = rows_by_name(await stats_rows(daemon))
    assert NS_A not in rows or sum(rows[NS_A]["blocks"].values()) == 0
    assert sum(rows[NS_B]["blocks"].values()) == 3  # another namespace is untouched
    async with await connect(daemon, NS_B) as other:
        assert (await other.lookup(keys("b", 3))).count == 3


async def removed_keys(client: Client, count: int) -> set[bytes]:
    """The keys of ``Removed`` events until ``count`` distinct keys came (every tier's)."""
    seen: set[bytes] = set()
    async for push in client.events():
        for event in push["events"]:
            if event["kind"] == "removed":
                seen.update(bytes(k) for k in event["keys"])
        if len(seen) >= count:
            return seen
    raise AssertionError("the event stream ended")


async def stats_rows(daemon: DaemonProcess) -> list[dict[str, Any]]:
    stats = await cli_json(daemon, "stats")
    rows: list[dict[str, Any]] = stats["tenants"]["default"]["namespaces"]
    return rows


async def test_a_pinned_block_is_kept_whole_and_reported_busy(daemon: DaemonProcess) -> None:
    async with await connect(daemon, NS_B) as reader:
        lease = await reader.prepare_load([b"b-2"])  # pinned while the lease is open
        busy = await tierd(
            "delete", "--namespace", NS_B, "--all", "--socket", daemon.socket_path, "--json"
        )
        assert busy.returncode == 1  # some blocks stayed: run it again
        assert json.loads(busy.stdout) | {"namespace": None} == {
            "removed": 2,
            "busy": 1,
            "namespace": None,
            "tenants": ["default"],
        }
        assert (await reader.lookup([b"b-2"])).count == 1
        assert [bytes(v) for v in lease.views()] == [block(b"b-2")]
        await lease.release()
        again = await cli_json(daemon, "delete", "--namespace", NS_B, "--all")
        assert (again["removed"], again["busy"]) == (1, 0)
        assert (await reader.lookup([b"b-2"])).count == 0
    stats = await cli_json(daemon, "stats")
    for tier in stats["tiers"]:
        assert tier["pinned"] == 0 and tier["writing"] == 0


async def test_deleted_blocks_stay_deleted_and_names_stay_known_after_a_restart(
    spawn: Spawn, daemon: DaemonProcess
) -> None:
    async with await connect(daemon, None) as operator:
        assert (await operator.flush()).dirty == 0  # every block is on the disk tier now
    deleted = await cli_json(daemon, "delete", "--namespace", NS_B, "--all")
    assert deleted["removed"] == 3
    assert await daemon.stop() == 0
    again = await spawn(daemon.config)
    after = rows_by_name(await stats_rows(again))  # no client has said hello yet
    assert NS_B not in after  # its disk blocks did not come back
    assert after[NS_A]["blocks"]["disk"] == 12
    assert after[NS_C]["namespace"] == NS_C
    async with await connect(again, NS_B) as client:
        assert (await client.lookup(keys("b", 3))).count == 0


async def test_delete_needs_a_namespace_and_one_kind_of_target(daemon: DaemonProcess) -> None:
    async with await connect(daemon, None) as operator:
        for fields in (
            {"all": True},
            {"namespace": NS_A},
            {"namespace": NS_A, "all": True, "prefix": b"a"},
        ):
            with pytest.raises(DaemonError) as caught:
                await operator.request("delete", **fields)
            assert caught.value.code == "bad_request", fields
        with pytest.raises(DaemonError) as bad_id:
            await operator.request("delete", namespace_id="xyz", all=True)
        assert bad_id.value.code == "bad_namespace"
    usage = await tierd("delete", "--all", "--socket", daemon.socket_path)
    assert usage.returncode == 2 and "--namespace" in usage.stderr


# -- who may delete what (tenants: clients of other users, as root) -----------------------------


@pytest.mark.skipif(
    os.getuid() != 0, reason="clients of other users (useradd, os.setuid) need root"
)
async def test_members_act_on_their_own_tenant_and_operators_on_any(
    tmp_path: Path, spawn: Spawn
) -> None:
    from tests.tenants_kit import system_users

    run = secrets.token_hex(3)
    with system_users([f"tierd-test-{role}-{run}" for role in ("alpha", "beta")]) as made:
        users = {role: made[f"tierd-test-{role}-{run}"] for role in ("alpha", "beta")}
        await _members_and_operators(tmp_path, spawn, users)


async def _members_and_operators(
    tmp_path: Path, spawn: Spawn, users: dict[str, tuple[int, int]]
) -> None:
    from tests.tenants_kit import as_user, tenants_config

    running = await spawn(tenants_config(tmp_path, {**users, "stranger": (0, 0)}))
    os.chmod(os.path.dirname(running.socket_path), 0o711)
    names = ["p-0", "p-1"]
    store = {"do": "store", "keys": names, "fill": 0xA1}
    _, stored = await as_user(running, users["alpha"], connect_step(), store)
    _, stored_b = await as_user(running, users["beta"], connect_step(), {**store, "fill": 0xB2})
    assert stored == stored_b == 2
    _, across, listed, outside, reload = await as_user(
        running,
        users["beta"],
        connect_step(),
        op("delete", tenant="alpha", namespace="model-x", all=True),
        op("namespaces"),
        op("inspect", tenant="alpha", key="p-0"),
        op("reload"),
    )
    assert across["error"] == outside["error"] == reload["error"] == "not_allowed"
    assert set(listed["tenants"]) == {"beta"}  # a member sees its own tenant only
    _, own, foreign = await as_user(
        running,
        users["alpha"],
        connect_step(),
        op("delete", keys=["p-0"]),  # its own namespace: allowed
        op("delete", namespace="other-x", all=True),  # outside alpha's model-* patterns
    )
    assert (own["removed"], own["tenants"]) == (1, ["alpha"])
    assert foreign["error"] == "not_allowed"
    _, beta_left = await as_user(running, users["beta"], connect_step(), lookup(names))
    assert beta_left == 2  # alpha's delete never reached beta's blocks
    done = await tierd(
        "delete",
        "--namespace",
        "model-x",
        "--tenant",
        "alpha",
        "--all",
        "--socket",
        running.socket_path,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["removed"] == 1
    _, alpha_left = await as_user(running, users["alpha"], connect_step(), lookup(names))
    _, beta_still = await as_user(running, users["beta"], connect_step(), lookup(names))
    assert (alpha_left, beta_still) == (0, 2)


def connect_step() -> dict[str, Any]:
    return {"do": "connect", "namespace": "model-x"}


def lookup(names: list[str]) -> dict[str, Any]:
    return {"do": "lookup", "keys": names}


def op(name: str, **fields: Any) -> dict[str, Any]:
    return {"do": "op", "name": name, "fields": fields}
