"""The soak and chaos campaign against a real tierd daemon.

Used by ``scripts/soak`` (the 10-minute run) and ``tests/test_soak.py`` (the CI run).

A :class:`Campaign` runs the daemon of :func:`soak_config` in a child process
(``tests/soak_daemon.py serve``: a real daemon on a loopback Unix socket, its disk tier on
a fault-injecting file layer) and drives it for a while with:

- ``clients`` :class:`Worker` tasks, each on its own connection: lookup the leading blocks
  of a random request (prefix chains of ``seq_len`` keys, Zipf popularity, a key space
  several times the tiers), load the hits through the shared pool and verify every byte,
  store the rest through the pool (:meth:`tierd.client.Client.store`), touch now and then;
- a :class:`Fuzzer` on a connection of its own (random bytes, random msgpack maps with the
  protocol's op names, valid frames flipped, truncated or padded), reading every reply;
- a :class:`StuckSubscriber` that subscribes to events and never reads its socket;
- two fault lanes at seeded random times: the *process lane* SIGKILLs the daemon (a
  *checkpoint* kill after a durability snapshot, or a *hot* kill under full load) and
  restarts it, and SIGKILLs clients holding a store or a load lease; the *disk lane* runs
  episodes of injected write EIO, write ENOSPC, a full disk (torn block writes and journal
  ENOSPC), read EIO and a slow disk.

Durability check (each checkpoint kill, and the final clean restart): stop the load and
the fuzzer, wait until the daemon is idle (no pin, no block in flight, no lease, no stray
connection), ``flush``, ``clear`` the CPU tier, and look every key up: what is present now
is on the disk tier. SIGKILL, restart, and every one of those keys must be served back
byte-identical; a key that is not is *lost*. Blocks the disk tier evicted earlier for room
are never counted as lost, because the set is read from the daemon right before the kill.

At the end: the load stops, every key the daemon still holds is loaded and verified, pins,
in-flight blocks and leases must be back to zero, the daemon's resident memory must stay
within the rule of :func:`judge`, and a SIGTERM must exit 0. :func:`judge` lists the
reasons a run fails; :func:`render` draws the table of a report.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import yaml

TESTS = Path(__file__).resolve().parent
for _path in (str(TESTS.parent), str(TESTS)):
    if _path not in sys.path:
        sys.path.insert(1, _path)

from soak_daemon import FaultControl, FaultPlan, content  # noqa: E402
from soak_hostile import GUARD_LIMITS, Hostile, RealFullDisk  # noqa: E402

from tierd.client import Client, DaemonError, Unreachable  # noqa: E402
from tierd.control.protocol import (  # noqa: E402
    HEADER,
    OPERATIONS,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameDecoder,
    encode,
)
from tierd.errors import ProtocolError  # noqa: E402

RUNNER = TESTS / "soak_daemon.py"
NAMESPACE = "soak"
FUZZ_NAMESPACE = "soak-fuzz"
DEADLINE_S = 60.0  # safety net for one request, one quiescence, one holder
START_DEADLINE_S = 180.0  # a daemon's start: imports torch, may rebuild the disk index
RSS_FACTOR, RSS_SLACK_KIB = 2.0, 64 << 10  # end <= 2 x warm + 64 MiB, per incarnation
CODES = frozenset(str(code) for code in ErrorCode)
# Error codes after which the daemon hangs up (the client's view of a dead connection).
_HANGUP = frozenset({"not_allowed", "busy", "shutting_down", "frame_too_large"})

DISK_EPISODES: dict[str, FaultPlan] = {
    "disk_write_eio": FaultPlan(write_rate=0.3, write_mode="eio"),
    "disk_write_enospc": FaultPlan(write_rate=0.3, write_mode="enospc"),
    "disk_full": FaultPlan(write_rate=0.5, write_mode="short", journal_rate=0.5),
    "disk_read_eio": FaultPlan(read_rate=0.3),
    "disk_slow": FaultPlan(slow_s=0.02),
    "disk_real_full": FaultPlan(),  # no injection: a real tmpfs filled up (root only)
}
# The fault layer's counter that shows an episode really injected something.
EPISODE_COUNTERS = {
    "disk_write_eio": "write_eio",
    "disk_write_enospc": "write_enospc",
    "disk_full": "write_short",
    "disk_read_eio": "read_eio",
    "disk_slow": "slow",
}
PROCESS_FAULTS = ("daemon_sigkill_checkpoint", "daemon_sigkill_hot")
CLIENT_FAULTS = ("client_killed_mid_store", "client_killed_mid_load")
STEADY_FAULTS = ("stuck_subscriber", "fuzz_connection")
FAULT_KINDS = (*PROCESS_FAULTS, *CLIENT_FAULTS, *DISK_EPISODES, *STEADY_FAULTS)


@dataclass(frozen=True, slots=True)
class Settings:
    """One campaign: its length, its load and the daemon's (small) tiers."""

    seconds: float = 600.0
    clients: int = 16
    seed: int = 1
    block_bytes: int = 64 << 10
    cpu_blocks: int = 64
    disk_blocks: int = 512
    sequences: int = 384  # prefix chains: 1536 keys against 576 slots in all
    seq_len: int = 4
    # Lease bounds (the daemon's defaults; a tiny tier of a focused test, filled by one
    # lease, lifts them: they are tested in tests/test_leases.py).
    lease_per_connection: str = "50%"
    lease_per_tenant: str = "75%"
    fuzz_frames_per_s: float = 100.0

    @property
    def key_space(self) -> int:
        return self.sequences * self.seq_len


def soak_config(
    workdir: Path, socket_path: str, settings: Settings, full_disk: Path | None = None
) -> dict[str, Any]:
    """The daemon's config: a CPU pool over a disk tier in ``workdir``, both small (with
    ``full_disk``, a second directory of the disk tier: a tmpfs that episodes fill)."""
    disk = workdir / "disk"
    disk.mkdir(mode=0o700, parents=True, exist_ok=True)
    directories = [str(disk)] + ([str(full_disk)] if full_disk is not None else [])
    return {
        "block_bytes": settings.block_bytes,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": settings.cpu_blocks},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": settings.disk_blocks,
                "directories": directories,
            },
        ],
        "socket": {"path": socket_path},
        "limits": {
            "max_frame_bytes": max(256 << 10, 2 * settings.block_bytes + (64 << 10)),
            "lease_blocks_per_connection": settings.lease_per_connection,
            "lease_blocks_per_tenant": settings.lease_per_tenant,
            **GUARD_LIMITS,
        },
        "shutdown": {"write_back": "flush", "grace": 30},
        "events": {"queue_batches": 64},
        "logging": {"format": "json", "level": "info"},
    }


# -- bookkeeping ---------------------------------------------------------------------------


class KeySpace:
    """``sequences`` prefix chains of ``seq_len`` keys; chain ``i`` is picked with weight
    ``1 / (i + 1) ** 0.9`` (a few hot prompts, a long tail)."""

    def __init__(self, sequences: int, seq_len: int) -> None:
        self.sequences, self.seq_len = sequences, seq_len
        self._cum = list(itertools.accumulate(1.0 / (i + 1) ** 0.9 for i in range(sequences)))

    def keys(self, sequence: int) -> list[bytes]:
        return [f"s{sequence:05d}-b{i}".encode() for i in range(self.seq_len)]

    def pick(self, rng: random.Random) -> list[bytes]:
        return self.keys(rng.choices(range(self.sequences), cum_weights=self._cum)[0])

    def all_keys(self) -> list[bytes]:
        return [k for s in range(self.sequences) for k in self.keys(s)]


@dataclass
class Tally:
    """What the clients did and saw. ``wrong`` counts blocks with any wrong byte."""

    block_bytes: int
    started: float = field(default_factory=time.monotonic)
    ops: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    per_second: Counter[int] = field(default_factory=Counter)
    wrong: int = 0
    wrong_examples: list[str] = field(default_factory=list)

    def op(self, kind: str) -> None:
        self.ops[kind] += 1
        self.per_second[int(time.monotonic() - self.started)] += 1

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    def verify(self, keys: Sequence[bytes], blocks: Sequence[bytes], where: str) -> int:
        """Check each block against its key's bytes; returns how many were wrong."""
        bad = 0
        for key, data in zip(keys, blocks, strict=False):
            self.blocks["verified"] += 1
            if data != content(key, self.block_bytes):
                bad += 1
                if len(self.wrong_examples) < 20:
                    self.wrong_examples.append(f"{where}: {key!r} ({len(data)} bytes)")
        self.wrong += bad
        return bad


class Gate:
    """Lets the load run in turns; :meth:`close` waits until no turn is running."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = 0

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        await self._open.wait()
        self._busy += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    async def close(self) -> None:
        self._open.clear()
        async with asyncio.timeout(DEADLINE_S * 2):
            await self._idle.wait()

    def open(self) -> None:
        self._open.set()


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, DaemonError):
        return exc.code
    if isinstance(exc, Unreachable):
        return "unreachable"
    if isinstance(exc, ProtocolError):
        return f"protocol:{exc.code}"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return type(exc).__name__


# -- the load --------------------------------------------------------------------------------


class Worker:
    """One client connection running lookup / load (verified) / store / touch rounds,
    reconnecting (with a 0.2 s back-off, as an engine would) while the daemon is down."""

    def __init__(
        self, path: str, keys: KeySpace, tally: Tally, gate: Gate, rng: random.Random
    ) -> None:
        self.path, self.keys, self.tally, self.gate, self.rng = path, keys, tally, gate, rng
        self.client: Client | None = None

    async def run(self, stop: asyncio.Event, rounds: int | None = None) -> None:
        done = 0
        try:
            while not stop.is_set() and (rounds is None or done < rounds):
                backoff = 0.0
                async with self.gate.turn():
                    if stop.is_set():
                        break
                    if self.client is None:
                        backoff = 0.0 if await self._connect() else 0.2
                    else:
                        await self._round()
                        done += 1
                if backoff:
                    await asyncio.sleep(backoff)  # the daemon is down: retry later
        finally:
            await self.drop()

    async def _connect(self) -> bool:
        try:
            async with asyncio.timeout(DEADLINE_S):
                self.client = await Client.connect(
                    self.path, namespace=NAMESPACE, block_bytes=self.tally.block_bytes
                )
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.tally.error(f"connect:{_error_kind(exc)}")
            return False
        self.tally.blocks["connects"] += 1
        return True

    async def drop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(DEADLINE_S):
                    await client.close()

    async def _round(self) -> None:
        client = self.client
        if client is None:
            return
        keys, tally = self.keys.pick(self.rng), self.tally
        try:
            async with asyncio.timeout(DEADLINE_S):
                found = await client.lookup(keys)
                tally.op("lookup")
                if found.count:
                    blocks = await client.load(keys[: found.count])
                    tally.op("load")
                    tally.verify(keys, blocks, "load")
                    tally.blocks["loaded"] += len(blocks)
                    tally.blocks["load_shortfall"] += found.count - len(blocks)
                if found.count < len(keys):
                    size = tally.block_bytes
                    tally.blocks["stored"] += await client.store(
                        keys, [content(k, size) for k in keys]
                    )
                    tally.op("store")
                if self.rng.random() < 0.1:
                    await client.touch(keys)
                    tally.op("touch")
        except (DaemonError, Unreachable, ProtocolError, OSError, TimeoutError) as exc:
            kind = _error_kind(exc)
            tally.error(kind)
            if not isinstance(exc, DaemonError) or kind in _HANGUP:
                await self.drop()


# -- the fuzzer ------------------------------------------------------------------------------

OPS = list(OPERATIONS)
FIELDS = ("keys", "lease", "ok", "data", "tier", "namespace", "version", "block_bytes", "id")


class Fuzzer:
    """Bad frames on a connection of its own, at about ``rate`` frames per second; reads
    every reply and checks it (a map with ``ok``, an error code of the closed set, never
    ``internal``). ``counts``: frames, bad_frames, replies, internal, malformed, ..."""

    def __init__(
        self, path: str, rng: random.Random, gate: Gate, block_bytes: int, rate: float = 100.0
    ) -> None:
        self.path, self.rng, self.gate, self.rate = path, rng, gate, rate
        self.block_bytes = block_bytes
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._named = False  # whether this connection's hello named a namespace

    async def run(self, stop: asyncio.Event, frames: int | None = None) -> None:
        try:
            while not stop.is_set() and (frames is None or self.counts["frames"] < frames):
                pause = 0.0
                async with self.gate.turn():
                    if stop.is_set():
                        break
                    if self._writer is None or self._writer.is_closing():
                        await self.disconnect()
                        pause = 0.0 if await self._connect() else 0.2
                    else:
                        burst = self.rng.randint(1, 10)
                        await self._send_burst(burst)
                        pause = burst / self.rate
                await asyncio.sleep(pause)  # the pace of the fuzzing, not a synchronisation
        finally:
            await self.disconnect()

    async def _connect(self) -> bool:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError:
            self.counts["refused"] += 1
            return False
        self.counts["connections"] += 1
        self._writer = writer
        self._reading = asyncio.create_task(self._read(reader))
        roll = self.rng.random()
        self._named = roll < 0.8
        if roll < 0.9:
            hello: dict[str, Any] = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION}
            if self._named:
                hello["namespace"] = FUZZ_NAMESPACE
            writer.write(encode(hello))
        return True

    async def disconnect(self) -> None:
        writer, self._writer = self._writer, None
        reading, self._reading = self._reading, None
        if writer is not None:
            # Abort, not close: a close waits to flush what the daemon will not read while
            # its own replies to us are unread (both sides full), and hangs for good.
            writer.transport.abort()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(DEADLINE_S):
                    await writer.wait_closed()
        if reading is not None:
            await asyncio.wait([reading], timeout=DEADLINE_S)

    async def _send_burst(self, count: int) -> None:
        writer = self._writer
        if writer is None:
            return
        broken = False
        for _ in range(count):
            frame, bad, breaks = self._frame()
            writer.write(frame)
            self.counts["frames"] += 1
            self.counts["bad_frames"] += bad
            broken = broken or breaks
        try:
            async with asyncio.timeout(DEADLINE_S):
                await writer.drain()
        except (OSError, TimeoutError):
            broken = True
        # Framing lost (or just time for a fresh connection): start over, as a client would.
        if (broken and self.rng.random() < 0.5) or self.rng.random() < 0.02:
            await self.disconnect()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = FrameDecoder(1 << 30)
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                try:
                    messages = decoder.feed(data)
                except ProtocolError:
                    self._bad_reply("an undecodable frame length")
                    return
                for message in messages:
                    self._check(message)
        self.counts["hangups"] += 1

    def _check(self, message: Any) -> None:
        self.counts["replies"] += 1
        if isinstance(message, ProtocolError) or not isinstance(message, dict):
            self._bad_reply(f"not a map: {message!r:.80}")
        elif "push" in message:
            self.counts["pushes"] += 1
        elif not isinstance(message.get("ok"), bool):
            self._bad_reply(f"no ok: {message!r:.80}")
        elif not message["ok"]:
            code = message.get("error")
            self.counts[f"error:{code}"] += 1
            if code == ErrorCode.INTERNAL:
                self.counts["internal"] += 1
                self._example(f"internal: {message.get('message')!r:.200}")
            elif code not in CODES:
                self._bad_reply(f"unknown error code {code!r:.40}")

    def _bad_reply(self, what: str) -> None:
        self.counts["malformed"] += 1
        self._example(what)

    def _example(self, what: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(what)

    # -- frames ---------------------------------------------------------------------------

    def _frame(self) -> tuple[bytes, bool, bool]:
        """(frame, whether it is bad, whether it breaks the framing)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return encode(self._valid()), False, False
        if roll < 0.45:
            return self._mutated(encode(self._valid()))
        if roll < 0.8:
            return encode(self._random_map()), True, False
        if roll < 0.95:
            body = rng.randbytes(rng.randint(0, 200))
            return HEADER.pack(len(body)) + body, True, False
        return rng.randbytes(rng.randint(1, 64)), True, True

    def _key(self) -> bytes:
        return f"f{self.rng.randint(0, 63)}".encode()

    def _valid(self) -> dict[str, Any]:
        rng = self.rng
        keys = [self._key() for _ in range(rng.randint(1, 4))]
        keys = list(dict.fromkeys(keys))
        request: dict[str, Any] = rng.choice(
            [
                {"op": "lookup", "keys": keys},
                {"op": "touch", "keys": keys},
                {"op": "prepare_load", "keys": keys},
                {"op": "prepare_store", "keys": keys},
                {"op": "complete_store", "lease": rng.randint(0, 50), "ok": True},
                {"op": "complete_load", "lease": rng.randint(0, 50)},
                {"op": "abort_store", "lease": rng.randint(0, 50)},
                {"op": "get", "keys": keys},
                {"op": "put", "keys": keys[:1], "data": [bytes(self.block_bytes)]},
                {"op": "stats"},
                {"op": "health"},
                {"op": "subscribe"},
                {"op": "unsubscribe"},
            ]
        )
        return {"id": rng.randint(1, 1 << 20), **request}

    def _mutated(self, frame: bytes) -> tuple[bytes, bool, bool]:
        rng, data = self.rng, bytearray(frame)
        how = rng.random()
        if how < 0.6:  # flip bytes of the body (the length stays right)
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(HEADER.size, len(data)) if len(data) > HEADER.size else 0
                data[pos] ^= 1 << rng.randrange(8)
            return bytes(data), True, False
        if how < 0.8:  # truncated: the daemon reads the next frame's bytes as its rest
            return bytes(data[: rng.randrange(1, len(data))]), True, True
        if how < 0.9:  # a length header that lies
            data[: HEADER.size] = HEADER.pack(rng.randrange(0, 1 << 20))
            return bytes(data), True, True
        return bytes(data) + rng.randbytes(rng.randint(1, 16)), True, True

    def _random_map(self) -> dict[str, Any]:
        rng = self.rng
        ops = OPS if self._named else [op for op in OPS if op not in ("clear", "stop")]
        message: dict[str, Any] = {"id": self._value(0), "op": rng.choice(ops)}
        if rng.random() < 0.1:
            message["op"] = self._value(0)
        if rng.random() < 0.05:
            del message["id"]
        for name in rng.sample(FIELDS, rng.randint(0, 3)):
            message[name] = self._value(0)
        return message

    def _value(self, depth: int) -> Any:
        rng = self.rng
        kind = rng.randrange(10 if depth < 2 else 7)
        if kind == 0:
            return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randint(0, 99)])
        if kind == 1:
            return rng.choice([0.5, -1e300, float("inf"), float("nan")])
        if kind == 2:
            return rng.choice(["", "x" * rng.randint(1, 300), FUZZ_NAMESPACE, "a/b", "\u00e9"])
        if kind == 3:
            return rng.randbytes(rng.choice([0, 1, 8, 56, 57, 64, 65, self.block_bytes]))
        if kind == 4:
            return rng.choice([True, False])
        if kind == 5:
            return None
        if kind == 6:
            return [self._key() for _ in range(rng.randint(0, 5))]
        if kind == 7:
            return [self._value(depth + 1) for _ in range(rng.randint(0, 4))]
        if kind == 8:
            return {str(self._value(2)): self._value(depth + 1) for _ in range(rng.randint(0, 3))}
        return msgpack.ExtType(rng.randint(0, 127), rng.randbytes(4))


class StuckSubscriber:
    """A client that subscribes to events and never reads its socket (small receive
    buffer, so the daemon's side fills quickly)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.sock.settimeout(DEADLINE_S)
            self.sock.connect(path)
            hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NAMESPACE}
            self.sock.sendall(encode(hello) + encode({"id": 2, "op": "subscribe"}))
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()


# -- processes -------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """This environment without anything that would configure the daemon."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("TIERD_") and k != "NOTIFY_SOCKET"
    }


class DaemonFailed(RuntimeError):
    """The daemon did not start (the message holds the end of its log)."""


class DaemonProcess:
    """The daemon of ``config`` as a child process (``soak_daemon.py serve``); each start
    is a new *incarnation* with its own log file in ``workdir``."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir
        self.config = config
        self.config_file = workdir / "tierd.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.fault_file = workdir / "faults.bin"
        self.control = FaultControl(self.fault_file, create=True)
        self.proc: asyncio.subprocess.Process | None = None
        self.incarnation = 0
        self.started_at = 0.0
        self.pids: list[int] = []

    @property
    def socket_path(self) -> str:
        return str(self.config["socket"]["path"])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_path(self, incarnation: int | None = None) -> Path:
        return self.workdir / f"daemon-{incarnation or self.incarnation}.log"

    async def start(self) -> None:
        self.incarnation += 1
        with self.log_path().open("wb") as log:
            self.proc = proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(RUNNER),
                "serve",
                str(self.config_file),
                str(self.fault_file),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env(),
            )
        line = b""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_DEADLINE_S):
                line = await proc.stdout.readline() if proc.stdout else b""
        if not line.startswith(b"ready"):
            if proc.returncode is None:
                proc.kill()
            status = await proc.wait()
            tail = self.log_path().read_text(errors="replace")[-2000:]
            raise DaemonFailed(f"the daemon did not start (status {status}):\n{tail}")
        self.started_at = time.monotonic()
        self.pids.append(proc.pid)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self) -> int:
        """SIGTERM; the exit status (-9 when it had to be killed after the deadline)."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(START_DEADLINE_S):
                return await proc.wait()
        except TimeoutError:
            await self.kill()
            return -9

    def rss_kib(self) -> int | None:
        if not self.alive or self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def cleanup(self) -> None:
        """Close the control connection (killed incarnations leave no pool behind: a
        pool is a memfd, gone with its last descriptor)."""
        self.control.close()


async def spawn_holder(path: str, mode: str, keys: Sequence[bytes], log: Path) -> tuple[Any, str]:
    """Start a ``soak_daemon.py hold`` child and wait until it holds its lease: returns
    the process and its first line (``ready N``, ``refused CODE`` or ``""``)."""
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(RUNNER),
            "hold",
            path,
            NAMESPACE,
            mode,
            *(k.hex() for k in keys),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=child_env(),
        )
    line = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DEADLINE_S):
            line = await proc.stdout.readline() if proc.stdout else b""
    return proc, line.decode().strip()


async def wait_idle(client: Client, connections: Callable[[], int]) -> dict[str, Any] | None:
    """Poll the daemon's stats until no block is pinned or in flight, no lease is open and
    at most ``connections()`` clients are connected; the stats then, or ``None`` after
    :data:`DEADLINE_S`. (The daemon learns that a peer went away on its own schedule:
    there is nothing to wait on but its own answer.)"""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while True:
        stats = await client.stats()
        busy = any(t["pinned"] or t["writing"] for t in stats["tiers"])
        server = stats["server"]
        if not busy and not server["leases"] and server["connections"] <= connections():
            return stats
        if loop.time() > deadline:
            return None
        await asyncio.sleep(0.05)


def idle_figures(stats: dict[str, Any]) -> dict[str, int]:
    tiers = stats["tiers"]
    return {
        "pinned": sum(t["pinned"] for t in tiers),
        "writing": sum(t["writing"] for t in tiers),
        "leases": stats["server"]["leases"],
        "connections": stats["server"]["connections"],
    }


# -- the campaign ----------------------------------------------------------------------------


def schedule(settings: Settings, rng: random.Random) -> dict[str, Any]:
    """Seeded fault times (seconds from the start of the load): every kind at least once,
    more in longer runs; disk episodes never overlap; the last kill comes by 70% of the
    run so the last incarnation runs long enough to judge its memory."""
    d = settings.seconds
    warm, last = min(30.0, 0.15 * d), 0.7 * d
    kills = [PROCESS_FAULTS[i % 2] for i in range(max(2, round(d / 120)))]
    clients = [CLIENT_FAULTS[i % 2] for i in range(max(2, round(d / 60)))]
    process = kills + clients
    rng.shuffle(process)
    times = sorted(rng.uniform(warm, last) for _ in process)
    episode = min(15.0, max(3.0, d / 40))
    rounds = max(1, int((last - warm) // (2 * len(DISK_EPISODES) * episode)))
    disk: list[str] = []
    for _ in range(rounds):
        kinds = list(DISK_EPISODES)
        rng.shuffle(kinds)
        disk += kinds
    free = max(0.0, last - warm - len(disk) * episode)
    cuts = sorted(rng.uniform(0, free) for _ in disk)
    starts = [warm + cut + i * episode for i, cut in enumerate(cuts)]
    return {
        "warmup_s": warm,
        "episode_s": episode,
        "process": list(zip(times, process, strict=True)),
        "disk": list(zip(starts, disk, strict=True)),
    }


class FaultSwitch:
    """The disk lane's wish, unless suspended (durability checks and restarts run with a
    healthy disk: they check the crash, not a crash with a failing drive at once)."""

    def __init__(self, control: FaultControl, full_disk: RealFullDisk) -> None:
        self.control = control
        self.full_disk = full_disk  # the real full file system, filled while wanted
        self.wanted = FaultPlan()
        self.full_wanted = False
        self.suspended = 0

    def want(self, plan: FaultPlan) -> None:
        self.wanted = plan
        self._apply()

    def want_full(self, full: bool) -> bool:
        """Fill (or free) the real file system; whether it is full now."""
        self.full_wanted = full
        return self._apply()

    def suspend(self) -> None:
        self.suspended += 1
        self._apply()

    def resume(self) -> None:
        self.suspended -= 1
        self._apply()

    def _apply(self) -> bool:
        self.control.set(FaultPlan() if self.suspended else self.wanted)
        if self.full_wanted and not self.suspended:
            return self.full_disk.fill()
        self.full_disk.release()
        return False


class Campaign:
    """One run; :meth:`run` returns the report (see :func:`judge` and :func:`render`)."""

    def __init__(self, settings: Settings, workdir: Path, socket_path: str) -> None:
        self.s = settings
        self.workdir = workdir
        self.rng = random.Random(settings.seed)
        self.plan = schedule(settings, random.Random(settings.seed + 1))
        self.keys = KeySpace(settings.sequences, settings.seq_len)
        self.tally = Tally(settings.block_bytes)
        self.gate = Gate()
        # The tmpfs holds its half of the slab, plus room for the index and a journal.
        share = settings.disk_blocks // 2 * (settings.block_bytes + 4096) + 4096
        self.full_disk = RealFullDisk(workdir, share + (20 << 20))
        config = soak_config(workdir, socket_path, settings, self.full_disk.directory)
        self.daemon = DaemonProcess(workdir, config)
        self.hostile = Hostile(
            lambda: self.path, "soak-hostile", lambda: self.daemon.incarnation, self.gate.turn
        )
        self.real_full = self.full_disk.directory is not None
        self.faults = FaultSwitch(self.daemon.control, self.full_disk)
        self.injected: Counter[str] = Counter()
        self.durability: Counter[str] = Counter()
        self.lost_examples: list[str] = []
        self.problems: list[str] = []
        self.rss: list[tuple[float, int, int]] = []  # (seconds, incarnation, KiB)
        self.last_stats: dict[int, dict[str, Any]] = {}
        self.restarts = 0
        self.unexpected_exits = 0
        self.aborted_visible = 0
        self.exit_statuses: list[int] = []
        self.leaks: dict[str, Any] = {}
        self.stop = asyncio.Event()
        self.lifecycle = asyncio.Lock()
        self.workers = [
            Worker(
                self.path, self.keys, self.tally, self.gate, random.Random(settings.seed * 97 + i)
            )
            for i in range(settings.clients)
        ]
        self.fuzzer = Fuzzer(
            self.path,
            random.Random(settings.seed * 89),
            self.gate,
            settings.block_bytes,
            settings.fuzz_frames_per_s,
        )
        self.subscriber: StuckSubscriber | None = None
        self._ctl: Client | None = None
        self._ctl_lock = asyncio.Lock()
        self._victims = itertools.count()
        self.load_seconds = 0.0
        self.fault_calls: dict[str, int] = {}
        self.timeline: list[tuple[float, str]] = []

    def note(self, event: str) -> None:
        """One line of the run's timeline (seconds from the start of the load)."""
        self.timeline.append((round(time.monotonic() - self.tally.started, 2), event))

    @property
    def path(self) -> str:
        return self.daemon.socket_path

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        try:
            await self.daemon.start()
            self._subscribe()
            self.tally.started = time.monotonic()
            await self._load_phase()
            await self._final_phase()
        except DaemonFailed as exc:  # the report still comes, failing, with the reason
            self.problems.append(str(exc))
        finally:
            await self._close_ctl()
            self._unsubscribe()
            await self.daemon.kill()
            self.fault_calls = self.daemon.control.counters()
            self.daemon.cleanup()
            self.full_disk.unmount()
        return self.report()

    async def _load_phase(self) -> None:
        tasks = [asyncio.create_task(w.run(self.stop)) for w in self.workers]
        tasks.append(asyncio.create_task(self.fuzzer.run(self.stop)))
        tasks.append(asyncio.create_task(self.hostile.run(self.stop)))
        sampler = asyncio.create_task(self._sample())
        try:
            await asyncio.gather(self._process_lane(), self._disk_lane())
            left = self.tally.started + self.s.seconds - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)  # the rest of the run, fault-free
        finally:
            self.load_seconds = time.monotonic() - self.tally.started
            self.note("load stops")
            self.stop.set()
            self.gate.open()
            await asyncio.gather(*tasks)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    async def _at(self, offset: float) -> None:
        left = self.tally.started + offset - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)  # the seeded time of the next fault

    async def _process_lane(self) -> None:
        for offset, kind in self.plan["process"]:
            await self._at(offset)
            if kind == "daemon_sigkill_checkpoint":
                await self._checkpoint_kill()
            elif kind == "daemon_sigkill_hot":
                async with self.lifecycle:
                    self.injected[kind] += 1
                    self.note("SIGKILL under load")
                    await self._kill_and_start()
            else:
                await self._kill_client("store" if kind.endswith("store") else "load")

    async def _disk_lane(self) -> None:
        """Each episode counts once the layer really failed (or slowed) a call; one that
        fell into a restart (faults suspended) or an idle disk is run again."""
        control = self.daemon.control
        for offset, kind in self.plan["disk"]:
            await self._at(offset)
            if kind == "disk_real_full":
                await self._real_full_episode()
                continue
            counter = EPISODE_COUNTERS[kind]
            for _attempt in range(3):
                before = control.counters()[counter]
                self.note(f"{kind} starts")
                self.faults.want(DISK_EPISODES[kind])
                await asyncio.sleep(self.plan["episode_s"])  # the episode's length
                self.faults.want(FaultPlan())
                injected = control.counters()[counter] - before
                self.note(f"{kind} ends: {injected} calls faulted")
                if injected:
                    self.injected[kind] += 1
                    break

    async def _real_full_episode(self) -> None:
        """Fill the tmpfs directory of the disk tier, hold it full, free it again (it is
        freed too while faults are suspended: checkpoints and restarts see a healthy
        disk). An attempt that fell into a suspension is run again."""
        if self.full_disk.directory is None:
            self.note("disk_real_full skipped: no tmpfs (not root)")
            return
        for _attempt in range(3):
            full = self.faults.want_full(True)
            self.note(f"disk_real_full: {'the tmpfs is full' if full else 'suspended'}")
            try:
                await asyncio.sleep(self.plan["episode_s"])
            finally:
                self.faults.want_full(False)
                self.note("disk_real_full: space freed")
            if full:
                self.injected["disk_real_full"] += 1
                return

    async def _sample(self) -> None:
        """Every second: the daemon's RSS; every other: its stats. Restarts a daemon that
        died on its own (that fails the run, but the campaign goes on)."""
        for tick in itertools.count():
            await asyncio.sleep(1.0)  # a sampling period, not a synchronisation
            if self.lifecycle.locked():
                continue
            if not self.daemon.alive:
                async with self.lifecycle:
                    if self.daemon.alive:  # restarted by a fault lane meanwhile
                        continue
                    self.unexpected_exits += 1
                    status = self.daemon.proc.returncode if self.daemon.proc else None
                    self.note(f"the daemon exited on its own (status {status})")
                    self.problems.append(
                        f"the daemon exited on its own (status {status}), incarnation"
                        f" {self.daemon.incarnation}: see {self.daemon.log_path()}"
                    )
                    await self._kill_and_start(killed=False)
                continue
            self._sample_rss()
            if tick % 2 == 0:
                with contextlib.suppress(DaemonError, Unreachable, OSError, TimeoutError):
                    async with asyncio.timeout(DEADLINE_S):
                        ctl = await self._control()
                        self.last_stats[self.daemon.incarnation] = await ctl.stats()

    def _sample_rss(self) -> None:
        kib = self.daemon.rss_kib()
        if kib is not None:
            now = time.monotonic() - self.tally.started
            self.rss.append((round(now, 1), self.daemon.incarnation, kib))

    # -- faults ---------------------------------------------------------------------------

    async def _kill_and_start(self, *, killed: bool = True) -> None:
        if killed:
            await self.daemon.kill()
        await self._close_ctl()
        self._unsubscribe()
        self.faults.suspend()
        began = time.monotonic()
        try:
            await self.daemon.start()
        finally:
            self.faults.resume()
        self.restarts += 1
        self.note(
            f"restarted: incarnation {self.daemon.incarnation} ready after"
            f" {time.monotonic() - began:.1f} s"
        )
        self._subscribe()

    def _subscribe(self) -> None:
        try:
            self.subscriber = StuckSubscriber(self.path)
        except OSError as exc:
            self.problems.append(f"cannot open the stuck subscriber: {exc}")
            return
        self.injected["stuck_subscriber"] += 1

    def _unsubscribe(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    async def _control(self) -> Client:
        """The campaign's own connection (stats, checks), opened once per incarnation."""
        async with self._ctl_lock:
            if self._ctl is None:
                self._ctl = await Client.connect(self.path, namespace=NAMESPACE)
            return self._ctl

    async def _close_ctl(self) -> None:
        ctl, self._ctl = self._ctl, None
        if ctl is not None:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(DEADLINE_S):
                    await ctl.close()

    def _connections(self) -> int:
        """Connections the campaign holds now: the workers', the subscriber, control."""
        workers = sum(1 for w in self.workers if w.client is not None)
        return workers + (self.subscriber is not None) + 1

    async def _kill_client(self, mode: str) -> None:
        kind = f"client_killed_mid_{mode}"
        for _attempt in range(3):
            if mode == "store":  # fresh keys nobody else stores: they must never appear
                keys = [f"victim-{next(self._victims)}-{i}".encode() for i in range(4)]
            else:
                keys = self.keys.pick(self.rng)
            began = time.monotonic()
            proc, line = await spawn_holder(self.path, mode, keys, self.workdir / "holders.log")
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
            took = time.monotonic() - began
            self.note(f"client holding a {mode} lease SIGKILLed: {line!r} after {took:.1f} s")
            if line.startswith("ready"):
                self.injected[kind] += 1
            else:
                self.tally.error(f"holder:{line or 'no answer'}")
            if mode == "store":
                await self._check_victims(keys)
            if line.startswith("ready"):
                return

    async def _check_victims(self, keys: list[bytes]) -> None:
        """Blocks of a store that was never committed are never visible (its slots held
        wrong bytes)."""
        try:
            async with asyncio.timeout(DEADLINE_S):
                ctl = await self._control()
                found = await ctl.lookup(keys)
                if found.count:
                    self.aborted_visible += found.count
                    self.tally.verify(keys, await ctl.load(keys[: found.count]), "aborted store")
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.tally.error(f"control:{_error_kind(exc)}")

    # -- durability -----------------------------------------------------------------------

    async def _checkpoint_kill(self) -> None:
        async with self.lifecycle:
            self.faults.suspend()
            try:
                await self.gate.close()
                await self.fuzzer.disconnect()
                self.note("checkpoint: load stopped")
                durable = await self._disk_set("checkpoint")
                self.note(f"checkpoint: {len(durable or [])} blocks on DISK; SIGKILL")
                self.injected["daemon_sigkill_checkpoint"] += 1
                await self._kill_and_start()
                if durable is not None:
                    lost = self.durability["lost"]
                    await self._verify_durable(durable, "after SIGKILL")
                    self.note(f"checkpoint: verified, {self.durability['lost'] - lost} lost")
            finally:
                self.gate.open()
                self.faults.resume()

    async def _disk_set(self, where: str) -> list[bytes] | None:
        """With the load stopped: wait until the daemon is idle, flush, drop the CPU tier,
        and return the keys still present (all on the disk tier)."""
        try:
            async with asyncio.timeout(DEADLINE_S * 4):
                ctl = await self._control()
                if await wait_idle(ctl, self._connections) is None:
                    stats = idle_figures(await ctl.stats())
                    self.problems.append(f"{where}: the daemon never became idle: {stats}")
                    return None
                await ctl.flush()
                async with await Client.connect(self.path) as operator:
                    await operator.clear("cpu")
                keys = self.keys.all_keys()
                replies = await asyncio.gather(*(ctl.send("lookup", keys=[k]) for k in keys))
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.problems.append(f"{where}: the durability snapshot failed: {exc!r}")
            return None
        present = [k for k, r in zip(keys, replies, strict=True) if r["count"]]
        elsewhere = [
            k for k, r in zip(keys, replies, strict=True) if r["count"] and r["media"] != ["DISK"]
        ]
        if elsewhere:
            self.problems.append(f"{where}: {len(elsewhere)} blocks not on DISK after clear")
        return present

    async def _verify_durable(self, keys: list[bytes], where: str) -> None:
        self.durability["checks"] += 1
        self.durability["blocks"] += len(keys)
        try:
            async with asyncio.timeout(DEADLINE_S * 4):
                ctl = await self._control()
                for i in range(0, len(keys), 16):
                    part = keys[i : i + 16]
                    loads = await asyncio.gather(*(ctl.load([k]) for k in part))
                    for key, blocks in zip(part, loads, strict=True):
                        if not blocks:
                            self.durability["lost"] += 1
                            if len(self.lost_examples) < 20:
                                self.lost_examples.append(f"{where}: {key!r}")
                        else:
                            self.durability["wrong"] += self.tally.verify([key], blocks, where)
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.problems.append(f"{where}: the durability check failed: {exc!r}")

    async def _sweep(self, where: str) -> None:
        """Load and verify every block the daemon still holds."""
        try:
            async with asyncio.timeout(DEADLINE_S * 4):
                ctl = await self._control()
                keys = self.keys.all_keys()
                replies = await asyncio.gather(*(ctl.send("lookup", keys=[k]) for k in keys))
                present = [k for k, r in zip(keys, replies, strict=True) if r["count"]]
                for i in range(0, len(present), 16):
                    part = present[i : i + 16]
                    loads = await asyncio.gather(*(ctl.load([k]) for k in part))
                    for key, blocks in zip(part, loads, strict=True):
                        self.tally.verify([key], blocks, where)
                        self.tally.blocks["swept"] += len(blocks)
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.problems.append(f"{where}: the sweep failed: {exc!r}")

    async def _final_phase(self) -> None:
        self._unsubscribe()
        self.faults.suspend()
        async with self.lifecycle:
            if not self.daemon.alive:
                self.unexpected_exits += 1
                self.problems.append("the daemon was gone at the end of the load")
                await self._kill_and_start(killed=False)
            self._sample_rss()
            await self._sweep("final sweep")
            ctl = await self._control()
            stats = await wait_idle(ctl, lambda: 1)
            final = stats if stats is not None else await ctl.stats()
            self.leaks = {"idle_reached": stats is not None, **idle_figures(final)}
            self.last_stats[self.daemon.incarnation] = final
            durable = await self._disk_set("clean stop")
            self._sample_rss()
            await self._close_ctl()
            self.exit_statuses.append(await self.daemon.stop())
            self.note(f"SIGTERM: exit status {self.exit_statuses[-1]}")
            await self.daemon.start()
            if durable is not None:
                await self._verify_durable(durable, "after SIGTERM")
            self.note(f"clean restart: {len(durable or [])} blocks checked")
            await self._sweep("clean restart sweep")
            await self._close_ctl()
            self.exit_statuses.append(await self.daemon.stop())

    # -- the report -----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        t = self.tally
        ops_total = sum(t.ops.values())
        minutes = []
        span = max(self.load_seconds, 1e-9)
        for start in range(0, int(span) + 1, 60):
            length = min(60.0, span - start)
            if length >= 1.0:
                count = sum(t.per_second[s] for s in range(start, start + 60))
                minutes.append(round(count / length, 1))
        return {
            "settings": {**asdict(self.s), "key_space": self.s.key_space},
            "load_seconds": round(self.load_seconds, 1),
            "operations": dict(t.ops),
            "blocks": dict(t.blocks),
            "ops_per_s": {"overall": round(ops_total / span, 1), "per_minute": minutes},
            "faults": {
                **{
                    kind: self.injected[kind]
                    for kind in FAULT_KINDS
                    if kind != "disk_real_full" or self.real_full
                },
                "fuzz_connection": self.fuzzer.counts["connections"],
            },
            "fault_calls": self.fault_calls,
            "schedule": self.plan,
            "restarts": self.restarts,
            "unexpected_exits": self.unexpected_exits,
            "fuzz": dict(self.fuzzer.counts),
            "hostile": self.hostile.report(),
            "fuzz_examples": self.fuzzer.examples,
            "bad_frames_sent": self.fuzzer.counts["bad_frames"],
            "client_errors": dict(t.errors),
            "daemon_counters": self._daemon_counters(),
            "wrong_blocks": t.wrong,
            "wrong_examples": t.wrong_examples,
            "aborted_store_visible": self.aborted_visible,
            "durability": {**dict(self.durability), "examples": self.lost_examples},
            "durable_lost": self.durability["lost"],
            "leaks": self.leaks,
            "rss_kib": self._rss_summary(),
            "exit_statuses": self.exit_statuses,
            "problems": self.problems,
            "timeline": self.timeline,
        }

    def _daemon_counters(self) -> dict[str, Any]:
        """Summed over incarnations from the last stats sampled in each (every 2 s: what
        a hot-killed daemon counted after its last sample is missing)."""
        out: Counter[str] = Counter()
        for stats in self.last_stats.values():
            for tier in stats["tiers"]:
                for key in ("io_errors", "dropped", "evictions", "demotions", "promotions"):
                    out[f"{tier['name']}.{key}"] += tier[key]
            out["events_dropped"] += stats["chain"]["events_dropped"]
            for code, count in stats["server"]["errors"].items():
                out[f"errors.{code}"] += count
        return dict(sorted(out.items()))

    def _rss_summary(self) -> dict[str, Any]:
        warm_age = self.plan["warmup_s"]
        incarnations = []
        for n in sorted({inc for _, inc, _ in self.rss}):
            samples = [(s, kib) for s, inc, kib in self.rss if inc == n]
            first = samples[0][0]
            warm = next((kib for s, kib in samples if s - first >= warm_age), None)
            end = samples[-1][1]
            entry = {
                "incarnation": n,
                "seconds": round(samples[-1][0] - first, 1),
                "start": samples[0][1],
                "warm": warm,
                "peak": max(kib for _, kib in samples),
                "end": end,
            }
            if warm is not None:
                entry["growth_after_warm"] = end - warm
                entry["limit"] = int(RSS_FACTOR * warm + RSS_SLACK_KIB)
                entry["ok"] = end <= entry["limit"]
            incarnations.append(entry)
        if not self.rss:
            return {"incarnations": [], "rule": _RSS_RULE}
        first_warm = next((i["warm"] for i in incarnations if i["warm"] is not None), None)
        return {
            "start": self.rss[0][2],
            "warm": first_warm,
            "peak": max(kib for *_, kib in self.rss),
            "end": self.rss[-1][2],
            "incarnations": incarnations,
            "rule": _RSS_RULE,
        }


_RSS_RULE = (
    "per daemon incarnation that outlived the warm-up: its last RSS sample <= 2 x its first"
    " sample after the warm-up + 64 MiB"
)


# -- judging and rendering -------------------------------------------------------------------


def judge(report: dict[str, Any]) -> list[str]:
    """Why the run fails (empty: it passes)."""
    reasons: list[str] = []
    if report["wrong_blocks"]:
        reasons.append(f"{report['wrong_blocks']} blocks served with wrong bytes")
    if report["durable_lost"]:
        reasons.append(f"{report['durable_lost']} durable blocks lost across a restart")
    if report["aborted_store_visible"]:
        reasons.append(f"{report['aborted_store_visible']} blocks of killed stores visible")
    internal = report["fuzz"].get("internal", 0) + report["client_errors"].get("internal", 0)
    if internal:
        reasons.append(f"{internal} 'internal' error replies (daemon bugs)")
    if report["fuzz"].get("malformed", 0):
        reasons.append(f"{report['fuzz']['malformed']} malformed replies to the fuzzer")
    leaks = report["leaks"]
    if not leaks.get("idle_reached") or any(leaks.get(k) for k in ("pinned", "writing", "leases")):
        reasons.append(f"pins or leases left once every client was gone: {leaks}")
    for inc in report["rss_kib"]["incarnations"]:
        if inc.get("ok") is False:
            reasons.append(
                f"daemon incarnation {inc['incarnation']}: RSS {inc['end']} KiB at the end is"
                f" over {inc['limit']} KiB (2 x {inc['warm']} KiB after warm-up + 64 MiB)"
            )
    if not any("ok" in inc for inc in report["rss_kib"]["incarnations"]):
        reasons.append("no daemon incarnation ran past the warm-up: memory not judged")
    if report["unexpected_exits"]:
        reasons.append(f"the daemon exited on its own {report['unexpected_exits']} times")
    if report["exit_statuses"] != [0, 0]:
        reasons.append(f"SIGTERM exit statuses {report['exit_statuses']}, expected [0, 0]")
    hostile = report.get("hostile", {})
    if hostile.get("unexpected"):
        reasons.append(f"misbehaving clients met no guard: {hostile['unexpected'][:3]}")
    missing = [kind for kind, count in report["faults"].items() if not count]
    if missing:
        reasons.append(f"fault kinds never injected: {', '.join(missing)}")
    if report["restarts"] < 1:
        reasons.append("no SIGKILL restart happened")
    ops, blocks = report["operations"], report["blocks"]
    if not ops.get("load") or not ops.get("store") or not blocks.get("verified"):
        reasons.append(f"no real load ran: {ops}")
    if report["durability"].get("blocks", 0) == 0:
        reasons.append("no durable block was ever checked across a restart")
    reasons += report["problems"]
    return reasons


def render(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    rows: list[tuple[str, str]] = []

    def add(name: str, value: Any) -> None:
        rows.append((name, str(value)))

    s = report["settings"]
    add("run", f"{report['load_seconds']} s, {s['clients']} clients, seed {s['seed']}")
    add(
        "daemon",
        f"block {s['block_bytes']} B, cpu {s['cpu_blocks']}, disk {s['disk_blocks']} blocks,"
        f" key space {s['key_space']}",
    )
    for kind, count in sorted(report["operations"].items()):
        add(f"ops.{kind}", count)
    for kind, count in sorted(report["blocks"].items()):
        add(f"blocks.{kind}", count)
    rate = report["ops_per_s"]
    add("ops/s overall", rate["overall"])
    add("ops/s per minute", " ".join(str(r) for r in rate["per_minute"]))
    for kind, count in report["faults"].items():
        add(f"fault.{kind}", count)
    for kind, count in report["fault_calls"].items():
        add(f"fault_calls.{kind}", count)
    for kind, count in sorted(report.get("hostile", {}).get("counts", {}).items()):
        add(f"hostile.{kind}", count)
    for what in report.get("hostile", {}).get("unexpected", []):
        add("hostile.unexpected", what)
    add("restarts (SIGKILL)", report["restarts"])
    add("bad frames sent", report["bad_frames_sent"])
    fuzz = report["fuzz"]
    add("fuzz replies / internal", f"{fuzz.get('replies', 0)} / {fuzz.get('internal', 0)}")
    for kind, count in sorted(report["client_errors"].items()):
        add(f"client_error.{kind}", count)
    for kind, count in report["daemon_counters"].items():
        add(f"daemon.{kind}", count)
    add("wrong blocks", report["wrong_blocks"])
    add("aborted stores visible", report["aborted_store_visible"])
    dur = report["durability"]
    add(
        "durable blocks checked / lost",
        f"{dur.get('blocks', 0)} in {dur.get('checks', 0)} checks / {dur.get('lost', 0)}",
    )
    add("pins/leases at the end", report["leaks"])
    rss = report["rss_kib"]
    add(
        "RSS KiB start/warm/peak/end",
        f"{rss.get('start')} / {rss.get('warm')} / {rss.get('peak')} / {rss.get('end')}",
    )
    for inc in rss["incarnations"]:
        add(
            f"RSS KiB incarnation {inc['incarnation']}",
            f"{inc['seconds']} s: start {inc['start']}, warm {inc['warm']}, peak {inc['peak']},"
            f" end {inc['end']}" + (f" (limit {inc['limit']})" if "limit" in inc else ""),
        )
    add("SIGTERM exit statuses", report["exit_statuses"])
    reasons = report.get("reasons", judge(report))
    add("result", "PASS" if not reasons else "FAIL")
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"  - {reason}" for reason in reasons]
    return "\n".join(lines)


async def run_campaign(settings: Settings, workdir: Path, socket_path: str) -> dict[str, Any]:
    """Run one campaign; the report carries ``reasons`` and ``passed``."""
    report = await Campaign(settings, workdir, socket_path).run()
    report["reasons"] = judge(report)
    report["passed"] = not report["reasons"]
    return report
