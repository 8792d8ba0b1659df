"""The metrics endpoint against the local users who can reach its port: what each is
shown, and scrapes answered beside clients that are slow on purpose.

Who asks is the uid the kernel recorded for the client's socket, decided as the control
socket decides it: the privacy tests run a real ``tierd serve`` (as root) with the
tenants of tests/tenants_kit.py (``ops``: root, the operator; ``alpha`` and ``beta``:
users made with ``useradd``) and fetch ``/status.json`` and ``/metrics`` from processes
that dropped to those users (and to a user of no tenant) while each tenant's client is
connected. The slow-client tests hold dozens of real TCP connections that send their
request a byte a second, send nothing, or never read their answer, and scrape beside
them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_kit import DEADLINE_S, Spawn
from tests.daemon_kit import raw_get as page_get
from tests.port_kit import free_port
from tests.tenants_kit import tenants_config
from tierd.control.figures.prometheus import render_prometheus
from tierd.daemon import metrics_http, status_page
from tierd.daemon.http_peer import View, shown_stats, socket_owner
from tierd.testing import daemon_config, running_daemon

as_root = pytest.mark.skipif(
    os.getuid() != 0, reason="clients of other users (useradd, os.setuid) need root"
)

ALPHA_NS = "model-alpha-own"  # alpha's patterns: model-*
BETA_NS = "b-secret-ns"

# A client of another user: imports everything (the interpreter's own files may not be
# readable by the user it drops to), drops to UID/GID, connects to the
# control socket (when NAMESPACE is not empty) and stores a block, says "ready", then
# at each line on stdin fetches /status.json and /metrics from PORT and prints both
# (JSON), until stdin closes; then it hangs up.
CHILD = r"""
import asyncio, encodings.idna, json, os, socket, sys
from tierd.client import Client

uid, gid, path, namespace, port = sys.argv[1:]
loop = asyncio.new_event_loop()
os.setgroups([])
os.setgid(int(gid))
os.setuid(int(uid))

def get(target):
    with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as conn:
        conn.sendall(f"GET {target} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return [head.split(b"\r\n", 1)[0].decode(), body.decode()]

async def connect():
    client = await Client.connect(path, namespace=namespace)
    assert await client.store([b"k"], [b"\x01" * client.block_bytes]) == 1
    return client

client = loop.run_until_complete(connect()) if namespace else None
print("ready", flush=True)
while sys.stdin.readline():  # the connection stays open, idle, while this one asks
    print(json.dumps({t: get(t) for t in ("/status.json", "/metrics")}), flush=True)
if client is not None:
    loop.run_until_complete(client.close())
"""


class UserClient:
    """A :data:`CHILD` process: a user's control connection held open, and its fetches."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def line(self) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(DEADLINE_S):
            text = await self.process.stdout.readline()
        assert text, "the child exited"
        return text.decode()

    async def fetch(self) -> dict[str, tuple[str, str]]:
        """``/status.json`` and ``/metrics`` as this user: (status line, body) of each."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"fetch\n")
        return {path: (head, body) for path, (head, body) in json.loads(await self.line()).items()}


@asynccontextmanager
async def user_client(
    socket_path: str, user: tuple[int, int], namespace: str, port: int
) -> AsyncIterator[UserClient]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(user[0]),
        str(user[1]),
        socket_path,
        namespace,
        str(port),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    child = UserClient(process)
    try:
        assert await child.line() == "ready\n"
        yield child
    finally:
        if process.stdin is not None:
            process.stdin.close()
        async with asyncio.timeout(DEADLINE_S):
            await process.wait()


def figures(pages: dict[str, tuple[str, str]]) -> tuple[dict[str, Any], str, str]:
    """The status JSON (parsed), its text and the metrics text, both answered 200."""
    for path, (head, body) in pages.items():
        assert head.endswith("200 OK"), (path, head, body[:200])
    status = pages["/status.json"][1]
    return dict(json.loads(status)), status, pages["/metrics"][1]


def root_pages(port: int) -> dict[str, tuple[str, str]]:
    return {path: raw_get(port, path) for path in ("/status.json", "/metrics")}


def raw_get(port: int, path: str) -> tuple[str, str]:
    """The status line and body (text) of ``GET path``, sent as a browser at the port."""
    status, body = page_get(port, path, f"127.0.0.1:{port}")
    return status, body.decode()


# -- who sees what ---------------------------------------------------------------------------


@as_root
async def test_each_user_sees_its_own_tenants_details_and_only_totals_of_others(
    tmp_path: Path, spawn: Spawn, users: dict[str, tuple[int, int]]
) -> None:
    """Every local user who reached the port was shown every tenant's namespace names
    and the pid, uid and command name of every process on the control socket. Now a
    member (alpha, beta) sees its own tenant's, the other tenants as ``#N`` totals; a
    user of no tenant the totals only; the operator everything; /metrics likewise."""
    port = free_port()
    config = tenants_config(tmp_path, users)
    config["metrics"] = {"http_port": port, "cache": 0}
    daemon = await spawn(config)
    os.chmod(os.path.dirname(daemon.socket_path), 0o711)  # others may reach the socket
    path = daemon.socket_path
    async with (
        user_client(path, users["alpha"], ALPHA_NS, port) as alpha,
        user_client(path, users["beta"], BETA_NS, port) as beta,
        user_client(path, users["stranger"], "", port) as stranger,  # no tenant: no connection
    ):
        # A member: its own tenant's names and processes, the others as totals.
        page, text, metrics = figures(await alpha.fetch())
        assert page["view"] == {"operator": False, "tenant": "alpha"}
        assert ["alpha", ALPHA_NS] in [[n["tenant"], n["namespace"]] for n in page["namespaces"]]
        (me,) = page["clients"]
        assert (me["pid"], me["uid"], me["tenant"]) == (alpha.pid, users["alpha"][0], "alpha")
        assert me["namespaces"] == [ALPHA_NS] and me["process"]
        assert page["clients_total"] == 2 and page["clients_hidden"] == 1  # beta's process
        assert sorted(t["name"] for t in page["tenants"]) == ["#1", "#3", "alpha"]
        assert page["tenants_total"] == 3 and page["namespaces_total"] == 2
        for secret in (BETA_NS, '"beta"', '"ops"', f'"pid":{beta.pid},'):
            assert secret not in text, secret
        assert f'namespace="{ALPHA_NS}",tenant="alpha"' in metrics
        assert 'namespace="other",tenant="#3"' in metrics  # beta's namespaces, added up
        assert 'tierd_namespaces{tenant="#3"} 1.0' in metrics
        for secret in (BETA_NS, 'tenant="beta"', 'tenant="ops"'):
            assert secret not in metrics, secret

        # A user of no tenant: totals only.
        page, text, metrics = figures(await stranger.fetch())
        assert page["view"] == {"operator": False, "tenant": None}
        assert page["clients"] == [] and page["clients_hidden"] == page["clients_total"] == 2
        assert sorted(t["name"] for t in page["tenants"]) == ["#1", "#2", "#3"]
        assert {n["namespace"] for n in page["namespaces"]} == {"other"}
        assert page["tiers"] and page["server"]["connections"] == 2  # the daemon's own: public
        for secret in (ALPHA_NS, BETA_NS, '"alpha"', '"beta"', '"ops"', f'"pid":{alpha.pid},'):
            assert secret not in text, secret
        for secret in (ALPHA_NS, BETA_NS, 'tenant="alpha"', 'tenant="beta"'):
            assert secret not in metrics, secret
        assert "tierd_tier_hits_total" in metrics

        # The operator (root, here): everything.
        page, text, metrics = figures(await asyncio.to_thread(root_pages, port))
        assert page["view"] == {"operator": True, "tenant": None}
        assert {c["pid"] for c in page["clients"]} == {alpha.pid, beta.pid}
        assert page["clients_hidden"] == 0
        shown = {(n["tenant"], n["namespace"]) for n in page["namespaces"]}
        assert {("alpha", ALPHA_NS), ("beta", BETA_NS)} <= shown
        assert sorted(t["name"] for t in page["tenants"]) == ["alpha", "beta", "ops"]
        assert f'namespace="{BETA_NS}",tenant="beta"' in metrics

        # Beta sees its own, not alpha's.
        page, text, _ = figures(await beta.fetch())
        assert [c["pid"] for c in page["clients"]] == [beta.pid]
        assert BETA_NS in text and ALPHA_NS not in text and '"alpha"' not in text
    assert await daemon.stop() == 0


# -- slow clients ----------------------------------------------------------------------------


async def silent(port: int, stop: asyncio.Event) -> None:
    """A connection that sends nothing, opened again whenever the daemon closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        try:
            await wait_either(reader.read(), stop)
        finally:
            writer.close()


async def trickle(port: int, stop: asyncio.Event) -> None:
    """A connection that sends a request a byte a second, opened again when closed."""
    request = f"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        try:
            for byte in request:
                writer.write(bytes([byte]))
                await writer.drain()
                if await wait_either(reader.read(), stop, within=1.0) is not None:
                    break  # closed (or answered: not before the whole request)
        except OSError:
            pass  # reset by the daemon
        finally:
            writer.close()


async def wait_either(read: Any, stop: asyncio.Event, within: float | None = None) -> bytes | None:
    """What ``read`` gives, or ``None`` once ``stop`` is set or ``within`` seconds pass."""
    reading = asyncio.ensure_future(read)
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({reading, stopping}, timeout=within, return_when="FIRST_COMPLETED")
    stopping.cancel()
    if reading in done:
        try:
            return bytes(reading.result())
        except OSError:
            return b""
    reading.cancel()
    return None


async def scrape(port: int, path: str) -> bytes:
    """The status line of a real scrape's answer (empty: closed unanswered), once the
    whole answer is read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        async with asyncio.timeout(DEADLINE_S):
            reply = await reader.read()
    except OSError:
        return b""
    finally:
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert not head.endswith(b"200 OK") or body, "a 200 without its body"
    return head.split(b"\r\n", 1)[0]


@asynccontextmanager
async def slow_clients(port: int, silent_ones: int, trickling: int) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(silent(port, stop)) for _ in range(silent_ones)]
    tasks += [asyncio.create_task(trickle(port, stop)) for _ in range(trickling)]
    try:
        yield
    finally:
        stop.set()
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*tasks)


async def test_scrapes_are_answered_beside_forty_slow_connections(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Forty connections that send their request a byte a second or send nothing (and
    reconnect when closed) held every serving slot for 5 s at a time: each scrape beside
    them was closed unanswered. Twenty scrapes of the metrics and the page's figures, in
    rounds of five at once over three seconds (longer than a slow request may take),
    each get their answer."""
    port = free_port()
    daemon = await spawn(daemon_config(tmp_path, metrics={"http_port": port, "cache": 0}))
    async with slow_clients(port, silent_ones=20, trickling=20):
        statuses = []
        for _ in range(4):
            paths = ["/metrics", "/status.json"] * 2 + ["/metrics"]
            statuses += await asyncio.gather(*(scrape(port, path) for path in paths))
            await asyncio.sleep(0.75)  # pacing over the slow clients' cycle, not a wait
    assert statuses == [b"HTTP/1.0 200 OK"] * 20
    assert await daemon.stop() == 0


async def test_scrapes_are_answered_past_the_bound_on_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More silent connections than may be open (here the bound is 32, and 64 of them
    held): each scrape closes the oldest of them rather than being closed itself."""
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 32)
    port = free_port()
    config = daemon_config(tmp_path, metrics={"http_port": port, "cache": 0})
    async with asyncio.timeout(120), running_daemon(config):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(64)]
        try:
            statuses = [await scrape(port, "/metrics") for _ in range(10)]
        finally:
            for _, writer in held:
                writer.close()
    assert statuses == [b"HTTP/1.0 200 OK"] * 10


async def test_clients_that_do_not_read_their_answer_hold_no_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sixteen clients ask for the page's figures (made 8 MB here, more than the
    kernel's buffers take) and never read them: scrapes beside them are answered, and
    each of them is cut off at the deadline on writing an answer (1 s here)."""
    monkeypatch.setattr(metrics_http, "WRITE_DEADLINE_S", 1.0)
    monkeypatch.setattr(status_page, "render", lambda *_: b"x" * (8 << 20))
    port = free_port()
    config = daemon_config(tmp_path, metrics={"http_port": port, "cache": 3600})
    async with asyncio.timeout(120), running_daemon(config):
        stalled = []
        for _ in range(16):
            conn = socket.socket()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.setblocking(False)
            await asyncio.get_running_loop().sock_connect(conn, ("127.0.0.1", port))
            conn.sendall(f"GET /status.json HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            stalled.append(conn)
        try:
            statuses = [await scrape(port, "/metrics") for _ in range(10)]
            assert statuses == [b"HTTP/1.0 200 OK"] * 10
            await asyncio.sleep(3)  # past the deadline (a deadline is what is tested here)
            for conn in stalled:  # read now: cut off before the whole answer
                assert len(await drain(conn)) < 8 << 20
        finally:
            for conn in stalled:
                conn.close()


async def drain(conn: socket.socket) -> bytes:
    """Everything the daemon sent on ``conn`` until it closed it (or reset it)."""
    loop = asyncio.get_running_loop()
    got = b""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            try:
                chunk = await loop.sock_recv(conn, 1 << 20)
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_client_socket_is_its_owners_until_its_process_closes_it(family: int) -> None:
    """The kernel's row of a client's socket names its uid; once its process closed it
    the row has no inode (and a TIME_WAIT row reads uid 0: never taken for root)."""
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    try:
        server = socket.socket(family)
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    with server:
        server.listen()
        client = socket.socket(family)
        client.connect(server.getsockname()[:2])
        conn, peer = server.accept()
        with conn:
            assert socket_owner(peer, conn.getsockname()) == os.getuid()
            client.close()
            assert socket_owner(peer, conn.getsockname()) is None


def test_a_hidden_tenant_is_one_other_row_yet_counts_every_namespace() -> None:
    """A tenant the asker may not see has its namespaces added up into one ``other`` row,
    and its count stays the real one, in ``tierd_namespaces`` and the page's tenant row
    (the snapshot's own rows are left as they are, for the other views)."""

    def row(name: str, held: int) -> dict[str, Any]:
        counts = {"lookups": 1, "hit_blocks": 1, "miss_blocks": 0, "stored_blocks": 1}
        return {"namespace": name, "id": "ab", "blocks": {"cpu": held}, "bytes": held, **counts}

    leases = {"leases_held_blocks": 0, "leases_expired": 0, "lease_refusals": 0}
    part = {
        "tiers": [{"name": "cpu", "used": 6, "capacity": 8}],
        "chain": {"hit_ratio": 0.5},
        "leases": leases,
        "namespaces": [row("n1", 1), row("n2", 2), row("n3", 3)],
    }
    stats = {"tenants": {"alpha": part, "beta": dict(part)}}
    shown = shown_stats(stats, View(tenant="alpha"))["tenants"]
    assert [(r["namespace"], r["bytes"]) for r in shown["#2"]["namespaces"]] == [("other", 6)]
    assert len(stats["tenants"]["beta"]["namespaces"]) == 3
    chain = dict.fromkeys(
        ("lookups", "hit_blocks", "miss_blocks", "events_published", "events_dropped"), 0
    )
    text = render_prometheus({"tiers": [], "routes": [], "chain": chain, "tenants": shown})
    assert 'tierd_namespaces{tenant="#2"} 3.0' in text
    assert 'tierd_namespaces{tenant="alpha"} 3.0' in text
    rows = {r["name"]: r["namespaces"] for r in status_page._tenant_rows(shown)}
    assert rows == {"alpha": 3, "#2": 3}
