"""The oracle for a tierd hit under vLLM: vLLM's own CPU-tier hit of the same prompt.

On a random-weight model a cached prefix may change greedy tokens against a cold run
(the cached KV was computed in other batch shapes, so its last bits differ), for vLLM's
own CPU tier as much as for tierd: a cold run is no oracle for a hit. What a tierd hit
must equal, bit for bit, is a hit of vLLM's own CPU tier on the same prompt: the same
cached tokens, the same generated tokens and the same logprobs, float for float.

One engine process (vLLM's CPU build, the tiny Llama, tierd behind vLLM's CPU tier),
five prompts (the test prompt rotated): each generated cold; vLLM's prefix cache reset
(its CPU tier keeps the blocks) and each generated again, served from vLLM's CPU tier;
then vLLM's CPU tier reset too and each generated a third time, served from tierd. About
a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

from daemon_kit import Spawn
from vllm_e2e_kit import (
    E2E_MARKS,
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_TOKENS,
    ROW_BYTES,
    VLLM_PYTHON,
    tier_stats,
    vllm_env,
)

from tierd.testing import daemon_config

pytestmark = E2E_MARKS

SHIFTS = (0, 7, 13, 29, 41)  # five prompts: the test prompt rotated by these many tokens

# run_engine.py's engine (tierd behind vLLM's CPU tier), generating with logprobs.
ENGINE = """
import argparse, json, sys
from run_engine import emit, engine
from vllm import SamplingParams, TokensPrompt

model, socket, prompt_file, shifts = sys.argv[1:5]
args = argparse.Namespace(model=model, socket=socket, namespace=None, cpu_bytes=64 << 20,
                          max_model_len=2048)
llm = engine(args)
ids = [int(t) for t in open(prompt_file).read().split()]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
for phase in ("cold", "vllm-cpu", "tierd"):
    if phase == "vllm-cpu":
        llm.reset_prefix_cache(reset_connector=False)  # vLLM's CPU tier keeps its blocks
    if phase == "tierd":
        llm.reset_prefix_cache(reset_connector=True)  # and now it is empty: tierd's
    for k in map(int, shifts.split(",")):
        (out,) = llm.generate(TokensPrompt(prompt_token_ids=ids[k:] + ids[:k]), params,
                              use_tqdm=False)
        got = out.outputs[0]
        emit({"phase": phase, "shift": k, "token_ids": list(got.token_ids),
              "cached": out.num_cached_tokens,
              "logprobs": [[float(lp[t].logprob).hex() for t in sorted(lp)]
                           for lp in got.logprobs]})
"""


async def generations(
    tmp_path: Path, weights: Path, socket_path: str, prompt: Path
) -> dict[tuple[str, int], dict[str, Any]]:
    """The engine's generations, by (phase, shift)."""
    log = tmp_path / "vllm-oracle.log"
    command = [str(VLLM_PYTHON), "-c", ENGINE, str(weights), socket_path, str(prompt)]
    command.append(",".join(map(str, SHIFTS)))
    with log.open("w") as stderr:
        done = await asyncio.to_thread(
            subprocess.run,
            command,
            env=vllm_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
            cwd=HERE,
        )
    tail = (done.stdout + log.read_text(errors="replace"))[-6000:]
    assert done.returncode == 0, f"the engine exited {done.returncode}:\n{tail}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(line["phase"], line["shift"]): line for line in lines}


async def test_a_tierd_hit_is_bit_for_bit_vllms_own_cpu_tier_hit(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt_file: Path,
) -> None:
    daemon = await spawn(
        daemon_config(tmp_path, cpu_blocks=256, disk_blocks=None, block_bytes=ROW_BYTES)
    )
    got = await generations(tmp_path, model, daemon.socket_path, prompt_file)
    assert len(got) == 3 * len(SHIFTS)
    for k in SHIFTS:
        cold, own, ours = got["cold", k], got["vllm-cpu", k], got["tierd", k]
        assert cold["cached"] == 0
        # Each prompt's full blocks are hits both times: the comparison is of two hits.
        assert own["cached"] == ours["cached"] == PREFIX_TOKENS, (k, own, ours)
        assert ours["token_ids"] == own["token_ids"], k
        assert ours["logprobs"] == own["logprobs"], k  # every float, bit for bit
    cpu = (await tier_stats(daemon))["cpu"]
    assert cpu["hits"] >= len(SHIFTS) * (PREFIX_TOKENS // 32)  # the third phase: tierd's
