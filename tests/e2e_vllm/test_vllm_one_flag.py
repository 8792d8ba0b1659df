"""vLLM's CPU build with tierd turned on by ``TIERD`` alone: no ``--kv-transfer-config``.

tierd's ``vllm.general_plugins`` entry point is installed in ``.venv-vllm-cpu`` by
``scripts/setup_vllm_cpu`` (an editable pip install of this checkout, which writes the
entry point into the venv's metadata). The engine process here builds its ``LLM`` with
no transfer config at all and ``TIERD=<the daemon's socket>`` in its environment; the
plugin fills in the config (on this CPU platform with tierd's plain-torch copy worker,
``tierd.integrations.vllm.cpu_spec``). Proof that tierd served it: after vLLM's own prefix
cache and CPU tier are emptied the prompt's six full blocks come back cached, and the
daemon counts six stores and six hits. The same engine without ``TIERD`` gets no transfer
config (the plugin changes nothing). With the daemon serving a pool, ``TIERD`` makes it
vLLM's CPU tier; ``TIERD_VLLM_MODE=secondary`` keeps vLLM's own CPU tier with tierd
behind it, and both modes share the node's blocks (one namespace, one block size).
About two minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import yaml
from daemon_kit import Spawn
from port_kit import free_port
from vllm_e2e_kit import (
    E2E_MARKS,
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    ROOT,
    ROW_BYTES,
    VLLM_PYTHON,
    tier_stats,
    vllm_env,
)

from tierd.client import Client
from tierd.testing import daemon_config

pytestmark = E2E_MARKS

# The engine: run_engine.py's generate, with an LLM built with no transfer config.
ENGINE = """
import argparse, json, sys
from run_engine import emit, generate
from vllm import LLM

model, prompt_file, steps = sys.argv[1:4]
llm = LLM(model=model, tokenizer=model, dtype="bfloat16", block_size=32, max_model_len=2048,
          max_num_seqs=4, max_num_batched_tokens=2048, enforce_eager=True,
          enable_prefix_caching=True, seed=0, distributed_executor_backend="uni")
config = llm.llm_engine.vllm_config.kv_transfer_config
emit({"step": "config", "kv_transfer_config": None if config is None else {
    "kv_connector": config.kv_connector,
    "kv_connector_extra_config": config.kv_connector_extra_config}})
ids = [int(t) for t in open(prompt_file).read().split()]
for step in steps.split(","):
    if step == "reset":
        emit({"step": step, "ok": bool(llm.reset_prefix_cache(reset_connector=True))})
    else:
        emit({"step": step, **generate(llm, argparse.Namespace(max_tokens=8), step, ids)})
"""


async def run(
    tmp_path: Path, name: str, model: Path, prompt: Path, steps: str, **env: str
) -> dict[str, dict[str, Any]]:
    """One engine process through ``steps``; its JSON lines by step name."""
    log = tmp_path / f"vllm-{name}.log"
    command = [str(VLLM_PYTHON), "-c", ENGINE, str(model), str(prompt), steps]
    with log.open("w") as stderr:
        done = await asyncio.to_thread(
            subprocess.run,
            command,
            env=vllm_env() | env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
            cwd=HERE,
        )
    text = done.stdout + log.read_text(errors="replace")  # vLLM logs on stdout
    assert done.returncode == 0, f"engine {name} exited {done.returncode}:\n{text[-6000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {line["step"]: line for line in lines} | {"log": {"text": text}}


async def test_tierd_on_with_only_the_environment_variable(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt_file: Path,
) -> None:
    config = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=ROW_BYTES)
    daemon = await spawn(config)
    sock = daemon.socket_path

    # The daemon serves a pool: it becomes vLLM's CPU tier (one copy on the node).
    out = await run(tmp_path, "one-flag", model, prompt_file, "cold,reset,warm", TIERD=sock)
    extra = out["config"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "tierd.integrations.vllm.pool_spec"
    assert extra["tierd"]["socket"] == sock
    assert "tierd on (TIERD): tierd's pool is vLLM's CPU tier" in out["log"]["text"]
    cold, warm = out["cold"], out["warm"]
    assert cold["num_cached_tokens"] == 0
    assert out["reset"]["ok"] is True
    assert warm["num_cached_tokens"] == PREFIX_TOKENS  # from the pool: vLLM has no tier
    assert warm["token_ids"] == cold["token_ids"]
    cpu = (await tier_stats(daemon))["cpu"]
    assert (cpu["stores"], cpu["hits"]) == (PREFIX_BLOCKS, PREFIX_BLOCKS)

    # TIERD_VLLM_MODE=secondary keeps vLLM's own CPU tier, tierd behind it.
    behind = await run(
        tmp_path,
        "secondary",
        model,
        prompt_file,
        "cold,reset,warm",
        TIERD=sock,
        TIERD_VLLM_MODE="secondary",
    )
    extra = behind["config"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "tierd.integrations.vllm.cpu_spec"
    assert extra["secondary_tiers"][0]["socket"] == sock
    assert "tierd on (TIERD): secondary KV tier" in behind["log"]["text"]
    assert behind["cold"]["num_cached_tokens"] == PREFIX_TOKENS  # the pool's blocks: shared
    assert behind["warm"]["num_cached_tokens"] == PREFIX_TOKENS  # from tierd, behind vLLM's
    assert behind["warm"]["token_ids"] == cold["token_ids"]

    # Without the variable the plugin changes nothing: no transfer config, no tierd.
    off = await run(tmp_path, "off", model, prompt_file, "cold")
    assert off["config"]["kv_transfer_config"] is None
    assert (await tier_stats(daemon))["cpu"]["stores"] == PREFIX_BLOCKS  # nothing new


# An SGLang-shaped neighbour: one page of a 2-layer, 2-KV-head model with 64-token pages
# (layers x kv_heads x (K, V) x 64 tokens x head_dim 64 x 2 bytes), stored through its pool.
PAGE_BYTES = 2 * 2 * 2 * 64 * 64 * 2


def page(key: bytes) -> bytes:
    stamp = b"page:" + key + b";"
    return (stamp * (PAGE_BYTES // len(stamp) + 1))[:PAGE_BYTES]


async def test_vllm_and_an_sglang_shaped_client_share_one_daemon_at_their_own_sizes(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt_file: Path,
) -> None:
    """Neither engine's size is configured: the daemon's ``block_bytes`` is 4096, and
    ``block_sizes: 3`` lets each client's hello open its own. Through a restart, vLLM
    (a fresh engine process, its own caches empty) is served its prefix from tierd's
    disk tier, and the neighbour its pages, each at its size."""
    config = daemon_config(
        tmp_path, cpu_blocks=256, disk_blocks=1024, block_bytes=4096, block_sizes=3
    )
    daemon = await spawn(config)
    out = await run(tmp_path, "sized", model, prompt_file, "cold", TIERD=daemon.socket_path)
    assert out["cold"]["num_cached_tokens"] == 0
    names = [f"page-{i}".encode() for i in range(4)]
    async with await Client.connect(
        daemon.socket_path, namespace="sglang-shaped", block_bytes=PAGE_BYTES
    ) as neighbour:
        assert neighbour.block_bytes == PAGE_BYTES
        assert await neighbour.store(names, [page(k) for k in names]) == len(names)
        stats = await neighbour.stats()
    sizes = stats["tenants"]["default"]["block_sizes"]
    assert set(sizes) == {"4096", str(ROW_BYTES), str(PAGE_BYTES)}
    assert sizes[str(ROW_BYTES)]["tiers"][0]["stores"] == PREFIX_BLOCKS
    assert sizes[str(PAGE_BYTES)]["tiers"][0]["stores"] == len(names)
    assert await daemon.stop() == 0  # write-back: the CPU tiers' blocks go to disk

    again = await spawn(config)
    warm = await run(tmp_path, "sized-again", model, prompt_file, "warm", TIERD=again.socket_path)
    assert warm["warm"]["num_cached_tokens"] == PREFIX_TOKENS  # a fresh engine: from tierd
    assert warm["warm"]["token_ids"] == out["cold"]["token_ids"]
    async with await Client.connect(
        again.socket_path, namespace="sglang-shaped", block_bytes=PAGE_BYTES
    ) as neighbour:
        assert list((await neighbour.lookup(names)).media) == ["DISK"] * len(names)
        assert await neighbour.load(names) == [page(k) for k in names]
        stats = await neighbour.stats()
    sizes = stats["tenants"]["default"]["block_sizes"]
    assert sizes[str(ROW_BYTES)]["tiers"][1]["hits"] == PREFIX_BLOCKS  # vLLM's, from disk
    assert await again.stop() == 0


async def test_a_daemon_of_another_size_stops_the_server_before_the_weights_load(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
) -> None:
    """``TIERD=1`` and a daemon that serves one block size, not the engine's: vLLM's server
    stops while it builds its config, in one line that says what to change, before it
    starts to load the model (the check used to come after the weights and the warm-up,
    minutes later, in a traceback)."""
    config = daemon_config(tmp_path, cpu_blocks=16, disk_blocks=None, block_bytes=2 * ROW_BYTES)
    daemon = await spawn(config)
    command = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--dtype",
        "bfloat16",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
    ]
    done = await asyncio.to_thread(
        subprocess.run,
        command,
        env=vllm_env() | {"TIERD": daemon.socket_path},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        cwd=HERE,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-6000:]
    line = (
        f"ERROR tierd at {daemon.socket_path} does not serve this engine's blocks of"
        f" {ROW_BYTES} bytes"
    )
    assert line in text, text[-6000:]
    assert f"set `block_bytes: {ROW_BYTES}` in tierd's config" in text
    assert "Traceback" not in text, text[-6000:]
    assert "Starting to load model" not in text  # stopped before the model was touched
    assert await daemon.stop() == 0


async def test_the_shipped_config_serves_the_first_engine_whatever_its_size(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt_file: Path,
) -> None:
    """The shipped ``config/tierd.yaml`` (its block sizes as shipped; its tiers made small
    and put in ``tmp_path``): an engine whose blocks are not the configured 256 KiB is
    served all the same, in a size of its own, and its prefix comes back from tierd."""
    shipped = yaml.safe_load((ROOT / "config" / "tierd.yaml").read_text())
    assert shipped["block_bytes"] == "256KiB" and ROW_BYTES != 256 << 10
    (tmp_path / "disk").mkdir(mode=0o700)
    shipped["tiers"][0]["capacity"] = "8MiB"
    shipped["tiers"][1] |= {"capacity": "16MiB", "directories": [str(tmp_path / "disk")]}
    shipped["socket"] = daemon_config(tmp_path)["socket"]
    daemon = await spawn(shipped)
    out = await run(
        tmp_path,
        "shipped",
        model,
        prompt_file,
        "cold,reset,warm",
        TIERD="1",
        TIERD_SOCKET=daemon.socket_path,
    )
    assert out["cold"]["num_cached_tokens"] == 0
    assert out["warm"]["num_cached_tokens"] == PREFIX_TOKENS
    assert out["warm"]["token_ids"] == out["cold"]["token_ids"]
    async with await Client.connect(daemon.socket_path, namespace=None) as operator:
        stats = await operator.stats()
    sizes = stats["tenants"]["default"]["block_sizes"]
    assert sizes[str(ROW_BYTES)]["tiers"][0]["stores"] == PREFIX_BLOCKS
    assert await daemon.stop() == 0
