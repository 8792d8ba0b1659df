"""``tierd top``: the frame rendered from two stats snapshots, and the command against a
real daemon (running in a background thread with its own event loop)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.loop_daemon_kit import ThreadDaemon, serve_in_thread
from tierd.cli import main
from tierd.cli.top_frame import render_frame
from tierd.client import Client, LoadLease
from tierd.testing import daemon_config, short_socket_path

MiB = 1 << 20


# -- render_frame on hand-built snapshots ------------------------------------------------


def _tier(name: str, medium: str, **figures: int) -> dict[str, Any]:
    tier = {"name": name, "medium": medium, "policy": "lru", "capacity": 8, "used": 0}
    counters = ("pinned", "writing", "hits", "misses", "stores", "evictions", "demotions")
    tier.update(dict.fromkeys((*counters, "promotions", "dropped", "refused", "io_errors"), 0))
    tier.update(figures)
    return tier


def _route(src: str, dst: str, moved: int, blocks: int = 1) -> dict[str, Any]:
    return {
        "src": src,
        "dst": dst,
        "bytes": moved,
        "blocks": blocks,
        "failures": 0,
        "busy_s": 0.0,
        "gb_per_s": 0.0,
        "in_flight_bytes": 0,
    }


def _snapshot(
    tiers: list[dict[str, Any]],
    routes: list[dict[str, Any]] | None = None,
    *,
    requests: int = 0,
    connections: int = 1,
    leases: int = 0,
    errors: dict[str, int] | None = None,
    hit_blocks: int = 0,
    miss_blocks: int = 0,
) -> dict[str, Any]:
    return {
        "block_bytes": 4096,
        "tiers": tiers,
        "routes": routes or [],
        "chain": {
            "lookups": 3,
            "hit_blocks": hit_blocks,
            "miss_blocks": miss_blocks,
            "hit_ratio": 0.0,
            "events_published": 0,
            "events_dropped": 0,
        },
        "server": {
            "version": "0.1.0",
            "uptime_s": 75.0,
            "connections": connections,
            "requests": requests,
            "errors": errors or {},
            "leases": leases,
            "subscribers": 0,
            "shutting_down": False,
        },
    }


def _row(lines: list[str], first: str, *, after: str | None = None) -> list[str]:
    """The cells of the first line whose first cell is ``first`` (after the line that
    starts with ``after``, when given)."""
    start = 0 if after is None else next(i for i, x in enumerate(lines) if x.startswith(after))
    for line in lines[start:]:
        cells = line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n" + "\n".join(lines))


def test_frame_shows_tier_occupancy_and_hit_ratio() -> None:
    cur = _snapshot(
        [
            _tier("cpu", "CPU", capacity=8, used=6, hits=1, misses=3),
            _tier("disk", "DISK", capacity=1000, used=250, hits=2, misses=0),
        ]
    )
    lines = render_frame(None, cur, 1.0)
    cpu = _row(lines, "cpu")
    assert cpu[:3] == ["cpu", "CPU", "6/8"]
    assert cpu[4:] == ["75.0%", "25.0%"]
    disk = _row(lines, "disk")
    assert disk[:3] == ["disk", "DISK", "250/1,000"]
    assert disk[4:] == ["25.0%", "100.0%"]
    # The bars: as many '#' as the used share of the bar's width.
    for cells, share in ((cpu, 6 / 8), (disk, 250 / 1000)):
        bar = cells[3]
        assert bar[0] == "[" and bar[-1] == "]"
        inner = bar[1:-1]
        assert inner.count("#") == round(len(inner) * share)
        assert set(inner) <= {"#", "."}


def test_frame_shows_tier_counters() -> None:
    cpu = _tier(
        "cpu",
        "CPU",
        stores=1234,
        evictions=56,
        demotions=7,
        promotions=89,
        pinned=3,
        io_errors=2,
    )
    lines = render_frame(None, _snapshot([cpu]), 1.0)
    header = _row(lines, "tier", after="tier  stores")
    assert header == [
        "tier",
        "stores",
        "evictions",
        "demotions",
        "promotions",
        "pinned",
        "io",
        "errors",
    ]
    assert _row(lines, "cpu", after="tier  stores") == ["cpu", "1,234", "56", "7", "89", "3", "2"]


def test_frame_without_capacity_or_lookups_shows_no_ratio() -> None:
    lines = render_frame(None, _snapshot([_tier("cpu", "CPU", capacity=0, used=0)]), 1.0)
    cells = _row(lines, "cpu")
    assert cells[2] == "0/0"
    assert "#" not in cells[3]
    assert cells[4:] == ["-", "-"]
    assert "chain hit ratio - (0 of 0 looked-up blocks" in "\n".join(lines)


def test_route_bytes_per_second_from_two_snapshots() -> None:
    tiers = [_tier("cpu", "CPU"), _tier("disk", "DISK")]
    prev = _snapshot(tiers, [_route("CPU", "DISK", 1 * MiB)])
    cur = _snapshot(tiers, [_route("CPU", "DISK", 4 * MiB, 3), _route("DISK", "CPU", 512 << 10)])
    lines = render_frame(prev, cur, 2.0)
    # 3 MiB in 2 s; a route new since the last snapshot counts from zero: 512 KiB in 2 s.
    assert _row(lines, "CPU->DISK") == [
        "CPU->DISK",
        "1.5",
        "MiB/s",
        "4.0",
        "MiB",
        "3",
        "0",
        "0",
        "B",
    ]
    assert _row(lines, "DISK->CPU")[1:5] == ["256.0", "KiB/s", "512.0", "KiB"]


def test_first_frame_has_no_rates() -> None:
    cur = _snapshot([_tier("cpu", "CPU")], [_route("CPU", "DISK", 4 * MiB)], requests=10)
    lines = render_frame(None, cur, 0.0)
    assert _row(lines, "CPU->DISK")[1] == "-"
    assert "requests 10 (-/s)" in "\n".join(lines)


def test_frame_shows_server_figures() -> None:
    tiers = [_tier("cpu", "CPU")]
    prev = _snapshot(tiers, requests=100)
    cur = _snapshot(
        tiers,
        requests=350,
        connections=4,
        leases=2,
        errors={"capacity": 3, "bad_request": 1},
        hit_blocks=30,
        miss_blocks=10,
    )
    text = "\n".join(render_frame(prev, cur, 0.5))
    assert "clients 4" in text
    assert "leases 2" in text
    assert "up 1m 15s" in text
    assert "requests 350 (500.0/s)" in text  # 250 requests in 0.5 s
    assert "errors 4 (bad_request 1, capacity 3)" in text
    assert "chain hit ratio 75.0% (30 of 40 looked-up blocks" in text


def _wide_snapshot() -> dict[str, Any]:
    tiers = [_tier("cpu", "CPU", used=4), _tier("nvme-scratch", "DISK", capacity=10**6)]
    return _snapshot(tiers, [_route("CPU", "DISK", 7 * MiB)], errors={"x" * 200: 1})


@pytest.mark.parametrize("width", [40, 80, 100, 160])
def test_lines_fit_the_width(width: int) -> None:
    cur = _wide_snapshot()
    lines = render_frame(cur, cur, 1.0, width=width)
    assert all(len(line) <= width for line in lines)
    assert any(len(line) == width for line in lines)  # the long error line is cut


def test_the_header_fits_80_columns_without_losing_a_word() -> None:
    tiers = [_tier("cpu", "CPU", used=4), _tier("disk", "DISK", capacity=10**6)]
    prev = _snapshot(tiers, requests=1_000_000)
    cur = _snapshot(
        tiers,
        requests=123_456_789,
        connections=1_024,
        leases=65_536,
        errors={"capacity": 12_345},
        hit_blocks=987_654_321,
        miss_blocks=123_456_789,
    )
    cur["server"].update(uptime_s=3 * 86_400 + 4 * 3_600, subscribers=12, version="10.20.30")
    cur["chain"].update(lookups=55_555_555, events_dropped=1_234_567)
    lines = render_frame(prev, cur, 1.0, width=80)
    header = lines[: lines.index("")]

    assert all(len(line) <= 80 for line in lines)
    words = " ".join(header).split()
    for expected in [
        "tierd",
        "10.20.30",
        "up",
        "3d",
        "04h",
        "clients",
        "1,024",
        "leases",
        "65,536",
        "subscribers",
        "12",
        "requests",
        "123,456,789",
        "(122,456,789.0/s)",
        "errors",
        "12,345",
        "(capacity",
        "chain",
        "hit",
        "ratio",
        "88.9%",
        "(987,654,321",
        "of",
        "1,111,111,110",
        "looked-up",
        "blocks)",
        "lookups",
        "55,555,555",
        "events",
        "dropped",
        "1,234,567",
    ]:
        assert expected in words, f"{expected!r} missing from the header:\n" + "\n".join(header)
    assert not any(line.endswith(" ") for line in header)


def test_the_bar_grows_with_the_width() -> None:
    cur = _wide_snapshot()
    bars = [len(_row(render_frame(cur, cur, 1.0, width=w), "cpu")[3]) for w in (60, 80, 200)]
    assert bars[0] < bars[1] <= bars[2]


def test_frame_of_an_empty_snapshot() -> None:
    lines = render_frame(None, {"tiers": [], "routes": [], "chain": {}}, 1.0)
    text = "\n".join(lines)
    assert "no tiers" in text
    assert "routes: no copies yet" in text


# -- the command against a real daemon -------------------------------------------------------


@pytest.fixture
def background_daemon(tmp_path: Path) -> Iterator[ThreadDaemon]:
    """A daemon serving in another thread's event loop."""
    with serve_in_thread(daemon_config(tmp_path, cpu_blocks=8, disk_blocks=64)) as daemon:
        yield daemon


@dataclass
class Activity:
    """A client that stored blocks and holds a load lease, and the stats it saw after."""

    client: Client
    lease: LoadLease
    stats: dict[str, Any]


async def _store_and_pin(path: str, stored: int, pinned: int) -> Activity:
    client = await Client.connect(path, namespace="top-test")
    keys = [f"block-{i}".encode() for i in range(stored)]
    for start in range(0, stored, 4):  # batches that fit the cpu tier
        batch = keys[start : start + 4]
        await client.store(batch, [key.ljust(client.block_bytes, b".") for key in batch])
    lease = await client.prepare_load(keys[-pinned:])
    assert lease.count == pinned
    return Activity(client, lease, await client.stats())


async def _finish(activity: Activity) -> None:
    await activity.lease.release()
    await activity.client.close()


def test_top_plain_into_a_closed_pipe_ends_quietly_with_status_0(
    background_daemon: ThreadDaemon,
) -> None:
    argv = ["top", "--plain", "--interval", "0.05", "--socket", background_daemon.path]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierd", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read()  # until it exits: it runs until its next frame finds no reader
    assert proc.wait(timeout=60) == 0
    assert first.startswith(b"tierd top at ")
    assert err == b""


@pytest.mark.parametrize("how", ["--socket", "TIERD_SOCKET", "-c"])
def test_top_plain_shows_the_running_daemon(
    background_daemon: ThreadDaemon,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    how: str,
) -> None:
    daemon = background_daemon
    monkeypatch.delenv("TIERD_SOCKET", raising=False)
    monkeypatch.delenv("TIERD_CONFIG", raising=False)
    if how == "--socket":
        where = ["--socket", daemon.path]
    elif how == "TIERD_SOCKET":
        monkeypatch.setenv("TIERD_SOCKET", daemon.path)
        where = []
    else:
        config_file = tmp_path / "tierd.yaml"
        config_file.write_text(yaml.safe_dump(daemon.config))
        where = ["-c", str(config_file)]
    activity = daemon.call(_store_and_pin(daemon.path, stored=12, pinned=3))
    try:
        status = main(["top", *where, "--plain", "--count", "2", "--interval", "0.05"])
    finally:
        daemon.call(_finish(activity))
    assert status == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out  # plain: no escape codes
    frames = out.split("tierd top at ")[1:]
    assert len(frames) == 2
    tiers = activity.stats["tiers"]
    assert [t["name"] for t in tiers] == ["cpu", "disk"]
    # 12 blocks stored into a cpu tier of 8: it is full, and the 4 evicted were demoted.
    assert [t["used"] for t in tiers] == [8, 4]
    for frame in frames:
        lines = frame.splitlines()
        for tier in tiers:
            cells = _row(lines, tier["name"])
            assert cells[:3] == [tier["name"], tier["medium"], f"{tier['used']}/{tier['capacity']}"]
            assert _row(lines, tier["name"], after="tier  stores")[5] == str(tier["pinned"])
        assert _row(lines, "cpu", after="tier  stores")[5] == "3"
        assert "clients 2" in frame  # the test's client and top itself
        assert "leases 1" in frame
    # 4 blocks of 4 KiB demoted; nothing moved between the frames.
    route = r"^CPU->DISK\s+{rate}\s+16\.0 KiB\s+4\s+0\s+0 B$"
    assert re.search(route.format(rate="-"), frames[0], re.MULTILINE)
    assert re.search(route.format(rate="0 B/s"), frames[1], re.MULTILINE)


def test_top_unreachable_socket_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    missing = short_socket_path()
    assert main(["top", "--socket", missing, "--plain", "--count", "1"]) == 3
    assert f"cannot reach the daemon at {missing}" in capsys.readouterr().err


def test_top_stale_socket_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    path = short_socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)  # the file stays, nobody listens: connection refused
    assert main(["top", "--socket", path, "--plain", "--count", "1"]) == 3
    err = capsys.readouterr().err
    assert f"cannot reach the daemon at {path}" in err
    assert "refused" in err.lower()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"], "--interval"),
        (["--interval", "-1"], "--interval"),
        (["--count", "0"], "--count"),
        (["--width", "5"], "--width"),
    ],
)
def test_top_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["top", "--socket", short_socket_path(), "--plain", *args]) == 2
    assert message in capsys.readouterr().err


def test_top_is_a_registered_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["top", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"--interval SECONDS", out)
    assert "--plain" in out
