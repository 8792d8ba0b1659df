"""tierd under LMCache's own code (issue 37): real ``tierd serve`` processes, LMCache 0.5.6's
plugin loader, ``lmcache bench l2`` and memory objects, in processes of .venv-lmcache's
python (scripts/setup_lmcache).

``lmcache bench l2`` runs as LMCache ships it, with the documented ``--l2-adapter`` JSON.
The other tests run tests/lmcache_driver.py: an LMCache "server" that builds the adapter
with LMCache's config parser and factory and waits on its event fds as LMCache's
controllers do; every loaded object is compared, byte for byte, with what the writer
process stored. The time bounds asserted are liveness bounds (many times the configured
deadline): a task that never finished used to be the failure, not a slow one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from lmcache_driver import adapter_json
from lmcache_kit import (
    ANSWER_S,
    BLOCK,
    LIVENESS_S,
    LMCACHE_PYTHON,
    MODEL,
    REASON,
    Lmcache,
    all_identical,
    child_env,
    config,
    delete_from,
)

from tierd.client import Client
from tierd.integrations.lmcache.object_keys import block_key

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

BENCH_BLOCK = 256 * 1024  # `lmcache bench l2`'s default object (--data-size-kb 256)
DEADLINE_S = 0.5


@pytest.fixture
def lmcache() -> Any:
    """``lmcache(spec)`` starts an LMCache process; all are closed at the end."""
    started: list[Lmcache] = []

    def start(spec: str, block: int = BLOCK, *, in_loop: bool = False) -> Lmcache:
        started.append(Lmcache(spec, block, in_loop=in_loop))
        return started[-1]

    yield start
    for process in started:
        process.close()


def eventually_identical(process: Lmcache, seed: int, count: int, tries: int = 5000) -> bool:
    """Whether a load of ``seed`` finds every object within ``tries`` loads and LIVENESS_S
    (bounded both ways, no sleep: while the daemon is away the breaker answers each load
    at once, until its probe finds the daemon back); every object loaded on the way must
    be right."""
    deadline = time.monotonic() + LIVENESS_S
    for _ in range(tries):
        answer = process.load(seed, count)
        assert answer["finished"], answer
        assert answer.get("identical") == answer.get("loaded"), answer
        if all_identical(answer, count):
            return True
        if time.monotonic() > deadline:
            break
    return False


async def flush(socket_path: str) -> None:
    client = await Client.connect(socket_path)
    try:
        await client.flush()
    finally:
        await client.close()


# -- 1. LMCache's own bench ---------------------------------------------------------------


def bench(spec: str, *extra: str) -> tuple[int, str, dict[str, Any]]:
    """``lmcache bench l2`` as LMCache ships it; (exit status, its log, its JSON report)."""
    command = [str(LMCACHE_PYTHON), "-m", "lmcache.cli.main", "bench", "l2"]
    command += ["--l2-adapter", spec, "--no-skip-verify", "--lookup-max-hit-rate", "1.0"]
    command += ["--format", "json", *extra]
    done = subprocess.run(
        command, capture_output=True, text=True, env=child_env(), cwd="/", timeout=ANSWER_S
    )
    out = done.stdout
    start = out.find("\n{")
    report = json.JSONDecoder().raw_decode(out[start + 1 :])[0] if start >= 0 else {}
    return done.returncode, out + done.stderr, report


@pytest.mark.parametrize("tier", ["cpu", "disk"])
async def test_lmcache_bench_l2_verifies_every_key_through_a_real_daemon(
    tmp_path: Path, spawn: Any, tier: str
) -> None:
    # "disk": a CPU tier of 8 blocks, so that the bench's 64 objects (2 rounds of 32)
    # are mostly served from the disk tier below it.
    cpu_blocks = 128 if tier == "cpu" else 8
    daemon = await spawn(config(tmp_path, BENCH_BLOCK, cpu_blocks=cpu_blocks))
    status, log, report = bench(adapter_json(daemon.socket_path))
    assert status == 0, log
    assert "All 32 keys data verified OK" in log, log
    ops = {op["operation"]: op for key, op in report["metrics"].items() if key.startswith("op_")}
    assert set(ops) == {"Store", "Lookup", "Load"}
    for op in ops.values():
        assert op["rounds_timed_out"] == 0, op
        assert op["total_success"] == op["total_keys"] == 32, op
    stats = await flush_stats(daemon.socket_path)
    assert stats >= 64  # both rounds' objects are in the daemon


async def flush_stats(socket_path: str) -> int:
    """Blocks the daemon holds in the bench's namespace, over every tier."""
    client = await Client.connect(socket_path)
    try:
        rows = [r for group in (await client.namespaces()).values() for r in group]
    finally:
        await client.close()
    mine = [r for r in rows if str(r.get("namespace", "")).startswith("lmcache/bench-model/")]
    return sum(int(r["bytes"]) for r in mine) // BENCH_BLOCK


# -- 2. two LMCache servers on one daemon --------------------------------------------------


async def test_two_lmcache_processes_share_blocks_and_a_restart_keeps_them(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    cfg = config(tmp_path)
    daemon = await spawn(cfg)
    spec = adapter_json(daemon.socket_path, deadline_s=DEADLINE_S, reconnect_max_s=0.5)
    writer, reader = lmcache(spec), lmcache(spec)
    stored = writer.store(seed=1, count=24)
    assert stored["ok"] and stored["bytes"] == 24 * BLOCK, stored
    assert all_identical(reader.load(seed=1, count=24), 24)
    assert reader.load(seed=2, count=8)["found"] == 0  # never stored: a miss, not an error
    assert await daemon.stop() == 0  # drains, writes the CPU tier back to disk
    await spawn(cfg)
    assert eventually_identical(reader, seed=1, count=24), reader.log()
    assert eventually_identical(writer, seed=1, count=24), writer.log()


# -- 3. a daemon that stops answering or dies ------------------------------------------------


def finished_in_time(answer: dict[str, Any], *keys: str) -> bool:
    return bool(answer["finished"]) and all(answer[k] < LIVENESS_S for k in keys)


async def test_a_stopped_daemon_costs_each_task_a_deadline_and_lmcache_recovers(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    spec = adapter_json(daemon.socket_path, deadline_s=DEADLINE_S, breaker_failures=2)
    server = lmcache(spec)
    assert server.store(seed=1, count=8)["ok"]
    daemon.signal(signal.SIGSTOP)
    try:
        for _ in range(3):  # the first waits a deadline; the breaker answers the rest
            stored = server.store(seed=2, count=8)
            assert finished_in_time(stored, "elapsed_s") and not stored["ok"], stored
            missed = server.load(seed=1, count=8)
            assert finished_in_time(missed, "lookup_s") and missed["found"] == 0, missed
        status = server.ask("status")
        assert status["is_healthy"] is False, status
    finally:
        daemon.signal(signal.SIGCONT)
    assert eventually_identical(server, seed=1, count=8), server.log()
    assert server.store(seed=2, count=8)["ok"]
    assert all_identical(server.load(seed=2, count=8), 8)
    assert server.ask("status")["is_healthy"] is True


async def test_a_killed_daemon_fails_tasks_at_once_and_its_successor_serves_the_disk_tier(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    cfg = config(tmp_path)
    daemon = await spawn(cfg)
    server = lmcache(adapter_json(daemon.socket_path, deadline_s=DEADLINE_S, reconnect_max_s=0.5))
    assert server.store(seed=1, count=8)["ok"]
    assert all_identical(server.load(seed=1, count=8), 8)  # pins, loads, unlocks
    await flush(daemon.socket_path)  # on the disk tier now
    daemon.signal(signal.SIGKILL)
    await daemon.wait()
    for _ in range(3):
        stored = server.store(seed=2, count=8)
        assert finished_in_time(stored, "elapsed_s") and not stored["ok"], stored
        missed = server.load(seed=1, count=8)
        assert finished_in_time(missed, "lookup_s") and missed["found"] == 0, missed
    await spawn(cfg)
    assert eventually_identical(server, seed=1, count=8), server.log()
    assert server.store(seed=2, count=8)["ok"]


# -- 4. objects of another size than the daemon's blocks -------------------------------------


async def test_objects_of_another_size_fail_their_tasks_and_say_what_to_set(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    server = lmcache(adapter_json(daemon.socket_path, deadline_s=DEADLINE_S), block=BLOCK // 2)
    stored = server.store(seed=1, count=4)
    assert stored["finished"] and not stored["ok"], stored
    loaded = server.load(seed=1, count=4)
    assert loaded["finished"] and loaded["found"] == 0, loaded
    assert f"`block_bytes: {BLOCK // 2}`" in server.log()
    # Said at start-up when adapter_params name the object size: every task then fails.
    named = lmcache(adapter_json(daemon.socket_path, block_bytes=BLOCK // 2), block=BLOCK // 2)
    assert f"`block_bytes: {BLOCK // 2}`" in named.log()
    assert named.ask("status")["refusal"] is not None
    assert not named.store(seed=1, count=4)["ok"]


async def test_a_daemon_of_several_sizes_serves_lmcache_at_the_size_it_names(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    daemon = await spawn(config(tmp_path, block_sizes=2))
    other = BLOCK * 2  # another size than the daemon's block_bytes
    server = lmcache(adapter_json(daemon.socket_path, block_bytes=other), block=other)
    assert server.ask("status")["refusal"] is None, server.log()
    stored = server.store(seed=1, count=4)
    assert stored["ok"] and stored["bytes"] == 4 * other, (stored, server.log())
    assert all_identical(server.load(seed=1, count=4), 4)
    async with await Client.connect(daemon.socket_path) as operator:
        sizes = (await operator.stats())["tenants"]["default"]["block_sizes"]
    assert sizes[str(other)]["tiers"][0]["stores"] == 4


# -- 4a. LMCache's per-adapter serde (fp8) on top of the adapter -----------------------------


FP8 = {"type": "fp8", "fp8_dtype": "float8_e4m3fn"}


def with_serde(spec: str, serde: dict[str, Any]) -> str:
    return json.dumps({**json.loads(spec), "serde": serde})


async def test_fp8_serde_wraps_the_adapter_and_the_daemon_stores_the_serialised_half(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    # `lmcache bench l2` builds the adapter without LMCache's serde wrapper (only its
    # storage manager wraps), so the driver wraps it the same way. bf16 objects of BLOCK
    # bytes serialise to BLOCK // 2 bytes of fp8: the daemon's blocks are that size.
    daemon = await spawn(config(tmp_path, BLOCK // 2))
    spec = with_serde(adapter_json(daemon.socket_path, namespace="fp8"), FP8)
    writer, reader = lmcache(spec), lmcache(spec)
    assert writer.ask("status")["serde_wrapped"] is True
    stored = writer.store(seed=1, count=8)
    assert stored["ok"] and stored["bytes"] == 8 * (BLOCK // 2), (stored, writer.log())
    loaded = reader.load(seed=1, count=8)
    assert loaded["finished"] and loaded["found"] == loaded["loaded"] == 8, loaded
    # Lossy: each object is the fp8 round trip of what was stored, within fp8's tolerance.
    assert loaded["identical"] == loaded["within"] == 8 and loaded["exact"] == 0, loaded
    assert reader.load(seed=2, count=4)["found"] == 0
    # A daemon sized to the raw objects refuses the serialised ones and names the size.
    (tmp_path / "raw").mkdir()
    raw = await spawn(config(tmp_path / "raw", BLOCK))
    spec = with_serde(adapter_json(raw.socket_path, deadline_s=DEADLINE_S), FP8)
    mis = lmcache(spec)
    assert not mis.store(seed=3, count=2)["ok"]
    assert f"`block_bytes: {BLOCK // 2}`" in mis.log(), mis.log()


# -- 4b. what is not interchangeable stays apart ----------------------------------------------


async def test_another_cache_salt_or_model_misses_and_gets_a_namespace_of_its_own(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    spec = adapter_json(daemon.socket_path, deadline_s=DEADLINE_S)
    alice, other = lmcache(spec), lmcache(spec)
    alice.ask("as_user", model=MODEL, salt="alice")
    assert alice.store(seed=1, count=6)["ok"]
    for model, salt in ((MODEL, "bob"), (MODEL, ""), ("org/other-7b", "alice")):
        other.ask("as_user", model=model, salt=salt)
        assert other.load(seed=1, count=6)["found"] == 0, (model, salt)
    other.ask("as_user", model=MODEL, salt="alice")
    assert all_identical(other.load(seed=1, count=6), 6)
    spaces = set(other.ask("status")["namespaces"])
    assert len(spaces) == 4 and all(s.startswith("lmcache/") for s in spaces), spaces
    # The same facts name the same namespace in every LMCache process.
    assert set(alice.ask("status")["namespaces"]) < spaces


# -- 5. locks pin blocks in the daemon until LMCache unlocks them ----------------------------


async def test_a_lock_pins_the_blocks_until_unlock_and_delete_goes_through_the_daemon(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    server = lmcache(adapter_json(daemon.socket_path, deadline_s=DEADLINE_S))
    assert server.store(seed=1, count=8)["ok"]
    (namespace,) = server.ask("status")["namespaces"]
    # The driver's keys: chunk hash seed * 1_000_003 + i, KV rank i % 2, group 0.
    raw = [block_key((1_000_003 + i).to_bytes(16, "big"), i % 2, 0) for i in range(8)]
    assert server.ask("lock", seed=1, count=8)["found"] == 8
    assert server.ask("status")["locked_keys"] == 8
    held = await delete_from(daemon.socket_path, namespace, raw)
    assert held["removed"] == 0 and held["busy"] == 8, held  # pinned: the daemon keeps them
    server.ask("unlock", seed=1, count=8)
    assert server.ask("status")["locked_keys"] == 0
    server.ask("delete", seed=1, count=8)  # through the daemon: gone for every server
    reader = lmcache(adapter_json(daemon.socket_path, deadline_s=DEADLINE_S))
    for _ in range(40):  # the delete is sent without waiting: bounded, no sleep
        if reader.load(seed=1, count=8)["found"] == 0:
            break
    else:
        raise AssertionError("the adapter's delete left the blocks in the daemon")


async def test_the_adapter_starts_inside_a_running_event_loop_as_lmcache_server_builds_it(
    tmp_path: Path, spawn: Any, lmcache: Any
) -> None:
    # `lmcache server` builds its L2 adapters in its HTTP frontend's start-up, on a running
    # event loop: the adapter's first contact with the daemon must not need a loop of its
    # own on that thread.
    daemon = await spawn(config(tmp_path))
    server = lmcache(adapter_json(daemon.socket_path, deadline_s=DEADLINE_S), in_loop=True)
    assert server.ask("status")["block_bytes"] == BLOCK, server.log()
    assert server.store(seed=1, count=4)["ok"]
    assert all_identical(server.load(seed=1, count=4), 4)


# -- 6. LMCache's MP server --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=log, env=child_env(), cwd="/")


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return dict(json.loads(reply.read()))


async def server_status(url: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """``GET /status`` of a starting ``lmcache server``, polled until it answers (start-up:
    nothing to wait on but the port); bounded by ANSWER_S, failing at once if it exits."""
    deadline = time.monotonic() + ANSWER_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"lmcache server exited with {proc.returncode}")
        try:
            return await asyncio.to_thread(get_json, url)
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"lmcache server did not answer {url} within {ANSWER_S} s")


async def test_lmcache_server_builds_the_adapter_from_the_documented_json(
    tmp_path: Path, spawn: Any
) -> None:
    daemon = await spawn(config(tmp_path))
    http_port = free_port()
    command = [str(LMCACHE_PYTHON), "-m", "lmcache.cli.main", "server"]
    command += ["--host", "127.0.0.1", "--port", str(free_port())]
    command += ["--http-host", "127.0.0.1", "--http-port", str(http_port)]
    command += ["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--disable-observability"]
    command += ["--l2-adapter", adapter_json(daemon.socket_path)]
    log_path = tmp_path / "lmcache-server.log"
    proc = start_server(command, log_path)
    try:
        status = await server_status(f"http://127.0.0.1:{http_port}/status", proc)
        (adapter,) = status["storage_manager"]["l2_adapters"]
        assert adapter["type"] == "tierd" and adapter["is_healthy"] is True, adapter
        assert adapter["block_bytes"] == BLOCK and adapter["refusal"] is None, adapter
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, ANSWER_S)
    assert "MPCacheServer closed" in log_path.read_text(), log_path.read_text()[-3000:]


# -- 7. the adapter's parts under faults, directly --------------------------------------------


def _space(tmp_path: Path, workers: int = 2, socket_path: str = "") -> Any:
    from tierd.integrations.lmcache.space import Space, SpaceSettings

    path = socket_path or str(tmp_path / "no-daemon.sock")
    return Space(SpaceSettings(path, "ns", BLOCK, 5.0, 3, 1.0, (), workers))


def test_a_closed_event_fd_is_never_written_again_whatever_reused_its_number() -> None:
    from tierd.integrations.lmcache.task_book import Book, StoreOutcome

    book = Book()
    task = book.new_task()
    number = book.store_events.fd
    reader, writer = os.pipe()
    book.close()
    reused = os.dup(writer)  # the lowest free number: the store fd's comes back
    try:
        book.stored(task, StoreOutcome(True, 1))
        os.set_blocking(reader, False)
        with pytest.raises(BlockingIOError):
            os.read(reader, 64)  # nothing was written into the pipe
        assert reused == number
    finally:
        for fd in (reader, writer, reused):
            os.close(fd)


def test_a_lease_chunk_leaves_room_for_every_worker_and_the_request_bound(
    tmp_path: Path,
) -> None:
    space = _space(tmp_path, workers=2)
    try:
        space.lease_bound, space.request_bound = 400, 0
        assert space.chunk() == 100  # locks, two workers' leases and a spare: 4 x 100
        space.lease_bound, space.request_bound = 0, 64
        assert space.chunk() == 64
        space.lease_bound, space.request_bound = 3, 0
        assert space.chunk() == 1  # at least one key
    finally:
        space.close()


def test_an_unlock_during_a_load_keeps_the_pins_lease_until_the_copy_is_done(
    tmp_path: Path,
) -> None:
    from tierd.integrations.lmcache.space import LeaseShare, Pin
    from tierd.integrations.lmcache.tasks import Tasks

    class Settings:
        namespace, block_bytes, deadline_s, breaker_failures = "ns", BLOCK, DEADLINE_S, 3
        reconnect_max_s, server_uids, max_namespaces, workers = 1.0, (), 4, 2

    class Key:
        chunk_hash, model_name, kv_rank, object_group_id, cache_salt = b"k", MODEL, 0, 0, ""

    class Obj:
        byte_array = bytearray(BLOCK)

        def get_size(self) -> int:
            return BLOCK

    class Lease:
        count, keys, slots = 1, [b"k"], [0]

    tasks = Tasks(Settings(), str(tmp_path / "no-daemon.sock"))
    tasks.block_bytes = BLOCK
    key = Key()
    space = tasks._space(key, BLOCK)
    hold = LeaseShare(Lease(), None, space.link.connects)  # type: ignore[arg-type]
    tasks._locks[key].append((space, Pin(hold, 0)))
    released: list[LeaseShare] = []
    lefts: list[int] = []
    space._release = released.append  # type: ignore[method-assign]

    def load(raw: Any, targets: Any, pins: Any, expires: float) -> list[bool]:
        tasks.unlock([key])  # LMCache unlocks while the load copies
        lefts.append(hold.left)
        return [True]

    space.load = load  # type: ignore[method-assign]
    try:
        assert tasks.load([key], [Obj()], time.monotonic() + 1) == [True]
        assert lefts == [1] and released == [hold]  # released after the copy, not before
    finally:
        tasks.close()


async def test_a_deadline_passing_during_a_stores_copy_aborts_its_reservation(
    tmp_path: Path, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierd.control.clients.handshake import DaemonSilent
    from tierd.integrations.core import link as link_module
    from tierd.integrations.lmcache import space as lmcache_space

    limits = {"lease_blocks_per_connection": 1, "store_lease_ttl_s": 600}
    daemon = await spawn(config(tmp_path, limits=limits))
    skew = [0.0]
    copy = lmcache_space.copy_bytes

    def slow_copy(dst: Any, src: Any) -> None:  # the copy outlasts the task's deadline
        copy(dst, src)
        skew[0] += 100.0

    clock = type("Clock", (), {"monotonic": staticmethod(lambda: time.monotonic() + skew[0])})
    monkeypatch.setattr(lmcache_space, "time", clock)
    monkeypatch.setattr(link_module, "time", clock)  # the link's bounded ask reads it too
    monkeypatch.setattr(lmcache_space, "copy_bytes", slow_copy)
    space = _space(tmp_path, socket_path=daemon.socket_path)
    try:
        block = bytes(BLOCK)
        with pytest.raises(DaemonSilent):
            await asyncio.to_thread(space.store, [b"a"], [block], time.monotonic() + 5)
        skew[0] = -100.0  # the next copy is in time
        # The connection may hold one block: the reservation of b"a" was given back.
        stored = await asyncio.to_thread(space.store, [b"b"], [block], time.monotonic() + 5)
        assert stored == BLOCK
    finally:
        space.close()


async def test_a_busy_daemon_at_the_first_hello_is_asked_again_not_refused_for_good(
    tmp_path: Path, spawn: Any
) -> None:
    from tierd.client import Unreachable
    from tierd.integrations.lmcache.tasks import Tasks

    class Settings:
        namespace, block_bytes, deadline_s, breaker_failures = "ns", None, 5.0, 3
        reconnect_max_s, server_uids, max_namespaces, workers = 1.0, (), 4, 2

    daemon = await spawn(config(tmp_path, limits={"max_connections": 1}))
    tasks = Tasks(Settings(), daemon.socket_path)
    other = await Client.connect(daemon.socket_path)  # the only connection allowed
    try:
        with pytest.raises(Unreachable):
            await asyncio.to_thread(tasks._probe, time.monotonic() + 5)
        assert tasks.refusal is None
    finally:
        await other.close()
    tasks._probed = 0.0  # asked again now, not a second later
    assert await asyncio.to_thread(tasks._probe, time.monotonic() + 5) == BLOCK
    tasks.close()
