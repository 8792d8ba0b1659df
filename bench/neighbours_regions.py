"""A bystander's region loads while a neighbour loads the daemon through its own regions.

A real ``tierd serve`` in a child process, with two tenants told apart by uid (the
bystander and the neighbour; this script runs as root and starts each as a child process
that drops to its uid), or, when not root or with ``--same-user``, two namespaces of the
one tenant of this user. The bystander stores 4 keys once, then loads them back into its
memfd with ``region_load`` every ``--interval-ms`` (4 keys, one job), ``--samples`` times
at most and for ``--phase-s`` seconds at most, and reports the round trip of each job
(p50, p99, max), and after each job the round trip of a ``lookup`` of its keys. It runs
alone, then while the neighbour keeps ``--in-flight`` jobs in flight, each phase with a
fresh neighbour:

- **one key x 4,096**: ``region_load`` jobs of one stored key repeated 4,096 times, each
  copy to its own row of the neighbour's memfd;
- **scattered pieces**: jobs of 64 stored keys cut into 64 pieces each (4,096 pieces a
  job), every piece at a random offset of the memfd;
- **own writes**: jobs of 1,024 stored keys while a thread of the neighbour writes into
  the same memfd without pause (4 MiB at a time through its mapping: the daemon seals a
  region it loads into, so ``pwrite`` is refused; the pages are then contended by the
  daemon's copies and the owner's writes);
- **40 connections**: jobs of 256 stored keys (memory copies out of the CPU tier) from
  40 connections of the neighbour's at once, ``--in-flight`` / 40 (rounded up) on each:
  what one tenant's many engines cost another when fairness is per connection;

and alone again at the end. The daemon's RSS high-water mark (``VmHWM`` of
``/proc/PID/status``) is read before and after each phase; the neighbour's jobs are
counted (done, keys failed, errors by code). Prints a Markdown table and, with ``--out``,
writes the figures as JSON with the commit (``git rev-parse HEAD``) they were measured on.

    scripts/bench neighbours_regions --out /tmp/n.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.figures import median_of

if TYPE_CHECKING:
    from tierd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
BYSTANDER_UID, NEIGHBOUR_UID = 61001, 61002  # only as tenants' uids: no account needed
PHASES = (
    "alone",
    "one key x 4096",
    "scattered pieces",
    "own writes",
    "40 connections",
    "alone again",
)
CONNECTIONS = 40  # the neighbour's, in the phase of that name
JOB_KEYS = 4096
PIECES = 64
WRITES = 4 << 20
START_S = 60.0  # safety nets: the daemon's start, a neighbour's set-up
STOP_S = 30.0


# -- the children ---------------------------------------------------------------------------


def drop_to(uid: int | None) -> None:
    """Become ``uid`` (gid the same, no supplementary groups), after every import: the
    interpreter's own files may be out of that user's reach (root's home)."""
    import numpy.random  # noqa: F401  (the client imports numpy when regions are used)

    import tierd.client  # noqa: F401

    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def memfd(size: int) -> int:
    fd = os.memfd_create("bench-region", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    for offset in range(0, size, WRITES):  # allocated now: no page is created by a copy
        os.pwrite(fd, os.urandom(min(WRITES, size - offset)), offset)
    return fd


async def bystander(args: argparse.Namespace) -> dict[str, Any]:
    """Store 4 keys, then load them every ``interval_ms``: the round trip of each job."""
    import numpy as np

    from tierd.client import Client, DaemonError

    block = args.block_kib << 10
    fd = memfd(8 * block)
    keys = [f"bystander-{os.getpid()}-{i}".encode() for i in range(4)]  # fresh each phase
    front = np.arange(4, dtype=np.uint64).reshape(4, 1) * np.uint64(block)
    back = front + np.uint64(4 * block)
    times: list[float] = []
    lookups: list[float] = []
    failed = errors = 0
    async with await Client.connect(args.socket, namespace="bystander") as client:
        region = await client.register_region(fd, 8 * block)
        if not all(await client.region_store(region, keys, front)):
            raise RuntimeError("the bystander could not store its 4 keys")
        deadline = time.monotonic() + args.phase_s
        due = time.perf_counter()
        while len(times) < args.samples and time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                done = await client.region_load(region, keys, back)
            except DaemonError:
                errors += 1
                done = []
            times.append(time.perf_counter() - started)
            failed += done.count(False) if done else 4
            started = time.perf_counter()
            await client.lookup(keys)
            lookups.append(time.perf_counter() - started)
            due = max(due + args.interval_ms / 1e3, time.perf_counter())
            await asyncio.sleep(due - time.perf_counter())
        exact = os.pread(fd, 4 * block, 4 * block) == os.pread(fd, 4 * block, 0)
    os.close(fd)
    return {
        "seconds": times,
        "lookup_seconds": lookups,
        "keys_failed": failed,
        "errors": errors,
        "byte_exact": exact,
    }


def neighbour_job(kind: str, block: int) -> tuple[int, list[bytes], Any, list[int] | None]:
    """What one neighbour job is: the memfd's size, keys, offsets and pieces."""
    import numpy as np

    rng = np.random.default_rng(7)
    if kind == "one key x 4096":
        offsets = np.arange(JOB_KEYS, dtype=np.uint64).reshape(-1, 1) * np.uint64(block)
        return JOB_KEYS * block, [b"neighbour-0"] * JOB_KEYS, offsets, None
    if kind == "scattered pieces":
        piece = block // PIECES
        size = JOB_KEYS * block
        slots = rng.integers(0, size // piece, size=(JOB_KEYS // PIECES, PIECES))
        keys = [f"neighbour-{i}".encode() for i in range(JOB_KEYS // PIECES)]
        return size, keys, slots.astype(np.uint64) * np.uint64(piece), [piece] * PIECES
    if kind == "40 connections":
        count = 256
        offsets = np.arange(count, dtype=np.uint64).reshape(-1, 1) * np.uint64(block)
        return count * block, [f"neighbour-{i}".encode() for i in range(count)], offsets, None
    count = 1024  # own writes
    offsets = np.arange(count, dtype=np.uint64).reshape(-1, 1) * np.uint64(block)
    return 4 * count * block, [f"neighbour-{i}".encode() for i in range(count)], offsets, None


async def neighbour(args: argparse.Namespace) -> dict[str, Any]:
    """Keep ``in_flight`` jobs of ``args.kind`` in flight until SIGTERM (or the safety
    deadline); prints ``ready`` once the daemon has answered a first job (the others are
    queued behind it by then). The jobs under way at the end are given up (the
    connection closes), not counted."""
    import numpy as np

    from tierd.client import Client, DaemonError

    block = args.block_kib << 10
    size, keys, offsets, pieces = neighbour_job(args.kind, block)
    fd = memfd(size)
    own = mmap.mmap(fd, size)  # the neighbour's writes go through it once the file is sealed
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    counts: dict[str, int] = {"jobs": 0, "keys": 0, "keys_failed": 0, "writes": 0}
    errors: dict[str, int] = {}
    first = asyncio.Event()
    halt = threading.Event()
    many = args.kind == "40 connections"
    clients = [
        await Client.connect(args.socket, namespace="neighbour")
        for _ in range(CONNECTIONS if many else 1)
    ]
    async with contextlib.AsyncExitStack() as opened:
        for each in clients:
            await opened.enter_async_context(each)
        regions = [await each.register_region(fd, size) for each in clients]
        client, region = clients[0], regions[0]
        distinct = list(dict.fromkeys(keys))
        rows = np.arange(len(distinct), dtype=np.uint64).reshape(-1, 1) * np.uint64(block)
        if not all(await client.region_store(region, distinct, rows)):
            raise RuntimeError("the neighbour could not store its keys")

        async def work(i: int) -> None:
            mine, its = clients[i % len(clients)], regions[i % len(clients)]
            while not stop.is_set():
                try:
                    done = await mine.region_load(its, keys, offsets, pieces)
                    counts["keys_failed"] += done.count(False)
                except DaemonError as exc:
                    errors[exc.code] = errors.get(exc.code, 0) + 1
                counts["jobs"] += 1
                counts["keys"] += len(keys)
                first.set()

        writer = threading.Thread(target=scribble, args=(own, size, halt, counts))
        if args.kind == "own writes":
            writer.start()
        in_flight = -(-args.in_flight // len(clients)) * len(clients)  # each its share
        workers = [asyncio.create_task(work(i)) for i in range(in_flight)]
        try:
            async with asyncio.timeout(START_S):
                await first.wait()
            print(json.dumps({"ready": True}), flush=True)
            async with asyncio.timeout(args.phase_s + START_S):  # a safety net
                await stop.wait()
        finally:
            stop.set()
            halt.set()
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if writer.is_alive():
                writer.join()
    os.close(fd)
    return {**counts, "errors": errors}


def scribble(own: mmap.mmap, size: int, halt: threading.Event, counts: dict[str, int]) -> None:
    """Write over the memfd through its mapping (made before it was registered), 4 MiB
    at a time, until ``halt``."""
    chunk = os.urandom(WRITES)
    offset = 0
    while not halt.is_set():
        own[offset : offset + WRITES] = chunk[: size - offset]
        offset = (offset + WRITES) % size
        counts["writes"] += 1


def child_main(args: argparse.Namespace) -> None:
    drop_to(args.uid)
    run = bystander if args.role == "bystander" else neighbour
    print(json.dumps(asyncio.run(run(args))), flush=True)


# -- the orchestrator -----------------------------------------------------------------------


def daemon_config(workdir: Path, args: argparse.Namespace, tenants: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "block_bytes": args.block_kib << 10,
        "tiers": [{"name": "cpu", "kind": "cpu", "capacity": f"{args.cpu_mib}MiB"}],
        "socket": {"path": str(workdir / "tierd.sock"), "mode": 0o666},
        "limits": {"lease_blocks_per_connection": "100%", "lease_blocks_per_tenant": "100%"},
        "logging": {"level": "warning"},
    }
    if tenants:
        config["tenants"] = [
            {"name": "bystander", "uids": [BYSTANDER_UID], "quota": {"cpu": "25%"}},
            {"name": "neighbour", "uids": [NEIGHBOUR_UID], "quota": {"cpu": "75%"}},
        ]
    return config


def start_daemon(workdir: Path, config: dict[str, Any]) -> DaemonProcess:
    """``tierd serve`` of ``config`` (the tierd beside this script), once READY=1."""
    from tierd.testing import start_daemon as serve

    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the tierd beside this script
    log = workdir / "tierd.stderr"
    return serve(config, env=env, log=log, cwd=ROOT, timeout_s=START_S)


def memory_kib(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of ``pid``, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            out[name] = int(value.split()[0])
    return out


def spawn_child(args: argparse.Namespace, role: str, uid: int | None, kind: str = "") -> Any:
    command = [
        sys.executable,
        "-m",
        "bench.neighbours_regions",
        "--role",
        role,
        "--socket",
        args.socket,
    ]
    command += ["--kind", kind, "--in-flight", str(args.in_flight)] if kind else []
    command += ["--uid", str(uid)] if uid is not None else []
    for name in ("block_kib", "samples", "interval_ms", "phase_s"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, env=env, cwd="/")


def read_line(child: Any, timeout: float) -> dict[str, Any]:
    """The child's next JSON line, within ``timeout`` seconds."""
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    line = child.stdout.readline() if ready else b""
    if not line:
        child.kill()
        raise RuntimeError(f"a {child.args[3]} child gave no answer (exit {child.wait()})")
    return dict(json.loads(line))


def run_phase(args: argparse.Namespace, name: str, daemon_pid: int) -> dict[str, Any]:
    uids = (None, None) if args.same_user else (BYSTANDER_UID, NEIGHBOUR_UID)
    before = memory_kib(daemon_pid)
    other = None
    if not name.startswith("alone"):
        other = spawn_child(args, "neighbour", uids[1], name)
        read_line(other, START_S)  # its jobs are in flight
    try:
        watcher = spawn_child(args, "bystander", uids[0])
        seen = read_line(watcher, args.phase_s + START_S)
        watcher.wait(timeout=STOP_S)
    finally:
        load: dict[str, Any] = {}
        if other is not None:
            other.send_signal(signal.SIGTERM)
            load = read_line(other, STOP_S)
            other.wait(timeout=STOP_S)
    after = memory_kib(daemon_pid)
    return {
        "phase": name,
        "bystander": summary(seen),
        "neighbour": load,
        "daemon_kib": {"vmhwm_before": before["VmHWM"], "vmhwm_after": after["VmHWM"]}
        | {"vmrss_after": after["VmRSS"]},
    }


def summary(seen: dict[str, Any]) -> dict[str, Any]:
    ms = sorted(s * 1e3 for s in seen["seconds"])
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    looked = sorted(s * 1e3 for s in seen["lookup_seconds"]) or [0.0]
    return {
        "jobs": len(ms),
        "p50_ms": round(median_of(ms), 3),
        "p99_ms": round(p99, 3),
        "max_ms": round(ms[-1], 3),
        "lookup_p99_ms": round(looked[min(len(looked) - 1, int(len(looked) * 0.99))], 3),
        "lookup_max_ms": round(looked[-1], 3),
        "keys_failed": seen["keys_failed"],
        "errors": seen["errors"],
        "byte_exact": seen["byte_exact"],
    }


def table(phases: list[dict[str, Any]]) -> str:
    alone = phases[0]["bystander"]
    lines = [
        "| phase | bystander p50 | p99 | max | p99 / alone | lookup p99 | max |"
        " jobs (keys failed) | neighbour jobs (keys failed, errors) |"
        " daemon VmHWM before -> after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for phase in phases:
        b, n, mem = phase["bystander"], phase["neighbour"], phase["daemon_kib"]
        theirs = (
            f"{n['jobs']:,} ({n['keys_failed']:,} of {n['keys']:,}, {n['errors'] or 'none'})"
            if n
            else "-"
        )
        lines.append(
            f"| {phase['phase']} | {b['p50_ms']:.2f} ms | {b['p99_ms']:.2f} ms |"
            f" {b['max_ms']:.2f} ms | {b['p99_ms'] / alone['p99_ms']:.1f}x |"
            f" {b['lookup_p99_ms']:.2f} ms | {b['lookup_max_ms']:.2f} ms |"
            f" {b['jobs']:,} ({b['keys_failed']}) | {theirs} |"
            f" {mem['vmhwm_before'] / 1024:.0f} -> {mem['vmhwm_after'] / 1024:.0f} MiB |"
        )
    return "\n".join(lines)


def commit(given: str) -> str:
    """The commit measured: ``given`` (``--commit``, for a ``git archive`` of it), else
    this checkout's HEAD, marked when tracked files differ from it."""
    if given:
        return given
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def orchestrate(args: argparse.Namespace) -> None:
    args.same_user = args.same_user or os.geteuid() != 0
    with tempfile.TemporaryDirectory(prefix="tierd-neighbours-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        os.chmod(workdir, 0o755)  # the tenants' processes reach the socket through it
        config = daemon_config(workdir, args, tenants=not args.same_user)
        daemon = start_daemon(workdir, config)
        args.socket = config["socket"]["path"]
        try:
            phases = [run_phase(args, name, daemon.pid) for name in args.phases]
        finally:
            daemon.stop(timeout_s=STOP_S)
    report = {
        "commit": commit(args.commit),
        "code": str(ROOT),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tenants": "one namespace each, one user" if args.same_user else "two, by uid",
        "block_bytes": args.block_kib << 10,
        "cpu_tier_mib": args.cpu_mib,
        "in_flight": args.in_flight,
        "interval_ms": args.interval_ms,
        "cpus": os.cpu_count(),
        "load_average_after": os.getloadavg()[0],
        "phases": phases,
    }
    print(
        f"commit {report['commit']}; tenants: {report['tenants']}; blocks of"
        f" {args.block_kib} KiB; neighbour: {args.in_flight} jobs in flight"
    )
    print(table(phases))
    print(f"load average {report['load_average_after']:.1f} on {os.cpu_count()} CPUs")
    wrong = [p["phase"] for p in phases if not p["bystander"]["byte_exact"]]
    if wrong:
        print(f"NOT BYTE-EXACT: the bystander's loads in {', '.join(wrong)}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--samples", type=int, default=2000, help="bystander jobs per phase")
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--phase-s", type=float, default=20.0, help="at most, per phase")
    parser.add_argument("--in-flight", type=int, default=64, help="the neighbour's jobs")
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--cpu-mib", type=int, default=512, help="the CPU tier, all tenants")
    parser.add_argument("--same-user", action="store_true", help="two namespaces, one user")
    parser.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(PHASES), help="the phases to run"
    )
    parser.add_argument("--commit", default="", help="the commit measured (not a checkout)")
    parser.add_argument("--role", choices=["bystander", "neighbour"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="", help=argparse.SUPPRESS)
    parser.add_argument("--socket", default="", help=argparse.SUPPRESS)
    parser.add_argument("--uid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.phase_s <= 20 or args.samples < 1 or args.in_flight < 1:
        parser.error("--phase-s must be in (0, 20], --samples and --in-flight at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    arguments = parse(argv)
    if arguments.role is None:
        orchestrate(arguments)
    else:
        child_main(arguments)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
