"""The markdown report of ``scripts/bench remote`` (docs/bench/remote.md): the machine
and versions, then one section per part that ran: (a) the tier's GB/s against raw
redis-py with the target, (b) the lookup latencies and what the remote check adds, (c)
the replays' hit ratios, throughput, the remote level's counters and the server's
memory."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
from pathlib import Path
from typing import Any

import redis
import uvloop

from bench.figures import Figure, median_of
from bench.remote_lookups import LOOKUP_CASES, REMOTE_CASES
from bench.remote_stats import KiB
from bench.remote_trace import REPLAY_MODES, TRACE, Split, combined

TARGET = 0.8


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
        "# The remote level on Redis (`scripts/bench remote`)",
        "",
        f"Machine: {_cpu()}, {os.cpu_count()} cores, {_versions()}, redis-server "
        f"{server_version} on 127.0.0.1 (TCP loopback), no persistence. The machine was "
        f"shared with other work: 1-minute load average {load[0]:.2f} at the start, "
        f"{load[1]:.2f} at the end. Every timing is the median of {args.runs} runs "
        "(min-max in brackets) unless said otherwise. Re-run: `scripts/bench remote` "
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
    return f"{median_of(rates):.3f} ({min(rates):.3f}-{max(rates):.3f})"


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
        f"{args.clients} --unordered` (its own process, full rate, every loaded block verified "
        "byte for byte). Hit ratio: block hits found by the lookups over block accesses, "
        f"both halves together. {args.replay_runs} runs of each mode, the modes interleaved; "
        "median (min-max).",
        "",
        "| mode | hit ratio | from CPU | from REMOTE | half A / half B | requests/s (both) "
        "| lookup p50 A / B (ms) | wrong bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in REPLAY_MODES:
        results = [combined(r) for r in replays[mode]]
        ratio = Figure([r["hit_ratio"] for r in results])
        cpu = Figure([r["by_medium"].get("CPU", 0.0) for r in results])
        remote = Figure([r["by_medium"].get("REMOTE", 0.0) for r in results])
        half_a = median_of(r["per_half"][0] for r in results)
        half_b = median_of(r["per_half"][1] for r in results)
        rate = Figure([r["requests_per_s"] for r in results])
        lookup_a = median_of(r["lookup_p50_ms"][0] for r in results)
        lookup_b = median_of(r["lookup_p50_ms"][1] for r in results)
        wrong = sum(r["wrong_bytes"] for r in results)
        out.append(
            f"| {mode} | {ratio.text(1, 4)} | {cpu.text(1, 4)} | {remote.text(1, 4)} | "
            f"{half_a:.4f} / {half_b:.4f} | {rate.text(1, 0)} | {lookup_a:.2f} / "
            f"{lookup_b:.2f} | {wrong} |"
        )
    medians = {
        mode: {
            key: median_of(combined(r)[key] for r in replays[mode])
            for key in ("hit_ratio", "requests_per_s")
        }
        for mode in REPLAY_MODES
    }
    lookup_p50 = {
        mode: median_of(p for r in replays[mode] for p in combined(r)["lookup_p50_ms"])
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
        middle = sorted(results, key=lambda r: combined(r)["hit_ratio"])[len(results) // 2]
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
        memory = sorted(results, key=lambda r: combined(r)["hit_ratio"])[len(results) // 2]["redis"]
        per_key = memory["used_memory"] / max(1, memory["keys"])
        out.append(
            f"| {mode} | {memory['keys']:,} | {memory['used_memory'] / (1 << 20):,.0f} MiB | "
            f"{per_key / KiB:.1f} KiB for a block of {args.block_bytes // KiB} KiB | "
            f"{memory['evicted_keys']:,} |"
        )
    return out
