"""Hypothesis against the control socket of one running daemon.

One daemon serves the whole module: it runs in a background thread with its own event
loop (:class:`DaemonThread`), and the tests talk to it with plain blocking sockets (or,
for the stateful test, with :class:`tierd.client.Client` in a loop of their own). After
every example the daemon must still answer a fresh client, and once every connection of
the example is closed (the daemon noticed it: :class:`Tracker`) no lease, pin or
reservation may be left and the chain's invariants must hold.

The oracle for random input: every reply decodes, is a map with ``ok``, names an error
code of the closed set, and is never ``internal`` (a bug in the daemon).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierd.control.serving.server as server_module
from tierd.client import Client, DaemonError, LoadLease, StoreLease, Unreachable
from tierd.control.protocol import (
    HEADER,
    OPERATIONS,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameDecoder,
    encode,
)
from tierd.daemon import Daemon
from tierd.errors import ProtocolError
from tierd.testing import daemon_config, running_daemon

T = TypeVar("T")

BLOCK = 4096
CPU_BLOCKS = 4
DISK_BLOCKS = 32
MAX_FRAME = 128 << 10
MAX_KEYS = 16
NS = "fuzz"
CODES = {str(code) for code in ErrorCode}
OPS = [op for op in OPERATIONS if op != "stop"]  # stop would end the daemon under test


def content(key: bytes) -> bytes:
    return hashlib.shake_256(b"block:" + key).digest(BLOCK)


# -- the daemon in a thread ------------------------------------------------------------------


class Tracker:
    """Counts the connections the daemon has closed, and the requests that were still
    running when their connection closed, so a test can wait until all of it is over."""

    def __init__(self) -> None:
        self.closed = 0
        self.running: set[asyncio.Task[None]] = set()
        self.changed: asyncio.Event | None = None

    def connection_class(self) -> type[server_module.Connection]:
        tracker = self

        class TrackedConnection(server_module.Connection):
            def connection_lost(self, exc: Exception | None) -> None:
                running = {task for task in self.session.tasks if not task.done()}
                super().connection_lost(exc)
                tracker._lost(running)

        return TrackedConnection

    def _lost(self, running: set[asyncio.Task[None]]) -> None:
        self.closed += 1
        for task in running:
            self.running.add(task)
            task.add_done_callback(self._finished)
        self._poke()

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self._poke()

    def _poke(self) -> None:
        if self.changed is not None:
            self.changed.set()

    async def wait(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` holds, re-checked each time a connection or request ends."""
        if self.changed is None:
            self.changed = asyncio.Event()
        async with asyncio.timeout(30):
            while not done():
                self.changed.clear()
                await self.changed.wait()


class DaemonThread:
    """A daemon running in its own thread and event loop until :meth:`stop`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.path = str(config["socket"]["path"])
        self.tracker = Tracker()
        self.daemon: Daemon | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # What reached the loop's exception handler: an exception that escaped a protocol
        # callback or a task (asyncio would only log it and drop the connection).
        self.loop_errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="tierd-fuzz", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the daemon did not start within 60 s")
        if self._error is not None:
            raise RuntimeError("the daemon failed to start") from self._error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(
            lambda loop, context: self.loop_errors.append(
                f"{context.get('message')}: {context.get('exception')!r}"
            )
        )
        self._stop = asyncio.Event()
        async with running_daemon(self.config) as daemon:
            self.daemon = daemon
            self._ready.set()
            await self._stop.wait()

    def call(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work()`` in the daemon's loop and return its result."""
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(work), self.loop)
        return future.result(timeout=60)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the daemon did not stop"
        if self._error is not None:
            raise self._error

    # -- checks ----------------------------------------------------------------------------

    def settle(self) -> dict[str, Any]:
        """Wait until the daemon closed every connection and finished every request of
        the closed ones; then check that nothing is pinned, reserved or leased, and return
        the stats."""

        async def check() -> dict[str, Any]:
            daemon = self.daemon
            assert daemon is not None and daemon.server is not None and daemon.chain is not None
            server = daemon.server
            await self.tracker.wait(lambda: not server.connections and not self.tracker.running)
            daemon.chain.check_invariants(idle=True)
            stats: dict[str, Any] = server.ctx.stats()
            return stats

        stats = self.call(check)
        assert not self.loop_errors, self.loop_errors
        for tier in stats["tiers"]:
            assert (tier["name"], tier["pinned"], tier["writing"]) == (tier["name"], 0, 0)
        assert stats["server"]["leases"] == 0
        assert stats["server"]["connections"] == 0
        return stats

    def wait_closed(self, count: int) -> None:
        """Until the daemon has closed ``count`` connections in all (and so finished
        their leases). Requests of theirs may still run: see :meth:`wait_orphans`."""
        tracker = self.tracker

        async def wait() -> None:
            await tracker.wait(lambda: tracker.closed >= count)

        self.call(wait)

    def wait_orphans(self) -> None:
        """Until every request that was running when its connection closed has ended."""
        tracker = self.tracker

        async def wait() -> None:
            await tracker.wait(lambda: not tracker.running)

        self.call(wait)

    def assert_alive(self) -> None:
        hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION}
        replies = exchange(self.path, encode(hello) + encode({"id": 2, "op": "health"}))
        assert [(r["id"], r["ok"]) for r in replies] == [(1, True), (2, True)]
        assert replies[1]["status"] == "ok"


async def _as_coroutine(work: Callable[[], Awaitable[T]]) -> T:
    return await work()


@pytest.fixture(scope="module")
def fuzzd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonThread]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    config = daemon_config(
        tmp,
        cpu_blocks=CPU_BLOCKS,
        disk_blocks=DISK_BLOCKS,
        block_bytes=BLOCK,
        # The model knows the chain's capacity, not the lease bounds (tests/test_leases.py):
        # a repeated load of pinned blocks counts again against them, and here it must not.
        limits={
            "max_frame_bytes": MAX_FRAME,
            "max_keys_per_request": MAX_KEYS,
            "lease_blocks_per_connection": 1 << 20,
            "lease_blocks_per_tenant": 1 << 20,
        },
        events={"queue_batches": 8},
        shutdown={"write_back": "none"},
    )
    thread = DaemonThread(config)
    with pytest.MonkeyPatch.context() as patch:
        # The server builds each connection from this name when a client connects.
        patch.setattr(server_module, "Connection", thread.tracker.connection_class())
        thread.start()
        try:
            yield thread
            thread.settle()
        finally:
            thread.stop()


# -- raw exchanges ---------------------------------------------------------------------------


def exchange(path: str, payload: bytes) -> list[dict[str, Any]]:
    """Connect, send ``payload`` and half-close (while reading), then read until the
    daemon closes. Returns the messages received; they must all be whole, valid frames."""
    received: list[bytes] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)

        def send() -> None:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon hung up first (frame_too_large)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            while chunk := sock.recv(1 << 16):
                received.append(chunk)
        finally:
            sender.join(30)
    decoder = FrameDecoder(1 << 30)
    messages = decoder.feed(b"".join(received))
    assert decoder.buffered == 0, "the daemon sent a partial frame"
    for message in messages:
        assert not isinstance(message, ProtocolError), "the daemon sent an undecodable frame"
        assert isinstance(message, dict), message
    return messages


def check_replies(replies: list[dict[str, Any]], request_ids: set[int] | None = None) -> None:
    """Every reply is well formed and none reports a bug; ``frame_too_large`` is last."""
    for index, reply in enumerate(replies):
        if "push" in reply:
            assert reply["push"] == "events"
            assert isinstance(reply["events"], list) and reply["events"]
            continue
        assert isinstance(reply["id"], int) and not isinstance(reply["id"], bool)
        assert reply["ok"] in (True, False)
        if request_ids is not None:
            assert reply["id"] == 0 or reply["id"] in request_ids, reply
        if reply["ok"]:
            continue
        assert reply["error"] in CODES, reply
        assert reply["error"] != ErrorCode.INTERNAL, reply
        assert isinstance(reply["message"], str) and reply["message"]
        if reply["error"] == ErrorCode.FRAME_TOO_LARGE:
            assert reply["id"] == 0
            assert index == len(replies) - 1, "the daemon went on after frame_too_large"


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


HELLO = encode({"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NS})


def run_example(fuzzd: DaemonThread, payload: bytes, *, hello: bool) -> list[dict[str, Any]]:
    replies = exchange(fuzzd.path, (HELLO if hello else b"") + payload)
    check_replies(replies)
    if hello:
        assert (replies[0]["id"], replies[0]["ok"]) == (1, True), replies[0]
    fuzzd.assert_alive()
    fuzzd.settle()
    return replies


# -- strategies ------------------------------------------------------------------------------

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, 2, 7, 255, 2**31, 2**32, 2**63, 2**64 - 1, -1, -(2**63)]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.binary(max_size=72),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.text(max_size=10), children, max_size=6),
        st.dictionaries(st.binary(max_size=6), children, max_size=3),
    ),
    max_leaves=24,
)
client_keys = st.binary(min_size=0, max_size=60)
key_lists = st.one_of(
    st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=4),  # often valid
    st.lists(client_keys, max_size=MAX_KEYS + 2),
    st.lists(st.one_of(client_keys, values), max_size=4),
    values,
)
block_data = st.sampled_from(
    [bytes(BLOCK), b"\x01" * BLOCK, b"", bytes(BLOCK - 1), bytes(BLOCK + 1)]
)
requests = st.fixed_dictionaries(
    {"id": st.one_of(st.integers(0, 2**64 - 1), values), "op": st.sampled_from(OPS)},
    optional={
        "keys": key_lists,
        "lease": st.one_of(st.integers(0, 64), ints, values),
        "ok": st.one_of(st.booleans(), st.lists(st.booleans(), max_size=6), values),
        "data": st.one_of(st.lists(block_data, max_size=4), values),
        "tier": st.one_of(st.sampled_from(["cpu", "disk", "nvme", ""]), values),
        "version": st.one_of(st.just(PROTOCOL_VERSION), ints, values),
        "namespace": st.one_of(st.sampled_from([NS, "other", "bad name", ""]), values),
        "block_bytes": st.one_of(st.just(BLOCK), ints, values),
    },
)
TEMPLATES = [
    {"id": 2, "op": "lookup", "keys": [b"a", b"b"]},
    {"id": 3, "op": "put", "keys": [b"t"], "data": [bytes(BLOCK)]},
    {"id": 4, "op": "get", "keys": [b"t", b"a"]},
    {"id": 5, "op": "prepare_store", "keys": [b"m", b"n"]},
    {"id": 6, "op": "prepare_load", "keys": [b"t"]},
    {"id": 7, "op": "complete_store", "lease": 1, "ok": [True, False]},
    {"id": 8, "op": "stats"},
    {"id": 9, "op": "hello", "version": PROTOCOL_VERSION, "namespace": NS},
]


def frames_of(messages: list[Any]) -> bytes:
    return b"".join(encode(m) for m in messages)


# -- random frames ---------------------------------------------------------------------------


@settings(deadline=None)
@given(
    blobs=st.lists(st.binary(max_size=200), min_size=1, max_size=5),
    prefixed=st.booleans(),
    hello=st.booleans(),
)
def test_random_bytes(fuzzd: DaemonThread, blobs: list[bytes], prefixed: bool, hello: bool) -> None:
    payload = b"".join(frame(b) if prefixed else b for b in blobs)
    replies = run_example(fuzzd, payload, hello=hello)
    if prefixed:
        # Every frame is whole and under the limit: each gets exactly one answer.
        answers = [r for r in replies if "push" not in r]
        assert len(answers) == len(blobs) + hello


@settings(deadline=None)
@given(messages=st.lists(values, min_size=1, max_size=6), hello=st.booleans())
def test_random_msgpack_values(fuzzd: DaemonThread, messages: list[Any], hello: bool) -> None:
    payload = b"".join(frame(msgpack.packb(m, use_bin_type=True)) for m in messages)
    replies = run_example(fuzzd, payload, hello=hello)
    answers = [r for r in replies if "push" not in r]
    # None of these is a request that starts work, so each is answered at once.
    if not any(isinstance(m, dict) and m.get("op") in OPS for m in messages):
        assert len(answers) == len(messages) + hello
        assert all(r["ok"] is False for r in answers[hello:])


@settings(deadline=None)
@given(messages=st.lists(requests, min_size=1, max_size=12), hello=st.booleans())
def test_random_requests(fuzzd: DaemonThread, messages: list[dict[str, Any]], hello: bool) -> None:
    replies = run_example(fuzzd, frames_of(messages), hello=hello)
    ids = {m["id"] for m in messages if isinstance(m["id"], int) and not isinstance(m["id"], bool)}
    check_replies(replies, ids | {1})


@settings(deadline=None)
@given(
    chosen=st.lists(st.sampled_from(TEMPLATES), min_size=1, max_size=4),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_frames(
    fuzzd: DaemonThread, chosen: list[dict[str, Any]], flips: list[tuple[int, int]], cut: int | None
) -> None:
    payload = bytearray(frames_of(chosen))
    for position, mask in flips:
        payload[position % len(payload)] ^= mask
    if cut is not None:
        del payload[cut % len(payload) :]
    run_example(fuzzd, bytes(payload), hello=True)


# -- two clients, random interleavings -------------------------------------------------------

# Few keys, so that requests of the two clients often meet on the same blocks.
KEYS = [f"s{i}".encode() for i in range(6)]
# Mostly runs of consecutive keys, as an engine sends the blocks of a prefix (so loads
# often meet what was stored); sometimes any keys in any order.
key_subsets = st.one_of(
    st.tuples(st.integers(0, len(KEYS) - 1), st.integers(1, 3)).map(
        lambda run: KEYS[run[0] : run[0] + run[1]]
    ),
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
)
# Repeats weight the draw towards the two-phase operations.
STEP_OPS = [
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "put",
    "get",
    "lookup",
    "abort_store",
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
]


def step_of(op: str) -> st.SearchStrategy[tuple[Any, ...]]:
    """``(op, client, ...)``: keys, or which open lease (modulo how many there are), and
    for complete_store the bits of the blocks that failed (0, the likeliest: none)."""
    who = st.integers(0, 1)
    if op in ("prepare_store", "prepare_load", "lookup", "put", "get"):
        return st.tuples(st.just(op), who, key_subsets)
    if op == "complete_store":
        return st.tuples(st.just(op), who, st.integers(0, 7), st.integers(0, 7))
    return st.tuples(st.just(op), who, st.integers(0, 7))


steps = st.sampled_from(STEP_OPS).flatmap(step_of)


class Interleaving:
    """Runs the steps on two clients and checks every answer against a small model.

    ``committed`` holds the keys some reply proved stored (complete_store's flags, a put
    that stored every key); ``maybe`` those a put may have skipped. The cpu tier is small
    and the disk tier holds every key, so a committed key is never lost: while nothing is
    in flight, a lookup's count is exactly the leading run of committed keys.
    """

    def __init__(self, fuzzd: DaemonThread, clients: list[Client]) -> None:
        self.fuzzd = fuzzd
        self.clients: list[Client | None] = list(clients)
        self.stores: list[list[StoreLease]] = [[], []]
        self.loads: list[list[LoadLease]] = [[], []]
        # Requests that may wait for a store lease: (client, op, keys, future).
        self.pending: list[tuple[int, str, list[bytes], asyncio.Future[dict[str, Any]]]] = []
        # Keys of requests that were waiting when their client closed: the daemon runs
        # them on (holding their pins) until the store leases they wait for finish.
        self.orphans: list[list[bytes]] = []
        self.committed: set[bytes] = set()
        self.maybe: set[bytes] = set()

    # -- model ---------------------------------------------------------------------------

    def in_flight(self) -> set[bytes]:
        return {lease.keys[i] for leases in self.stores for lease in leases for i in lease.to_write}

    def quiet(self) -> bool:
        """Nothing runs in the daemon on the test's behalf, and nothing is held."""
        return not (self.pending or self.orphans or any(self.stores) or any(self.loads))

    def run_of(self, keys: list[bytes], known: set[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if key not in known), len(keys))

    # -- steps ---------------------------------------------------------------------------

    async def step(self, step: tuple[Any, ...]) -> None:
        op, index = step[0], step[1]
        client = self.clients[index]
        if client is None:
            return
        if op in ("prepare_load", "get") and set(step[2]) & self.in_flight():
            # It waits for a store lease of ours: collect it once that lease is finished.
            self.pending.append((index, op, step[2], client.send(op, keys=step[2])))
            return
        await getattr(self, op)(index, client, *step[2:])

    async def unless_full(self, request: Awaitable[T]) -> T | None:
        """The request's result, or ``None`` when the cpu tier had no room: allowed only
        while the test holds pins or reservations (or requests that may take some)."""
        quiet = self.quiet()
        refused: DaemonError | None = None
        try:
            return await request
        except DaemonError as exc:
            refused = exc
        assert refused.code == ErrorCode.CAPACITY and not quiet, refused
        return None

    async def prepare_store(self, index: int, client: Client, keys: list[bytes]) -> None:
        lease = await self.unless_full(client.prepare_store(keys))
        if lease is None:
            return
        busy = self.in_flight()
        for i, slot in enumerate(lease.slots):
            # Keys in a store lease get no slot here; the others do unless the cpu holds them.
            assert slot is None or keys[i] not in busy
        for view, i in zip(lease.views(), lease.to_write, strict=True):
            view[:] = content(keys[i])
        if lease.lease is not None:
            self.stores[index].append(lease)

    async def complete_store(self, index: int, client: Client, which: int, failed: int) -> None:
        if not self.stores[index]:
            return
        lease = self.stores[index].pop(which % len(self.stores[index]))
        flags = [not failed >> i & 1 for i in range(len(lease.to_write))]
        assert await lease.commit(flags) == sum(flags)
        self.committed.update(
            lease.keys[i] for i, ok in zip(lease.to_write, flags, strict=True) if ok
        )
        await self.collect()

    async def abort_store(self, index: int, client: Client, which: int) -> None:
        if self.stores[index]:
            await self.stores[index].pop(which % len(self.stores[index])).abort()
            await self.collect()

    async def prepare_load(self, index: int, client: Client, keys: list[bytes]) -> None:
        quiet = self.quiet()
        self.took_load(index, keys, await client.prepare_load(keys), quiet=quiet)

    def took_load(self, index: int, keys: list[bytes], lease: LoadLease, *, quiet: bool) -> None:
        """``quiet``: the request ran while nothing else did, so it loads every leading
        committed key (the cpu tier has room: nothing is pinned)."""
        assert lease.count <= len(keys)
        assert lease.keys == keys[: lease.count]
        assert set(lease.keys) <= self.committed | self.maybe
        assert lease.count >= self.run_of(keys, self.committed) or not quiet
        assert [bytes(v) for v in lease.views()] == [content(k) for k in lease.keys]
        if lease.lease is not None:
            self.loads[index].append(lease)

    async def complete_load(self, index: int, client: Client, which: int) -> None:
        if self.loads[index]:
            lease = self.loads[index].pop(which % len(self.loads[index]))
            # Pinned all along: nobody may have overwritten the slots meanwhile.
            assert [bytes(v) for v in lease.views()] == [content(k) for k in lease.keys]
            await lease.release()

    async def lookup(self, index: int, client: Client, keys: list[bytes]) -> None:
        hit = await client.lookup(keys)
        assert set(hit.media) <= {"CPU", "DISK"} and len(hit.media) == hit.count
        assert self.run_of(keys, self.committed) <= hit.count or not self.quiet()
        assert hit.count <= self.run_of(keys, self.committed | self.maybe)
        if hit.count < len(keys) and keys[hit.count] in self.in_flight():
            assert hit.in_flight

    async def put(self, index: int, client: Client, keys: list[bytes]) -> None:
        stored = await self.unless_full(client.put(keys, [content(k) for k in keys]))
        if stored is None:
            return
        (self.committed if stored == len(keys) else self.maybe).update(keys)

    async def get(self, index: int, client: Client, keys: list[bytes]) -> None:
        quiet = self.quiet()
        self.took_data(keys, await client.get(keys), quiet=quiet)

    def took_data(self, keys: list[bytes], data: list[bytes], *, quiet: bool) -> None:
        assert data == [content(k) for k in keys[: len(data)]]
        assert len(data) <= self.run_of(keys, self.committed | self.maybe)
        assert len(data) >= self.run_of(keys, self.committed) or not quiet

    async def collect(self) -> None:
        """Take the answers of the waiting requests no open store lease holds up."""
        busy = self.in_flight()
        waiting = []
        for index, op, keys, future in self.pending:
            if set(keys) & busy:
                waiting.append((index, op, keys, future))
                continue
            async with asyncio.timeout(30):
                reply = await future
            # Answered some time after it was sent: the model has moved on since.
            if op == "get":
                self.took_data(keys, list(reply["data"]), quiet=False)
            else:
                client = self.clients[index]
                assert client is not None
                self.took_load(index, keys, LoadLease(client, keys, reply), quiet=False)
        self.pending = waiting
        if self.orphans and not any(set(keys) & busy for keys in self.orphans):
            await asyncio.to_thread(self.fuzzd.wait_orphans)
            self.orphans = []

    async def close(self, index: int) -> None:
        """Close a client without finishing its leases; wait until the daemon noticed."""
        client = self.clients[index]
        if client is None:
            return
        closed = self.fuzzd.tracker.closed
        self.clients[index] = None
        self.stores[index], self.loads[index] = [], []
        await client.close()
        for entry in [p for p in self.pending if p[0] == index]:
            self.pending.remove(entry)
            try:
                await entry[3]  # it may have been answered before the close
            except Unreachable:
                self.orphans.append(entry[2])
        await asyncio.to_thread(self.fuzzd.wait_closed, closed + 1)
        await self.collect()

    async def finish(self) -> None:
        """Complete every open store lease and release every load, then close."""
        for index, client in enumerate(self.clients):
            while client is not None and self.stores[index]:
                await self.complete_store(index, client, 0, 0)
        await self.collect()
        assert not self.pending
        for index, client in enumerate(self.clients):
            while client is not None and self.loads[index]:
                await self.complete_load(index, client, 0)
        for index in range(2):
            await self.close(index)


namespaces = itertools.count()


@settings(deadline=None)
@given(
    plan=st.lists(steps, min_size=8, max_size=40),
    # Where in the plan one client goes away; the simplest (48, past any plan) is never.
    close_at=st.integers(0, 48).map(lambda n: 48 - n),
    victim=st.integers(0, 1),
)
def test_two_clients_random_interleavings(
    fuzzd: DaemonThread, plan: list[tuple[Any, ...]], close_at: int, victim: int
) -> None:
    # Start from an empty cache (the disk tier then holds every key of the example).
    replies = exchange(
        fuzzd.path,
        encode({"id": 1, "op": "hello", "version": PROTOCOL_VERSION})
        + encode({"id": 2, "op": "clear"}),
    )
    assert [r["ok"] for r in replies] == [True, True]
    dropped = fuzzd.settle()["tiers"][0]["dropped"]
    namespace = f"stateful-{next(namespaces)}"

    async def scenario() -> set[bytes]:
        clients = [await Client.connect(fuzzd.path, namespace=namespace) for _ in range(2)]
        try:
            run = Interleaving(fuzzd, clients)
            for position, step in enumerate(plan):
                if position == close_at:
                    await run.close(victim)
                await run.step(step)
            await run.finish()
            return run.committed
        finally:
            for client in clients:  # after a failure too, so the next example starts clean
                await client.close()

    committed = asyncio.run(scenario())
    stats = fuzzd.settle()
    assert stats["tiers"][0]["dropped"] == dropped  # every demotion found room on disk

    async def verify() -> None:
        async with await Client.connect(fuzzd.path, namespace=namespace) as client:
            for key in sorted(committed):
                assert await client.get([key]) == [content(key)]
            for key in sorted(set(KEYS) - committed):
                data = await client.get([key])
                assert data in ([], [content(key)])

    asyncio.run(verify())
    fuzzd.settle()
