#!/usr/bin/env python
"""Replay benchmark: the shared conversation trace through a live daemon, every byte checked.

Two daemons, one after the other, on this machine, with the same CPU capacity:

- ``cpu``: a CPU tier alone;
- ``cpu+disk``: the same CPU tier over a disk tier five times its size (a directory on the
  project's file system, not /dev/shm).

Each is started with ``tierd serve`` from the shipped default config with ``--set``
overrides (the capacities below, scaled to this machine), then ``tierd replay`` drives it
with N clients at full rate and writes ``summary.json`` and the plots to
``docs/bench/replay-<name>/``. The markdown table goes to ``docs/bench/replay.md``.

Capacities are in blocks, chosen as the points of the single-tier figures in
docs/BENCHMARKS.md: 9,139 CPU blocks (5 % of the trace's unique blocks) and 45,697 disk
blocks (25 %). Hit ratios do not depend on the machine; latencies and throughput do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.fragment import write_fragment

if TYPE_CHECKING:
    from tierd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
CPU_BLOCKS, DISK_BLOCKS = 9139, 45697


def serve(name: str, block_bytes: int, with_disk: bool, work: Path) -> tuple[DaemonProcess, str]:
    """Start ``tierd serve`` (the shipped config, with ``--set``s); returns the process and
    its socket once it is ready (its READY=1: a large disk tier is preallocated first)."""
    from tierd.testing import start_daemon

    sock = str(work / f"{name}.sock")
    sets = [
        f"socket.path={sock}",
        f"block_bytes={block_bytes}",
        f"tiers.cpu.capacity={CPU_BLOCKS}",
        "logging.level=warning",
        "shutdown.write_back=none",
    ]
    if with_disk:
        sets += [
            f"tiers.disk.capacity={DISK_BLOCKS}",
            f"tiers.disk.directories=[{work / 'disk'}]",
        ]
    else:
        sets.append(f"tiers=[{{name: cpu, kind: cpu, capacity: {CPU_BLOCKS}, policy: lru}}]")
    config = ROOT / "config" / "tierd.yaml"
    proc = start_daemon(config, sets=sets, log=work / f"{name}.log", cwd=work, timeout_s=600)
    return proc, sock


def replay(sock: str, out: Path, clients: int, limit: int | None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "tierd", "replay", str(TRACE), "--socket", sock]
    # --unordered: the clients' calls overlap, as the figures in docs/BENCHMARKS.md were taken
    argv += ["--clients", str(clients), "--unordered", "--max-rate", "--out", str(out), "--json"]
    if limit is not None:
        argv += ["--limit", str(limit)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"replay failed ({done.returncode}):\n{done.stderr}")
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def row(name: str, s: dict[str, Any]) -> str:
    by = s["hit_ratio_by_medium"]
    lat = s["latency"]
    loads = lat["load"]

    def ms(stats: dict[str, Any] | None, key: str) -> str:
        return f"{stats[key] * 1e3:.2f}" if stats and stats.get("count") else "-"

    return (
        f"| {name} | {s['hit_ratio']:.4f} | {by.get('CPU', 0.0):.4f} | {by.get('DISK', 0.0):.4f}"
        f" | {ms(lat['lookup'], 'p50')} / {ms(lat['lookup'], 'p99')}"
        f" | {ms(loads.get('CPU'), 'p50')} / {ms(loads.get('CPU'), 'p99')}"
        f" | {ms(loads.get('DISK'), 'p50')} / {ms(loads.get('DISK'), 'p99')}"
        f" | {s['throughput']['requests_per_s']:.0f}"
        f" | {s['throughput']['load_gb_s']:.3f} / {s['throughput']['store_gb_s']:.3f}"
        f" | {s['wrong_bytes']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-bytes", type=int, default=64 << 10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    for name, with_disk in (("cpu", False), ("cpu+disk", True)):
        work = Path(tempfile.mkdtemp(prefix="tierd-bench-replay-", dir=ROOT))
        proc = None
        try:
            proc, sock = serve(name.replace("+", "-"), args.block_bytes, with_disk, work)
            out = args.out / f"replay-{name.replace('+', '-')}"
            results[name] = replay(sock, out, args.clients, args.limit)
            print(row(name, results[name]), flush=True)
        finally:
            if proc is not None:
                proc.stop(timeout_s=120)
            shutil.rmtree(work, ignore_errors=True)
    write_report(args, results)
    return 0


def write_report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    first = next(iter(results.values()))
    lines = [
        "# Replay of the shared conversation trace through a live daemon",
        "",
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}. "
        f"Trace: `{TRACE.name}`, {first['requests']:,} requests, "
        f"{first['block_accesses']:,} block accesses. Blocks of {args.block_bytes:,} bytes; "
        f"CPU tier {CPU_BLOCKS:,} blocks, disk tier {DISK_BLOCKS:,} blocks (cpu+disk only); "
        f"{args.clients} clients at full rate; every loaded block verified byte-for-byte.",
        "Latencies in ms (p50 / p99); throughput in GB/s of blocks loaded / stored over "
        "the replay's wall time. Produced by `scripts/bench replay`.",
        "",
        "| config | hit ratio | from CPU | from DISK | lookup | load from CPU |"
        " load from DISK | requests/s | load / store GB/s | wrong bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(name, s) for name, s in results.items()]
    lines += [
        "",
        "Plots: `replay-cpu/` and `replay-cpu-disk/` (hit_ratio.png, load_latency.png, "
        "occupancy.png).",
        "",
    ]
    write_fragment("\n".join(lines), args.out / "replay.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
