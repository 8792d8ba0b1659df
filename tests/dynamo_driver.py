"""Run inside a private network namespace (``unshare -rn``): NVIDIA Dynamo's standalone KV
indexer subscribed to a tierd daemon's KV events, asked to score a prefix that tierd holds
only in its disk tier (tests/test_kv_events_dynamo.py; docs/events.md, mode 2).

In the namespace only loopback exists (brought up here), so the indexer's HTTP server,
which binds 0.0.0.0 with no host option, is reachable from nowhere else. The daemon runs in
this process's loop (``tierd.testing.running_daemon``), the indexer as a child process
stopped by its PID. Prints one JSON object: what tierd holds where, the indexer's answers.

Usage: python tests/dynamo_driver.py DYNAMO_PYTHON WORKDIR [--restarts | --follow]

With ``--restarts`` the daemon is a process of its own, restarted four ways under the one
indexer (``restarts``): what the indexer credits after each.

With ``--follow`` there is no daemon: the indexer follows an engine's own publisher (mode
1, tests/e2e_vllm/test_vllm_node_events.py), as ``WORKDIR/follow.json`` says
(``endpoint``, ``replay_endpoint``: ipc sockets, which a network namespace does not
hide; ``block_size``: the engine's; ``queries``: token lists by name). Until SIGTERM,
every 0.1 s, the indexer's answer to each query goes to ``WORKDIR/follow-state.json``
(written whole, then renamed): ``{"answers": {name: /query body}, "connected": n,
"registered": ...}``, ``connected`` the indexer's sockets connected to the engine's
publisher (the accepted end of a unix socket belongs to the namespace of the socket that
dialed: it is listed here, not in the engine's).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tierd.client import Client
from tierd.testing import daemon_config, running_daemon, start_daemon

BLOCK_SIZE = 4  # tokens per engine block: the indexer's --block-size
CHAIN = 6  # blocks stored; a CPU tier of 2 leaves the first 4 on disk only
EVENTS_PORT = 5557  # the namespace is private: fixed ports cannot collide
REPLAY_PORT = 5558
HTTP_PORT = 8090
MODEL = "default"
WORKER_ID = 1
NAMESPACE = "model-a"
RESULT = "dynamo-driver-result: "  # the line the test reads (the daemon logs too)
POLLS = 200  # bounded waits: at most POLLS tries, POLL_S apart
POLL_S = 0.05


def loopback_up() -> None:
    """Bring ``lo`` up (a fresh network namespace has it down), by ioctl: no ``ip`` needed."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, siocgifflags, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH14x", got)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def chain() -> tuple[list[bytes], list[dict[str, Any]], list[int]]:
    """Keys, descriptions (one engine block each, parent-linked) and the token sequence."""
    keys = [f"block-{i}".encode() for i in range(CHAIN)]
    tokens = [100 + t for t in range(CHAIN * BLOCK_SIZE)]
    descs = [
        {
            "hashes": [7000 + i],
            "parent": None if i == 0 else 7000 + i - 1,
            "tokens": tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE],
            "block_size": BLOCK_SIZE,
            "lora_name": None,
        }
        for i in range(CHAIN)
    ]
    return keys, descs, tokens


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no *_proxy variables


def http(method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request to the indexer on loopback: (status, decoded JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{HTTP_PORT}{path}",
        data=data,
        method=method,
        headers={"content-type": "application/json"},
    )
    try:
        with _DIRECT.open(req, timeout=5) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def start_indexer(
    dynamo_python: str, log: Path, block_size: int = BLOCK_SIZE
) -> subprocess.Popen[bytes]:
    """The indexer with no worker yet: ``register`` adds tierd with its replay endpoint."""
    cmd = [dynamo_python, "-m", "dynamo.indexer", "--block-size", str(block_size)]
    cmd += ["--port", str(HTTP_PORT), "--threads", "1", "--model-name", MODEL]
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )


def _die_with_parent() -> None:
    """In the child: SIGKILL when this driver dies, so a killed driver leaves no indexer."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def register() -> tuple[int, Any]:
    """tierd's publisher as worker 1 (what ``--workers 1=tcp://...`` does, plus the replay
    endpoint, which ``--workers`` cannot name: a batch the subscriber missed is asked
    again instead of lost)."""
    return http(
        "POST",
        "/register",
        {
            "instance_id": WORKER_ID,
            "model_name": MODEL,
            "endpoint": f"tcp://127.0.0.1:{EVENTS_PORT}",
            "replay_endpoint": f"tcp://127.0.0.1:{REPLAY_PORT}",
            "block_size": BLOCK_SIZE,
        },
    )


async def wait_healthy(proc: subprocess.Popen[bytes]) -> None:
    for _ in range(POLLS):
        if proc.poll() is not None:
            raise RuntimeError(f"the indexer exited with status {proc.returncode}")
        try:
            if (await asyncio.to_thread(http, "GET", "/health"))[0] == 200:
                return
        except OSError:
            pass  # not listening yet: asked again, at most POLLS times
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"the indexer did not answer /health in {POLLS * POLL_S:.0f} s")


def query(tokens: list[int]) -> tuple[int, Any]:
    return http("POST", "/query", {"token_ids": tokens, "model_name": MODEL})


async def wait_scored(tokens: list[int], want: int) -> tuple[int, Any]:
    """Ask until worker 1's disk tier matches ``want`` tokens (bounded); the last answer."""
    answer: tuple[int, Any] = (0, None)
    for _ in range(POLLS):
        answer = await asyncio.to_thread(query, tokens)
        if answer[0] == 200 and score_of(answer[1], "disk") >= want:
            break
        await asyncio.sleep(POLL_S)
    return answer


def score_of(body: Any, field: str = "longest_matched") -> int:
    """Worker 1's figure in a /query answer: ``scores`` counts device (GPU) blocks only;
    ``instances`` has, per worker, the longest match over every tier and per tier."""
    if not isinstance(body, dict) or not isinstance(body.get("instances"), dict):
        return 0
    mine = body["instances"].get(str(WORKER_ID))
    return int(mine.get(field, 0)) if isinstance(mine, dict) else 0


def signed64(value: int) -> int:
    """The dump prints its u64 hashes unsigned; /query_by_hash takes them as i64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def by_hash(dump: Any, hashes: list[int]) -> tuple[int, Any]:
    """/query_by_hash with the indexer's own hashes of the blocks (``tokens_hash`` in its
    dump) of the engine hashes ``hashes``, in that order."""
    events = dump.get(f"{MODEL}:default", {}).get("events", []) if isinstance(dump, dict) else []
    ours: dict[int, int] = {}
    for event in events:
        for block in event["event"]["data"].get("stored", {}).get("blocks", []):
            ours[int(block["block_hash"])] = signed64(int(block["tokens_hash"]))
    wanted = [ours[h] for h in hashes if h in ours]
    return http("POST", "/query_by_hash", {"block_hashes": wanted, "model_name": MODEL})


def probe(i: int) -> tuple[bytes, dict[str, Any]]:
    """Probe block ``i``: one engine block with tokens of its own, outside the chain."""
    tokens = [50_000 + i * BLOCK_SIZE + t for t in range(BLOCK_SIZE)]
    return f"probe-{i}".encode(), {
        "hashes": [90_000 + i],
        "parent": None,
        "tokens": tokens,
        "block_size": BLOCK_SIZE,
    }


async def subscribed(client: Client) -> int:
    """Store probe blocks until the indexer holds the first: its subscription is then
    live (a batch it missed before is replayed on the next one it gets, so each try
    stores one more). Returns the probes stored."""
    first = probe(1)[1]["tokens"]
    for i in range(1, POLLS + 1):
        key, desc = probe(i)
        await client.describe([key], [desc])
        await client.put([key], [key.ljust(4096, b".")])
        if score_of((await asyncio.to_thread(query, first))[1]) >= BLOCK_SIZE:
            return i
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"the indexer held none of {POLLS} probe blocks")


async def store_chain(client: Client) -> dict[str, Any]:
    keys, descs, _ = chain()
    await client.describe(keys, descs)
    for key in keys:  # one at a time: the CPU tier of 2 demotes the oldest to disk
        await client.put([key], [key.ljust(4096, b".")])
    hashes = [d["hashes"][0] for d in descs]
    media: list[str] = []
    for _ in range(POLLS):  # the feed follows the chain's events within a batch
        media = (await client.blocks_held([hashes]))[0]
        if len(media) == CHAIN and media.count("DISK") == CHAIN - 2:
            break
        await asyncio.sleep(POLL_S)
    lookup = await client.lookup(keys)
    return {"blocks_held": media, "lookup_media": [str(m) for m in lookup.media]}


async def exercise(client: Client) -> dict[str, Any]:
    """Probe, store the chain, then ask the indexer about it and about its disk prefix."""
    probes = await subscribed(client)
    held = await store_chain(client)
    _, _, tokens = chain()
    on_disk = held["blocks_held"].count("DISK")
    status, body = await wait_scored(tokens, on_disk * BLOCK_SIZE)
    prefix = await asyncio.to_thread(query, tokens[: on_disk * BLOCK_SIZE])
    other = await asyncio.to_thread(query, [t + 1 for t in tokens])  # never stored
    dump = await asyncio.to_thread(http, "GET", "/dump")
    engine = [int(d["hashes"][0]) for d in chain()[1]]
    hashed = await asyncio.to_thread(by_hash, dump[1], engine)
    engine_hashed = await asyncio.to_thread(
        http, "POST", "/query_by_hash", {"block_hashes": engine, "model_name": MODEL}
    )
    return {
        "probes": probes,
        **held,
        "query": {"status": status, "body": body},
        "query_disk_prefix": {"status": prefix[0], "body": prefix[1]},
        "query_other": {"status": other[0], "body": other[1]},
        "query_by_hash_tokens_hash": {"status": hashed[0], "body": hashed[1]},
        "query_by_hash_engine_hash": {"status": engine_hashed[0], "body": engine_hashed[1]},
        "dump": {"status": dump[0], "body": dump[1]},
    }


async def run(dynamo_python: str, work: Path) -> dict[str, Any]:
    kv = {
        "enabled": True,
        "endpoint": f"tcp://127.0.0.1:{EVENTS_PORT}",
        "replay_endpoint": f"tcp://127.0.0.1:{REPLAY_PORT}",
        "anyone_may_read": True,  # the indexer dials tcp, as a router on another host does
        "batch_s": 0.001,
    }
    config = daemon_config(work, cpu_blocks=2, disk_blocks=16, kv_events=kv)
    async with running_daemon(config) as daemon:  # publishing before the indexer dials
        proc = start_indexer(dynamo_python, work / "indexer.log")
        try:
            await wait_healthy(proc)
            registered = await asyncio.to_thread(register)
            if registered[0] not in (200, 201):
                raise RuntimeError(f"the indexer refused the worker: {registered}")
            sock = str(daemon.config.socket.path)
            async with await Client.connect(sock, namespace=NAMESPACE) as client:
                return await exercise(client)
        finally:
            stop(proc)


def wiped(work: Path) -> None:
    """The disk tier's directory emptied, as a node whose disk was replaced."""
    for path in (work / "disk").iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


async def credited(tokens: list[int], want: int) -> int:
    """Ask until worker 1's longest match is ``want`` tokens (bounded); the last one."""
    got = -1
    for _ in range(POLLS):
        answer = await asyncio.to_thread(query, tokens)
        got = score_of(answer[1]) if answer[0] == 200 else -1
        if got == want:
            return got
        await asyncio.sleep(POLL_S)
    return got


async def held_after(client: Client, hashes: list[int]) -> int:
    """Leading blocks of ``hashes`` the node holds, once its kept blocks are adopted
    (the answer stops changing)."""
    last = -1
    for _ in range(POLLS):
        now = len((await client.blocks_held([hashes]))[0])
        if now == last:
            return now
        last = now
        await asyncio.sleep(0.2)
    return last


async def restarts(dynamo_python: str, work: Path) -> dict[str, Any]:
    """One indexer, connected throughout, and a daemon process restarted four ways
    (SIGTERM or SIGKILL, its disk kept or wiped): after each, the indexer's longest match
    for the chain is what the node holds, and a block stored after the restart is
    credited too."""
    kv = {
        "enabled": True,
        "endpoint": f"tcp://127.0.0.1:{EVENTS_PORT}",
        "replay_endpoint": f"tcp://127.0.0.1:{REPLAY_PORT}",
        "anyone_may_read": True,
        "batch_s": 0.001,
    }
    config = daemon_config(work, cpu_blocks=2, disk_blocks=16, kv_events=kv)
    _, descs, tokens = chain()
    hashes = [d["hashes"][0] for d in descs]
    daemon = start_daemon(config, log=work / "tierd-0.log")
    proc = start_indexer(dynamo_python, work / "indexer.log")
    results: dict[str, Any] = {}
    try:
        await wait_healthy(proc)
        registered = await asyncio.to_thread(register)
        if registered[0] not in (200, 201):
            raise RuntimeError(f"the indexer refused the worker: {registered}")
        sock = str(daemon.socket)
        async with await Client.connect(sock, namespace=NAMESPACE) as client:
            await subscribed(client)
            await store_chain(client)
        results["before"] = await credited(tokens, CHAIN * BLOCK_SIZE)
        for n, (how, wipe) in enumerate(
            [
                (signal.SIGTERM, False),
                (signal.SIGKILL, False),
                (signal.SIGTERM, True),
                (signal.SIGKILL, True),
            ]
        ):
            name = f"{signal.Signals(how).name}{' wiped' if wipe else ''}"
            async with await Client.connect(sock, namespace=NAMESPACE) as client:
                await store_chain(client)  # (again, after a wipe)
            if how == signal.SIGTERM:
                daemon.stop()
            else:
                daemon.kill()
            if wipe:
                wiped(work)
            daemon = start_daemon(config, log=work / f"tierd-{n + 1}.log")
            async with await Client.connect(sock, namespace=NAMESPACE) as client:
                held = await held_after(client, hashes)
                got = await credited(tokens, held * BLOCK_SIZE)
                key, desc = probe(1000 + n)  # stored after the restart
                await client.describe([key], [desc])
                await client.put([key], [key.ljust(4096, b".")])
                fresh = await credited(desc["tokens"], BLOCK_SIZE)
            results[name] = {"held": held, "credited": got, "fresh": fresh}
        return results
    finally:
        stop(proc)
        daemon.stop()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the indexer by its PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def connections(endpoint: str) -> int:
    """Sockets of this network namespace connected to the ipc socket at ``endpoint``: the
    accepted ends (state 03), which /proc/net/unix lists under the socket's path."""
    path = endpoint.removeprefix("ipc://")
    rows = (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
    return sum(1 for row in rows if len(row) >= 8 and row[7] == path and row[5] == "03")


async def follow(dynamo_python: str, work: Path) -> dict[str, Any]:
    """The indexer on an engine's publisher (see the module's docstring), until SIGTERM."""
    spec = json.loads((work / "follow.json").read_text())
    block_size = int(spec["block_size"])
    proc = start_indexer(dynamo_python, work / "indexer.log", block_size)
    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    state = work / "follow-state.json"
    try:
        await wait_healthy(proc)
        worker = {
            "instance_id": WORKER_ID,
            "model_name": MODEL,
            "endpoint": spec["endpoint"],
            "replay_endpoint": spec["replay_endpoint"],
            "block_size": block_size,
        }
        registered = await asyncio.to_thread(http, "POST", "/register", worker)
        if registered[0] not in (200, 201):
            raise RuntimeError(f"the indexer refused the worker: {registered}")
        while not stopped.is_set():
            answers = {}
            for name, tokens in spec["queries"].items():
                answers[name] = (await asyncio.to_thread(query, tokens))[1]
            connected = connections(spec["endpoint"])
            partial = state.with_suffix(".tmp")
            now = {"answers": answers, "connected": connected, "registered": registered}
            partial.write_text(json.dumps(now))
            partial.replace(state)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), 0.1)
        return {"registered": registered}
    finally:
        stop(proc)


def main() -> int:
    dynamo_python, work = sys.argv[1], Path(sys.argv[2])
    loopback_up()
    modes = {"--restarts": restarts, "--follow": follow}
    mode = modes[sys.argv[3]] if sys.argv[3:] else run
    result = asyncio.run(mode(dynamo_python, work))
    print(RESULT + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
