"""The ``tierd`` commands that run the daemon and talk to it: ``serve``, ``stats``,
``events``, ``flush``, ``clear``, ``health``.

The client commands call ``asyncio.run`` themselves, so they cannot run inside a test's
event loop: the ``live`` fixture runs a daemon (:func:`tierd.testing.running_daemon`) in a
thread with its own loop, and the tests call :func:`tierd.cli.main` from the test thread,
doing their own client work through :func:`with_client` (a client in a fresh loop).
``tierd serve`` runs as a child process; its readiness and its stop are awaited through
the systemd notify socket it writes to (``READY=1``, ``STOPPING=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import structlog
import yaml

from tests.loop_daemon_kit import serve_in_thread
from tierd.cli import main
from tierd.client import Client
from tierd.testing import (
    DaemonProcess,
    daemon_config,
    running_daemon,
    short_socket_path,
    start_daemon,
)
from tierd.version import __version__

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4096
NAMESPACE = "cli"
DEADLINE_S = 30.0  # safety net for anything a test waits on, never a timed assertion
EXIT_DEADLINE_S = 60.0  # a child daemon's exit, on a loaded machine
CLEAR_SCREEN = "\x1b[H\x1b[2J"
FRAME_TITLE = "tierd stats at "

_T = TypeVar("_T")


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """``main`` (and ``serve``) point structlog at the captured stderr; put the previous
    configuration back so later tests do not log to a closed capture file."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TIERD_* variables from the caller, and a default socket path nobody serves."""
    for name in list(os.environ):
        if name.startswith("TIERD_") and name != "TIERD_HYPOTHESIS_PROFILE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.dirname(short_socket_path()))


@dataclass
class Live:
    """A daemon serving on ``socket`` from a thread; ``config`` is what it runs."""

    socket: str
    config: dict[str, Any]


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64, block_bytes=BLOCK)
    # The daemon thread logs through the global structlog configuration: warnings only,
    # to stderr, so that no line of it lands in the stdout a test compares (structlog's
    # default prints debug lines to stdout, at whatever moment the thread gets to them).
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    with serve_in_thread(
        config, start_s=DEADLINE_S, stop_s=EXIT_DEADLINE_S, name="tierd-daemon"
    ) as daemon:
        yield Live(daemon.path, config)


def with_client(
    path: str, work: Callable[[Client], Awaitable[_T]], namespace: str = NAMESPACE
) -> _T:
    """Run ``work`` on a client of the daemon at ``path``, in a fresh event loop."""

    async def run() -> _T:
        async with asyncio.timeout(DEADLINE_S):
            async with await Client.connect(path, namespace=namespace) as client:
                return await work(client)

    return asyncio.run(run())


def names(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(count)]


def store(path: str, keys: list[bytes]) -> int:
    """Store ``keys`` (through the mapped pool); returns how many the daemon stored."""

    async def work(client: Client) -> int:
        return await client.store(keys, [bytes([i]) * BLOCK for i in range(len(keys))])

    return with_client(path, work)


def stats(path: str) -> dict[str, Any]:
    return with_client(path, Client.stats)


def tier(snapshot: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [t for t in snapshot["tiers"] if t["name"] == name]
    return found


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``tierd ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


class CliThread:
    """``tierd ARGV`` in a thread, for commands that wait on something the test does."""

    def __init__(self, *argv: str) -> None:
        self.status: int | None = None
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(list(argv),), daemon=True)
        self._thread.start()

    def _run(self, argv: list[str]) -> None:
        try:
            self.status = main(argv)
        except BaseException as exc:  # handed to the test thread
            self.failure = exc

    def join(self) -> int:
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "the command did not finish"
        if self.failure is not None:
            raise self.failure
        assert self.status is not None
        return self.status


class Watched(io.StringIO):
    """A stderr that sets ``seen`` once ``marker`` has been written to it."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.seen = threading.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.marker in self.getvalue():
            self.seen.set()
        return written


class Terminal(io.StringIO):
    """A stdout that says it is a terminal; raises KeyboardInterrupt (Ctrl-C) instead of
    drawing the frame after the first ``frames``."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        self.frames = frames

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if FRAME_TITLE in text and self.getvalue().count(FRAME_TITLE) >= self.frames:
            raise KeyboardInterrupt
        return super().write(text)


def dead_socket() -> str:
    """A socket file that nobody listens on (connecting is refused)."""
    path = short_socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
    return path


# -- tierd stats ----------------------------------------------------------------------------


def test_stats_json_agrees_with_what_a_client_did(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = names("s", 3)
    assert store(live.socket, keys) == 3
    found = with_client(live.socket, lambda c: c.lookup([*keys, b"absent"]))
    assert found.count == 3

    status, out, _ = run_cli(capsys, "stats", "--socket", live.socket, "--json")

    assert status == 0
    shown = json.loads(out)
    cpu = tier(shown, "cpu")
    assert (cpu["used"], cpu["capacity"], cpu["stores"], cpu["hits"]) == (3, 8, 3, 3)
    assert (shown["chain"]["hit_blocks"], shown["chain"]["miss_blocks"]) == (3, 1)
    assert shown["server"]["requests"] > 0
    after = stats(live.socket)  # stats requests change only the server's counters
    assert (shown["tiers"], shown["chain"]) == (after["tiers"], after["chain"])


def test_stats_table(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    keys = names("t", 3)
    store(live.socket, keys)
    with_client(live.socket, lambda c: c.lookup([*keys, b"absent"]))

    status, out, _ = run_cli(capsys, "stats", "--socket", live.socket)

    assert status == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["tier"][:3] == ["tier", "medium", "used/capacity"]
    # name medium used/capacity (share) hits misses ratio stores evictions demotions
    # promotions io_errors
    assert rows["cpu"] == ["cpu", "CPU", "3/8", "(37.5%)", "3", "1", "75.0%", "3"] + ["0"] * 4
    assert rows["disk"][:8] == ["disk", "DISK", "0/64", "(0.0%)", "0", "1", "0.0%", "0"]
    assert "chain hit ratio 75.0% (3 of 4 looked-up blocks)" in out
    assert "routes: no copies yet" in out
    assert rows["server:"][-2:] == ["0", "errors"]


def test_stats_table_shows_routes_after_a_flush(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    store(live.socket, names("r", 2))
    assert run_cli(capsys, "flush", "--socket", live.socket)[0] == 0

    status, out, _ = run_cli(capsys, "stats", "--socket", live.socket)

    assert status == 0
    (route,) = [line.split() for line in out.splitlines() if line.startswith("CPU->DISK")]
    assert route[1] == f"{2 * BLOCK:,}"


def test_stats_watch_json_prints_one_object_per_frame(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    store(live.socket, names("w", 2))

    status, out, _ = run_cli(
        capsys, "stats", "--socket", live.socket, "--watch", "0.01", "--count", "3", "--json"
    )

    assert status == 0
    frames = [json.loads(line) for line in out.splitlines()]
    assert len(frames) == 3
    assert [tier(frame, "cpu")["used"] for frame in frames] == [2, 2, 2]
    requests = [frame["server"]["requests"] for frame in frames]
    assert requests == sorted(set(requests))  # a fresh snapshot each frame


def test_stats_watch_prints_blocks_when_not_a_terminal(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_cli(
        capsys, "stats", "--socket", live.socket, "--watch", "0.01", "--count", "2"
    )

    assert status == 0
    assert CLEAR_SCREEN not in out
    assert out.count(FRAME_TITLE) == 2
    assert out.count("chain hit ratio") == 2


def test_stats_watch_clears_a_terminal_and_stops_on_ctrl_c(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal(frames=2)
    monkeypatch.setattr(sys, "stdout", terminal)

    status = main(["stats", "--socket", live.socket, "--watch", "0.01"])

    assert status == 0
    frames = terminal.getvalue().split(CLEAR_SCREEN)
    assert frames[0] == ""
    assert len(frames) == 3  # two frames drawn, Ctrl-C while drawing the third
    assert all("cpu" in frame and "chain hit ratio" in frame for frame in frames[1:])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "2"], "--count needs --watch"),
        (["--watch", "0"], "--watch takes a positive number"),
        (["--watch", "1", "--count", "0"], "--count must be at least 1"),
    ],
)
def test_stats_usage_errors(
    live: Live, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = run_cli(capsys, "stats", "--socket", live.socket, *argv)

    assert (status, out) == (2, "")
    assert message in err


# -- tierd events ---------------------------------------------------------------------------


def subscribed(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    following: str,
    socket_path: str,
    *argv: str,
) -> CliThread:
    """``tierd events --socket SOCKET_PATH ARGV`` in a thread, once it says on stderr that
    it is ``following`` (subscribed); what was captured before is dropped."""
    stderr = Watched(following)
    monkeypatch.setattr(sys, "stderr", stderr)
    capsys.readouterr()
    cli = CliThread("events", "--socket", socket_path, *argv)
    assert stderr.seen.wait(DEADLINE_S), "the command did not subscribe"
    return cli


def test_events_json_prints_a_store_made_elsewhere(
    live: Live, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    following = "tierd: following events"
    cli = subscribed(monkeypatch, capsys, following, live.socket, "--count", "1", "--json")
    keys = names("e", 3)

    async def store_and_name(client: Client) -> str:
        await client.store(keys, [bytes(BLOCK)] * len(keys))
        return str(client.info["namespace_id"])

    namespace_id = with_client(live.socket, store_and_name)

    assert cli.join() == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "kind": "stored",
            "medium": "CPU",
            "tier": "cpu",
            "keys": [namespace_id + key.hex() for key in keys],
            "dropped": 0,
            "batch": 1,
        }
    ]


def test_events_of_one_namespace_show_its_own_keys(
    live: Live, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    following = "tierd: following events of namespace mine"
    cli = subscribed(
        monkeypatch, capsys, following, live.socket, "--namespace", "mine", "--count", "1"
    )
    with_client(live.socket, lambda c: c.store([b"other"], [bytes(BLOCK)]), namespace="other")
    with_client(live.socket, lambda c: c.store([b"k1", b"k2"], [bytes(BLOCK)] * 2), "mine")

    assert cli.join() == 0
    # The other namespace's store came first and was not shown: one batch, this one.
    assert capsys.readouterr().out == (
        f"batch 1 (1 event)\nstored CPU cpu 2 keys: {b'k1'.hex()} {b'k2'.hex()}\n"
    )


def test_events_end_with_status_3_when_the_daemon_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stderr = Watched("tierd: following events")
    monkeypatch.setattr(sys, "stderr", stderr)
    config = daemon_config(tmp_path, disk_blocks=None, block_bytes=BLOCK)
    path = str(config["socket"]["path"])
    cli: CliThread | None = None

    async def serve_until_subscribed() -> None:
        nonlocal cli
        async with running_daemon(config):
            cli = CliThread("events", "--socket", path)
            await asyncio.to_thread(stderr.seen.wait, DEADLINE_S)
        # leaving the block stopped the daemon, which closed the subscriber's connection

    asyncio.run(serve_until_subscribed())

    assert stderr.seen.is_set()
    assert cli is not None
    assert cli.join() == 3
    # The reason depends on what the client was doing as the daemon left (waiting for a
    # push: "closed the connection"; still writing: "the connection was lost: ...").
    announced, failure = stderr.getvalue().splitlines()
    assert announced == "tierd: following events (Ctrl-C to stop)"
    assert failure.startswith(f"tierd: error: cannot reach the daemon at {path}: ")


# -- tierd flush / clear / health ---------------------------------------------------------


def test_flush_copies_dirty_blocks_down(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    store(live.socket, names("f", 3))

    done = run_cli(capsys, "flush", "--socket", live.socket)
    assert done == (0, "copied 3 blocks; nothing left dirty\n", "")
    assert tier(stats(live.socket), "disk")["used"] == 3
    # Every block is clean now; no remote level, so nothing was sent to one.
    assert run_cli(capsys, "flush", "--socket", live.socket, "--json") == (
        0,
        '{"copied": 0, "dirty": 0, "dirty_by_tier": {}, "reason": "", "remote_sent": 0,'
        ' "remote_missed": 0, "remote_missed_by_level": {}, "remote_reason": ""}\n',
        "",
    )


def test_clear_one_tier(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    store(live.socket, names("c", 3))
    run_cli(capsys, "flush", "--socket", live.socket)
    store(live.socket, names("d", 2))

    status, out, _ = run_cli(capsys, "clear", "--tier", "cpu", "--socket", live.socket)

    assert (status, out) == (0, "removed 5 blocks\n")
    after = stats(live.socket)
    assert (tier(after, "cpu")["used"], tier(after, "disk")["used"]) == (0, 3)


def test_clear_every_tier_json(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    store(live.socket, names("c", 3))
    run_cli(capsys, "flush", "--socket", live.socket)

    status, out, _ = run_cli(capsys, "clear", "--socket", live.socket, "--json")

    assert status == 0
    assert json.loads(out) == {"removed": 6, "tier": None}
    assert [t["used"] for t in stats(live.socket)["tiers"]] == [0, 0]


def test_clear_an_unknown_tier_fails(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    store(live.socket, names("u", 2))

    status, out, err = run_cli(capsys, "clear", "--tier", "nope", "--socket", live.socket)

    assert (status, out) == (1, "")
    assert "no tier named 'nope' (tiers: cpu, disk)" in err
    assert tier(stats(live.socket), "cpu")["used"] == 2


def test_health(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "health", "--socket", live.socket)

    assert status == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert (fields["status"], fields["version"], fields["connections"]) == ("ok", __version__, "1")
    assert fields["uptime"].endswith(" s")

    status, out, _ = run_cli(capsys, "health", "--socket", live.socket, "--json")
    assert status == 0
    health = json.loads(out)
    assert (health["status"], health["version"]) == ("ok", __version__)


# -- finding the daemon ---------------------------------------------------------------------


COMMANDS = [["stats"], ["events"], ["flush"], ["clear"], ["health"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda argv: argv[0])
@pytest.mark.parametrize("kind", ["missing", "refused"])
def test_unreachable_daemon_exits_3(
    capsys: pytest.CaptureFixture[str], command: list[str], kind: str
) -> None:
    path = short_socket_path() if kind == "missing" else dead_socket()
    reason = (
        "no socket there: no daemon serves this path"
        if kind == "missing"
        else "the socket is there but no daemon listens on it"
    )

    status, out, err = run_cli(capsys, *command, "--socket", path)

    assert (status, out) == (3, "")
    assert err.startswith(f"tierd: error: cannot reach the daemon at {path}: {reason} (")
    assert err.count("\n") == 1


def test_socket_option_beats_the_environment(
    live: Live, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = dead_socket()
    monkeypatch.setenv("TIERD_SOCKET", live.socket)
    assert run_cli(capsys, "health")[0] == 0
    status, _, err = run_cli(capsys, "health", "--socket", dead)
    assert status == 3
    assert dead in err

    monkeypatch.setenv("TIERD_SOCKET", dead)
    assert run_cli(capsys, "health", "--socket", live.socket)[0] == 0


def test_environment_beats_the_config_file(
    live: Live, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "tierd.yaml"
    config_file.write_text(yaml.safe_dump(live.config))
    assert run_cli(capsys, "health", "-c", str(config_file))[0] == 0
    monkeypatch.setenv("TIERD_CONFIG", str(config_file))
    assert run_cli(capsys, "health")[0] == 0

    dead = dead_socket()
    monkeypatch.setenv("TIERD_SOCKET", dead)
    status, _, err = run_cli(capsys, "health", "-c", str(config_file))
    assert status == 3
    assert dead in err


def test_default_socket_path(
    live: Live, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # short_socket_path() names the socket tierd.sock, the default in $XDG_RUNTIME_DIR/tierd.
    assert os.path.basename(live.socket) == "tierd.sock"
    status, _, err = run_cli(capsys, "health")
    assert status == 3
    assert os.environ["XDG_RUNTIME_DIR"] in err

    runtime = os.path.dirname(short_socket_path())
    os.symlink(os.path.dirname(live.socket), os.path.join(runtime, "tierd"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    assert run_cli(capsys, "health")[0] == 0


def test_a_bad_config_file_for_the_socket_exits_78(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "tierd.yaml"
    config_file.write_text("socket:\n  path: [not, a, path]\n")

    status, out, err = run_cli(capsys, "stats", "-c", str(config_file))

    assert (status, out) == (78, "")
    assert "socket.path" in err


# -- tierd serve ----------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    return {**env, **extra}


@contextlib.contextmanager
def notify_socket() -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's ``NOTIFY_SOCKET``."""
    path = short_socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(DEADLINE_S)
        yield sock


def wait_for_notice(sock: socket.socket, daemon: DaemonProcess, state: str) -> None:
    # Start-up progress (EXTEND_TIMEOUT_USEC, one per GiB of the CPU pool) comes first.
    while (message := sock.recv(4096).decode()).startswith("EXTEND_TIMEOUT_USEC="):
        pass
    assert message == state, f"expected {state}, got {message} (exit status {daemon.returncode})"


def test_serve_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=16, block_bytes=BLOCK)
    path = str(config["socket"]["path"])
    log_file = tmp_path / "serve.log"
    with notify_socket() as notices:
        # The notices are this test's to read: the helper leaves NOTIFY_SOCKET to it.
        env = child_env(NOTIFY_SOCKET=notices.getsockname())
        daemon = start_daemon(config, env=env, log=log_file, cwd=ROOT, notify=False, wait=False)
        try:
            wait_for_notice(notices, daemon, "READY=1")
            assert store(path, names("p", 3)) == 3
            status, out, _ = run_cli(capsys, "stats", "--socket", path, "--json")
            assert status == 0
            assert tier(json.loads(out), "cpu")["used"] == 3

            daemon.signal(signal.SIGTERM)
            wait_for_notice(notices, daemon, "STOPPING=1")
            assert daemon.wait(EXIT_DEADLINE_S) == 0
        finally:
            daemon.kill()
    assert not os.path.exists(path)
    lines = log_file.read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines if line.startswith("{")]
    # The config's logging (info, JSON off a terminal), not the command line's warnings.
    assert events[-1] == "stopped"
    assert {"ready", "stopping: draining requests"} <= set(events)


def test_serve_with_a_bad_config_file_exits_78(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = daemon_config(tmp_path, block_bytes=BLOCK)
    config["tiers"][1]["capacity"] = "lots"
    config_file = tmp_path / "tierd.yaml"
    config_file.write_text(yaml.safe_dump(config))

    status, out, err = run_cli(capsys, "serve", "-c", str(config_file))

    assert (status, out) == (78, "")
    assert err.startswith("tierd: error: invalid configuration:\n")
    assert "tiers.1.capacity" in err


def test_serve_with_a_bad_set_exits_78(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = tmp_path / "tierd.yaml"
    config_file.write_text(yaml.safe_dump(daemon_config(tmp_path, block_bytes=BLOCK)))

    status, _, err = run_cli(capsys, "serve", "-c", str(config_file), "--set", "socket.mode=rwx")

    assert status == 78
    assert "socket.mode (from --set)" in err


def test_a_second_serve_on_a_live_socket_exits_1(
    live: Live, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "second.yaml"
    config_file.write_text(yaml.safe_dump(daemon_config(tmp_path, block_bytes=BLOCK)))

    status, out, err = run_cli(
        capsys, "serve", "-c", str(config_file), "--set", f"socket.path={live.socket}"
    )

    assert (status, out) == (1, "")
    assert f"tierd: error: tierd is already running on {live.socket}\n" in err
    # The first daemon kept its socket and still answers.
    assert run_cli(capsys, "health", "--socket", live.socket)[0] == 0
