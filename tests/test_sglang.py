"""tierd under SGLang's own HiCache code (issue 25): real ``tierd serve`` processes, SGLang's
real host pools and HiCacheController on CPU, in two engine processes.

Each engine is a process of .venv-sglang's python (tests/sglang_kit/driver.py): SGLang's
``StorageBackendFactory`` loads ``TierdHiCache`` from the documented extra-config JSON, and
pages move only through the controller's own backup, hit-query and transfer threads.
Every loaded page is compared, byte for byte, with what the writer process put there.
The time bounds asserted are liveness bounds (many times the configured deadline).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from sglang_kit.engines import Engines, file_spec, missing_reason, page_bytes, tierd_spec
from sglang_kit.shared import BLOCK, LIVENESS_S, PAGES, config, loaded_all, until

from tierd.client import Client
from tierd.testing import daemon_config

REASON = missing_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

MLA = {"mla": True, "lora": 24, "rope": 8}  # (24 + 8) x 3 layers x 2 B x 4 tokens = 768
FAST = {"lookup_deadline_s": 0.2, "job_deadline_s": 0.5}
RECONNECT_WITHIN_S = 30.0  # the link's backoff is at most 10 s (reconnect_max_s)


def eventually_loaded(engines: Engines, name: str, seed: int, tries: int = 20) -> bool:
    """Whether a read of ``seed``'s pages loads them all within ``tries`` reads and
    :data:`RECONNECT_WITHIN_S` (each read is SGLang's own prefetch; a read that loads
    nothing is followed by a short pause, as an engine's next request would be, so that
    reads answered at once by an open breaker cannot use up the tries before its probe);
    every page loaded on the way must be right."""
    deadline = time.monotonic() + RECONNECT_WITHIN_S
    for _ in range(tries):
        answer = engines.read(name, seed=seed, pages=PAGES)
        assert answer["identical"] == answer["loaded_pages"]
        if loaded_all(answer, PAGES):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return False


async def daemon_stats(socket_path: str) -> dict[str, Any]:
    client = await Client.connect(socket_path)
    try:
        return await client.stats()
    finally:
        await client.close()


async def test_two_engines_share_pages_byte_for_byte_in_every_layout_and_allocator(
    tmp_path: Path, spawn: Any, pair: Any, sglang_daemon: Any
) -> None:
    a, b = pair
    sock = sglang_daemon.socket_path
    opened = {
        ("a", "pf"): a.open("pf", tierd_spec(sock)),
        ("b", "pf"): b.open("pf", tierd_spec(sock, allocator="shm")),
        ("a", "lf"): a.open("lf", tierd_spec(sock, layout="layer_first", allocator="shm")),
        ("b", "lf"): b.open("lf", tierd_spec(sock, layout="layer_first")),
    }
    for info in opened.values():
        assert info["backend"] == "TierdHiCache", info
        assert info["namespace"].startswith("sglang/tiny-model/")
    assert [opened[k]["memfd"] for k in opened] == [False, True, True, False]
    # The allocator moves the same bytes; the layout changes them: its own namespace.
    assert opened[("a", "pf")]["namespace"] == opened[("b", "pf")]["namespace"]
    assert opened[("a", "lf")]["namespace"] == opened[("b", "lf")]["namespace"]
    assert opened[("a", "pf")]["namespace"] != opened[("a", "lf")]["namespace"]

    # Lease copies in one process, the memfd hand-off in the other, both ways.
    assert a.write("pf", seed=1, pages=PAGES)["stored_pages"] == PAGES
    assert loaded_all(b.read("pf", seed=1, pages=PAGES + 4), PAGES)
    assert b.write("pf", seed=3, pages=PAGES)["stored_pages"] == PAGES
    assert loaded_all(a.read("pf", seed=3, pages=PAGES), PAGES)
    assert a.write("lf", seed=2, pages=PAGES)["stored_pages"] == PAGES
    assert loaded_all(b.read("lf", seed=2, pages=PAGES), PAGES)
    # layer_first bytes never load into a page_first pool.
    assert b.read("pf", seed=2, pages=PAGES)["hit_pages"] == 0

    # `tierd stop` and a new sglang_daemon: the pages come back from its disk tier (the memfd
    # region is registered again on the new connection).
    assert await sglang_daemon.stop() == 0
    sglang_daemon = await spawn(config(tmp_path, socket={"path": sock}))
    assert eventually_loaded(b, "pf", seed=1)  # the first lookup may spend its deadline
    assert eventually_loaded(a, "pf", seed=3)  # reconnecting: a miss, then hits
    assert eventually_loaded(a, "lf", seed=2)
    stats = await daemon_stats(sock)
    disk = next(t for t in stats["tiers"] if t["medium"] == "DISK")
    assert disk["hits"] >= 3 * PAGES
    for engines, name in [(a, "pf"), (a, "lf"), (b, "pf"), (b, "lf")]:
        assert engines.stats(name)["sglang_errors"] == 0
        engines.ask("close", name)


async def test_namespaces_mla_writer_rank_and_other_shapes(pair: Any, sglang_daemon: Any) -> None:
    a, b = pair
    sock = sglang_daemon.socket_path
    # MLA: ranks hold the same pages, so they share a namespace; rank 1 never writes.
    r1 = a.open("mla1", tierd_spec(sock, tp_rank=1, tp_size=2, **MLA))
    r0 = b.open("mla0", tierd_spec(sock, tp_rank=0, tp_size=2, allocator="shm", **MLA))
    assert r1["namespace"] == r0["namespace"] and r0["page_bytes"] == BLOCK
    assert a.write("mla1", seed=5, pages=PAGES)["stored_pages"] == 0  # SGLang skips it
    assert b.read("mla0", seed=5, pages=PAGES)["hit_pages"] == 0
    assert b.write("mla0", seed=6, pages=PAGES)["stored_pages"] == PAGES
    assert loaded_all(a.read("mla1", seed=6, pages=PAGES), PAGES)

    # Another model, or another rank of a sharded (MHA) model: no hit.
    a.open("mha", tierd_spec(sock))
    assert a.write("mha", seed=7, pages=8)["stored_pages"] == 8
    # SGLang's generic calls (no interface_v1: get/set/batch_get/batch_set, a page copied
    # through a flat tensor) lay a block out otherwise: their own namespace.
    b.open("generic", tierd_spec(sock, extra={"interface_v1": 0}))
    a.open("generic", tierd_spec(sock, extra={"interface_v1": 0}))
    assert b.read("generic", seed=7, pages=8)["hit_pages"] == 0
    assert b.write("generic", seed=8, pages=8)["stored_pages"] == 8
    assert loaded_all(a.read("generic", seed=8, pages=8), 8)
    assert a.read("mha", seed=8, pages=8)["hit_pages"] == 0
    a.ask("close", "generic")
    other = b.open("other", tierd_spec(sock, model="other-model"))
    rank1 = b.open("rank1", tierd_spec(sock, tp_rank=1, tp_size=2))
    user = b.open("named", tierd_spec(sock, extra={"namespace": "team-a"}))
    names = {other["namespace"], rank1["namespace"], user["namespace"]}
    assert len(names) == 3 and a.stats("mha")["namespace"] not in names
    assert user["namespace"].startswith("sglang/tiny-model/")
    for name in ("other", "rank1", "named"):
        assert b.read(name, seed=7, pages=8)["hit_pages"] == 0
    # Another shape: one page is no longer block_bytes; SGLang refuses to start, saying why.
    refused = b.open("wide", tierd_spec(sock, heads=4))
    assert f"block_bytes: {page_bytes({'heads': 4})}" in refused["refused"]
    for engines, name in [(a, "mla1"), (a, "mha"), (b, "mla0"), (b, "other")]:
        assert engines.stats(name)["sglang_errors"] == 0
        engines.ask("close", name)
    for name in ("rank1", "named", "generic"):
        b.ask("close", name)
    assert sglang_daemon.proc.poll() is None


async def test_a_stopped_or_killed_daemon_costs_a_deadline_and_sglang_never_sees_an_error(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    a, _ = pair
    daemon = await spawn(config(tmp_path))
    sock = daemon.socket_path
    a.open("f", tierd_spec(sock, allocator="shm", extra=FAST))
    assert a.write("f", seed=11, pages=PAGES)["stored_pages"] == PAGES
    daemon.signal(signal.SIGSTOP)
    try:
        stored = a.write("f", seed=12, pages=PAGES)
        missed = a.read("f", seed=11, pages=PAGES)
        again = a.read("f", seed=11, pages=PAGES)  # the breaker answers at once now
    finally:
        daemon.signal(signal.SIGCONT)
    assert stored["stored_pages"] < PAGES and stored["took_s"] < LIVENESS_S
    assert missed["hit_pages"] == 0 and missed["took_s"] < LIVENESS_S
    assert again["hit_pages"] == 0 and again["took_s"] < LIVENESS_S
    # Back: the breaker's probe closes it; a bounded number of tries.
    assert eventually_loaded(a, "f", seed=11, tries=40)

    daemon.signal(signal.SIGKILL)
    await daemon.wait()
    assert a.write("f", seed=13, pages=PAGES)["stored_pages"] == 0
    assert a.read("f", seed=11, pages=PAGES)["hit_pages"] == 0
    daemon = await spawn(config(tmp_path, socket={"path": sock}))
    # Back after a kill: the link reconnects with backoff (up to reconnect_max_s, 10 s),
    # and a write before then fails at once. So the tries are bounded in time as well as
    # count, paced, rather than 40 back-to-back writes that can all land in one backoff.
    stored: list[int] = []
    deadline = time.monotonic() + RECONNECT_WITHIN_S
    while PAGES not in stored and len(stored) < 400 and time.monotonic() < deadline:
        stored.append(a.write("f", seed=14, pages=PAGES)["stored_pages"])
        if stored[-1] != PAGES:
            await asyncio.sleep(0.1)  # pacing the retries, as an engine's next request would
    assert PAGES in stored, stored
    assert loaded_all(a.read("f", seed=14, pages=PAGES), PAGES)
    stats = a.stats("f")
    assert stats["sglang_errors"] == 0, stats["last_error"]
    assert stats["totals"]["failed_calls"] > 0
    # The link's own lines reach SGLang's log (they went to structlog, which SGLang never
    # shows: a lost daemon was silent there).
    said = [(level, text.split(":")[0]) for level, text in stats["tierd_logs"]]
    assert ("WARNING", "tierd breaker open") in said, said
    assert ("WARNING", "tierd daemon lost") in said, said
    assert ("INFO", "tierd daemon reachable again") in said, said
    a.ask("close", "f")


async def test_under_sglangs_failure_injector_every_loaded_page_is_right(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    _, b = pair
    daemon = await spawn(config(tmp_path))
    env = {
        "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3",
        "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": "0.01",
    }
    info = b.open("inj", tierd_spec(daemon.socket_path, allocator="shm", env=env))
    assert info["backend"] == "HiCacheStorageFailureInjector"
    # The injector's draws are its own (unseeded): a round loads pages only when its
    # write, exists and get all pass (0.7 ** 3), so ten rounds load nothing once in 67
    # runs. At least ten rounds, then on until one has loaded (at most 60: 1 in 10 ** 11).
    loaded = 0
    for seed in range(20, 80):
        b.write("inj", seed=seed, pages=8)
        answer = b.read("inj", seed=seed, pages=8)
        assert answer["identical"] == answer["loaded_pages"] <= answer["hit_pages"] <= 8
        loaded += answer["loaded_pages"]
        if loaded and seed >= 29:
            break
    assert loaded > 0
    assert b.stats("inj")["sglang_errors"] == 0
    b.ask("close", "inj")


async def test_same_hits_as_sglangs_file_backend_and_a_bound_file_does_not_keep(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    a, _ = pair
    daemon = await spawn(config(tmp_path, cpu_blocks=16, disk_blocks=32))
    files = tmp_path / "hicache-file"
    a.open("file", file_spec(files))
    a.open("tierd", tierd_spec(daemon.socket_path))
    script = [("write", 40, 8), ("read", 40, 8), ("read", 41, 8), ("write", 42, 4)]
    script += [("read", 42, 8), ("read", 40, 4)]
    results = {}
    for backend in ("file", "tierd"):
        results[backend] = [
            a.ask(op, backend, seed=seed, pages=pages) for op, seed, pages in script
        ]
    for f, t in zip(results["file"], results["tierd"], strict=True):
        assert f.get("stored_pages") == t.get("stored_pages")
        assert f.get("hit_pages") == t.get("hit_pages")
        assert f.get("identical") == t.get("identical")
    assert [r.get("hit_pages") for r in results["tierd"]] == [None, 8, 0, None, 4, 4]

    # A working set of 100 pages against 48 blocks of capacity.
    for seed in range(50, 60):
        for backend in ("file", "tierd"):
            assert a.write(backend, seed=seed, pages=10)["stored_pages"] == 10
    stats = await daemon_stats(daemon.socket_path)
    assert sum(t["used"] for t in stats["tiers"]) <= 16 + 32
    pages_on_file = [n for n in os.listdir(files) if n.endswith(".bin")]
    assert len(pages_on_file) >= 100 + 12  # SGLang's file backend keeps every page
    assert loaded_all(a.read("tierd", seed=59, pages=10), 10)
    assert a.read("tierd", seed=50, pages=10)["hit_pages"] < 10  # evicted: a bound
    for backend in ("file", "tierd"):
        assert a.stats(backend)["sglang_errors"] == 0
        a.ask("close", backend)


BIG = {"page": 512, "layers": 8, "heads": 8, "head_dim": 128}  # 16 MiB pages: K, V 8 MiB


async def test_a_load_that_gave_up_never_writes_into_pages_sglang_reused(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """SGLang's recommended memfd path, 4 pages of 16 MiB, a reader whose job deadline
    (5 ms) expires in the middle of its loads (the pages come up from the daemon's disk
    tier: 64 MiB read, and as much demoted to make room). After each failed load SGLang's
    pages are reused at once (a sentinel); none may change afterwards. When the daemon
    wrote into the memfd itself, its copy calls under way at the deadline landed
    afterwards."""
    a, _ = pair
    size = page_bytes(BIG)
    daemon = await spawn(daemon_config(tmp_path, block_bytes=size, cpu_blocks=8, disk_blocks=16))
    common = {**BIG, "allocator": "shm", "host_pages": 6, "device_tokens": 6 * 512}
    a.open("big-w", tierd_spec(daemon.socket_path, **common))
    for seed in (90, 91, 92):  # 91 and 92 fill the CPU tier: 90 goes down to disk
        assert a.write("big-w", seed=seed, pages=4)["stored_pages"] == 4
    tight = {"lookup_deadline_s": 0.5, "job_deadline_s": 0.005, "breaker_failures": 0}
    assert a.open("big-r", tierd_spec(daemon.socket_path, **common, extra=tight))["memfd"]
    failed = overwritten = 0
    for _ in range(8):  # bounded: each round ends in about reuse_s
        answer = a.read("big-r", seed=90, pages=4, reuse_s=0.3)
        assert answer["identical"] == answer["loaded_pages"]
        failed += answer["loaded_pages"] < answer["hit_pages"]
        overwritten += answer.get("overwritten", 0)
    assert failed > 0  # the deadline did cut loads short
    assert overwritten == 0
    for name in ("big-w", "big-r"):
        a.ask("close", name)


async def test_a_sequence_longer_than_the_tiers_keeps_its_head_not_a_dead_tail(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 35, item 11: a 100-page sequence, backed up by SGLang's controller in turns of
    10 pages (each with SGLang's prefix keys), into 16 CPU + 32 disk blocks. Each turn's
    pages used to be the most recent, so the turns after the first pushed the sequence's
    head out and the 48 pages kept were its tail: served 0 pages. The backend now tells
    the daemon the whole sequence was used, head most recent, after every turn."""
    a, _ = pair
    daemon = await spawn(config(tmp_path, cpu_blocks=16, disk_blocks=32))
    a.open("tierd", tierd_spec(daemon.socket_path))
    for start in range(0, 100, 10):
        assert a.write("tierd", seed=80, pages=start + 10, start=start)["stored_pages"] == 10
    stats = await daemon_stats(daemon.socket_path)
    assert sum(t["used"] for t in stats["tiers"]) == 16 + 32
    answer = a.read("tierd", seed=80, pages=100)
    assert answer["loaded_pages"] >= 16, answer  # a whole CPU tier's worth at least
    assert answer["identical"] == answer["loaded_pages"]
    assert a.stats("tierd")["sglang_errors"] == 0
    a.ask("close", "tierd")


async def test_sequences_that_fill_the_tiers_keep_their_heads(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 35, item 11: ten 10-page sequences into 16 CPU + 32 disk blocks, then each
    read back once, newest first. A sequence's pages go to the daemon in pieces (its
    lease bound), each newer than the one before, so eviction took heads and kept tails
    that no read reaches. The backend now touches a call's pages, head most recent."""
    a, _ = pair
    daemon = await spawn(config(tmp_path, cpu_blocks=16, disk_blocks=32))
    a.open("tierd", tierd_spec(daemon.socket_path))
    for seed in range(50, 60):
        assert a.write("tierd", seed=seed, pages=10)["stored_pages"] == 10
    stats = await daemon_stats(daemon.socket_path)
    held = sum(t["used"] for t in stats["tiers"])
    served = [a.read("tierd", seed=seed, pages=10)["hit_pages"] for seed in range(59, 49, -1)]
    assert sum(served) >= 36, (held, served)  # 30 before (38 now: promoted copies take room)
    a.ask("close", "tierd")


async def test_sglang_at_its_own_page_size_beside_another_on_a_daemon_of_several_sizes(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """SGLang's own code, two shapes on one daemon (``block_sizes: 2``): the configured
    page and a wider one nobody configured, each served at its size, byte for byte."""
    a, b = pair
    wide = {"heads": 16}
    limits = {"min_block_bytes": 4096}
    daemon = await spawn(
        config(tmp_path, cpu_blocks=1024, disk_blocks=1024, block_sizes=2, limits=limits)
    )
    sock = daemon.socket_path
    opened = a.open("wide", tierd_spec(sock, **wide))
    assert "refused" not in opened and opened["page_bytes"] == page_bytes(wide) != BLOCK
    b.open("wide", tierd_spec(sock, **wide))
    a.open("narrow", tierd_spec(sock))
    assert a.write("wide", seed=31, pages=8)["stored_pages"] == 8
    assert a.write("narrow", seed=32, pages=8)["stored_pages"] == 8
    assert loaded_all(b.read("wide", seed=31, pages=8), 8)
    stats = await daemon_stats(sock)
    sizes = stats["tenants"]["default"]["block_sizes"]
    assert {size: part["tiers"][0]["stores"] for size, part in sizes.items()} == {
        str(BLOCK): 8,
        str(page_bytes(wide)): 8,
    }
    for engines in (a, b):
        assert engines.stats("wide")["sglang_errors"] == 0
        engines.ask("close", "wide")
    a.ask("close", "narrow")


FROZEN_PAGES = 256
# Long enough that no copy of a running engine outlives it on a loaded 2-core machine:
# only the stopped one's lease expires.
FROZEN_TTL_S = 2.0


async def lease_figures(socket_path: str) -> tuple[int, int]:
    """The daemon's (store leases expired, CPU slots quarantined)."""
    stats = await daemon_stats(socket_path)
    return stats["leases"]["leases_expired"], stats["tiers"][0].get("quarantined", 0)


def frozen_spec(socket_path: str, model: str) -> dict[str, Any]:
    """An engine whose calls wait long (a stopped writer's call is not cut by its own
    deadline: the lease's expiry is what the daemon sees)."""
    slow = {"job_deadline_s": 60.0, "lookup_deadline_s": 5.0, "breaker_failures": 0}
    return tierd_spec(socket_path, model=model, host_pages=FROZEN_PAGES + 64, extra=slow)


async def test_a_writer_stopped_past_its_lease_never_writes_into_another_engines_pages(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 57, item 0: SGLang's writer process is stopped (SIGSTOP) in the middle of a
    256-page store through a lease until the lease expires; a second engine (another
    namespace, same tenant) then stores 256 pages into a full CPU tier; the first
    resumes and finishes its copy. The expired lease's slots used to be freed at expiry
    and given to the second engine's pages, which the first then overwrote: a reader
    was served hit 256, byte-equal about half. A slot a live client may still write into
    is now given to no other block until that client is done or gone."""
    a, b = pair
    cfg = config(
        tmp_path,
        cpu_blocks=3 * FROZEN_PAGES,
        disk_blocks=None,
        limits={"store_lease_ttl_s": FROZEN_TTL_S},
    )
    daemon = await spawn(cfg)
    a.open("frozen-w", frozen_spec(daemon.socket_path, "model-a"))
    b.open("frozen-b", frozen_spec(daemon.socket_path, "model-b"))
    for seed in (300, 301):  # the CPU tier's first two thirds, ready
        assert b.write("frozen-b", seed=seed, pages=FROZEN_PAGES)["stored_pages"] == FROZEN_PAGES
    writing = None
    for seed in range(302, 314, 2):  # bounded: until the writer stops under a lease
        writing = asyncio.create_task(
            asyncio.to_thread(a.write, "frozen-w", seed=seed, pages=FROZEN_PAGES, freeze_after=100)
        )
        await until(a.stopped, "the writer stopped in the middle of its copy")
        if await _leased(daemon.socket_path):
            break
        # Stopped outside a lease (a copy SGLang made without one): not this test's case.
        os.kill(a.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(writing, LIVENESS_S)
        writing = None
    assert writing is not None, "the writer never stopped in the middle of a leased copy"
    try:
        try:
            await until(
                lambda: _expired(daemon.socket_path),
                "the writer's store lease expired",
                within_s=FROZEN_TTL_S + 10,
            )
        except AssertionError as exc:  # say what the daemon counted, and the writer did
            figures = await lease_figures(daemon.socket_path)
            os.kill(a.proc.pid, signal.SIGCONT)
            late = await asyncio.wait_for(writing, LIVENESS_S)
            said = a.ask("log")["tierd_logs"][-12:]
            raise AssertionError(
                f"{exc}: (expired, quarantined) = {figures}; the write: {late};"
                f" tierd's last lines in the writer: {said}"
            ) from None
        # The second engine's pages go into the last free slots the tier has.
        assert b.write("frozen-b", seed=303, pages=FROZEN_PAGES)["stored_pages"] == FROZEN_PAGES
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    late = await asyncio.wait_for(writing, LIVENESS_S)
    assert late["stored_pages"] < FROZEN_PAGES  # its commit came after the expiry
    b.open("frozen-r", frozen_spec(daemon.socket_path, "model-b"))
    for _ in range(2):  # and again on a second read
        answer = b.read("frozen-r", seed=303, pages=FROZEN_PAGES)
        assert answer["hit_pages"] == FROZEN_PAGES
        assert answer["identical"] == answer["loaded_pages"] == FROZEN_PAGES, answer
    # The writer's commit told the daemon it was done: the slots are free again.
    assert await lease_figures(daemon.socket_path) == (1, 0)
    for name, engines in (("frozen-w", a), ("frozen-b", b), ("frozen-r", b)):
        engines.ask("close", name)


async def _leased(socket_path: str) -> bool:
    """Whether some client holds blocks in a lease now (a stopped writer's copy)."""
    stats = await daemon_stats(socket_path)
    return int(stats["leases"]["leases_held_blocks"]) > 0


async def _expired(socket_path: str) -> bool:
    return (await lease_figures(socket_path))[0] == 1


async def test_a_reader_stopped_in_the_middle_of_a_load_keeps_its_pages_from_every_store(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 57, item 0, for loads: SGLang's reader is stopped in the middle of copying
    256 pages out of the daemon's pool; another engine stores three times the tier's
    size meanwhile, each store into the part of the tier not pinned. The pages under the
    reader's load lease stay pinned until it is done (a load lease ends by no timer): it
    resumes and every page it copies is right."""
    a, b = pair
    cfg = config(
        tmp_path,
        cpu_blocks=2 * FROZEN_PAGES,
        disk_blocks=None,
        limits={"store_lease_ttl_s": FROZEN_TTL_S},
    )
    daemon = await spawn(cfg)
    b.open("frozen-b", frozen_spec(daemon.socket_path, "model-b"))
    assert b.write("frozen-b", seed=310, pages=FROZEN_PAGES)["stored_pages"] == FROZEN_PAGES
    a.open("frozen-r", frozen_spec(daemon.socket_path, "model-b"))
    reading = asyncio.create_task(
        asyncio.to_thread(a.read, "frozen-r", seed=310, pages=FROZEN_PAGES, freeze_after=100)
    )
    try:
        await until(a.stopped, "the reader stopped in the middle of its copy")
        await asyncio.sleep(
            FROZEN_TTL_S + 0.5
        )  # past store_lease_ttl_s: no timer ends a load lease
        stored = sum(
            b.write("frozen-b", seed=seed, pages=FROZEN_PAGES)["stored_pages"]
            for seed in (311, 312, 313)
        )
        assert stored == 3 * FROZEN_PAGES  # each into the half of the tier not pinned
        pinned = (await daemon_stats(daemon.socket_path))["tiers"][0]["pinned"]
        assert pinned >= 100  # the reader's batch (SGLang's) under its load lease stays
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    answer = await asyncio.wait_for(reading, LIVENESS_S)
    # Every page of the batch it held is served right (the pages past it, not pinned,
    # made room for the stores: the load ends before the first one gone).
    assert answer["identical"] == answer["loaded_pages"] >= pinned, answer
    for name, engines in (("frozen-r", a), ("frozen-b", b)):
        engines.ask("close", name)
