"""The figures of ``scripts/bench daemon`` and their report: :class:`Figures` (every
run's value per figure: median and spread), the table of tierd against each baseline
with its targets, and the markdown of docs/bench/daemon.md (machine, method, table,
server-side profile)."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
from dataclasses import dataclass
from typing import Any

import msgpack
import uvloop

from bench.daemon_wire import KEY_BYTES
from bench.figures import Figures

# -- report ------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _versions() -> str:
    import tierd

    return (
        f"Python {platform.python_version()}, uvloop {uvloop.__version__}, "
        f"msgpack {'.'.join(map(str, msgpack.version))}, tierd {tierd.__version__}"
    )


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    key: str  # tierd's figure; the baseline's is named in base
    base: str
    unit: str  # "us" (lower is better) or "req/s" or "GB/s"
    target: float  # tierd/baseline: at most (us) or at least (rates)


ROWS = (
    Row("lookup(32) round trip, 1 client, median", "tierd.rt", "echo.rt", "us", 3.0),
    Row("pipelined lookups, 1 client", "tierd.pipe", "echo.pipe", "req/s", 0.5),
    Row(
        "lookup(32) round trip, {clients} clients, median",
        "tierd.multi_rt",
        "echo.multi_rt",
        "us",
        3.0,
    ),
    Row(
        "pipelined lookups, {clients} clients", "tierd.multi_pipe", "echo.multi_pipe", "req/s", 0.5
    ),
    Row("zero-copy store (write views + commit)", "data.store", "data.copy_in", "GB/s", 0.7),
    Row("zero-copy load (prepare, copy out, release)", "data.load", "data.copy_out", "GB/s", 0.7),
)

_SCALE = {"us": (1e6, ".1f"), "req/s": (1e-3, ".1f"), "GB/s": (1e-9, ".2f")}


def table(figs: Figures, args: argparse.Namespace) -> list[str]:
    lines = [
        "| figure | tierd | baseline | ratio | target | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in ROWS:
        scale, fmt = _SCALE[row.unit]
        unit = "k req/s" if row.unit == "req/s" else row.unit
        mine, base = figs.median(row.key), figs.median(row.base)
        ratio = mine / base
        lower = row.unit == "us"
        met = ratio <= row.target if lower else ratio >= row.target
        lines.append(
            f"| {row.label.format(clients=args.clients)} ({unit}) "
            f"| {mine * scale:{fmt}} ({figs.spread(row.key, scale, fmt)}) "
            f"| {base * scale:{fmt}} ({figs.spread(row.base, scale, fmt)}) "
            f"| {ratio:.2f}x | {'<=' if lower else '>='} {row.target}x "
            f"| {'yes' if met else '**no**'} |"
        )
    return lines


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    figs: Figures = result["figs"]
    conns = args.clients // args.client_procs
    (b1, _, _), (a1, _, _) = result["load"]
    lines = [
        "## Daemon: control path and zero-copy data path (`scripts/bench daemon`)",
        "",
        f"Machine: {_cpu_model()}, {os.cpu_count()} cores, {_versions()}. "
        f"1-minute load average {b1:.2f} at the start, {a1:.2f} at the end.",
        "",
        f"tierd: started with `{result['launcher']}` in its own process, this config:",
        "",
        "```yaml",
        result["config"].rstrip(),
        "```",
        "",
        "Baseline: a bare length-prefixed msgpack server in its own process, uvloop, a Unix "
        "socket; it decodes each request and answers a lookup-shaped reply of the same size "
        "(`count`, one medium per key, `in_flight`), the replies of one read in one write.",
        "Client: the same raw asyncio.Protocol client under uvloop for both (not "
        "`tierd.client`), in spawned client processes (1 client: one connection in one "
        f"process), {args.keys} keys of {KEY_BYTES} bytes per lookup, all hits; the "
        "next request is written from `data_received`. Round trip: one request at a time, "
        f"{args.n} after {args.warmup} warm-up requests (1 client), {args.multi_n} per "
        f"connection ({args.clients} clients). Pipelined: a window of {args.window} requests "
        f"per connection, {args.pipe} requests (1 client), {args.multi_pipe} per connection "
        f"({args.clients} clients). {args.clients} clients = {args.client_procs} client "
        f"processes x {conns} connections (tasks in one event loop per process); the server "
        f"and the client processes share the {os.cpu_count()} cores, so these figures measure "
        "how the scheduler shares the cores between both ends as much as the server: when it "
        "favours one client process, the pooled median round trip is that process's (the "
        "spread shows it); the aggregate rates are steadier.",
        f"Data path: `tierd.client` with the pool mapped, {args.batch} blocks of 2 MiB per "
        f"`storing`/`loading` call, {args.mib} MiB per run; baseline: the same bytes copied "
        "into a preallocated buffer and out of it with memoryview slices in the client "
        "process (one memcpy each way). GB/s = 10^9 bytes/s.",
        f"Each figure: the median of {args.runs} runs, the spread (min-max) in brackets; "
        "baseline and tierd interleave, order alternating. Ratio = tierd / baseline.",
        "",
        *table(figs, args),
        "",
        f"With {args.clients} clients in round trip mode the servers answered "
        f"{figs.median('echo.multi_rt_rate') / 1e3:.1f} k req/s (echo) and "
        f"{figs.median('tierd.multi_rt_rate') / 1e3:.1f} k req/s (tierd) in all.",
        "",
        f"`tierd.client` (information, no target): `Client.lookup` round trip "
        f"{figs.median('client.rt') * 1e6:.1f} us median, `Client.send` pipelined "
        f"(window {args.window}) {figs.median('client.pipe') / 1e3:.1f} k req/s.",
        "",
    ]
    if result["profile"] is not None:
        lines += profile_lines(result["profile"])
    return "\n".join(lines)


def profile_lines(profile: tuple[list[tuple[str, int, float, float]], float, int]) -> list[str]:
    rows, total, requests = profile
    lines = [
        "### Server-side profile (cProfile, lookups of 32 keys)",
        "",
        f"The daemon under cProfile (start to exit) through {requests} lookups from one "
        f"client (round trips, then pipelined): {total:.2f} s of profiled time. Top functions "
        "by own time (cProfile inflates per-call costs; read the shares). The own time of "
        "`asyncio/runners.py(run)` is the uvloop loop itself (socket I/O, in C):",
        "",
        "| function | calls | own s | share | cumulative s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, calls, own, cum in rows:
        share = own / total if total else 0.0
        lines.append(f"| `{name}` | {calls} | {own:.3f} | {share:.1%} | {cum:.3f} |")
    return [*lines, ""]
