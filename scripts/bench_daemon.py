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
import asyncio
import contextlib
import glob
import multiprocessing
import os
import platform
import queue
import re
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import uvloop

# Only light imports at the top: client processes are spawned and import this module.

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
HEADER = struct.Struct(">I")
NAMESPACE = "bench"
KEY_BYTES = 32
START_TIMEOUT_S = 60.0


# -- framing (the echo server and the raw client) ----------------------------------------


def frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class Frames:
    """Length-prefixed msgpack frames out of a byte stream (as tierd's FrameDecoder)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self.buf
        buf += data
        out = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if end - pos - 4 < size:
                break
            out.append(msgpack.unpackb(buf[pos + 4 : pos + 4 + size], raw=False))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out


def lookup_keys(count: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * (KEY_BYTES // 4) for i in range(1, count + 1)]


# -- the baseline: a bare echo server (child process) ------------------------------------


class EchoProtocol(asyncio.Protocol):
    """Decodes each request and answers with a lookup-shaped reply of the same size."""

    def __init__(self) -> None:
        self.frames = Frames()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        out = []
        for msg in self.frames.feed(data):
            keys = msg.get("keys") or ()
            reply = {"id": msg.get("id", 0), "ok": True}
            if msg.get("op") == "lookup":
                reply.update(count=len(keys), media=["CPU"] * len(keys), in_flight=False)
            out.append(frame(reply))
        if out:
            self.transport.writelines(out)


async def echo_main(path: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = await loop.create_unix_server(EchoProtocol, path)
    print("ready", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()


# -- the raw client ----------------------------------------------------------------------


class RawClient(asyncio.Protocol):
    """One connection; :meth:`run` sends ``count`` requests keeping ``window`` in flight,
    each next request written from ``data_received`` (replies come back in order)."""

    def __init__(self) -> None:
        self.frames = Frames()
        self.transport: Any = None
        self.next_id = 0
        self.last_reply: dict[str, Any] = {}
        self._done: asyncio.Future[float] | None = None
        self._make: Callable[[int], bytes] = lambda i: b""
        self._left = 0
        self._pending = 0
        self._sent_at: deque[float] | None = None
        self.latencies: list[float] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"the server closed the connection: {exc}"))

    def _request(self) -> bytes:
        self.next_id += 1
        self._left -= 1
        self._pending += 1
        if self._sent_at is not None:
            self._sent_at.append(time.perf_counter())
        return self._make(self.next_id)

    async def run(
        self, make: Callable[[int], bytes], count: int, window: int, timed: bool = False
    ) -> list[float]:
        """Latencies in seconds when ``timed``, else an empty list."""
        self._done = asyncio.get_running_loop().create_future()
        self._make, self._left, self._pending = make, count, 0
        self._sent_at = deque() if timed else None
        self.latencies = []
        self.transport.writelines([self._request() for _ in range(min(window, count))])
        await self._done
        return self.latencies

    def data_received(self, data: bytes) -> None:
        out = []
        now = time.perf_counter()
        for msg in self.frames.feed(data):
            self._pending -= 1
            if self._sent_at is not None:
                self.latencies.append(now - self._sent_at.popleft())
            if msg.get("ok") is not True:
                if self._done is not None and not self._done.done():
                    self._done.set_exception(RuntimeError(f"error reply: {msg}"))
                return
            self.last_reply = msg
            if self._left > 0:
                out.append(self._request())
        if out:
            self.transport.writelines(out)
        done = self._done
        if self._left == 0 and self._pending == 0 and done is not None and not done.done():
            done.set_result(now)


async def raw_connect(path: str) -> RawClient:
    loop = asyncio.get_running_loop()
    _, client = await loop.create_unix_connection(RawClient, path)
    hello = frame({"id": 0, "op": "hello", "version": 1, "namespace": NAMESPACE})
    await client.run(lambda i: hello, 1, 1)
    return client


def lookup_request(keys: list[bytes]) -> Callable[[int], bytes]:
    def make(request_id: int) -> bytes:
        return frame({"id": request_id, "op": "lookup", "keys": keys})

    return make


# -- client processes --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    count: int  # per connection
    window: int
    timed: bool


@dataclass(frozen=True, slots=True)
class ClientPlan:
    path: str
    conns: int  # per process
    keys: int
    warmup: int  # requests per connection, pipelined, before the first phase
    phases: tuple[Phase, ...]


async def _client_body(plan: ClientPlan, barrier: Any) -> dict[str, Any]:
    clients = [await raw_connect(plan.path) for _ in range(plan.conns)]
    make = lookup_request(lookup_keys(plan.keys))
    await asyncio.gather(*(c.run(make, plan.warmup, 16) for c in clients))
    count = clients[0].last_reply.get("count")
    if count != plan.keys:
        raise RuntimeError(f"a lookup of {plan.keys} keys found {count}: not all hits")
    out: dict[str, Any] = {}
    for phase in plan.phases:
        barrier.wait(START_TIMEOUT_S)  # every process starts the phase together
        started = time.perf_counter()
        lats = await asyncio.gather(
            *(c.run(make, phase.count, phase.window, phase.timed) for c in clients)
        )
        out[phase.name] = {
            "start": started,
            "end": time.perf_counter(),
            "requests": phase.count * plan.conns,
            "latencies": [x for lat in lats for x in lat],
        }
    for c in clients:
        c.transport.close()
    return out


def client_process(plan: ClientPlan, barrier: Any, results: Any) -> None:
    try:
        results.put(("ok", uvloop.run(_client_body(plan, barrier))))
    except BaseException:
        barrier.abort()
        results.put(("error", traceback.format_exc()))


def run_clients(plan: ClientPlan, procs: int) -> dict[str, dict[str, float]]:
    """Run ``plan`` in ``procs`` spawned processes; per phase: the median latency (s), the
    aggregate requests/s, from the first start to the last end."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=client_process, args=(plan, barrier, results)) for _ in range(procs)
    ]
    try:
        for w in workers:
            w.start()
        outs = []
        while len(outs) < procs:
            try:
                status, value = results.get(timeout=5)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process died (exit status {dead[0]})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"a client process failed:\n{value}")
            outs.append(value)
        for w in workers:
            w.join(30)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
    figures = {}
    for phase in plan.phases:
        parts = [o[phase.name] for o in outs]
        elapsed = max(p["end"] for p in parts) - min(p["start"] for p in parts)
        lats = [x for p in parts for x in p["latencies"]]
        figures[phase.name] = {
            "latency": statistics.median(lats) if lats else 0.0,
            "rate": sum(p["requests"] for p in parts) / elapsed,
        }
    return figures


# -- server processes --------------------------------------------------------------------

_DAEMON = """
import sys
from tierd.daemon import run_daemon
from tierd.settings import load_settings
config = load_settings(sys.argv[1])
if len(sys.argv) > 2:
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    try:
        status = run_daemon(config)
    finally:
        profile.disable()
        profile.dump_stats(sys.argv[2])
else:
    status = run_daemon(config)
sys.exit(status)
"""


@dataclass
class Servers:
    """The child processes; :meth:`stop_all` ends them (SIGTERM, then SIGKILL)."""

    workdir: Path
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_echo(self, path: str) -> None:
        script = str(Path(__file__).resolve())
        child = subprocess.Popen(
            [sys.executable, script, "--echo-server", path], stdout=subprocess.PIPE
        )
        self.children.append(child)
        ready, _, _ = select.select([child.stdout], [], [], START_TIMEOUT_S)
        line = child.stdout.readline() if ready and child.stdout else b""
        if line.strip() != b"ready":
            raise RuntimeError(f"the echo server did not start (exit status {child.poll()})")

    def start_daemon(self, config: Path, launcher: str, profile: Path | None = None) -> None:
        """Start tierd and wait for its READY=1 (sd_notify) on a socket of ours."""
        notify = str(self.workdir / f"notify-{len(self.children)}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(notify)
            if launcher == "serve" and profile is None:
                argv = [sys.executable, "-m", "tierd", "serve", "-c", str(config)]
            else:
                argv = [sys.executable, "-c", _DAEMON, str(config)]
                argv += [str(profile)] if profile is not None else []
            env = {**os.environ, "NOTIFY_SOCKET": notify}
            log_path = self.workdir / f"daemon-{len(self.children)}.log"
            with log_path.open("wb") as errors:
                child = subprocess.Popen(argv, env=env, stderr=errors)
            self.children.append(child)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and child.poll() is None:
                ready, _, _ = select.select([sock], [], [], 1.0)  # 1 s: to notice an exit
                if ready and b"READY=1" in sock.recv(4096):
                    return
        log = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"tierd did not become ready (exit status {child.poll()}):\n{log}")

    def stop(self, child: subprocess.Popen[bytes]) -> int | None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                # A killed daemon cannot unlink its pool: remove ours, and only ours.
                for pool in glob.glob(f"/dev/shm/tierd-{child.pid}-*"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(pool)
        if child in self.children:
            self.children.remove(child)
        return child.returncode

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)


def daemon_yaml(path: Path, socket_path: str, cpu_capacity: str, block_bytes: str) -> Path:
    path.write_text(
        f"""block_bytes: {block_bytes}
tiers:
  - {{name: cpu, kind: cpu, capacity: {cpu_capacity}, policy: lru}}
socket: {{path: {socket_path}}}
logging: {{level: warning, format: json}}
shutdown: {{grace: 5s, write_back: none}}
"""
    )
    return path


def serve_launcher() -> str:
    from tierd.cli import COMMANDS

    return "serve" if "serve" in COMMANDS else "python -c"


# -- tierd.client: lookups (information) and the zero-copy data path ---------------------


async def store_lookup_keys(path: str, count: int) -> None:
    from tierd.control.client import Client

    async with await Client.connect(path, namespace=NAMESPACE) as client:
        keys = lookup_keys(count)
        await client.store(keys, [bytes(client.block_bytes)] * count)
        found = await client.lookup(keys)
        if found.count != count:
            raise RuntimeError(f"stored {count} keys, a lookup finds {found.count}")


async def tierd_client_lookups(path: str, keys: int, n: int, window: int) -> tuple[float, float]:
    """``tierd.client`` figures: median ``lookup`` round trip (s), pipelined requests/s."""
    from tierd.control.client import Client

    batch = lookup_keys(keys)
    async with await Client.connect(path, namespace=NAMESPACE) as client:
        for _ in range(min(n, 500)):
            await client.lookup(batch)
        lats = []
        for _ in range(n):
            started = time.perf_counter()
            await client.lookup(batch)
            lats.append(time.perf_counter() - started)
        pending: deque[asyncio.Future[dict[str, Any]]] = deque()
        count = 10 * n
        started = time.perf_counter()
        for _ in range(count):
            if len(pending) >= window:
                await pending.popleft()
            pending.append(client.send("lookup", keys=batch))
        for future in pending:
            await future
        rate = count / (time.perf_counter() - started)
    return statistics.median(lats), rate


@dataclass(frozen=True, slots=True)
class DataPlan:
    path: str
    runs: int
    batch: int
    blocks: int  # per run, a multiple of batch


async def data_path(plan: DataPlan) -> dict[str, list[float]]:
    """Per run, bytes/s of: zero-copy store and load through the pool, and the two plain
    copies of the same bytes (into a preallocated buffer, and out of it)."""
    from tierd.control.client import Client

    # ``clear`` drops every namespace's blocks: only a connection without one may send it.
    async with (
        await Client.connect(plan.path, namespace=NAMESPACE) as client,
        await Client.connect(plan.path) as operator,
    ):
        bb, pool = client.block_bytes, client.require_pool()
        srcs = [memoryview(bytearray(os.urandom(64) * (bb // 64))) for _ in range(plan.batch)]
        dsts = [memoryview(bytearray(bb)) for _ in range(plan.batch)]
        buffer = memoryview(bytearray(plan.blocks * bb))  # the baseline's "pool"
        total = plan.blocks * bb
        # Warm-up: touch every pool slot in this process's mapping once (the page
        # faults of a first touch are not the steady state), and the baseline's buffer.
        await _store_load(client, srcs, dsts, pool.num_blocks // plan.batch * plan.batch, "w")
        await operator.clear()
        _copies(buffer, srcs, dsts, plan.blocks)
        out: dict[str, list[float]] = {"store": [], "load": [], "copy_in": [], "copy_out": []}
        for run in range(plan.runs):
            for which in ("base", "tierd") if run % 2 == 0 else ("tierd", "base"):
                if which == "base":
                    t_in, t_out = _copies(buffer, srcs, dsts, plan.blocks)
                    out["copy_in"].append(total / t_in)
                    out["copy_out"].append(total / t_out)
                else:
                    t_in, t_out = await _store_load(client, srcs, dsts, plan.blocks, f"r{run}")
                    out["store"].append(total / t_in)
                    out["load"].append(total / t_out)
                    if bytes(dsts[-1]) != bytes(srcs[-1]):
                        raise RuntimeError("a block loaded back differs from the one stored")
                    await operator.clear()
    return out


def _copies(
    buffer: memoryview, srcs: list[memoryview], dsts: list[memoryview], blocks: int
) -> tuple[float, float]:
    bb, batch = len(srcs[0]), len(srcs)
    started = time.perf_counter()
    for i in range(blocks):
        buffer[i * bb : (i + 1) * bb] = srcs[i % batch]
    copied_in = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(blocks):
        dsts[i % batch][:] = buffer[i * bb : (i + 1) * bb]
    return copied_in, time.perf_counter() - started


async def _store_load(
    client: Any, srcs: list[memoryview], dsts: list[memoryview], blocks: int, tag: str
) -> tuple[float, float]:
    """Seconds to store ``blocks`` new blocks in batches, then to load them back."""
    batch = len(srcs)
    keys = [f"{tag}-{i}".encode() for i in range(blocks)]
    groups = [keys[i : i + batch] for i in range(0, blocks, batch)]
    started = time.perf_counter()
    for group in groups:
        async with client.storing(group) as lease:
            views = lease.views()
            if len(views) != len(group):
                raise RuntimeError(f"{len(group) - len(views)} blocks were already stored")
            for view, src in zip(views, srcs, strict=False):
                view[:] = src
    stored = time.perf_counter() - started
    started = time.perf_counter()
    for group in groups:
        async with client.loading(group) as lease:
            if lease.count != len(group):
                raise RuntimeError(f"loaded {lease.count} of {len(group)} blocks")
            for view, dst in zip(lease.views(), dsts, strict=False):
                dst[:] = view
    return stored, time.perf_counter() - started


# -- the server-side profile -------------------------------------------------------------


def profile_summary(path: Path, top: int) -> tuple[list[tuple[str, int, float, float]], float]:
    """The ``top`` functions by own time: (name, calls, own s, cumulative s); total s."""
    import pstats

    stats = pstats.Stats(str(path))
    rows = []
    entries: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, line, name), (_, calls, own, cum, _) in entries.items():
        short = filename.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        short = re.sub(r"^.*/lib/python3\.\d+/", "", short)  # the standard library
        where = f"{short}:{line}({name})" if line else name
        rows.append((where, calls, own, cum))
    rows.sort(key=lambda r: r[2], reverse=True)
    return rows[:top], stats.total_tt  # type: ignore[attr-defined]


def profile_daemon(
    servers: Servers, args: argparse.Namespace, config: Path
) -> tuple[list[tuple[str, int, float, float]], float, int]:
    """Run tierd under cProfile through one client's round trips and pipelined lookups."""
    prof = servers.workdir / "daemon.prof"
    servers.start_daemon(config, "python -c", profile=prof)
    child = servers.children[-1]
    path = str(config.with_suffix(".sock"))
    uvloop.run(store_lookup_keys(path, args.keys))
    phases = (Phase("rt", args.n, 1, True), Phase("pipe", args.pipe, args.window, False))
    run_clients(ClientPlan(path, 1, args.keys, args.warmup, phases), 1)
    status = servers.stop(child)
    if status != 0 or not prof.exists():
        raise RuntimeError(f"the profiled daemon exited with status {status}")
    rows, total = profile_summary(prof, args.profile_top)
    return rows, total, args.n + args.pipe + args.warmup


# -- orchestration -----------------------------------------------------------------------


@dataclass
class Figures:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def spread(self, name: str, scale: float, fmt: str) -> str:
        v = self.values[name]
        return f"{format(min(v) * scale, fmt)}-{format(max(v) * scale, fmt)}"


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
        servers.start_daemon(config, launcher)
        daemon = servers.children[-1]
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
        "## Daemon: control path and zero-copy data path (`scripts/bench_daemon.py`)",
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
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "daemon.md")
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
    print(text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
