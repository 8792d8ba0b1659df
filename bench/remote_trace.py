"""Part (c) of ``scripts/bench remote``: the shared Mooncake trace split across two
daemons. Deriving the conversations (:func:`conversations`) and splitting the trace by
them (:func:`split_trace`, :class:`Split`, with the bounds of an infinite prefix cache),
then, per run and remote mode (:data:`REPLAY_MODES`), two fresh daemons and two ``tierd
replay`` processes at once; :func:`combined` sums both halves' replay summaries."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench.remote_servers import Daemon, RedisServer, daemons
from tierd.client import Client

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"


def conversations(requests: Sequence[Sequence[int]], min_shared: int) -> list[int]:
    """A conversation number per request. The trace names none, but its block ids are
    prefix-chained, so a request that shares its first ``n`` blocks with an earlier one
    continues what that one said. A request continues the conversation of the latest
    earlier request that holds the last block of its longest shared prefix, when that
    prefix is at least ``min_shared`` blocks long; otherwise it starts a new one. (Block 0
    opens every request of the trace, and short shared prefixes are system prompts that
    unrelated conversations have in common, hence the minimum.)"""
    latest: dict[int, int] = {}  # block id -> the latest request that held it
    conv: list[int] = []
    count = 0
    for index, ids in enumerate(requests):
        shared = 0
        for block_id in ids:
            if block_id not in latest:
                break
            shared += 1
        if shared >= min_shared:
            conv.append(conv[latest[ids[shared - 1]]])
        else:
            conv.append(count)
            count += 1
        for block_id in ids:
            latest[block_id] = index
    return conv


@dataclass
class Split:
    halves: list[list[str]]  # the trace's lines, per daemon, in trace order
    conversations: int
    unique: int
    unique_per_half: list[int]
    shared_blocks: int  # blocks named by both halves
    accesses: list[int]
    infinite_shared: float  # hit ratio of one infinite prefix cache serving both halves
    infinite_private: float  # of an infinite cache per half


def infinite_hits(requests: Sequence[Sequence[int]]) -> int:
    """Block hits of an infinite prefix cache: each request hits the leading run of its
    blocks seen before."""
    seen: set[int] = set()
    hits = 0
    for ids in requests:
        for block_id in ids:
            if block_id not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits


def split_trace(path: Path, min_shared: int, limit: int | None) -> Split:
    lines = path.read_text().splitlines()
    if limit is not None:
        lines = lines[:limit]
    requests = [json.loads(line)["hash_ids"] for line in lines]
    conv = conversations(requests, min_shared)
    halves: list[list[str]] = [[], []]
    half_ids: list[list[list[int]]] = [[], []]
    blocks: list[set[int]] = [set(), set()]
    accesses = [0, 0]
    for line, ids, number in zip(lines, requests, conv, strict=True):
        side = number % 2  # conversations alternate between the daemons, as they start
        halves[side].append(line)
        half_ids[side].append(ids)
        blocks[side].update(ids)
        accesses[side] += len(ids)
    total = sum(accesses)
    return Split(
        halves,
        max(conv) + 1,
        len(blocks[0] | blocks[1]),
        [len(b) for b in blocks],
        len(blocks[0] & blocks[1]),
        accesses,
        infinite_hits(requests) / total,
        sum(infinite_hits(ids) for ids in half_ids) / total,
    )


REPLAY_MODES = ("no remote", "shared remote", "private remote")


def _replay_configs(mode: str, url: str, block: int, cpu_blocks: int) -> list[dict[str, Any]]:
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": cpu_blocks}]
    configs: list[dict[str, Any]] = []
    for side in ("a", "b"):
        config: dict[str, Any] = {"block_bytes": block, "tiers": tiers}
        if mode != "no remote":
            prefix = "tierd:" if mode == "shared remote" else f"tierd-{side}:"
            config["remote"] = {"url": url, "key_prefix": prefix}
        configs.append(config)
    return configs


async def _stats(daemon: Daemon) -> dict[str, Any]:
    async with await Client.connect(daemon.socket) as client:
        return await client.stats()


def _replay_once(
    server: RedisServer, mode: str, files: list[Path], args: argparse.Namespace, cpu_blocks: int
) -> dict[str, Any]:
    server.sync.flushall()
    configs = _replay_configs(mode, server.url, args.block_bytes, cpu_blocks)
    with daemons(configs, args.tmp) as pair:
        uvloop.run(_ready(pair))
        replays = []
        started = time.perf_counter()
        for daemon, trace in zip(pair, files, strict=True):
            command = [
                sys.executable,
                "-m",
                "tierd",
                "replay",
                str(trace),
                "--socket",
                daemon.socket,
                "--clients",
                str(args.clients),
                "--unordered",  # calls overlap, as measured
                "--json",
                "--no-progress",
            ]
            replays.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            )
        outputs = [proc.communicate() for proc in replays]
        seconds = time.perf_counter() - started
        for proc, (_, err) in zip(replays, outputs, strict=True):
            if proc.returncode != 0:
                raise SystemExit(f"tierd replay exited {proc.returncode}: {err.decode()[-2000:]}")
        summaries = [json.loads(out) for out, _ in outputs]
        stats = [uvloop.run(_stats(daemon)) for daemon in pair]
    return {
        "mode": mode,
        "seconds": seconds,
        "summaries": summaries,
        "remote": [s.get("remote") for s in stats],
        "redis": server.memory(),
    }


async def _ready(pair: list[Daemon]) -> None:
    await asyncio.gather(*(daemon.ready() for daemon in pair))


def part_c(
    server: RedisServer, args: argparse.Namespace, split: Split
) -> dict[str, list[dict[str, Any]]]:
    directory = Path(tempfile.mkdtemp(prefix="split-", dir=args.tmp))
    files = []
    for side, lines in zip("ab", split.halves, strict=True):
        path = directory / f"half-{side}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    cpu_blocks = max(1, math.ceil(split.unique * args.cpu_share))
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in REPLAY_MODES}
    for run in range(args.replay_runs):
        for mode in REPLAY_MODES:
            result = _replay_once(server, mode, files, args, cpu_blocks)
            runs[mode].append(result)
            ratio = combined(result)["hit_ratio"]
            print(
                f"(c) run {run + 1}/{args.replay_runs} {mode}: hit ratio {ratio:.4f},"
                f" {result['seconds']:.1f} s",
                file=sys.stderr,
            )
    return runs


def combined(result: dict[str, Any]) -> dict[str, Any]:
    summaries = result["summaries"]
    accesses = sum(s["block_accesses"] for s in summaries)
    hits = sum(s["hits"] for s in summaries)
    by_medium: Counter[str] = Counter()
    for s in summaries:
        by_medium.update(s["hits_by_medium"])
    return {
        "accesses": accesses,
        "hits": hits,
        "hit_ratio": hits / accesses if accesses else 0.0,
        "by_medium": {m: n / accesses for m, n in by_medium.items() if accesses},
        "per_half": [s["hit_ratio"] for s in summaries],
        "wrong_bytes": sum(s["wrong_bytes"] for s in summaries),
        "shortfalls": sum(s["load_shortfalls"] for s in summaries),
        # Each replay's own wall time (its start-up, loading the trace, is not in it).
        "requests_per_s": sum(s["requests"] for s in summaries)
        / max(s["seconds"] for s in summaries),
        "lookup_p50_ms": [s["latency"]["lookup"]["p50"] * 1e3 for s in summaries],
    }
