"""Recording live traffic (``trace:``): a real daemon records what ``tierd replay`` sends,
and the recorded trace sizes the tiers exactly as the trace that was replayed would."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import xxhash
import yaml

from tests.daemon_kit import Spawn
from tests.tenants_kit import as_user, connect, tenants_config
from tierd.cli import main
from tierd.client import Client, DaemonError
from tierd.control.figures.recorder import RecorderSettings, TraceRecorder, hash_id
from tierd.keys import int_key
from tierd.testing import daemon_config
from tierd.workload.curve import lru_curve
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import TraceRecord, read_trace, write_trace

SAMPLE = 0.5


def sampled(record: TraceRecord, share: float) -> bool:
    first = int_key(record.hash_ids[0])
    return xxhash.xxh3_64_intdigest(first) < int(share * (1 << 64))


async def trace_op(socket: str, **fields: Any) -> dict[str, Any]:
    async with await Client.connect(socket) as client:
        reply = await client.request("trace", **fields)
    return dict(reply["trace"])


async def test_a_recorded_replay_has_the_curve_of_the_sampled_requests(
    tmp_path: Path, spawn: Spawn, capsys: pytest.CaptureFixture[str]
) -> None:
    records = generate(GeneratorConfig(seed=5, conversations=60))
    source = tmp_path / "source.jsonl"
    write_trace(source, records)
    traces = tmp_path / "traces"
    cfg = daemon_config(
        tmp_path,
        cpu_blocks=256,
        disk_blocks=None,
        trace={"directory": str(traces), "sample": SAMPLE, "max_bytes": "1MiB"},
    )
    daemon = await spawn(cfg)
    socket = daemon.socket_path
    assert (await trace_op(socket))["enabled"] is False  # off by default
    on = ["record", "on", "--socket", socket, "--json"]
    assert await asyncio.to_thread(main, on) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["enabled"] is True
    argv = ["replay", str(source), "--socket", socket, "--max-rate", "--clients", "1", "--json"]
    argv += ["--namespace", "replay"]  # named, so the recorded namespace id is known
    assert await asyncio.to_thread(main, argv) == 0
    state = await trace_op(socket, enabled=False)  # flushes the file
    recorded = read_trace(traces / "default.jsonl")

    kept = [r for r in records if sampled(r, SAMPLE)]
    assert 0 < len(kept) < len(records)
    assert state["recorded"] == len(kept) == len(recorded)
    assert state["skipped"] == len(records) - len(kept)
    expected = tmp_path / "expected.jsonl"
    write_trace(expected, kept)
    want, got = lru_curve(read_trace(expected)), lru_curve(recorded)
    assert got.unique_blocks == want.unique_blocks
    assert [got.hits_at(c) for c in want.capacities()] == [
        want.hits_at(c) for c in want.capacities()
    ]
    lines = (traces / "default.jsonl").read_text().splitlines()
    assert {json.loads(line)["namespace"] for line in lines} == {
        xxhash.xxh3_64_digest(b"replay").hex()
    }

    chain = tmp_path / "chain.yaml"
    chain.write_text(yaml.safe_dump({"block_bytes": 4096, "tiers": cfg["tiers"]}))
    capsys.readouterr()
    argv = ["simulate", str(traces / "default.jsonl"), "--curve", "--config", str(chain), "--json"]
    assert await asyncio.to_thread(main, argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["unique_blocks"] == want.unique_blocks


async def test_recording_is_per_tenant_and_only_an_operator_turns_it_on(
    tmp_path: Path, spawn: Spawn, users: dict[str, tuple[int, int]]
) -> None:
    cfg = tenants_config(tmp_path, users)
    cfg["trace"] = {"directory": str(tmp_path / "traces"), "enabled": True}
    daemon = await spawn(cfg)
    os.chmod(os.path.dirname(daemon.socket_path), 0o711)
    keys = [[f"{who}-{i}" for i in range(3)] for who in ("alpha", "beta")]
    alpha = await as_user(
        daemon,
        users["alpha"],
        connect(),
        {"do": "lookup", "keys": keys[0]},
        {"do": "op", "name": "trace"},
    )
    beta = await as_user(daemon, users["beta"], connect("m"), {"do": "lookup", "keys": keys[1]})
    assert alpha[2]["error"] == "not_allowed"
    assert alpha[1] == beta[1] == 0  # looked up: nothing cached yet
    async with await Client.connect(daemon.socket_path) as client:
        with pytest.raises(DaemonError) as bad:
            await client.request("trace", enabled="yes")
        assert bad.value.code == "bad_request"
        assert (await client.request("trace", enabled=False))["trace"]["recorded"] == 2
    for tenant, want in (("alpha", keys[0]), ("beta", keys[1])):
        path = tmp_path / "traces" / f"{tenant}.jsonl"
        (request,) = read_trace(path).requests
        # A recorded line names its namespace: read back, its keys follow that id.
        namespace = bytes.fromhex(json.loads(path.read_text())["namespace"])
        assert list(request.keys) == [namespace + int_key(hash_id(k.encode())) for k in want]


def test_files_rotate_at_their_size_and_keep_a_bounded_number(tmp_path: Path) -> None:
    settings = RecorderSettings(tmp_path, sample=1.0, max_bytes=4096, keep=2)
    recorder = TraceRecorder(settings, enabled=True)
    keys = [int_key(i) for i in range(40)]
    for n in range(200):
        recorder.record("t", b"\0" * 8, [int_key(n), *keys])
    recorder.set_enabled(False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    assert all((tmp_path / n).stat().st_size <= 4096 for n in names)
    last = read_trace(tmp_path / "t.jsonl").requests[-1]
    assert last.keys[0] == b"\0" * 8 + int_key(199)  # after the recorded namespace's id
