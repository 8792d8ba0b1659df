#!/usr/bin/env python
"""Remote level benchmark: the tier's reads and writes against raw redis-py, the latency a
remote existence check adds to a lookup, and the shared trace split across two daemons.

(a) Blocks through the tier against raw redis-py, same server, same run. Batches of 32
blocks of 64 KiB and of 256 KiB: ``RedisLevel.put`` against a pipelined ``SET`` of the
bare payloads, ``RedisLevel.get`` (every value checked before it is handed on) against a
pipelined ``GET``. Both clients are redis-py's asyncio client with hiredis, under uvloop
(the daemon's event loop). Each repetition empties the database (not timed), then writes
a batch of new keys through each, then reads them back through each, the order of the two
alternating. Reported as GB/s and as the ratio tier / raw (target: at least 0.8x). Two
more figures of the tier's write path, for information: a write that first asks which keys
the server holds (what the level does while writes find their blocks there already), and a
write of a batch the server already holds (against raw redis-py sending the bytes again).

(b) What the remote existence check adds to a lookup of 32 keys: an in-process chain
(``TierChain.find``) and a daemon (``Client.lookup`` over its socket), each without a
remote level (32 local hits) and with one (32 local hits; 32 local misses the server holds;
32 local misses it does not hold). The cases interleave call by call.

(c) The shared Mooncake trace split across two daemons by conversation (see
:func:`conversations`), both halves replayed at once (``tierd replay`` in two processes,
every block verified), with the remote level off, shared by both daemons, and private to
each (the same server under two key prefixes: capacity without sharing).

Every timing is the median of ``--runs`` runs (the spread min-max in brackets). The
markdown goes to docs/bench/remote.md; ``--quick`` is a smoke run that writes nothing. The
redis-server and the daemons are started here, on 127.0.0.1 and Unix sockets, and stopped
by their PIDs. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import uvloop
import yaml
from redis.asyncio import Redis

from tierd.client import Client, Unreachable
from tierd.keys import BlockKey
from tierd.library import open_chain
from tierd.remote.redis_level import RedisLevel, RemoteSettings

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
OUT = ROOT / "docs" / "bench" / "remote.md"
KiB = 1 << 10
START_DEADLINE_S = 60.0
TARGET = 0.8


# -- processes: a redis-server and tierd daemons, each stopped by its PID --------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], deadline: float = 60.0) -> int:
    """SIGTERM by PID, wait; SIGKILL only past the deadline."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(deadline)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(deadline)
    return proc.returncode


class RedisServer:
    """redis-server on 127.0.0.1, no persistence, in a directory of its own."""

    def __init__(self, workdir: Path, maxmemory: str, policy: str = "allkeys-lru") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (scripts/setup installs it)")
        self.port = _free_port()
        self.maxmemory, self.policy = maxmemory, policy
        workdir.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", maxmemory,
            "--maxmemory-policy", policy,
            "--dir", str(workdir),
            "--logfile", str(workdir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.sync = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sync.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)  # start-up: nothing to wait on but the port
        self.version = str(self.sync.info("server")["redis_version"])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def memory(self) -> dict[str, Any]:
        info = self.sync.info()
        return {
            "keys": int(self.sync.dbsize()),
            "used_memory": int(info["used_memory"]),
            "evicted_keys": int(info["evicted_keys"]),
        }

    def stop(self) -> None:
        self.sync.close()
        _stop(self.proc)


class Daemon:
    """``tierd serve`` from a config mapping, in a directory of its own under /tmp."""

    def __init__(self, config: dict[str, Any], home: Path) -> None:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.socket = str(home / "tierd.sock")
        self.config = {
            **config,
            "socket": {"path": self.socket},
            "logging": {"level": "warning"},
        }
        path = home / "tierd.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.log = home / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierd", "serve", "-c", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
            )

    async def ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"tierd serve exited:\n{self.log.read_text()[-4000:]}")
            try:
                client = await Client.connect(self.socket)
            except Unreachable:
                if time.monotonic() > deadline:
                    message = f"tierd serve not ready:\n{self.log.read_text()[-4000:]}"
                    raise SystemExit(message) from None
                await asyncio.sleep(0.05)  # start-up: nothing to wait on but the socket
                continue
            await client.close()
            return

    def stop(self) -> int:
        return _stop(self.proc)


@contextlib.contextmanager
def daemons(configs: Sequence[dict[str, Any]], base: Path) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    try:
        for index, config in enumerate(configs):
            started.append(Daemon(config, Path(tempfile.mkdtemp(prefix=f"d{index}-", dir=base))))
        yield started
    finally:
        for daemon in started:
            daemon.stop()


# -- figures -----------------------------------------------------------------------------------


@dataclass
class Figure:
    """One figure's per-run values (each run's median)."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def text(self, scale: float = 1.0, digits: int = 3) -> str:
        lo, hi = min(self.runs) * scale, max(self.runs) * scale
        return f"{self.median * scale:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def _keys(tag: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{tag}-{i}".encode()) for i in range(count)]


# -- (a) GET/SET through the tier against raw redis-py ----------------------------------------


async def _transfer_run(
    url: str, size: int, batch: int, reps: int, warmup: int
) -> dict[str, list[float]]:
    """One run at one block size: per repetition, seconds of each operation."""
    settings = RemoteSettings(name="remote", block_bytes=size, url=url, deadline_s=10.0)
    level = await RedisLevel(settings).open()
    raw = Redis.from_url(url)
    payloads = [os.urandom(size) for _ in range(batch)]
    names = ("raw_set", "tier_set", "tier_set_checked", "raw_get", "raw_mget", "tier_get")
    times: dict[str, list[float]] = {k: [] for k in (*names, "raw_resend", "tier_held")}

    async def raw_set(keys: list[bytes]) -> None:
        pipe = raw.pipeline(transaction=False)
        for key, value in zip(keys, payloads, strict=True):
            pipe.set(key, value)
        await pipe.execute()

    async def raw_get(keys: list[bytes]) -> None:
        pipe = raw.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = await pipe.execute()
        assert all(len(v) == size for v in values)

    async def raw_mget(keys: list[bytes]) -> None:
        values = await raw.mget(keys)
        assert all(v is not None and len(v) == size for v in values)

    async def tier_set(keys: list[BlockKey]) -> None:
        assert await level.put(keys, payloads) == batch

    async def tier_set_checked(keys: list[BlockKey]) -> None:
        # The write path while writes find their blocks on the server: EXISTS first.
        learned, level.held_share = level.held_share, 1.0
        try:
            assert await level.put(keys, payloads) == batch
        finally:
            level.held_share = learned

    async def tier_held(keys: list[BlockKey]) -> None:
        learned, level.held_share = level.held_share, 1.0
        try:
            assert await level.put(keys, payloads) == 0  # all there: no bytes sent
        finally:
            level.held_share = learned

    async def tier_get(keys: list[BlockKey]) -> None:
        assert len(await level.get(keys)) == batch

    async def timed(name: str, call: Awaitable[None], record: bool) -> None:
        started = time.perf_counter()
        await call
        if record:
            times[name].append(time.perf_counter() - started)

    def rotated(
        items: Sequence[tuple[str, Awaitable[None]]], by: int
    ) -> list[tuple[str, Awaitable[None]]]:
        by %= len(items)
        return [*items[by:], *items[:by]]

    try:
        for rep in range(warmup + reps):
            # Each group's order rotates from one repetition to the next: the first write
            # after FLUSHDB, say, pays for the server's memory coming back.
            record = rep >= warmup
            await raw.flushdb(asynchronous=False)
            tier_keys, checked_keys = _keys(f"t{rep}", batch), _keys(f"c{rep}", batch)
            raw_keys = [b"raw:" + k for k in _keys(f"r{rep}", batch)]
            writes = [
                ("raw_set", raw_set(raw_keys)),
                ("tier_set", tier_set(tier_keys)),
                ("tier_set_checked", tier_set_checked(checked_keys)),
            ]
            for name, call in rotated(writes, rep):
                await timed(name, call, record)
            reads = [
                ("raw_get", raw_get(raw_keys)),
                ("raw_mget", raw_mget(raw_keys)),
                ("tier_get", tier_get(tier_keys)),
            ]
            for name, call in rotated(reads, rep):
                await timed(name, call, record)
            again = [("raw_resend", raw_set(raw_keys)), ("tier_held", tier_held(tier_keys))]
            for name, call in rotated(again, rep):
                await timed(name, call, record)
    finally:
        await level.close()
        await raw.aclose()
    return times


def part_a(server: RedisServer, args: argparse.Namespace) -> dict[int, dict[str, Figure]]:
    results: dict[int, dict[str, list[float]]] = {}
    for run in range(args.runs):
        for size in args.sizes:
            times = uvloop.run(_transfer_run(server.url, size, args.batch, args.reps, 6))
            for name, values in times.items():
                results.setdefault(size, {}).setdefault(name, []).append(statistics.median(values))
        print(f"(a) run {run + 1}/{args.runs} done", file=sys.stderr)
    return {size: {k: Figure(v) for k, v in by.items()} for size, by in results.items()}


# -- (b) lookup latency with and without the remote check -------------------------------------


LOOKUP_CASES = ("no remote, 32 local hits", "remote, 32 local hits")
REMOTE_CASES = ("remote, 32 local misses held remotely", "remote, 32 local misses held nowhere")


async def _chain_lookups(url: str, calls: int) -> dict[str, float]:
    """Median seconds of ``TierChain.find`` of 32 keys in each case (one run)."""
    block = 4 * KiB
    base = {"block_bytes": block, "tiers": [{"name": "mem", "kind": "memory", "capacity": 64}]}
    remote = {**base, "remote": {"url": url, "deadline": "1s"}}
    local, there, nowhere = _keys("local", 32), _keys("remote", 32), _keys("absent", 32)
    data = [os.urandom(block) for _ in range(32)]
    async with open_chain(base) as plain, open_chain(remote) as chain:
        await plain.store(local, data)
        await chain.store(local, data)
        assert chain.remote is not None
        await chain.remote.level.put(there, data)
        cases = [
            (LOOKUP_CASES[0], plain, local, 32),
            (LOOKUP_CASES[1], chain, local, 32),
            (REMOTE_CASES[0], chain, there, 32),
            (REMOTE_CASES[1], chain, nowhere, 0),
        ]
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for call in range(calls):
            turn = call % len(cases)  # the order rotates: no case always follows another
            for name, target, keys, expect in cases[turn:] + cases[:turn]:
                started = time.perf_counter()
                found = await target.find(keys)
                times[name].append(time.perf_counter() - started)
                assert found.count == expect, (name, found)
    return {name: statistics.median(values) for name, values in times.items()}


async def _daemon_lookups(plain: Daemon, remote: Daemon, url: str, calls: int) -> dict[str, float]:
    """Median seconds of ``Client.lookup`` of 32 keys through each daemon (one run)."""
    block = 4 * KiB
    local, there, nowhere = _keys("local", 32), _keys("remote", 32), _keys("absent", 32)
    data = [os.urandom(block) for _ in range(32)]
    await asyncio.gather(plain.ready(), remote.ready())
    async with (
        await Client.connect(plain.socket, namespace="bench", block_bytes=block) as a,
        await Client.connect(remote.socket, namespace="bench", block_bytes=block) as b,
    ):
        await a.store(local, data)
        await b.store(local, data)
        # The remote-only keys: the level writes them under the daemon's own key layout
        # (key prefix + namespace id + key), as a flush from another daemon would.
        namespace_id = bytes.fromhex(b.info["namespace_id"])
        settings = RemoteSettings(name="remote", block_bytes=block, url=url, deadline_s=5.0)
        writer = await RedisLevel(settings).open()
        assert await writer.put([BlockKey(namespace_id + k) for k in there], data) == 32
        await writer.close()
        cases = [
            (LOOKUP_CASES[0], a, local, 32),
            (LOOKUP_CASES[1], b, local, 32),
            (REMOTE_CASES[0], b, there, 32),
            (REMOTE_CASES[1], b, nowhere, 0),
        ]
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for call in range(calls):
            turn = call % len(cases)
            for name, client, keys, expect in cases[turn:] + cases[:turn]:
                started = time.perf_counter()
                found = await client.lookup(keys)
                times[name].append(time.perf_counter() - started)
                assert found.count == expect, (name, found)
    return {name: statistics.median(values) for name, values in times.items()}


def part_b(
    server: RedisServer, args: argparse.Namespace, base: Path
) -> tuple[dict[str, Figure], dict[str, Figure]]:
    chain_runs: dict[str, list[float]] = {}
    daemon_runs: dict[str, list[float]] = {}
    block = 4 * KiB
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": 64}]
    configs = [
        {"block_bytes": block, "tiers": tiers},
        {"block_bytes": block, "tiers": tiers, "remote": {"url": server.url, "deadline": "1s"}},
    ]
    with daemons(configs, base) as (plain, remote):
        for run in range(args.runs):
            server.sync.flushdb()
            for name, value in uvloop.run(_chain_lookups(server.url, args.calls)).items():
                chain_runs.setdefault(name, []).append(value)
            server.sync.flushdb()
            found = uvloop.run(_daemon_lookups(plain, remote, server.url, args.calls))
            for name, value in found.items():
                daemon_runs.setdefault(name, []).append(value)
            print(f"(b) run {run + 1}/{args.runs} done", file=sys.stderr)
    return (
        {k: Figure(v) for k, v in chain_runs.items()},
        {k: Figure(v) for k, v in daemon_runs.items()},
    )


# -- (c) the shared trace split across two daemons --------------------------------------------


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
                sys.executable, "-m", "tierd", "replay", str(trace),
                "--socket", daemon.socket,
                "--clients", str(args.clients),
                "--json", "--no-progress",
            ]  # fmt: skip
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
            ratio = _combined(result)["hit_ratio"]
            print(
                f"(c) run {run + 1}/{args.replay_runs} {mode}: hit ratio {ratio:.4f},"
                f" {result['seconds']:.1f} s",
                file=sys.stderr,
            )
    return runs


def _combined(result: dict[str, Any]) -> dict[str, Any]:
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


# -- the report ---------------------------------------------------------------------------------


def _versions() -> str:
    import hiredis

    return (
        f"Python {platform.python_version()}, redis-py {redis.__version__}, hiredis "
        f"{hiredis.__version__}, uvloop {getattr(uvloop, '__version__', '?')}"
    )


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _gb_s(seconds: float, nbytes: int) -> float:
    return nbytes / seconds / 1e9


def render(
    args: argparse.Namespace,
    server_version: str,
    load: tuple[float, float],
    transfer: dict[int, dict[str, Figure]] | None,
    lookups: tuple[dict[str, Figure], dict[str, Figure]] | None,
    split: Split | None,
    replays: dict[str, list[dict[str, Any]]] | None,
    maxmemory: str,
) -> str:
    out = [
        "# The remote level on Redis (`scripts/bench_remote.py`)",
        "",
        f"Machine: {_cpu()}, {os.cpu_count()} cores, {_versions()}, redis-server "
        f"{server_version} on 127.0.0.1 (TCP loopback), no persistence. The machine was "
        f"shared with other work: 1-minute load average {load[0]:.2f} at the start, "
        f"{load[1]:.2f} at the end. Every timing is the median of {args.runs} runs "
        "(min-max in brackets) unless said otherwise. Re-run: `scripts/bench_remote.py` "
        "(about 12 minutes here; `--parts`, `--limit`, `--quick` for less).",
    ]
    if transfer is not None:
        out += _render_transfer(args, transfer)
    if lookups is not None:
        out += _render_lookups(args, *lookups)
    if split is not None and replays is not None:
        out += _render_replays(args, split, replays, maxmemory)
    return "\n".join(out) + "\n"


def _render_transfer(args: argparse.Namespace, transfer: dict[int, dict[str, Figure]]) -> list[str]:
    out = [
        "",
        "## (a) Blocks through the tier against raw redis-py",
        "",
        f"Batches of {args.batch} blocks, one pipelined round trip each; the tier's value is "
        "the block plus a 19-byte header and the key (`tierd/remote/values.py`); every value "
        "the tier reads is checked (magic, version, key, length, xxh3) before it is handed "
        "on. Both sides: redis-py's asyncio client (hiredis parser) under uvloop, one "
        "connection pool each, to the same server. Per repetition: FLUSHDB (not timed), "
        "a batch of new keys written through each side, then read back through each, then "
        "written again, the order within each group rotating from one repetition to the "
        "next; 6 warm-up repetitions, then "
        f"{args.reps} timed, per run. GB/s of block bytes (10^9 bytes/s).",
        "",
        "| block | operation | tier GB/s | raw redis-py GB/s | tier / raw | target | met |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for size, figures in transfer.items():
        nbytes = args.batch * size
        for label, tier, raw in (
            ("write (SET) of new blocks", "tier_set", "raw_set"),
            ("read (GET)", "tier_get", "raw_get"),
        ):
            t, r = figures[tier], figures[raw]
            ratio = r.median / t.median
            out.append(
                f"| {size // KiB} KiB | {label} | {_rate_text(t, nbytes)} | "
                f"{_rate_text(r, nbytes)} | {ratio:.2f}x | >= {TARGET}x | "
                f"{'yes' if ratio >= TARGET else '**no**'} |"
            )
    out += [
        "",
        "The tier writes with `SET NX` straight away here: after its first writes found none "
        "of their blocks on the server, it stops asking `EXISTS` first (it asks while the "
        "share of blocks found there, times the block size, exceeds 32 KiB per block). It "
        "encodes each value into a buffer reused from earlier writes (the header is "
        "written in place, the payload copied once and hashed once). It reads a batch with "
        "one `MGET` and checks every value before handing it on.",
        "",
        "The tier's write path in its other two states, and its read against a raw MGET "
        "(information, no target):",
        "",
        "| block | operation | tier GB/s | raw redis-py GB/s | tier / raw |",
        "|---|---|---:|---:|---:|",
    ]
    for size, figures in transfer.items():
        nbytes = args.batch * size
        checked, raw_set = figures["tier_set_checked"], figures["raw_set"]
        held, resend = figures["tier_held"], figures["raw_resend"]
        tier_get, raw_mget = figures["tier_get"], figures["raw_mget"]
        out.append(
            f"| {size // KiB} KiB | read, the raw side one MGET (the tier's own command on a "
            f"single server) | {_rate_text(tier_get, nbytes)} | {_rate_text(raw_mget, nbytes)} "
            f"| {raw_mget.median / tier_get.median:.2f}x |"
        )
        out.append(
            f"| {size // KiB} KiB | new blocks, EXISTS asked first | "
            f"{_rate_text(checked, nbytes)} | {_rate_text(raw_set, nbytes)} | "
            f"{raw_set.median / checked.median:.2f}x |"
        )
        out.append(
            f"| {size // KiB} KiB | blocks the server holds (tier: EXISTS, no bytes sent; "
            f"raw: SET again) | {_rate_text(held, nbytes)} | {_rate_text(resend, nbytes)} | "
            f"{resend.median / held.median:.2f}x |"
        )
    return out


def _rate_text(figure: Figure, nbytes: int) -> str:
    rates = [_gb_s(seconds, nbytes) for seconds in figure.runs]
    return f"{statistics.median(rates):.3f} ({min(rates):.3f}-{max(rates):.3f})"


def _render_lookups(
    args: argparse.Namespace, chain: dict[str, Figure], daemon: dict[str, Figure]
) -> list[str]:
    out = [
        "",
        "## (b) Lookup latency with and without the remote existence check",
        "",
        "A lookup of 32 keys of 4 KiB blocks. In-process: `TierChain.find` on a memory tier "
        "(without a remote level `find` is the synchronous `lookup` and never awaits). "
        "Daemon: `tierd.client.Client.lookup` round trip over the Unix socket to a "
        "`tierd serve` of one CPU tier, without and with a `remote:` section (with one, "
        "every lookup is served by the asynchronous `find`). A local miss asks the server "
        "once, with one pipelined EXISTS per key past the local run. "
        f"{args.calls} calls per case per run, the cases interleaved call by call (their "
        "order rotating); the median call in microseconds.",
        "",
        "| case | in-process find (us) | daemon lookup round trip (us) |",
        "|---|---:|---:|",
    ]
    for name in (*LOOKUP_CASES, *REMOTE_CASES):
        out.append(f"| {name} | {chain[name].text(1e6, 1)} | {daemon[name].text(1e6, 1)} |")
    base_chain, base_daemon = chain[LOOKUP_CASES[0]].median, daemon[LOOKUP_CASES[0]].median
    added_chain = chain[REMOTE_CASES[0]].median - base_chain
    added_daemon = daemon[REMOTE_CASES[0]].median - base_daemon
    out += [
        "",
        f"The remote check adds {added_chain * 1e6:.0f} us in-process and "
        f"{added_daemon * 1e6:.0f} us through the daemon to a lookup whose keys are not "
        "local (one loopback round trip to redis-server, plus redis-py's work for 32 "
        "commands). A lookup answered locally asks nothing of the server; through a daemon "
        "with a remote level it takes "
        f"{daemon[LOOKUP_CASES[1]].median * 1e6:.0f} us against {base_daemon * 1e6:.0f} us "
        "without one (there every lookup takes the asynchronous path; the two daemons are "
        "separate processes on a shared machine, so part of the gap is where each ran).",
    ]
    return out


def _render_replays(
    args: argparse.Namespace,
    split: Split,
    replays: dict[str, list[dict[str, Any]]],
    maxmemory: str,
) -> list[str]:
    cpu_blocks = max(1, math.ceil(split.unique * args.cpu_share))
    requests = sum(len(h) for h in split.halves)
    limit = f"the first {requests:,} requests" if args.limit else f"all {requests:,} requests"
    out = [
        "",
        "## (c) The shared trace split across two daemons",
        "",
        f"Trace: `{TRACE.name}` (read from `../shared/data/`), {limit}, "
        f"{sum(split.accesses):,} block accesses, {split.unique:,} unique blocks.",
        "",
        "**Split by conversation.** The trace names no conversation, so one is derived: "
        "block ids are prefix-chained, and a request continues the conversation of the "
        "latest earlier request that holds the last block of its longest shared prefix "
        f"when that prefix is at least {args.min_shared} blocks long (block 0 opens every "
        "request of the trace; shorter shared prefixes are system prompts that unrelated "
        "conversations share); otherwise it starts a new one. That gives "
        f"{split.conversations:,} conversations; they alternate between the two daemons in "
        "the order they start, each half keeping trace order. Half A: "
        f"{len(split.halves[0]):,} requests, {split.accesses[0]:,} accesses, "
        f"{split.unique_per_half[0]:,} unique blocks; half B: {len(split.halves[1]):,} "
        f"requests, {split.accesses[1]:,} accesses, {split.unique_per_half[1]:,} unique "
        f"blocks; {split.shared_blocks:,} blocks are named by both halves.",
        "",
        f"**Daemons.** Two `tierd serve`, each {args.block_bytes // KiB} KiB blocks and one CPU "
        f"tier (LRU) of {cpu_blocks:,} blocks ({args.cpu_share:.0%} of the trace's unique "
        "blocks), no disk tier. Remote modes: *no remote*; *shared remote*: both name the "
        "same server and key prefix (blocks evicted from a daemon's CPU tier go there, and "
        "either daemon finds the other's); *private remote*: the same server, a key prefix "
        "per daemon (the remote capacity without the sharing). Remote defaults otherwise "
        "(deadline 100 ms, breaker after 3 failures, 64 MiB of queued writes). "
        f"redis-server: maxmemory {maxmemory}, allkeys-lru. Fresh daemons and an empty "
        "server for every run.",
        "",
        "**Replay.** Both halves at once, each `tierd replay HALF --socket S --clients "
        f"{args.clients}` (its own process, full rate, every loaded block verified "
        "byte for byte). Hit ratio: block hits found by the lookups over block accesses, "
        f"both halves together. {args.replay_runs} runs of each mode, the modes interleaved; "
        "median (min-max).",
        "",
        "| mode | hit ratio | from CPU | from REMOTE | half A / half B | requests/s (both) "
        "| lookup p50 A / B (ms) | wrong bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in REPLAY_MODES:
        results = [_combined(r) for r in replays[mode]]
        ratio = Figure([r["hit_ratio"] for r in results])
        cpu = Figure([r["by_medium"].get("CPU", 0.0) for r in results])
        remote = Figure([r["by_medium"].get("REMOTE", 0.0) for r in results])
        half_a = statistics.median(r["per_half"][0] for r in results)
        half_b = statistics.median(r["per_half"][1] for r in results)
        rate = Figure([r["requests_per_s"] for r in results])
        lookup_a = statistics.median(r["lookup_p50_ms"][0] for r in results)
        lookup_b = statistics.median(r["lookup_p50_ms"][1] for r in results)
        wrong = sum(r["wrong_bytes"] for r in results)
        out.append(
            f"| {mode} | {ratio.text(1, 4)} | {cpu.text(1, 4)} | {remote.text(1, 4)} | "
            f"{half_a:.4f} / {half_b:.4f} | {rate.text(1, 0)} | {lookup_a:.2f} / "
            f"{lookup_b:.2f} | {wrong} |"
        )
    medians = {
        mode: {
            key: statistics.median(_combined(r)[key] for r in replays[mode])
            for key in ("hit_ratio", "requests_per_s")
        }
        for mode in REPLAY_MODES
    }
    lookup_p50 = {
        mode: statistics.median(p for r in replays[mode] for p in _combined(r)["lookup_p50_ms"])
        for mode in REPLAY_MODES
    }
    off, shared, private = (medians[m] for m in REPLAY_MODES)
    evicted = max(r["redis"]["evicted_keys"] for m in REPLAY_MODES[1:] for r in replays[m])
    gap = shared["hit_ratio"] - private["hit_ratio"]
    sharing = (
        f"Sharing adds nothing measurable over private key prefixes ({gap:+.4f})"
        if abs(gap) < 0.005
        else f"Sharing adds {gap:+.4f} over private key prefixes"
    )
    out += [
        "",
        f"Bounds: an infinite prefix cache shared by both halves would hit "
        f"{split.infinite_shared:.4f} of the accesses; one per half, "
        f"{split.infinite_private:.4f}. With the shared remote level the two daemons hit "
        f"{shared['hit_ratio']:.4f}, against {off['hit_ratio']:.4f} without it: the server "
        f"(which evicted {evicted:,} keys in any run) holds what the CPU tiers evict. "
        f"{sharing}: conversations hardly cross the split (only {split.shared_blocks:,} "
        "blocks are named by both halves), so what the remote level brings here is "
        "capacity; a router that keeps conversations together leaves little to share.",
        "",
        "The remote path costs the replay throughput: "
        f"{off['requests_per_s']:,.0f} requests/s without it, "
        f"{shared['requests_per_s']:,.0f} with it, and the median lookup went from "
        f"{lookup_p50['no remote']:.2f} ms to {lookup_p50['shared remote']:.2f} ms. On this "
        "machine two daemons, two replay processes and redis-server share 2 cores (with "
        "other work besides): a request that misses locally now waits for a round trip, "
        "and each daemon's event loop spends CPU on every block it sends or reads "
        "(redis-py packs and parses one command per block, about 30 us each). Timeouts "
        "(past the 100 ms deadline) and the writes dropped with them come from that "
        "contention.",
        "",
        "The remote level as the daemons counted it (the median run of each mode):",
        "",
    ]
    out += [
        "| mode | daemon | lookup hits | reads verified | stores | skipped | dropped "
        "| timeouts | errors | corrupt | breaker opened |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in REPLAY_MODES[1:]:
        results = replays[mode]
        middle = sorted(results, key=lambda r: _combined(r)["hit_ratio"])[len(results) // 2]
        for side, remote in zip("AB", middle["remote"], strict=True):
            out.append(
                f"| {mode} | {side} | {remote['lookup_hits']:,} | {remote['hits']:,} | "
                f"{remote['stores']:,} | {remote['skipped']:,} | {remote['dropped']:,} | "
                f"{remote['timeouts']:,} | {remote['errors']:,} | {remote['corrupt']:,} | "
                f"{remote['breaker_opened']:,} |"
            )
    out += [
        "",
        "`skipped`: blocks evicted again after a load had brought them back from the server "
        "(with 16 KiB blocks the level sends them with `SET NX` rather than asking first; "
        "the server keeps its copy). The server at the end of the median run of each mode:",
        "",
        "| mode | keys | used memory | per key | evicted keys |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in REPLAY_MODES[1:]:
        results = replays[mode]
        memory = sorted(results, key=lambda r: _combined(r)["hit_ratio"])[len(results) // 2][
            "redis"
        ]
        per_key = memory["used_memory"] / max(1, memory["keys"])
        out.append(
            f"| {mode} | {memory['keys']:,} | {memory['used_memory'] / (1 << 20):,.0f} MiB | "
            f"{per_key / KiB:.1f} KiB for a block of {args.block_bytes // KiB} KiB | "
            f"{memory['evicted_keys']:,} |"
        )
    return out


# -- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each timing (a, b)")
    parser.add_argument("--reps", type=int, default=20, help="timed batches per run (a)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per batch (a)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[64 * KiB, 256 * KiB], help="block sizes (a)"
    )
    parser.add_argument("--calls", type=int, default=1000, help="lookups per case per run (b)")
    parser.add_argument("--replay-runs", type=int, default=3, help="runs of each mode (c)")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, help="replay only the first N requests (c)")
    parser.add_argument("--min-shared", type=int, default=3, help="see conversations() (c)")
    parser.add_argument("--block-bytes", type=int, default=16 * KiB, help="block size (c)")
    parser.add_argument("--cpu-share", type=float, default=0.05, help="CPU tier / unique (c)")
    parser.add_argument("--clients", type=int, default=2, help="replay clients per daemon (c)")
    parser.add_argument("--maxmemory", default="6gb", help="redis-server maxmemory (c)")
    parser.add_argument("--parts", default="abc", help="which parts to run (default: abc)")
    parser.add_argument("--quick", action="store_true", help="a smoke run; writes nothing")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.reps, args.calls, args.replay_runs = 1, 3, 50, 1
        args.limit = args.limit or 600
    args.tmp = Path(tempfile.mkdtemp(prefix="tierd-bench-remote-", dir="/tmp"))
    load_start = os.getloadavg()[0]
    transfer = lookups = split = replays = None
    server = RedisServer(args.tmp / "redis", args.maxmemory)
    try:
        if "a" in args.parts:
            transfer = part_a(server, args)
        if "b" in args.parts:
            lookups = part_b(server, args, args.tmp)
        if "c" in args.parts:
            if not args.trace.is_file():
                print(f"no trace at {args.trace}: part (c) skipped", file=sys.stderr)
            else:
                split = split_trace(args.trace, args.min_shared, args.limit)
                replays = part_c(server, args, split)
        version = server.version
    finally:
        server.stop()
        shutil.rmtree(args.tmp, ignore_errors=True)
    text = render(
        args,
        version,
        (load_start, os.getloadavg()[0]),
        transfer,
        lookups,
        split,
        replays,
        args.maxmemory,
    )
    print(text)
    if not args.quick:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
