"""``tierd replay``: a trace driven through a live daemon or an in-process chain, every
byte verified; the counts agree with the daemon's own, and planted corruption is caught."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

import tierd
from tierd.cli import main
from tierd.cli.replay_report import describe
from tierd.client import Client
from tierd.testing import corrupt_disk_block, daemon_config, running_daemon, short_socket_path
from tierd.workload.backends import ChainBackend, chain_backends, daemon_backends
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.replayer import ReplaySummary, block_content, replay
from tierd.workload.trace import Trace, TraceRecord, read_trace, write_trace

BLOCK = 4096
NAMESPACE = "replay"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_trace(path, generate(GeneratorConfig(seed=11, conversations=40)))
    return path


@pytest.fixture(scope="module")
def trace(trace_path: Path) -> Trace:
    return read_trace(trace_path)


def accesses(trace: Trace, limit: int | None = None) -> int:
    return sum(len(set(r.keys)) for r in trace.requests[:limit])


def config_in(directory: Path, **kwargs: Any) -> dict[str, Any]:
    directory.mkdir(exist_ok=True)
    return daemon_config(directory, block_bytes=BLOCK, **kwargs)


async def replay_daemon(
    socket: str, trace: Trace, clients: int, speed: float | None = None
) -> ReplaySummary:
    async with daemon_backends(socket, clients, namespace=NAMESPACE) as backends:
        return await replay(trace, backends, speed=speed)


async def daemon_stats(socket: str) -> dict[str, Any]:
    async with await Client.connect(socket, namespace=NAMESPACE) as client:
        return await client.stats()


def by_name(tiers: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {tier["name"]: tier for tier in tiers}


# -- against a daemon ----------------------------------------------------------------------


async def test_daemon_replay_counts_agree_with_the_daemons_stats(
    tmp_path: Path, trace: Trace
) -> None:
    cfg = config_in(tmp_path, cpu_blocks=64, disk_blocks=300)
    async with running_daemon(cfg):
        summary = await replay_daemon(cfg["socket"]["path"], trace, clients=4)
        stats = await daemon_stats(cfg["socket"]["path"])

    assert summary.wrong_bytes == 0
    assert "wrong_bytes" not in summary.errors
    assert summary.requests == len(trace)
    assert summary.block_accesses == accesses(trace)
    chain = stats["chain"]
    assert (summary.lookups, summary.hits, summary.misses) == (
        chain["lookups"],
        chain["hit_blocks"],
        chain["miss_blocks"],
    )
    assert 0 < summary.hits < summary.block_accesses
    for tier in stats["tiers"]:  # one tier per medium here
        assert summary.hits_by_medium[tier["medium"]] == tier["hits"]
    last = summary.timeline[-1]
    assert last["requests"] == len(trace)
    assert last["occupancy"] == {t["name"]: t["used"] for t in stats["tiers"]}
    assert by_name(summary.tiers).keys() == {"cpu", "disk"}
    done = [sample["requests"] for sample in summary.timeline]
    assert done == sorted(done)
    assert summary.timeline[0]["requests"] == 0
    assert summary.loaded_blocks + summary.load_shortfalls > 0
    cpu = by_name(stats["tiers"])["cpu"]
    assert summary.stored_blocks == cpu["stores"] - cpu["promotions"]  # the rest came up


async def test_a_chain_and_a_daemon_with_one_client_count_the_same_hits(
    tmp_path: Path, trace: Trace
) -> None:
    daemon_cfg = config_in(tmp_path / "daemon", cpu_blocks=48, disk_blocks=200)
    async with running_daemon(daemon_cfg):
        through_daemon = await replay_daemon(daemon_cfg["socket"]["path"], trace, clients=1)
    async with tierd.open(config_in(tmp_path / "chain", cpu_blocks=48, disk_blocks=200)) as chain:
        in_process = await replay(trace, [ChainBackend(chain)], speed=None)

    assert through_daemon.wrong_bytes == in_process.wrong_bytes == 0
    assert through_daemon.hits_by_medium == in_process.hits_by_medium
    assert through_daemon.hits == in_process.hits > 0
    assert through_daemon.hits_by_medium["DISK"] > 0
    assert (through_daemon.loaded_blocks, through_daemon.stored_blocks) == (
        in_process.loaded_blocks,
        in_process.stored_blocks,
    )
    assert through_daemon.errors == in_process.errors
    assert (through_daemon.config["backend"], in_process.config["backend"]) == ("daemon", "chain")


# -- planted corruption ----------------------------------------------------------------------


async def test_bytes_flipped_in_the_pool_are_reported_and_the_cli_exits_1(
    tmp_path: Path, trace: Trace, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Room for every block: nothing is evicted, so the flipped block is served every time.
    cfg = config_in(tmp_path, cpu_blocks=2048, disk_blocks=None)
    socket = cfg["socket"]["path"]
    victim = trace.requests[0].keys[0]
    async with running_daemon(cfg):
        clean = await replay_daemon(socket, trace, clients=2)
        client = await Client.connect(socket, namespace=NAMESPACE)
        async with client, client.loading([victim]) as lease:
            assert lease.count == 1
            view = client.require_pool().view(lease.slots[0])
            view[:16] = bytes(b ^ 0xFF for b in view[:16])
            view.release()
        dirty = await replay_daemon(socket, trace, clients=2)
        argv = ["replay", str(trace_path), "--socket", socket, "--max-rate", "--json"]
        # the namespace with the flipped block
        status = await asyncio.to_thread(main, [*argv, "--namespace", NAMESPACE])

    assert clean.wrong_bytes == 0
    assert dirty.wrong_bytes == sum(victim in r.keys for r in trace.requests)
    assert dirty.errors["wrong_bytes"] == dirty.wrong_bytes
    assert set(dirty.wrong_bytes_keys) == {victim.hex()}
    assert status == 1
    out, err = capsys.readouterr()
    printed = [line for line in out.splitlines() if line.startswith("{")]  # not the daemon's logs
    assert len(printed) == 1
    assert json.loads(printed[0])["wrong_bytes"] == dirty.wrong_bytes
    assert "WRONG BYTES" in err


async def test_a_corrupted_disk_block_is_refused_not_served(tmp_path: Path, trace: Trace) -> None:
    # The disk holds every block (it never evicts), so a block that lives only there is
    # read from there the next time a request reaches it.
    cfg = config_in(tmp_path, cpu_blocks=32, disk_blocks=2048)
    socket = cfg["socket"]["path"]
    async with running_daemon(cfg) as daemon:
        first = await replay_daemon(socket, trace, clients=1)
        async with await Client.connect(socket, namespace=NAMESPACE) as client:
            prefix = bytes.fromhex(client.info["namespace_id"])
        assert daemon.chain is not None
        cpu, disk = (level.tier for level in daemon.chain.levels)
        victim = next(
            prefix + key
            for request in trace.requests
            for key in request.keys
            if prefix + key in disk and prefix + key not in cpu
        )
        slot = disk.slot_of(victim)  # type: ignore[arg-type]
        assert slot is not None
        corrupt_disk_block(daemon.chain.levels[1].store, slot)
        second = await replay_daemon(socket, trace, clients=1)
        stats = await daemon_stats(socket)

    assert first.wrong_bytes == second.wrong_bytes == 0
    assert first.load_shortfalls == 0
    assert second.load_shortfalls >= 1  # a count of its own, not an error
    assert second.errors == {}
    assert by_name(stats["tiers"])["disk"]["io_errors"] >= 1
    table = describe(second, "t.jsonl").splitlines()
    assert f"shortfall       {second.load_shortfalls:,} load(s)" in "\n".join(table)
    assert "errors          none" in table


# -- pacing and order ------------------------------------------------------------------------


class RecordingBackend(ChainBackend):
    """A chain backend that notes when each lookup was sent, and for which request."""

    def __init__(self, chain: Any, log: list[tuple[float, bytes]]) -> None:
        super().__init__(chain)
        self.log = log

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        self.log.append((time.perf_counter(), keys[0]))
        return await super().lookup(keys)


def timed_trace(path: Path, timestamps: Sequence[int]) -> Trace:
    records = [TraceRecord(ms, 1024, 16, (2 * i, 2 * i + 1)) for i, ms in enumerate(timestamps)]
    write_trace(path, records)
    return read_trace(path)


MEMORY_CHAIN = {"block_bytes": BLOCK, "tiers": [{"name": "m", "kind": "memory", "capacity": 64}]}


async def test_requests_wait_for_their_timestamps(tmp_path: Path) -> None:
    trace = timed_trace(tmp_path / "t.jsonl", [0, 40, 80, 120, 160, 200])
    log: list[tuple[float, bytes]] = []
    async with tierd.open(MEMORY_CHAIN) as chain:
        began = time.perf_counter()
        summary = await replay(trace, [RecordingBackend(chain, log) for _ in range(3)], speed=1.0)
        elapsed = time.perf_counter() - began

    assert [key for _, key in log] == [r.keys[0] for r in trace.requests]
    for (sent, _), request in zip(log, trace.requests, strict=True):
        assert sent - began >= request.timestamp / 1000  # a lower bound only
    assert elapsed >= 0.2
    assert summary.seconds >= 0.2
    assert summary.config["speed"] == 1.0


@pytest.mark.parametrize("speed", [20.0, 1e6, None])
async def test_many_clients_start_requests_in_trace_order(
    tmp_path: Path, speed: float | None
) -> None:
    # Groups of requests share a timestamp, as in real traces: ties must keep file order.
    trace = timed_trace(tmp_path / "t.jsonl", [i // 5 * 2 for i in range(300)])
    log: list[tuple[float, bytes]] = []
    async with tierd.open(MEMORY_CHAIN) as chain:
        summary = await replay(trace, [RecordingBackend(chain, log) for _ in range(4)], speed=speed)

    assert [key for _, key in log] == [r.keys[0] for r in trace.requests]
    assert summary.wrong_bytes == 0
    assert summary.config["clients"] == 4
    assert summary.config["speed"] == ("max" if speed is None else speed)


async def test_block_content_is_derived_from_the_key_alone() -> None:
    a, b = block_content(b"k1", 1000), block_content(b"k2", 1000)
    assert len(a) == 1000 and a != b
    assert block_content(b"k1", 1000) == a
    assert block_content(b"k1", 100) == a[:100]


def test_the_engine_leaves_the_packages_tier_replay_alone() -> None:
    import tierd.workload
    from tierd.workload.simulate import replay as tier_replay

    assert tierd.workload.replay is tier_replay  # not shadowed by a submodule


# -- the command line ------------------------------------------------------------------------


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def chain_config(directory: Path, cpu_blocks: int, disk_blocks: int | None) -> dict[str, Any]:
    cfg = config_in(directory, cpu_blocks=cpu_blocks, disk_blocks=disk_blocks)
    return {"block_bytes": cfg["block_bytes"], "tiers": cfg["tiers"]}


async def engine_replay(cfg: dict[str, Any], trace: Trace, limit: int) -> ReplaySummary:
    async with tierd.open(cfg) as chain:
        return await replay(trace, chain_backends(chain, 1), speed=None, limit=limit)


def test_cli_json_with_a_config_matches_an_engine_replay(
    tmp_path: Path, trace: Trace, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "a.yaml", chain_config(tmp_path / "a", 24, 200))
    out = tmp_path / "out"
    argv = ["replay", str(trace_path), "--config", str(config), "--json", "--limit", "30"]
    status = main([*argv, "--max-rate", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    expected = asyncio.run(engine_replay(chain_config(tmp_path / "b", 24, 200), trace, 30))

    assert status == 0
    assert printed["requests"] == 30
    assert printed["block_accesses"] == accesses(trace, 30)
    assert printed["hits"] == expected.hits
    assert printed["hits_by_medium"] == expected.hits_by_medium
    assert printed["wrong_bytes"] == 0
    assert printed["config"]["backend"] == "chain"
    assert printed["config"]["path"] == str(config)
    assert set(printed["latency"]) == {"lookup", "load", "store"}
    assert set(printed["latency"]["lookup"]) == {"p50", "p90", "p99", "mean", "count"}
    assert printed["latency"]["lookup"]["count"] == printed["lookups"] == 30
    saved = json.loads((out / "summary.json").read_text())
    assert saved == printed


def test_cli_compare_prints_one_column_per_config(
    tmp_path: Path, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = write_config(tmp_path / "small.yaml", chain_config(tmp_path / "s", 16, None))
    tiered = write_config(tmp_path / "tiered.yaml", chain_config(tmp_path / "t", 16, 2048))
    status = main(["replay", str(trace_path), "--compare", str(small), str(tiered), "--max-rate"])
    lines = capsys.readouterr().out.splitlines()

    assert status == 0
    assert lines[0].split() == ["small.yaml", "tiered.yaml"]
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]  # columns: 2+ spaces
    rows = {label: values for label, *values in cells}
    alone, with_disk = (float(cell) for cell in rows["hit ratio"])
    assert with_disk > alone  # the disk tier below adds hits
    assert rows["from DISK"][0] == "0.0000"
    assert rows["shortfall"] == ["0", "0"]
    assert rows["wrong bytes"] == ["0", "0"]


def test_cli_exits_3_when_no_daemon_answers(
    trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["replay", str(trace_path), "--socket", short_socket_path(), "--max-rate"])
    assert status == 3
    assert "cannot reach the daemon" in capsys.readouterr().err


async def test_cli_refuses_a_block_size_that_is_not_the_daemons(
    tmp_path: Path, trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config_in(tmp_path, cpu_blocks=16, disk_blocks=None)
    socket = cfg["socket"]["path"]
    async with running_daemon(cfg):
        argv = ["replay", str(trace_path), "--socket", socket, "--block-bytes", "8KiB"]
        status = await asyncio.to_thread(main, argv)
        stats = await daemon_stats(socket)
    assert status == 2
    assert "8192" in capsys.readouterr().err
    assert stats["chain"]["lookups"] == 0


async def test_a_load_that_promotes_from_disk_counts_as_a_disk_load(tmp_path: Path) -> None:
    # 0-23 fill the 24-block CPU tier, 24-29 push 0-5 down to disk; the last request reads
    # 24-26 (CPU) and 0-2 (DISK) in one chunk of 6 (a quarter of the CPU tier): its
    # latency is the disk's.
    records = [
        TraceRecord(0, 1024, 16, tuple(range(24))),
        TraceRecord(1, 1024, 16, tuple(range(24, 30))),
        TraceRecord(2, 1024, 16, (24, 25, 26, 0, 1, 2)),
    ]
    write_trace(tmp_path / "t.jsonl", records)
    trace = read_trace(tmp_path / "t.jsonl")
    async with tierd.open(config_in(tmp_path, cpu_blocks=24, disk_blocks=64)) as chain:
        summary = await replay(trace, [ChainBackend(chain)], speed=None)
    assert summary.wrong_bytes == 0
    assert (summary.hits_by_medium["CPU"], summary.hits_by_medium["DISK"]) == (3, 3)
    assert summary.latency["load"]["DISK"]["count"] == 1
    assert "CPU" not in summary.latency["load"]
