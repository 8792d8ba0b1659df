"""The soak campaign in CI size, and one focused test per fault kind of its fault layer.

``test_soak_short`` runs ``scripts/soak`` itself (a child daemon, verifying clients, a
fuzzer, a stuck subscriber, SIGKILL restarts, clients killed holding leases, every kind of
disk fault) for 60 s of load and checks its verdict and its report. The focused tests take
one fault at a time, through the same pieces (``tests/soak_daemon.py``: the fault layer,
the daemon runner, the lease-holding child; ``tests/soak_kit.py`` and its modules: workers,
fuzzer, stuck subscriber), and pin down what the daemon must do about it. What
``tests/test_daemon_api.py`` and ``tests/test_daemon_lifecycle.py`` already cover (a
killed client's leases, a never-reading subscriber on its own, SIGTERM restarts, the
fuzzer on its own) is not repeated: these tests go through the disk tier's file layer and
combine faults.

Where the daemon learns of a dead peer on its own schedule, the tests poll its stats
(:func:`soak_kit.wait_idle`, 60 s safety net); nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import soak_kit
from loop_daemon_kit import serve
from soak_daemon import FaultControl, FaultFileIO, FaultPlan, content
from soak_daemon_kit import BLOCK, NS, blocks, make_keys, store_batches, tier, unleashed_daemon

import tierd.stores.disk.store
from tierd.client import Client
from tierd.control.protocol import encode
from tierd.daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultControl]:
    """A fault control file; every disk store built in this test uses the faulty layer."""
    control = FaultControl(tmp_path / "faults.bin", create=True)
    monkeypatch.setattr(tierd.stores.disk.store, "FileIO", functools.partial(FaultFileIO, control))
    yield control
    control.close()


async def connect(daemon: Daemon, namespace: str | None = NS) -> Client:
    return await Client.connect(str(daemon.config.socket.path), namespace=namespace)


# -- the campaign, CI size -------------------------------------------------------------------


def test_soak_short(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    command = [
        str(ROOT / "scripts" / "soak"),
        *("--minutes", "1", "--clients", "6", "--seed", "7", "--out", str(out)),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["passed"] is True
    assert report["reasons"] == []
    assert report["wrong_blocks"] == 0
    assert report["durable_lost"] == 0
    assert report["aborted_store_visible"] == 0
    assert all(count >= 1 for count in report["faults"].values()), report["faults"]
    assert all(count >= 1 for count in report["fault_calls"].values()), report["fault_calls"]
    assert report["restarts"] >= 2  # one checkpoint kill, one hot kill
    assert report["durability"]["checks"] >= 2
    assert report["durability"]["blocks"] > 0
    assert report["blocks"]["verified"] > 0
    assert report["bad_frames_sent"] > 0
    assert report["fuzz"].get("internal", 0) == 0
    assert {k: report["leaks"][k] for k in ("pinned", "writing", "leases")} == {
        "pinned": 0,
        "writing": 0,
        "leases": 0,
    }
    assert report["exit_statuses"] == [0, 0]
    assert "PASS" in done.stdout


def _passing_report() -> dict[str, Any]:
    incarnation = {"incarnation": 1, "warm": 100, "end": 150, "limit": 65736, "ok": True}
    return {
        "wrong_blocks": 0,
        "durable_lost": 0,
        "aborted_store_visible": 0,
        "fuzz": {"internal": 0, "malformed": 0},
        "client_errors": {"unreachable": 3},
        "leaks": {"idle_reached": True, "pinned": 0, "writing": 0, "leases": 0},
        "rss_kib": {"incarnations": [incarnation]},
        "unexpected_exits": 0,
        "exit_statuses": [0, 0],
        "faults": dict.fromkeys(soak_kit.FAULT_KINDS, 1),
        "restarts": 2,
        "operations": {"load": 5, "store": 5, "lookup": 10},
        "blocks": {"verified": 20},
        "durability": {"blocks": 10, "lost": 0},
        "problems": [],
    }


OVER_LIMIT = {"incarnation": 2, "warm": 1, "end": 9, "limit": 3, "ok": False}
BREAKS = {
    "wrong bytes": ("wrong_blocks", 1),
    "lost": ("durable_lost", 1),
    "killed stores": ("aborted_store_visible", 2),
    "internal": ("fuzz", {"internal": 1, "malformed": 0}),
    "malformed": ("fuzz", {"internal": 0, "malformed": 1}),
    "pins or leases": ("leaks", {"idle_reached": True, "pinned": 0, "writing": 0, "leases": 1}),
    "RSS": ("rss_kib", {"incarnations": [OVER_LIMIT]}),
    "memory not judged": ("rss_kib", {"incarnations": [{"incarnation": 1, "warm": None}]}),
    "on its own": ("unexpected_exits", 1),
    "exit statuses": ("exit_statuses", [0, 1]),
    "never injected": ("faults", {**dict.fromkeys(soak_kit.FAULT_KINDS, 1), "disk_slow": 0}),
    "no SIGKILL": ("restarts", 0),
    "no real load": ("blocks", {"verified": 0}),
    "no durable block": ("durability", {"blocks": 0}),
    "never became idle": ("problems", ["checkpoint: the daemon never became idle: {}"]),
}


def test_judge_passes_a_clean_report() -> None:
    assert soak_kit.judge(_passing_report()) == []


@pytest.mark.parametrize("reason", list(BREAKS))
def test_judge_fails_on_each_broken_criterion(reason: str) -> None:
    field, value = BREAKS[reason]
    report = {**_passing_report(), field: value}
    reasons = soak_kit.judge(report)
    assert len(reasons) == 1 and reason in reasons[0], reasons


# -- 1. SIGKILL and restart ------------------------------------------------------------------


TORN_WRITES = FaultPlan(write_rate=1.0, write_mode="short")
JOURNAL_FULL = FaultPlan(journal_rate=1.0)


@pytest.mark.parametrize(
    "during", [None, TORN_WRITES, JOURNAL_FULL], ids=["healthy", "torn-writes", "journal-full"]
)
async def test_sigkill_restart_keeps_flushed_disk_blocks(
    tmp_path: Path, during: FaultPlan | None
) -> None:
    """Blocks acknowledged and flushed before a SIGKILL come back byte-identical, also
    when the kill lands while the disk tears block writes or refuses journal records."""
    daemon = unleashed_daemon(tmp_path, cpu_blocks=8, disk_blocks=64)
    durable, later = make_keys("durable", 40), make_keys("later", 16)
    try:
        await daemon.start()
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            await store_batches(client, durable)
            await client.flush()
            if during is not None:
                daemon.control.set(during)
            await store_batches(client, later)  # demotes (with faults) and dirties the CPU
            assert (await client.lookup(durable)).count == len(durable)
        await daemon.kill()
        daemon.control.set(FaultPlan())
        await daemon.start()
        log = daemon.log_path().read_text()
        assert "rebuilt disk index after an unclean shutdown" in log
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            found = await client.lookup(durable)
            assert (found.count, set(found.media)) == (len(durable), {"DISK"})
            for i in range(0, len(durable), 8):
                part = durable[i : i + 8]
                assert await client.load(part) == blocks(part)
            for key in later:  # not durable: gone, or else intact
                if (await client.lookup([key])).count:
                    assert await client.load([key]) in ([], blocks([key]))
        if during is TORN_WRITES:
            assert daemon.control.counters()["write_short"] > 0
        if during is JOURNAL_FULL:
            assert daemon.control.counters()["journal_enospc"] > 0
        assert await daemon.stop() == 0
    finally:
        await daemon.kill()
        daemon.cleanup()


# -- 2. clients killed holding a lease ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["store", "load"])
async def test_client_killed_holding_a_lease_leaves_nothing_behind(
    tmp_path: Path, mode: str
) -> None:
    """A client SIGKILLed holding a store lease (its slots full of wrong bytes) or a load
    lease: every pin and lease comes back, the aborted blocks are never visible, and the
    whole CPU tier can be stored into and read back right after."""
    async with serve(tmp_path, timeout_s=120) as daemon, await connect(daemon) as client:
        path = str(daemon.config.socket.path)
        held = make_keys(f"held-{mode}", 4)
        proc, line = await soak_kit.spawn_holder(path, mode, held, tmp_path / "holder.log")
        try:
            assert line == "ready 4", (tmp_path / "holder.log").read_text()
            stats = await client.stats()
            busy = "writing" if mode == "store" else "pinned"
            assert (tier(stats, "cpu")[busy], stats["server"]["leases"]) == (4, 1)
        finally:
            proc.kill()
            await proc.wait()
        idle = await soak_kit.wait_idle(client, lambda: 1)
        assert idle is not None, soak_kit.idle_figures(await client.stats())
        if mode == "store":  # never committed: not there, and the keys are free to store
            assert (await client.lookup(held)).count == 0
            fresh = [*held, *make_keys("after", 4)]
        else:  # committed before the pin: still there, intact
            assert await client.load(held) == blocks(held)
            fresh = make_keys("after", 8)
        await store_batches(client, fresh)  # as many blocks as the CPU tier holds
        assert await client.load(fresh) == blocks(fresh)
        daemon.chain.check_invariants(idle=True)


# -- 3. disk write errors, ENOSPC and torn writes during demotion -------------------------------


@pytest.mark.parametrize("mode", ["eio", "enospc", "short"])
async def test_failed_demotion_writes_drop_the_blocks(
    tmp_path: Path, faults: FaultControl, mode: str
) -> None:
    """Every demotion write fails: the demoted blocks are dropped and counted on the DISK
    tier (io_errors), never served; the daemon keeps serving, and demotes again once the
    disk is healthy."""
    keys = make_keys("demote", 32)
    async with serve(tmp_path, timeout_s=120) as daemon, await connect(daemon) as client:
        faults.set(FaultPlan(write_rate=1.0, write_mode=mode))
        await store_batches(client, keys[:24])  # batches 2 and 3 demote 16 blocks
        stats = await client.stats()
        assert tier(stats, "disk")["io_errors"] == 16
        assert tier(stats, "cpu")["dropped"] == 16
        assert tier(stats, "disk")["used"] == 0
        # Every block's own write failed (adjacent blocks are tried together first).
        assert faults.counters()[f"write_{mode}"] >= 16
        assert [(await client.lookup([k])).count for k in keys[:16]] == [0] * 16
        assert await client.load(keys[16:24]) == blocks(keys[16:24])

        faults.set(FaultPlan())
        await store_batches(client, keys[24:])  # demotes the third batch, for real
        assert tier(await client.stats(), "disk")["used"] == 8
        assert await client.load(keys[16:24]) == blocks(keys[16:24])
        assert await client.load(keys[24:]) == blocks(keys[24:])
        daemon.chain.check_invariants(idle=True)


async def test_flush_on_a_full_disk_says_what_stayed_dirty(
    tmp_path: Path, faults: FaultControl
) -> None:
    """A flush whose writes fail reports the blocks left dirty and why, and ``tierd flush``
    exits 1 saying so; once the disk has room again, a flush leaves nothing dirty."""
    keys = make_keys("flush", 8)
    async with serve(tmp_path, timeout_s=120) as daemon, await connect(daemon) as client:
        await store_batches(client, keys)
        faults.set(FaultPlan(write_rate=1.0, write_mode="enospc", journal_rate=1.0))
        done = await client.flush()
        assert (done.copied, done.dirty, done.dirty_by_tier) == (0, 8, {"cpu": 8})
        assert "8 failed writes into tier disk" in done.reason
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tierd",
            "flush",
            "--socket",
            str(daemon.config.socket.path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await cli.communicate()
        assert cli.returncode == 1, err
        assert "8 stayed dirty: 8 failed writes into tier disk" in out.decode()

        faults.set(FaultPlan())
        done = await client.flush()
        assert (done.copied, done.dirty, done.reason) == (8, 0, "")
        assert await client.load(keys) == blocks(keys)


# -- 4. disk read errors during promotion ------------------------------------------------------


async def test_failed_promotion_reads_are_a_miss(tmp_path: Path, faults: FaultControl) -> None:
    """Reading the DISK tier fails: the load comes back short (here: empty), never with
    wrong bytes; the DISK tier counts the errors and drops the unreadable blocks."""
    keys = make_keys("promote", 16)
    async with serve(tmp_path, timeout_s=120) as daemon, await connect(daemon) as client:
        await store_batches(client, keys)  # the first 8 now live on DISK only
        assert (await client.lookup(keys[:8])).media == ("DISK",) * 8
        before = tier(await client.stats(), "disk")["io_errors"]
        faults.set(FaultPlan(read_rate=1.0))
        assert await client.load(keys[:8]) == []
        assert tier(await client.stats(), "disk")["io_errors"] - before == 8
        # Every block's own read failed (adjacent blocks are tried together first).
        assert faults.counters()["read_eio"] >= 8
        faults.set(FaultPlan())
        assert (await client.lookup(keys[:8])).count == 0
        # The promotion made room first: the other 8 went down to DISK and read back fine.
        assert await client.load(keys[8:]) == blocks(keys[8:])
        await store_batches(client, keys[:8])
        assert await client.load(keys[:8]) == blocks(keys[:8])
        daemon.chain.check_invariants(idle=True)


# -- 5. a slow disk ------------------------------------------------------------------------------


async def test_slow_disk_keeps_every_byte_right(tmp_path: Path, faults: FaultControl) -> None:
    faults.set(FaultPlan(slow_s=0.005))
    keys = make_keys("slow", 32)
    async with serve(tmp_path, timeout_s=120) as daemon, await connect(daemon) as client:
        others = await asyncio.gather(*(connect(daemon) for _ in range(3)))
        try:
            await store_batches(client, keys)
            # Four clients load from the slow disk at once (2 blocks each: together they
            # fit the CPU tier, whose own blocks are demoted, slowly, meanwhile).
            wanted = [keys[i * 4 : i * 4 + 2] for i in range(4)]
            got = await asyncio.gather(
                *(c.load(part) for c, part in zip([client, *others], wanted, strict=True))
            )
            assert got == [blocks(part) for part in wanted]
        finally:
            for other in others:
                await other.close()
        assert await client.load(keys[:8]) == blocks(keys[:8])
        assert faults.counters()["slow"] > 0
        daemon.chain.check_invariants(idle=True)


# -- 6. a subscriber that never reads, while the disk fails --------------------------------------


async def test_stuck_subscriber_and_failing_disk_leave_other_clients_unaffected(
    tmp_path: Path, faults: FaultControl
) -> None:
    faults.set(FaultPlan(write_rate=1.0, write_mode="eio"))
    tally, gate = soak_kit.Tally(BLOCK), soak_kit.Gate()
    keys = soak_kit.KeySpace(sequences=64, seq_len=4)
    options: dict[str, Any] = {"cpu_blocks": 16, "events": {"queue_batches": 4}}
    async with serve(tmp_path, timeout_s=120, **options) as daemon, await connect(daemon) as client:
        path = str(daemon.config.socket.path)
        stuck = soak_kit.StuckSubscriber(path)
        try:
            worker = soak_kit.Worker(path, keys, tally, gate, random.Random(3))
            rounds = 0
            while (await client.stats())["chain"]["events_dropped"] == 0:
                rounds += 1
                assert rounds <= 100, "the stuck subscriber's queue never overflowed"
                await worker.run(asyncio.Event(), rounds=20)
            stats = await soak_kit.wait_idle(client, lambda: 2)  # the worker has gone
            assert stats is not None
            assert stats["server"]["subscribers"] == 1  # still stuck, still subscribed
        finally:
            stuck.close()
        assert tally.wrong == 0
        assert tally.ops["load"] > 0 and tally.ops["store"] > 0
        assert tally.errors == {}, tally.errors
        assert tier(stats, "disk")["io_errors"] > 0
        assert await soak_kit.wait_idle(client, lambda: 1) is not None
        daemon.chain.check_invariants(idle=True)


# -- 7. a fuzzer beside verifying clients -------------------------------------------------


async def test_fuzzer_beside_verifying_clients_never_costs_a_byte(tmp_path: Path) -> None:
    tally, gate = soak_kit.Tally(BLOCK), soak_kit.Gate()
    keys = soak_kit.KeySpace(sequences=32, seq_len=4)
    async with serve(tmp_path, timeout_s=120, cpu_blocks=16) as daemon:
        path = str(daemon.config.socket.path)
        fuzzer = soak_kit.Fuzzer(path, random.Random(11), gate, BLOCK, rate=1e6)
        workers = [soak_kit.Worker(path, keys, tally, gate, random.Random(i)) for i in range(2)]
        stop = asyncio.Event()
        await asyncio.gather(
            fuzzer.run(stop, frames=1500), *(w.run(stop, rounds=150) for w in workers)
        )
        counts = fuzzer.counts
        assert counts["frames"] >= 1500 and counts["bad_frames"] > 0
        assert counts["replies"] > 0
        assert (counts["internal"], counts["malformed"]) == (0, 0), fuzzer.examples
        assert tally.wrong == 0
        assert tally.blocks["verified"] > 0
        # The fuzzer's faults stay its own; only the room its open leases take can show.
        assert set(tally.errors) <= {"capacity"}, tally.errors
        async with await connect(daemon) as client:
            assert (await client.health())["status"] == "ok"
            assert await soak_kit.wait_idle(client, lambda: 1) is not None
        daemon.chain.check_invariants(idle=True)


async def test_fuzzer_disconnect_never_waits_on_a_stuck_peer(tmp_path: Path) -> None:
    """Regression (the first 10-minute run hung here): the fuzzer stopped reading replies
    and had requests left unsent while the daemon, its replies unread, had stopped reading
    too. A graceful close waits for those requests to go out, which never happens. The
    fuzzer aborts the connection instead."""
    async with serve(tmp_path, timeout_s=120) as daemon:
        fuzzer = soak_kit.Fuzzer(
            str(daemon.config.socket.path), random.Random(1), soak_kit.Gate(), BLOCK
        )
        assert await fuzzer._connect()
        writer, reading = fuzzer._writer, fuzzer._reading
        assert writer is not None and reading is not None
        reading.cancel()  # nobody reads the replies any more: they pile up
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        # 200k stats requests (4 MB): the daemon stops reading once its replies back up,
        # long before it has read them all.
        writer.write(b"".join(encode({"id": i, "op": "stats"}) for i in range(200_000)))
        assert writer.transport.get_write_buffer_size() > 0
        async with asyncio.timeout(60):
            await fuzzer.disconnect()
        async with await connect(daemon) as client:
            assert await soak_kit.wait_idle(client, lambda: 1) is not None


def test_fault_control_round_trip(tmp_path: Path) -> None:
    """The plan the campaign writes is the plan a second mapping (the daemon) reads."""
    writer = FaultControl(tmp_path / "f.bin", create=True)
    reader = FaultControl(tmp_path / "f.bin")
    try:
        assert reader.plan() == FaultPlan()
        plan = FaultPlan(write_rate=0.25, write_mode="short", journal_rate=0.5, slow_s=0.01)
        writer.set(plan)
        assert reader.plan() == plan
        reader.count("read_eio")
        reader.count("read_eio")
        assert writer.counters()["read_eio"] == 2
        with pytest.raises(ValueError, match="write_mode"):
            FaultPlan(write_mode="bogus")
    finally:
        writer.close()
        reader.close()


def test_content_depends_on_key_and_position() -> None:
    a, b = content(b"k1", 1 << 16), content(b"k2", 1 << 16)
    assert len(a) == 1 << 16 and a != b
    assert a[:64] != a[64:128]  # a block shifted by a chunk is not the same block
    assert content(b"k1", 100) == a[:100]
