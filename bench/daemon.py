#!/usr/bin/env python
"""Daemon benchmark: the control path against a bare msgpack echo server, and the
zero-copy data path against a plain memory copy, same machine, same run.

Control path. Two servers, each in its own process, each on a Unix socket under uvloop:

- the baseline: a bare asyncio.Protocol that decodes each frame (the framing of
  ``tierd.control.protocol``: a 4-byte big-endian length, then a msgpack map) and answers
  a ``lookup`` with a reply of the same shape and size as the daemon's (``id``, ``ok``,
  ``count``, one medium per key, ``in_flight``), writing the replies of one read at once;
- tierd: a real daemon (``tierd serve`` when the command exists, else ``load_settings`` +
  ``run_daemon``), one cpu tier, logging at warning; the 32 keys looked up are stored
  first, so each lookup is a hit of 32.

The same raw asyncio.Protocol client (not ``tierd.client``, so the client's cost is the
same on both sides) drives both, sending the next request from ``data_received``:

- round trip: one request at a time, the median of N after a warm-up (target: tierd at
  most 3x the echo server);
- pipelined: a window of requests in flight, requests/s over a fixed count (target: at
  least 0.5x);
- the same two figures with 16 connections, spread over client processes.

``tierd.client``'s own figures (``Client.lookup``, ``Client.send`` pipelining) are
reported as information, without a target.

Data path: ``tierd.client`` with the pool mapped stores batches of 2 MiB blocks
(``storing``: write into the pool views, commit) and loads them back (``loading``: copy
out of the views, release); bytes/s against two plain copies of the same bytes in the
client process (into a preallocated buffer, and out of it; target: at least 0.7x).

Each figure is the median of ``--runs`` runs (baseline and tierd interleaved, order
alternating), with the spread (min-max). The markdown goes to docs/bench/daemon.md.
``--quick`` is a smoke run of a few seconds that writes nothing. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvloop

# Only light imports at the top: client processes are spawned and import this module.
# The rest of the benchmark sits beside it (bench/daemon_*.py).
from bench.daemon_data import DataPlan, data_path, store_lookup_keys, tierd_client_lookups
from bench.daemon_report import markdown
from bench.daemon_servers import Servers, daemon_yaml, profile_daemon, serve_launcher
from bench.daemon_wire import ClientPlan, Phase, echo_main, run_clients
from bench.figures import Figures
from bench.fragment import default_out, write_fragment

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


# -- orchestration -----------------------------------------------------------------------


def control_runs(args: argparse.Namespace, paths: dict[str, str], figs: Figures) -> None:
    single = (Phase("rt", args.n, 1, True), Phase("pipe", args.pipe, args.window, False))
    conns = args.clients // args.client_procs
    multi = (
        Phase("rt", args.multi_n, 1, True),
        Phase("pipe", args.multi_pipe, args.window, False),
    )
    for run in range(args.runs):
        order = ("echo", "tierd") if run % 2 == 0 else ("tierd", "echo")
        for who in order:
            plan = ClientPlan(paths[who], 1, args.keys, args.warmup, single)
            got = run_clients(plan, 1)
            figs.add(f"{who}.rt", got["rt"]["latency"])
            figs.add(f"{who}.pipe", got["pipe"]["rate"])
        for who in order:
            plan = ClientPlan(paths[who], conns, args.keys, args.warmup, multi)
            got = run_clients(plan, args.client_procs)
            figs.add(f"{who}.multi_rt", got["rt"]["latency"])
            figs.add(f"{who}.multi_rt_rate", got["rt"]["rate"])
            figs.add(f"{who}.multi_pipe", got["pipe"]["rate"])
        lat, rate = uvloop.run(tierd_client_lookups(paths["tierd"], args.keys, args.n, args.window))
        figs.add("client.rt", lat)
        figs.add("client.pipe", rate)
        print(
            f"run {run + 1}/{args.runs}: 1 client rt echo {figs.values['echo.rt'][-1] * 1e6:.1f}"
            f" us, tierd {figs.values['tierd.rt'][-1] * 1e6:.1f} us",
            file=sys.stderr,
        )


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    servers = Servers(workdir)
    paths = {"echo": str(workdir / "echo.sock"), "tierd": str(workdir / "tierd.sock")}
    config = daemon_yaml(workdir / "tierd.yaml", paths["tierd"], args.cpu, "2MiB")
    launcher = serve_launcher()
    figs = Figures()
    load_before = os.getloadavg()
    try:
        servers.start_echo(paths["echo"])
        daemon = servers.start_daemon(config, launcher)
        uvloop.run(store_lookup_keys(paths["tierd"], args.keys))
        control_runs(args, paths, figs)
        plan = DataPlan(paths["tierd"], args.runs, args.batch, args.mib * MiB // (2 * MiB))
        for name, values in uvloop.run(data_path(plan)).items():
            for v in values:
                figs.add(f"data.{name}", v)
        status = servers.stop(daemon)
        if status != 0:
            raise RuntimeError(f"tierd exited with status {status} on SIGTERM")
        servers.stop_all()
        profile = None
        if args.profile:
            sock = str(workdir / "profiled.sock")
            profiled = daemon_yaml(workdir / "profiled.yaml", sock, args.cpu, "2MiB")
            profile = profile_daemon(servers, args, profiled)
    finally:
        servers.stop_all()
    return {
        "figs": figs,
        "launcher": launcher,
        "config": config.read_text().replace(str(workdir), "$TMPDIR"),
        "profile": profile,
        "load": (load_before, os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run; writes nothing")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--n", type=int, default=5000, help="round trips, 1 client")
    parser.add_argument("--pipe", type=int, default=50000, help="pipelined requests, 1 client")
    parser.add_argument("--window", type=int, default=64, help="requests in flight per conn")
    parser.add_argument("--warmup", type=int, default=2000, help="requests per connection")
    parser.add_argument("--keys", type=int, default=32, help="keys per lookup")
    parser.add_argument("--clients", type=int, default=16, help="connections, multi-client")
    parser.add_argument("--client-procs", type=int, default=2, help="processes for them")
    parser.add_argument("--multi-n", type=int, default=1000, help="round trips per conn")
    parser.add_argument("--multi-pipe", type=int, default=5000, help="pipelined per conn")
    parser.add_argument("--cpu", default="1GiB", help="the cpu tier's capacity")
    parser.add_argument("--mib", type=int, default=256, help="MiB stored+loaded per run")
    parser.add_argument("--batch", type=int, default=16, help="blocks per store/load call")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--profile-top", type=int, default=20)
    parser.add_argument("--out", type=Path, default=default_out("daemon"))
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        uvloop.run(echo_main(args.echo_server))
        return 0
    if args.quick:
        args.runs, args.n, args.pipe, args.warmup = 1, 500, 5000, 200
        args.multi_n, args.multi_pipe, args.mib, args.profile = 100, 500, 64, False
    if args.clients % args.client_procs or args.mib * MiB % (args.batch * 2 * MiB):
        parser.error("--clients must divide by --client-procs, --mib by 2 x --batch")
    workdir = Path(tempfile.mkdtemp(prefix="tierd-bench-", dir="/tmp"))  # short socket paths
    try:
        result = measure(args, workdir)
    finally:
        for leftover in workdir.iterdir():
            leftover.unlink()
        workdir.rmdir()
    text = markdown(result, args)
    write_fragment(text, None if args.quick else args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
