"""tierd's pool as every vLLM engine's CPU tier (issue 58), proven with vLLM's CPU build
generating in real engine processes beside real ``tierd serve`` processes.

Each engine is a ``run_engine.py --pool`` process: vLLM's ``OffloadingConnector`` with
``TierdPoolSpec`` (no CPU region of vLLM's own: the engine's copies go straight between
its KV cache and rows of the daemon's mapped pool). A stall is a real SIGSTOP of the
process, placed with ``--freeze`` just before its first copy of a store or a load; the
daemon is stopped, killed and restarted with signals. Each check is one of issue 58's
proof (shared at once, held once, bit for bit, evictions to disk and back, restarts,
faults mid-transfer, events) or issue 57's item 0 under vLLM. The model is the tiny
random Llama of ``make_tiny_llama.py``: 2 layers, 2 KV heads, rows of 32 KiB.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_kit import Spawn
from vllm_e2e_kit import (
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    PROMPT_TOKENS,
    ROW_BYTES,
    VLLM_PYTHON,
    tier_stats,
    vllm_env,
)

from tierd.client import Client
from tierd.testing import daemon_config

pytestmark = [
    pytest.mark.vllm_e2e,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"{VLLM_PYTHON} is missing"),
]

# Reservations of a loaded 2-core machine may take a while: a store the engine skips
# for want of an answer would fail the proof for the wrong reason.
SLOW_OK = ("--tierd", "job_deadline_s=2", "--tierd", "load_deadline_s=5")
STOPPED_S = 60.0  # a liveness bound for a process to show up stopped


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama-2x2"
    command = [str(VLLM_PYTHON), str(HERE / "make_tiny_llama.py"), "--model", str(path), "2", "2"]
    done = subprocess.run(
        command, env=vllm_env(), capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return path


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(58)
    ids = [4 + rng.randrange(250) for _ in range(PROMPT_TOKENS)]
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_text(" ".join(map(str, ids)))
    return path


class EngineProcess:
    """One ``run_engine.py`` process, its JSON lines read as they come (so a test can act
    between its steps)."""

    def __init__(self, tmp_path: Path, name: str, argv: list[str]) -> None:
        self.name = name
        self.log = tmp_path / f"vllm-{name}.log"
        self._stderr = self.log.open("w")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(HERE / "run_engine.py"), *argv],
            env=vllm_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.steps: dict[str, dict[str, Any]] = {}
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                step = json.loads(line)
                with self._seen:
                    self.steps[step["step"]] = step
                    self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    async def step(self, name: str) -> dict[str, Any]:
        """The line of step ``name``, once printed (bounded)."""

        def wait() -> dict[str, Any] | None:
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            with self._seen:
                while name not in self.steps and self.proc.poll() is None:
                    if not self._seen.wait(timeout=max(0.0, deadline - time.monotonic())):
                        break
                return self.steps.get(name)

        found = await asyncio.to_thread(wait)
        assert found is not None, f"engine {self.name} printed no {name}:\n{self.tail()}"
        return found

    def is_stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP: ``T`` in /proc)."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    async def stopped(self) -> None:
        """Until the process is stopped, bounded."""
        for _ in range(int(STOPPED_S / 0.05)):
            if self.is_stopped():
                return
            assert self.proc.poll() is None, f"engine {self.name} exited:\n{self.tail()}"
            await asyncio.sleep(0.05)
        raise AssertionError(f"engine {self.name} never stopped:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    async def done(self) -> int:
        code = await asyncio.to_thread(self.proc.wait, ENGINE_TIMEOUT_S)
        self._stderr.close()
        return code

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


async def engine(
    tmp_path: Path, name: str, model: Path, socket: str, prompt: Path, steps: str, *extra: str
) -> EngineProcess:
    argv = [str(model), "--socket", socket, "--prompt-file", str(prompt), "--steps", steps]
    return EngineProcess(tmp_path, name, [*argv, *extra])


async def run(
    tmp_path: Path,
    name: str,
    model: Path,
    socket: str,
    prompt: Path,
    steps: str,
    *extra: str,
) -> dict[str, dict[str, Any]]:
    """One engine through ``steps`` to its exit: its lines by step."""
    process = await engine(tmp_path, name, model, socket, prompt, steps, *extra)
    code = await process.done()
    assert code == 0, f"engine {name} exited {code}:\n{process.tail()}"
    assert list(process.steps) == steps.split(","), process.tail()
    return process.steps


def pool(*extra: str) -> tuple[str, ...]:
    return ("--pool", *SLOW_OK, *extra)


def rows(tmp_path: Path, cpu_blocks: int, disk_blocks: int | None = None) -> dict[str, Any]:
    """A daemon of this model's rows: ``cpu_blocks`` of pool over an optional disk tier."""
    return daemon_config(
        tmp_path, cpu_blocks=cpu_blocks, disk_blocks=disk_blocks, block_bytes=ROW_BYTES
    )


async def held(socket: str) -> tuple[int, int, int, int]:
    """The daemon's CPU tier: (pinned, writing, quarantined) and the blocks leases hold."""
    async with await Client.connect(socket) as client:
        stats = await client.stats()
    cpu = stats["tiers"][0]
    return cpu["pinned"], cpu["writing"], cpu["quarantined"], stats["leases"]["leases_held_blocks"]


async def until_released(socket: str) -> tuple[int, int, int, int]:
    """Until the daemon holds nothing for any engine (it has read their closes), bounded."""
    for _ in range(int(STOPPED_S / 0.05)):
        if (found := await held(socket)) == (0, 0, 0, 0):
            break
        await asyncio.sleep(0.05)
    return found


async def test_a_prefix_one_engine_computed_is_another_engines_cpu_tier_hit_held_once(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt: Path,
) -> None:
    """Engine A computes the prompt; engine B, another process that never saw it, is
    served its whole prefix from the pool, with tokens bit-identical to a CPU-tier hit of
    vLLM's own, to A's and to plain vLLM's (no offloading); neither maps a CPU region of
    vLLM's own, both map tierd's pool; the daemon holds each block once. A's reset
    empties vLLM's caches, not the node's pool: its next request is served from it too."""
    daemon = await spawn(rows(tmp_path, 64))
    sock = daemon.socket_path
    own, first = await asyncio.gather(
        # vLLM's own CPU tier (no tierd): cold, its prefix cache emptied, then its CPU hit.
        run(tmp_path, "own-cpu-tier", model, "", prompt, "cold,resetgpu,warm"),
        run(tmp_path, "a", model, sock, prompt, "cold,maps,reset,warm", *pool()),
    )
    assert own["warm"]["num_cached_tokens"] == PREFIX_TOKENS
    assert first["cold"]["num_cached_tokens"] == 0
    assert first["warm"]["num_cached_tokens"] == PREFIX_TOKENS
    second, plain = await asyncio.gather(
        run(tmp_path, "b", model, sock, prompt, "gen,maps", *pool()),
        run(tmp_path, "plain", model, "", prompt, "gen", "--plain"),  # no offloading at all
    )
    assert second["gen"]["num_cached_tokens"] == PREFIX_TOKENS
    assert second["gen"]["token_ids"] == own["warm"]["token_ids"]  # a CPU-tier hit, bit for bit
    assert second["gen"]["token_ids"] == first["cold"]["token_ids"] == plain["gen"]["token_ids"]
    for maps in (first["maps"], second["maps"]):
        assert maps["vllm_regions"] == [] and len(maps["tierd_pools"]) == 1
    cpu = (await tier_stats(daemon))["cpu"]
    assert (cpu["used"], cpu["stores"]) == (PREFIX_BLOCKS, PREFIX_BLOCKS)  # once on the node
    assert await until_released(sock) == (0, 0, 0, 0)


async def test_the_pool_full_demotes_to_disk_and_a_restart_keeps_the_blocks(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt: Path,
) -> None:
    """Three prompts (18 blocks) through an 8-row pool over a disk tier: the daemon's
    policy evicts and demotes; after a clean restart a fresh engine is served every
    prefix (from disk, promoted into the pool before its copy) with the same tokens."""
    config = rows(tmp_path, 8, disk_blocks=64)
    daemon = await spawn(config)
    sock = daemon.socket_path
    steps = "gen,shift50,shift100"
    first = await run(tmp_path, "filler", model, sock, prompt, steps, *pool())
    tiers = await tier_stats(daemon)
    # Each block once on the node: the pool's eight, the ten it demoted on the disk.
    assert (tiers["cpu"]["used"], tiers["disk"]["used"]) == (8, 3 * PREFIX_BLOCKS - 8)
    assert tiers["cpu"]["evictions"] == tiers["disk"]["stores"] == 3 * PREFIX_BLOCKS - 8
    daemon.signal(signal.SIGTERM)  # the clean stop writes the pool's blocks down
    assert await daemon.wait() == 0
    again = await spawn(config)
    assert (await tier_stats(again))["disk"]["used"] == 3 * PREFIX_BLOCKS
    second = await run(tmp_path, "after-restart", model, sock, prompt, steps, *pool())
    for step in steps.split(","):
        assert second[step]["num_cached_tokens"] == PREFIX_TOKENS, step
        assert second[step]["token_ids"] == first[step]["token_ids"], step
    assert (await tier_stats(again))["disk"]["hits"] >= PREFIX_BLOCKS


async def test_an_engine_stopped_past_its_store_lease_never_writes_into_another_engines_rows(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt: Path,
) -> None:
    """Issue 57, item 0, under vLLM: engine A is stopped (SIGSTOP) just before copying a
    store into the rows tierd reserved for it, past its store lease; engine B then stores
    another prompt into a pool with no unused row; A resumes and copies into its rows.
    Those rows were never given to B (the lease's expiry ends A's right to commit, not
    its rows' quarantine), so a third engine is served B's prefix with B's tokens, and A's
    late store is not served. Then an engine killed (SIGKILL) while stopped the same way
    gives every row back."""
    config = rows(tmp_path, 2 * PREFIX_BLOCKS)
    config["limits"]["store_lease_ttl_s"] = 1.0
    daemon = await spawn(config)
    sock = daemon.socket_path
    gate = tmp_path / "gate"
    steps = "gen,gate,shift50"
    b = await engine(tmp_path, "b", model, sock, prompt, steps, *pool("--gate", str(gate)))
    await b.step("gen")  # half the pool: B's first prompt
    a = await engine(tmp_path, "a", model, sock, prompt, "shift100", *pool("--freeze", "store"))
    try:
        await a.stopped()  # A's rows reserved: the other half of the pool
        await asyncio.sleep(2.0)  # past store_lease_ttl_s
        gate.touch()
        b_late = await b.step("shift50")  # B's second prompt: no row left unused
    finally:
        a.signal(signal.SIGCONT)
    assert await a.done() == 0, a.tail()
    assert await b.done() == 0, b.tail()
    assert b_late["num_cached_tokens"] == 0
    reader = await run(tmp_path, "reader", model, sock, prompt, "shift50,shift100", *pool())
    assert reader["shift50"]["num_cached_tokens"] == PREFIX_TOKENS
    assert reader["shift50"]["token_ids"] == b_late["token_ids"]
    assert reader["shift100"]["num_cached_tokens"] == 0  # A's store came too late: not kept
    assert reader["shift100"]["token_ids"] == a.steps["shift100"]["token_ids"]
    async with await Client.connect(sock) as client:
        assert (await client.stats())["leases"]["leases_expired"] >= 1

    frozen = pool("--freeze", "store")
    killed = await engine(tmp_path, "killed", model, sock, prompt, "shift150", *frozen)
    await killed.stopped()
    assert (await held(sock))[1] > 0  # its reservation, being written
    killed.signal(signal.SIGKILL)
    assert await killed.done() == -signal.SIGKILL
    assert await until_released(sock) == (0, 0, 0, 0)


async def test_an_engine_stopped_in_a_load_keeps_its_rows_through_pressure_and_a_daemon_restart(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt: Path,
) -> None:
    """Engine A, a HIT in hand, is stopped just before copying its rows out of the pool;
    engine B meanwhile stores two other prompts through the rest of the pool, then the
    daemon is killed (SIGKILL) and restarted empty. A resumes: its load copies the bytes
    its HIT promised (the pinned rows were never reused, and the dead daemon's pool,
    still mapped in A, is written by nobody), so its tokens are the prompt's; its next
    request goes to the new daemon (a miss, stored again), and the one after is a hit."""
    config = rows(tmp_path, 2 * PREFIX_BLOCKS)
    daemon = await spawn(config)
    sock = daemon.socket_path
    computed = await run(tmp_path, "writer", model, sock, prompt, "gen", *pool())
    steps = "gen,resetgpu,again,resetgpu2,again2"  # vLLM's own prefix cache emptied between
    a = await engine(tmp_path, "a", model, sock, prompt, steps, *pool("--freeze", "load"))
    try:
        await a.stopped()
        assert (await held(sock))[0] == PREFIX_BLOCKS  # A's pins
        pressure = await run(tmp_path, "pressure", model, sock, prompt, "shift50,shift100", *pool())
        assert pressure["shift100"]["num_cached_tokens"] == 0
        assert (await held(sock))[0] == PREFIX_BLOCKS  # never given up under the pressure
        daemon.signal(signal.SIGKILL)
        assert await daemon.wait() != 0
        again = await spawn(config)
    finally:
        a.signal(signal.SIGCONT)
    assert await a.done() == 0, a.tail()
    served = a.steps
    assert served["gen"]["num_cached_tokens"] == PREFIX_TOKENS
    assert served["gen"]["token_ids"] == computed["gen"]["token_ids"]
    assert served["again"]["num_cached_tokens"] == 0  # the new daemon started empty
    assert served["again"]["token_ids"] == computed["gen"]["token_ids"]
    assert served["again2"]["num_cached_tokens"] == PREFIX_TOKENS  # from the new pool
    assert served["again2"]["token_ids"] == computed["gen"]["token_ids"]
    assert await until_released(again.socket_path) == (0, 0, 0, 0)


async def test_a_stopped_daemon_costs_a_deadline_and_every_removal_is_a_cpu_event(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt: Path,
) -> None:
    """With the daemon stopped (SIGSTOP) a request costs at most the lookup's deadline
    and is computed (the same tokens); once resumed the breaker closes and the prefix is
    a hit again. The engine's KV events say CPU for tierd's pool: a stored event for each
    block it stored, a removed one for each the daemon then dropped (a 6-row pool, no
    disk: every later prompt evicts the one before)."""
    config = rows(tmp_path, PREFIX_BLOCKS)
    daemon = await spawn(config)
    steps = "cold,sigstop,resetgpu1,hung,sigcont,breaker,resetgpu2,back,shift50,shift100,drain"
    extra = pool("--daemon-pid", str(daemon.pid), "--kv-events")
    try:
        out = await run(tmp_path, "events", model, daemon.socket_path, prompt, steps, *extra)
    finally:
        daemon.signal(signal.SIGCONT)
    cold = out["cold"]
    assert out["hung"]["num_cached_tokens"] == 0 and out["hung"]["token_ids"] == cold["token_ids"]
    assert out["hung"]["seconds"] < 20.0  # a liveness bound: a few deadlines, not a hang
    assert out["breaker"]["closed"] is True
    assert out["back"]["num_cached_tokens"] == PREFIX_TOKENS
    assert out["back"]["token_ids"] == cold["token_ids"]
    drained = out["drain"]
    assert drained["stored"]["CPU"]["0"] == 3 * PREFIX_BLOCKS
    assert drained["removed"]["CPU"]["0"] == 2 * PREFIX_BLOCKS == drained["drops"]


DP_READY_S = 600.0  # an API server and two engine cores on a loaded 2-core machine


async def test_two_data_parallel_replicas_of_one_server_share_the_pool(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt: Path,
) -> None:
    """vLLM's OpenAI server with ``--data-parallel-size 2`` (two engine cores, their
    workers in processes of their own, which map the pool themselves): a prompt one
    replica computed is a CPU-tier hit for the other, with the same text, held once."""
    daemon = await spawn(rows(tmp_path, 64))
    port = _free_port()
    config = json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TierdPoolSpec",
                "spec_module_path": "tierd.integrations.vllm.pool_spec",
                "tierd": {"socket": daemon.socket_path, "job_deadline_s": 2},
            },
        }
    )
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(model), "--data-parallel-size", "2", "--dtype", "bfloat16"]
    command += ["--block-size", "32", "--max-model-len", "2048", "--enforce-eager"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", config]
    log = tmp_path / "vllm-dp.log"
    server = await asyncio.to_thread(_start, command, log)
    try:
        await asyncio.to_thread(_until_serving, port, server, log)
        ids = [int(t) for t in (await asyncio.to_thread(prompt.read_text)).split()]
        texts, hits = [], 0
        for _ in range(8):  # bounded: until a request lands on the replica that did not
            texts.append(await asyncio.to_thread(_complete, port, str(model), ids))
            hits = (await tier_stats(daemon))["cpu"]["hits"]
            if hits:
                break
        assert hits == PREFIX_BLOCKS, texts  # the other replica's, from the pool
        assert len(set(texts)) == 1, texts
        cpu = (await tier_stats(daemon))["cpu"]
        assert (cpu["used"], cpu["stores"]) == (PREFIX_BLOCKS, PREFIX_BLOCKS)  # held once
    finally:
        server.terminate()  # vLLM's server stops its engine cores and their workers
        try:
            await asyncio.to_thread(server.wait, 60)
        except subprocess.TimeoutExpired:
            server.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """vLLM's server, its own processes' multiprocessing on (its engine cores)."""
    env = {k: v for k, v in vllm_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with log.open("w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _until_serving(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + DP_READY_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise AssertionError(f"the server never served:\n{log.read_text()[-4000:]}")


def _complete(port: int, model: str, ids: list[int]) -> str:
    import urllib.request

    body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=ENGINE_TIMEOUT_S) as answer:
        return str(json.load(answer)["choices"][0]["text"])
