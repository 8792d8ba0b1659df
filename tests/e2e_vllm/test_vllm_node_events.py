"""Every engine's own KV event stream announces the node's blocks (issue 59, mode a).

Two engines of vLLM's CPU build on one daemon, each turned on by ``TIERD`` alone (tierd's
pool is their CPU tier, through ``TierdConnector``), each publishing its KV events through
its own zmq publisher. Engine A computes a prompt and exits: its blocks are in tierd,
described (A's KV events told tierd what each is). Engine B, started afterwards, never
computes that prompt; yet its own stream carries A's blocks, fully described (A's hashes,
parent, tokens, block size), medium ``CPU``, from its first step. When tierd lets them go,
B's stream says so at B's next step. SMG's relay (its gateway as it runs in SMG, on B's
publisher and replay socket) credits B with A's blocks, then with none of them; so does
NVIDIA Dynamo's standalone KV indexer (B's publisher registered as its worker, with B's
replay socket and block size), from the tokens: A's prefix in tierd's CPU tier, none of
it on B's GPU, then none of it.

About two minutes on 2 cores; skipped, saying why, where vLLM's CPU build, SMG's relay,
Dynamo's indexer or ``unshare -rn`` is missing (``TIERD_REQUIRE_ENGINES=1`` turns a skip
into a failure).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_kit import Spawn
from kv_events_kit import DRIVER, DYNAMO_PYTHON, SMG_PYTHON, unshare_works
from vllm_e2e_kit import (
    BLOCK_TOKENS,
    E2E_MARKS,
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    ROOT,
    ROW_BYTES,
    VLLM_PYTHON,
    listening,
    replay,
    stored,
    vllm_env,
)

from tierd.client import Client
from tierd.testing import daemon_config, poll_until

pytestmark = E2E_MARKS

WAIT_S = 60.0  # the longest the test waits for an event to travel

# One engine, TIERD in its environment, its KV events through zmq: steps "shift<k>"
# (generate the prompt rotated by k tokens), "gate:<path>" (wait for the file, stepping:
# an idle engine takes no events, the node's included) and "wait:<path>" (wait for the
# file without a step: nothing published until then).
ENGINE = """
import os, sys, time
from run_engine import emit
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.config import KVEventsConfig

model, prompt_file, endpoint, replay, steps = sys.argv[1:6]
events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                        replay_endpoint=replay)
llm = LLM(model=model, tokenizer=model, dtype="bfloat16", block_size=32, max_model_len=2048,
          max_num_seqs=4, max_num_batched_tokens=2048, enforce_eager=True,
          enable_prefix_caching=True, seed=0, distributed_executor_backend="uni",
          kv_events_config=events)
config = llm.llm_engine.vllm_config.kv_transfer_config
emit({"step": "config", "connector": config.kv_connector})
ids = [int(t) for t in open(prompt_file).read().split()]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
tick = SamplingParams(temperature=0.0, max_tokens=1)
for step in steps.split(","):
    if step.startswith("wait:"):
        deadline = time.monotonic() + 300
        while not os.path.exists(step[5:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        emit({"step": step, "opened": os.path.exists(step[5:])})
        continue
    if step.startswith("gate:"):  # the engine keeps stepping (its events are taken at
        deadline = time.monotonic() + 300  # steps): a prompt of no full block, one token
        while not os.path.exists(step[5:]) and time.monotonic() < deadline:
            llm.generate(TokensPrompt(prompt_token_ids=ids[:8]), tick, use_tqdm=False)
            time.sleep(0.05)
        emit({"step": step, "opened": os.path.exists(step[5:])})
        continue
    k = int(step.removeprefix("shift"))
    (out,) = llm.generate(TokensPrompt(prompt_token_ids=ids[k:] + ids[:k]), params,
                          use_tqdm=False)
    emit({"step": step, "cached": out.num_cached_tokens})
"""


def engine(
    tmp_path: Path, name: str, weights: Path, prompt: Path, steps: str, socket_path: str
) -> subprocess.Popen[str]:
    """One engine process (see ENGINE), publishing at ``ipc://<tmp>/<name>-pub``."""
    command = [str(VLLM_PYTHON), "-c", ENGINE, str(weights), str(prompt)]
    command += [f"ipc://{tmp_path}/{name}-pub", f"ipc://{tmp_path}/{name}-replay", steps]
    return subprocess.Popen(
        command,
        env=vllm_env() | {"TIERD": socket_path},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / f"vllm-{name}.log").open("w"),
        text=True,
        cwd=HERE,
    )


def lines_of(proc: subprocess.Popen[str], tmp_path: Path, name: str) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    log = (tmp_path / f"vllm-{name}.log").read_text(errors="replace")
    assert proc.returncode == 0, f"engine {name} exited {proc.returncode}:\n{log[-6000:]}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {line["step"]: line for line in lines if "step" in line}  # vLLM logs there too


def wait_for(check: Any, what: str) -> Any:
    """Poll ``check()`` (bounded) until it returns something true; that."""
    return poll_until(check, WAIT_S, what, every_s=0.1)


def held_by_node(batches: list[Any], medium: str) -> dict[Any, dict[str, Any]]:
    """What ``batches`` (a stream) says is held on ``medium``, by hash: the event."""
    held: dict[Any, dict[str, Any]] = {}
    for batch in batches:
        for event in batch[1]:
            if not isinstance(event, dict) or event.get("medium") != medium:
                continue
            for h in event.get("block_hashes", ()):
                if event["type"] == "BlockStored":
                    held[h] = event
                elif event["type"] == "BlockRemoved":
                    held.pop(h, None)
    return held


class Gateway:
    """SMG's relay, as SMG's gateway runs it, on one engine's publisher."""

    def __init__(self, tmp_path: Path, pub: str, replay_endpoint: str) -> None:
        self.state = tmp_path / "gateway.json"
        self.log = tmp_path / "gateway.log"
        argv = [str(SMG_PYTHON), str(ROOT / "tests" / "smg_gateway.py"), pub, replay_endpoint]
        self.proc = subprocess.Popen(
            [*argv, str(self.state)],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
            cwd="/",
        )

    def held(self) -> set[Any]:
        """The hashes SMG credits the engine with, as the engine publishes them (SMG keeps
        vLLM's 64-bit hashes as signed integers)."""
        if not self.state.exists():
            return set()
        return {h & (1 << 64) - 1 for h in json.loads(self.state.read_text())["held"]}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Indexer:
    """NVIDIA Dynamo's standalone KV indexer on one engine's publisher, the engine its
    worker 1 (tests/dynamo_driver.py ``--follow``, in a private network namespace: the
    engine's ipc sockets are files, which the namespace does not hide)."""

    def __init__(
        self, tmp_path: Path, pub: str, replay_endpoint: str, queries: dict[str, list[int]]
    ) -> None:
        self.work = tmp_path / "dynamo"
        self.work.mkdir()
        spec: dict[str, Any] = {"endpoint": pub, "replay_endpoint": replay_endpoint}
        spec |= {"block_size": BLOCK_TOKENS, "queries": queries}
        (self.work / "follow.json").write_text(json.dumps(spec))
        self.state = self.work / "follow-state.json"
        argv = ["unshare", "-rn", sys.executable, str(DRIVER), str(DYNAMO_PYTHON)]
        self.proc = subprocess.Popen(
            [*argv, str(self.work), "--follow"],
            stdout=subprocess.DEVNULL,
            stderr=(self.work / "driver.log").open("wb"),
            cwd=ROOT,
        )

    def matched(self, name: str) -> dict[str, int]:
        """Worker 1's tokens matched in the indexer's last answer to query ``name``
        (``longest_matched``, ``gpu``, ``cpu``, ``disk``; 0 where it credits none)."""
        answer = json.loads(self.state.read_text())["answers"][name] if self.state.exists() else {}
        mine = answer.get("instances", {}).get("1", {}) if isinstance(answer, dict) else {}
        fields = ("longest_matched", "gpu", "cpu", "disk")
        return {field: int(mine.get(field, 0)) for field in fields}

    def connected(self) -> bool:
        """Whether the indexer's socket is connected to the engine's publisher."""
        state = json.loads(self.state.read_text()) if self.state.exists() else {}
        return int(state.get("connected", 0)) > 0

    def wait_for(self, check: Any, what: str) -> Any:
        """``wait_for``, with the indexer's log and last answers when it fails."""
        try:
            return wait_for(check, what)
        except AssertionError as exc:
            log = self.work / "indexer.log"
            said = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
            answers = self.state.read_text()[-2000:] if self.state.exists() else "(none)"
            raise AssertionError(f"{exc}\nanswers: {answers}\nindexer: {said}") from None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def test_an_engine_announces_the_blocks_another_engine_left_in_tierd(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt_file: Path,
) -> None:
    if not SMG_PYTHON.is_file():
        pytest.skip(f"SMG's relay is not installed ({SMG_PYTHON} missing): run scripts/setup_smg")
    if not DYNAMO_PYTHON.exists():
        pytest.skip(f"Dynamo's indexer is not installed ({DYNAMO_PYTHON} missing)")
    if not unshare_works():
        pytest.skip("Dynamo's indexer: `unshare -rn` (a private network namespace) does not work")
    config = daemon_config(
        tmp_path,
        cpu_blocks=64,
        disk_blocks=None,
        block_bytes=ROW_BYTES,
        kv_events={"enabled": True},
    )
    daemon = await spawn(config)
    sock = daemon.socket_path
    async with await Client.connect(sock) as operator:
        node_replay = (await operator.stats())["kv_events"]["replay_endpoint"]

    # Engine A computes the prompt; its blocks reach tierd, described.
    a_gate = tmp_path / "a-done"
    a = engine(tmp_path, "a", model, prompt_file, f"shift0,gate:{a_gate}", sock)

    def described() -> dict[Any, dict[str, Any]] | None:
        held = held_by_node(replay(node_replay), "CPU")
        return held if len(held) >= PREFIX_BLOCKS else None

    try:
        node = await asyncio.to_thread(wait_for, described, "tierd announcing A's blocks")
    finally:
        a_gate.touch()
    out_a = await asyncio.to_thread(lines_of, a, tmp_path, "a")
    assert out_a["config"]["connector"] == "TierdConnector"
    assert out_a["shift0"]["cached"] == 0
    prompt = [int(t) for t in (await asyncio.to_thread(prompt_file.read_text)).split()]
    a_hashes = list(node)
    assert len(a_hashes) == PREFIX_BLOCKS
    assert sorted(t for e in node.values() for t in e["token_ids"]) == sorted(
        prompt[:PREFIX_TOKENS]
    )

    # Engine B: its own stream, and SMG's gateway on it.
    b_pub, b_replay = f"ipc://{tmp_path}/b-pub", f"ipc://{tmp_path}/b-replay"
    started, gone, end = tmp_path / "started", tmp_path / "gone", tmp_path / "end"
    gateway = Gateway(tmp_path, b_pub, b_replay)
    b7 = prompt[7:] + prompt[:7]
    queries = {"a": prompt[:PREFIX_TOKENS], "b": b7[:PREFIX_TOKENS]}
    indexer = Indexer(tmp_path, b_pub, b_replay, queries)
    try:
        with listening(b_pub) as b_batches:
            steps = f"wait:{started},shift7,gate:{gone},shift13,gate:{end}"
            b = engine(tmp_path, "b", model, prompt_file, steps, sock)
            try:
                # B publishes nothing until Dynamo's indexer is connected to it. The
                # indexer asks for a replay only when a live batch's sequence shows a gap,
                # and its zmq socket, dialing before B binds, retries with a back-off (up
                # to 5 s): B's first batches went out before it was connected, B idled (no
                # batch), and the indexer held nothing of B's until B's next batch, after
                # tierd had evicted A's blocks. (This test's socket retries every 0.1 s;
                # SMG's relay asks for a replay from 0 when it subscribes.)
                await asyncio.to_thread(
                    indexer.wait_for, indexer.connected, "Dynamo's indexer connected to B"
                )
                started.touch()
                b_cpu = await asyncio.to_thread(
                    wait_for,
                    lambda: (h := held_by_node(b_batches, "CPU")) and set(a_hashes) <= set(h) and h,
                    "A's blocks in B's stream",
                )
                # Fully described, as tierd (and A) described them.
                for h in a_hashes:
                    ours, theirs = b_cpu[h], node[h]
                    for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
                        assert ours[field] == theirs[field], (field, ours, theirs)
                got = [t for h in a_hashes for t in b_cpu[h]["token_ids"]]
                assert sorted(got) == sorted(prompt[:PREFIX_TOKENS])
                assert all(b_cpu[h]["block_size"] == BLOCK_TOKENS for h in a_hashes)
                # SMG's relay credits B with A's blocks.
                await asyncio.to_thread(
                    wait_for, lambda: set(a_hashes) <= gateway.held(), "SMG crediting B"
                )
                # So does Dynamo's indexer, from the tokens: A's prompt is B's, in tierd's
                # CPU tier (Dynamo's host_pinned), none of it on B's GPU.
                a_credit = await asyncio.to_thread(
                    indexer.wait_for,
                    lambda: (m := indexer.matched("a"))["longest_matched"] == PREFIX_TOKENS and m,
                    "Dynamo crediting B",
                )
                assert a_credit["cpu"] == PREFIX_TOKENS and a_credit["gpu"] == 0, a_credit
                await asyncio.to_thread(  # and B's own blocks, on its GPU
                    indexer.wait_for,
                    lambda: indexer.matched("b")["gpu"] == PREFIX_TOKENS,
                    "Dynamo crediting B's GPU blocks",
                )
                # tierd lets A's blocks go (another client fills the pool).
                async with await Client.connect(sock) as operator:
                    rows = (await operator.namespaces())["default"]
                (namespace,) = [r["namespace"] for r in rows if r["blocks"].get("cpu")]
                async with await Client.connect(sock, namespace=namespace) as filler:
                    junk = [f"junk-{i}".encode() for i in range(64)]
                    for at in range(0, 64, 16):
                        part = junk[at : at + 16]
                        await filler.store(part, [bytes(ROW_BYTES)] * len(part))
                await asyncio.to_thread(
                    wait_for,
                    lambda: not set(a_hashes) & set(held_by_node(replay(node_replay), "CPU")),
                    "tierd removing A's blocks",
                )
                gone.touch()  # B steps again: its stream takes the removals
                await asyncio.to_thread(
                    wait_for,
                    lambda: not set(a_hashes) & set(held_by_node(b_batches, "CPU")),
                    "A's blocks removed from B's stream",
                )
                await asyncio.to_thread(
                    wait_for, lambda: not set(a_hashes) & gateway.held(), "SMG no longer crediting"
                )
                await asyncio.to_thread(
                    indexer.wait_for,
                    lambda: indexer.matched("a")["longest_matched"] == 0,
                    "Dynamo no longer crediting",
                )
                assert indexer.matched("b")["gpu"] == PREFIX_TOKENS
            finally:
                started.touch()
                gone.touch()
                end.touch()
            out_b = await asyncio.to_thread(lines_of, b, tmp_path, "b")
    finally:
        gateway.close()
        indexer.close()
    assert out_b["shift7"]["cached"] == 0  # B never computed A's prompt, nor found it cached
    # B's GPU blocks are its own: none of A's hashes among them.
    gpu = [
        h for e in stored(b_batches) if e.get("medium") in (None, "GPU") for h in e["block_hashes"]
    ]
    assert not set(gpu) & set(a_hashes)
    assert await daemon.stop() == 0
