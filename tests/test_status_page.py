"""The status page on the metrics endpoint: its figures (``/status.json``) against what
``stats`` answers, who it answers, and the page itself in a real headless Chromium.

Each test runs the daemon as a real ``tierd serve`` process (the ``spawn`` fixture of
tests/daemon_kit.py) with ``metrics.http_port`` on a free loopback port, and talks to
it with :class:`tierd.client.Client`. The browser is Debian's ``chromium-headless-shell``
(or ``chromium``; ``scripts/setup`` installs it), driven over the DevTools protocol on a
pipe (``--remote-debugging-pipe``): the test waits in the page for what it expects (a
MutationObserver, bounded by a deadline), never by sleeping.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_kit import (
    BLOCK,
    DEADLINE_S,
    NAMESPACE,
    DaemonProcess,
    Spawn,
    block,
    http_get,
    keys,
    raw_get,
)
from tests.port_kit import free_port
from tierd.client import Client, DaemonError
from tierd.daemon import metrics_http, status_page
from tierd.daemon.http_peer import View
from tierd.testing import daemon_config, running_daemon

WIDTH, HEIGHT = 1280, 900


def chromium() -> str:
    for name in ("chromium-headless-shell", "chromium"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium is not installed (scripts/setup installs chromium-headless-shell)")


async def busy_daemon(
    tmp_path: Path, spawn: Spawn, cache: float = 1.0
) -> tuple[DaemonProcess, int]:
    """A daemon with its metrics endpoint on (``metrics.cache``: ``cache``), some blocks
    stored, some looked up: a CPU tier of 8 over a disk tier, 12 blocks stored (4 demoted),
    12 hits and one miss."""
    port = free_port()
    daemon = await spawn(daemon_config(tmp_path, metrics={"http_port": port, "cache": cache}))
    names = keys("page", 12)
    async with await daemon.connect() as client:
        for part in (names[:6], names[6:]):
            assert await client.store(part, [block(k) for k in part]) == 6
        assert (await client.lookup(names)).count == 12
        assert (await client.lookup([b"absent"])).count == 0
    return daemon, port


async def status_json(port: int) -> dict[str, Any]:
    status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/status.json")
    assert status == 200, text
    return dict(json.loads(text))


# -- /status.json --------------------------------------------------------------------------


async def test_status_json_shows_what_stats_reports(tmp_path: Path, spawn: Spawn) -> None:
    daemon, port = await busy_daemon(tmp_path, spawn, cache=0)  # every request: a new build
    async with await daemon.connect() as client:
        page = await status_json(port)
        stats = await client.stats(namespaces=True)
    for key in ("tiers", "routes", "chain", "remote", "block_bytes", "leases"):
        assert page[key] == stats[key], key
    assert page["version"] == stats["server"]["version"]
    assert [t["hits"] for t in page["tiers"]] == [8, 4]  # cpu, disk
    (row,) = stats["tenants"]["default"]["namespaces"]
    keep = ("blocks", "bytes", "lookups", "hit_blocks", "miss_blocks", "stored_blocks")
    assert page["namespaces"] == [
        {"tenant": "default", "namespace": NAMESPACE, **{k: row[k] for k in keep}}
    ]
    assert page["namespaces_total"] == 1
    assert [t["name"] for t in page["tenants"]] == ["default"]
    assert page["tenants"][0]["used"] == {t["name"]: t["used"] for t in stats["tiers"]}
    # This test's process was connected while the figures were taken: listed by pid.
    (me,) = [c for c in page["clients"] if c["pid"] == os.getpid()]
    assert me["namespaces"] == [NAMESPACE] and me["tenant"] == "default"
    assert me["connections"] == 1 and me["uid"] == os.getuid() and me["process"]
    assert page["recent_errors"] == []
    assert await daemon.stop() == 0


async def test_errors_are_listed_as_they_grow(tmp_path: Path, spawn: Spawn) -> None:
    """Each build (metrics.cache 0: every request) lists the error counters that grew
    since the last one; a counter growing at build after build stays one entry."""
    daemon, port = await busy_daemon(tmp_path, spawn, cache=0)
    assert (await status_json(port))["recent_errors"] == []
    async with await daemon.connect() as client:

        async def refused() -> None:
            with pytest.raises(DaemonError):
                await client.request("lookup", keys=[])  # an empty key list: bad_request

        await refused()
        (entry,) = (await status_json(port))["recent_errors"]
        assert entry["what"] == "error replies: bad_request"
        assert entry["count"] == entry["total"] == 1 and entry["until"] == entry["at"]
        await refused()
        (grown,) = (await status_json(port))["recent_errors"]  # grew again: the same entry
        assert (grown["at"], grown["count"], grown["total"]) == (entry["at"], 2, 2)
        assert grown["until"] > grown["at"]
        assert (await status_json(port))["recent_errors"] == [grown]  # no growth: as it was
        await refused()
        page = await status_json(port)
    newest, older = page["recent_errors"]  # after a build without growth: a new entry
    assert older == grown and (newest["count"], newest["total"]) == (1, 3)
    assert page["server"]["errors"]["bad_request"] == 3
    assert await daemon.stop() == 0


async def test_a_full_disk_tier_evicting_is_no_error(tmp_path: Path, spawn: Spawn) -> None:
    """Issue 61, item 4: the last tier's evictions counted as "dirty blocks dropped" and
    kept the page's recent errors red on a healthy node. They are traffic: not listed."""
    port = free_port()
    config = daemon_config(tmp_path, cpu_blocks=4, disk_blocks=8, metrics={"http_port": port})
    config["metrics"]["cache"] = 0
    daemon = await spawn(config)
    assert (await status_json(port))["recent_errors"] == []
    names = keys("evicted", 32)  # four times the disk tier
    async with await daemon.connect() as client:
        for start in range(0, len(names), 4):
            part = names[start : start + 4]
            assert await client.store(part, [block(k) for k in part]) == 4
        stats = await client.stats()
    assert stats["tiers"][1]["dropped"] > 0  # the disk tier evicted, with nothing below
    page = await status_json(port)
    assert page["recent_errors"] == [], page["recent_errors"]
    assert await daemon.stop() == 0


async def test_the_page_answers_only_a_loopback_host(tmp_path: Path, spawn: Spawn) -> None:
    """DNS rebinding: a web page's own name resolving to 127.0.0.1 must not read the
    page's figures through a browser on this machine."""
    daemon, port = await busy_daemon(tmp_path, spawn)
    for path in ("/", "/status", "/status.json"):
        status, _ = await asyncio.to_thread(raw_get, port, path, f"rebind.example:{port}")
        assert status.endswith("403 Forbidden"), (path, status)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            status, body = await asyncio.to_thread(raw_get, port, path, host)
            assert status.endswith("200 OK"), (path, host, status)
    status, body = await asyncio.to_thread(raw_get, port, "/metrics", "scraper.example")
    assert status.endswith("200 OK") and b"tierd_tier_hits_total" in body  # Prometheus: as before
    status, _ = await asyncio.to_thread(raw_get, port, "/status.js", f"127.0.0.1:{port}")
    assert status.endswith("404 Not Found")
    status, page = await asyncio.to_thread(raw_get, port, "/?x=1", f"127.0.0.1:{port}")
    assert status.endswith("200 OK") and b"<title>tierd status</title>" in page
    assert b"http://" not in page.replace(b"http://www.w3.org/2000/svg", b"")  # no external URL
    assert await daemon.stop() == 0


async def test_the_figures_are_built_once_per_interval_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any local user may poll /status.json: however many ask within ``metrics.cache``,
    one build serves them, and its JSON is made off the event loop (the in-loop daemon,
    so that the build can be watched)."""
    threads: list[str] = []
    real = status_page.render

    def watched(snapshot: dict[str, Any], view: View) -> bytes:
        threads.append(threading.current_thread().name)
        return real(snapshot, view)

    monkeypatch.setattr(status_page, "render", watched)
    port = free_port()
    config = daemon_config(tmp_path, metrics={"http_port": port, "cache": 3600})
    async with asyncio.timeout(120), running_daemon(config):
        # On the loop, not in threads: the daemon's build uses this loop's thread pool.
        replies = await asyncio.gather(*(loop_get(port, "/status.json") for _ in range(8)))
        replies.append(await loop_get(port, "/status.json"))  # later, within the interval
    assert {reply.split(b"\r\n", 1)[0] for reply in replies} == {b"HTTP/1.0 200 OK"}
    assert len(set(replies)) == 1
    assert len(threads) == 1 and threads[0] != threading.main_thread().name


async def loop_get(port: int, path: str) -> bytes:
    """The whole reply to ``GET path``, read on the event loop."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        return await reader.read()
    finally:
        writer.close()


# -- the page in a headless Chromium -------------------------------------------------------


class Browser:
    """A headless Chromium driven over the DevTools protocol on a pipe (fd 3: commands,
    fd 4: replies and events, each a JSON text ending in NUL), one page attached."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser, self._out = os.pipe()
        self._in, from_browser = os.pipe()
        # Above fd 9, so that the child's dup2 onto 3 and 4 overwrites neither of them.
        for fd in (to_browser, from_browser):
            os.set_inheritable(fd, False)
        child_in = fcntl.fcntl(to_browser, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(from_browser, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_browser)
        os.close(from_browser)
        command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
        command += ["--remote-debugging-pipe", f"--window-size={WIDTH},{HEIGHT}"]
        command += [f"--user-data-dir={profile}", "--hide-scrollbars", "about:blank"]
        self.proc = subprocess.Popen(
            command,
            pass_fds=(3, 4),
            preexec_fn=lambda: _onto(child_in, child_out),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(child_in)
        os.close(child_out)
        self._buffer = b""
        self._next = 0
        self.session = ""

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a command (to the attached page once there is one) and wait for its reply."""
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return dict(reply["result"])

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._in], [], [], DEADLINE_S)
            chunk = os.read(self._in, 1 << 20) if ready else b""
            if not chunk:
                raise AssertionError("chromium did not answer within the deadline")
            self._buffer += chunk
        text, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(text))

    def open(self, url: str) -> None:
        pages = self.call("Target.getTargets")["targetInfos"]
        target = next(t["targetId"] for t in pages if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.navigate", url=url)

    def wait_for(self, condition: str) -> Any:
        """The value of the JavaScript expression ``condition`` once it is truthy: checked
        at once, then at every change of the page, for at most DEADLINE_S."""
        script = f"""new Promise((resolve, reject) => {{
            const check = () => {{ try {{ return ({condition}); }} catch (e) {{ return null; }} }};
            const now = check(); if (now) return resolve(now);
            const watch = new MutationObserver(() => {{
                const value = check(); if (value) {{ watch.disconnect(); resolve(value); }} }});
            watch.observe(document, {{subtree: true, childList: true, characterData: true,
                                      attributes: true}});
            setTimeout(() => {{ watch.disconnect(); reject(new Error("timed out: " +
                document.body.innerText.slice(0, 2000))); }}, {int(DEADLINE_S * 1000) - 2000});
        }})"""
        reply = self.call(
            "Runtime.evaluate", expression=script, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in reply:
            raise AssertionError(f"{condition}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(
            base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        )

    def close(self) -> None:
        try:
            self.call("Browser.close")
        finally:
            os.close(self._out)
            os.close(self._in)
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _onto(commands: int, replies: int) -> None:
    """In the browser's process: the pipe's ends on the descriptors it reads and writes."""
    os.dup2(commands, 3)
    os.dup2(replies, 4)


@asynccontextmanager
async def browser(tmp_path: Path) -> AsyncIterator[Browser]:
    opened = Browser(chromium(), tmp_path / "chromium-profile")
    try:
        yield opened
    finally:
        await asyncio.to_thread(opened.close)


def cell(tier: str, column: str) -> str:
    """JavaScript: the text of a tier row's cell."""
    return f"document.querySelector('[data-tier=\"{tier}\"] .{column}')?.textContent"


async def test_chromium_shows_a_live_daemons_figures(tmp_path: Path, spawn: Spawn) -> None:
    image = pytest.importorskip("matplotlib.image")
    daemon, port = await busy_daemon(tmp_path, spawn)
    async with browser(tmp_path) as page:
        await asyncio.to_thread(page.open, f"http://127.0.0.1:{port}/")
        async with await daemon.connect() as client:
            for tier in (await client.stats())["tiers"]:  # the names, the hits reported
                shown = f"{cell(tier['name'], 'hits')} === '{tier['hits']:,}'"
                assert await asyncio.to_thread(page.wait_for, shown)
            # Live: later hits reach the page without a reload.
            for _ in range(3):
                assert (await client.lookup(keys("page", 12)[6:])).count == 6
            hits = (await client.stats())["tiers"][0]["hits"]
            assert hits == 8 + 18
            assert await asyncio.to_thread(page.wait_for, f"{cell('cpu', 'hits')} === '{hits:,}'")
            row = f"!!document.querySelector('[data-pid=\"{os.getpid()}\"]')"
            assert await asyncio.to_thread(page.wait_for, row)  # this process, connected
        text = await asyncio.to_thread(page.evaluate, "document.body.innerText")
        shown_all = "shown: every tenant (operator)"  # this test runs as the daemon's user
        for shown in (
            "cpu",
            "disk",
            "CPU → DISK",
            NAMESPACE,
            "default",
            "none configured",
            shown_all,
        ):
            assert shown in text, shown
        assert await asyncio.to_thread(page.evaluate, "document.getElementById('banner').hidden")
        await asyncio.to_thread(page.screenshot, tmp_path / "status.png")
        pixels = image.imread(tmp_path / "status.png")
        assert pixels.shape[:2] == (HEIGHT, WIDTH)
        colours = {tuple(p) for p in (pixels[::2, ::2, :3] * 255).astype(int).reshape(-1, 3)}
        assert len(colours) > 50, f"the screenshot is (nearly) blank: {len(colours)} colours"

        assert await daemon.stop() == 0
        banner = "document.getElementById('banner')"
        said = await asyncio.to_thread(page.wait_for, f"!{banner}.hidden && {banner}.textContent")
        assert said.startswith("daemon not answering since ")
        # The last figures stay, greyed out.
        assert await asyncio.to_thread(page.evaluate, cell("cpu", "hits")) == f"{hits:,}"
        assert await asyncio.to_thread(page.evaluate, "document.body.className") == "stale"


async def test_chromium_shows_a_user_of_no_tenant_the_totals_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page as a user of no tenant gets it (the in-loop daemon, told that the kernel
    names nobody; tests/test_status_privacy.py asks as real users): the figures, the
    tenant as ``#1``, its namespace added up as ``other``, the process counted only."""

    async def nobody(peer: Any, ours: Any) -> None:
        return None

    monkeypatch.setattr(metrics_http, "asker", nobody)
    port = free_port()
    config = daemon_config(tmp_path, metrics={"http_port": port})
    async with (
        asyncio.timeout(120),
        running_daemon(config) as daemon,
        await Client.connect(
            str(daemon.config.socket.path), namespace=NAMESPACE, block_bytes=BLOCK
        ) as client,
        browser(tmp_path) as page,
    ):
        assert await client.store([b"k"], [block(b"k")]) == 1
        await asyncio.to_thread(page.open, f"http://127.0.0.1:{port}/")
        hidden = "and 1 process of other tenants (an operator sees them)"
        text = "document.body.innerText"
        assert await asyncio.to_thread(page.wait_for, f"{text}.includes({hidden!r})")
        shown = await asyncio.to_thread(page.wait_for, f"{cell('cpu', 'hits')} && {text}")
        rows = "document.querySelectorAll('[data-pid]').length"
        assert await asyncio.to_thread(page.evaluate, rows) == 0
    assert "shown: totals only (no tenant of yours)" in shown
    assert "#1" in shown and "other" in shown
    assert NAMESPACE not in shown and "default" not in shown


async def test_names_reach_the_page_as_text_never_as_markup(tmp_path: Path, spawn: Spawn) -> None:
    """A namespace name is chosen by a client: where the pattern lets markup through, the
    page shows it as text, and nothing in it runs in the operator's browser."""
    port = free_port()
    config = daemon_config(
        tmp_path, metrics={"http_port": port}, namespaces={"pattern": r"^.{1,128}$"}
    )
    daemon = await spawn(config)
    name = "<img src=x onerror=\"document.title='pwned'\"><b id=injected>ns</b>"
    async with await Client.connect(
        daemon.socket_path, namespace=name, block_bytes=BLOCK
    ) as client:
        assert await client.store([b"k"], [block(b"k")]) == 1
        async with browser(tmp_path) as page:
            await asyncio.to_thread(page.open, f"http://127.0.0.1:{port}/")
            shown = await asyncio.to_thread(
                page.wait_for,
                "[...document.querySelectorAll('#namespaces td')].map(td => td.textContent)"
                ".find(t => t.includes('onerror'))",
            )
            assert shown == name
            assert (
                await asyncio.to_thread(page.evaluate, "document.getElementById('injected')")
                is None
            )
            assert await asyncio.to_thread(page.evaluate, "document.images.length") == 0
            assert await asyncio.to_thread(page.evaluate, "document.title") == "tierd status"
    assert await daemon.stop() == 0
