"""Latency histograms, their documentation, per-request debug lines and a quiet library.

Each test runs the daemon as a real ``tierd serve`` process (the ``spawn`` fixture of
tests/daemon_kit.py), talks to it with :class:`tierd.client.Client` over its Unix
socket and scrapes its loopback ``/metrics`` endpoint over HTTP; log lines are read from
the daemon's stderr file once it has exited.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.daemon_kit import DEADLINE_S, Spawn, block, child_env, http_get, keys
from tests.port_kit import free_port
from tierd.client import DaemonError
from tierd.testing import daemon_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "metrics.md"
REQUESTS = "tierd_request_duration_seconds"
LOADS = "tierd_load_duration_seconds"


async def scrape(port: int) -> dict[str, list[Sample]]:
    """Family name -> samples, from the daemon's /metrics endpoint."""
    status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def counts(samples: list[Sample], label: str) -> dict[str, float]:
    """``label`` value -> the histogram's ``_count`` for it."""
    return {s.labels[label]: s.value for s in samples if s.name.endswith("_count")}


def bucket(samples: list[Sample], label: str, value: str, le: str) -> float:
    (found,) = [
        s.value
        for s in samples
        if s.name.endswith("_bucket") and s.labels[label] == value and s.labels["le"] == le
    ]
    return found


# -- 1. latency histograms ----------------------------------------------------------------


async def test_histograms_count_every_operation_and_the_medium_of_each_load(
    tmp_path: Path, spawn: Spawn
) -> None:
    port = free_port()
    daemon = await spawn(daemon_config(tmp_path, cpu_blocks=8, metrics={"http_port": port}))
    old, new = keys("old", 8), keys("new", 8)
    async with await daemon.connect() as client:
        assert await client.store(old, [block(k) for k in old]) == 8
        assert await client.store(new, [block(k) for k in new]) == 8  # old: down to disk
        assert (await client.lookup(old)).media == ("DISK",) * 8
        assert (await client.lookup(new)).media == ("CPU",) * 8
        assert (await client.lookup([b"absent"])).count == 0
        await client.touch(new[:2])
        for _ in range(3):
            assert await client.load(new[:4]) == [block(k) for k in new[:4]]
        reply = await client.request("get", keys=new[:2])  # the inline load
        assert reply["data"] == [block(k) for k in new[:2]]
        assert set(reply) == {"id", "ok", "count", "data"}  # nothing internal leaks out
        assert await client.load(old[:2]) == [block(k) for k in old[:2]]  # promoted
        with_socket_op = await client.metrics()

    families = await scrape(port)
    by_op = counts(families[REQUESTS], "op")
    assert {op: by_op.get(op) for op in ("lookup", "touch", "get")} == {
        "lookup": 3,
        "touch": 1,
        "get": 1,
    }
    assert by_op["prepare_store"] == by_op["complete_store"] == 2
    assert by_op["prepare_load"] == by_op["complete_load"] == 4
    assert by_op["metrics"] == 1
    # Three loads and a get from the CPU tier; one load that had to read the disk tier.
    assert counts(families[LOADS], "medium") == {"CPU": 4, "DISK": 1}
    assert bucket(families[LOADS], "medium", "CPU", "+Inf") == 4
    sums = {s.labels["op"]: s.value for s in families[REQUESTS] if s.name.endswith("_sum")}
    assert all(total > 0 for total in sums.values())
    # The socket op renders the same families (its own request is counted after it).
    from_socket = {f.name for f in text_string_to_metric_families(with_socket_op)}
    assert {REQUESTS, LOADS} <= from_socket
    assert await daemon.stop() == 0


# -- 2. every family is documented --------------------------------------------------------


def documented_names() -> set[str]:
    """The metric names in the first column of docs/metrics.md's tables."""
    return set(re.findall(r"^\| `(tierd_[a-z_]+)`", DOCS.read_text(), flags=re.MULTILINE))


async def test_every_exposed_metric_family_is_documented(tmp_path: Path, spawn: Spawn) -> None:
    port = free_port()
    # A remote level whose server is absent (a closed loopback port): its families are
    # exposed all the same, its calls fail as misses.
    remote = {"url": f"redis://127.0.0.1:{free_port()}/0"}
    daemon = await spawn(daemon_config(tmp_path, metrics={"http_port": port}, remote=remote))
    status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert await daemon.stop() == 0
    # A counter family ``x`` is exposed as ``x_total``: the docs name what a query uses.
    exposed = {
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text)
    }
    documented = documented_names()
    assert sorted(exposed - documented) == [], "exposed but not in docs/metrics.md"
    assert sorted(documented - exposed) == [], "in docs/metrics.md but not exposed"


# -- 3. per-request debug lines -----------------------------------------------------------


def log_records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_debug_level_logs_one_line_per_request(tmp_path: Path, spawn: Spawn) -> None:
    config = daemon_config(tmp_path, logging={"level": "debug", "format": "json"})
    daemon = await spawn(config)
    name = b"\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a-rest"
    async with await daemon.connect() as client:
        await client.lookup([name, b"second"])
        with pytest.raises(DaemonError):
            await client.request("lookup", keys=[])  # refused: an empty key list
    assert await daemon.stop() == 0

    records = log_records(daemon.stderr())
    lookups = [r for r in records if r["event"] == "request" and r["op"] == "lookup"]
    assert len(lookups) == 2, lookups
    good, bad = lookups
    assert good["level"] == "debug"
    assert (good["keys"], good["key"], good["result"]) == (2, "0102030405060708", "ok")
    assert isinstance(good["us"], float | int)
    assert good["us"] > 0
    assert (bad["keys"], bad["key"]) == (0, "")
    assert bad["result"] not in ("ok", "internal")
    # The connection id names the client's connection, opened with its pid.
    opened = [r for r in records if r["event"] == "connection opened" and r["conn"] == good["conn"]]
    assert [r["pid"] for r in opened] == [os.getpid()]
    assert bad["conn"] == good["conn"]


async def test_info_level_logs_no_request_lines(tmp_path: Path, spawn: Spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, logging={"format": "json"}))
    async with await daemon.connect() as client:
        await client.lookup([b"one"])
    assert await daemon.stop() == 0
    events = [r["event"] for r in log_records(daemon.stderr())]
    assert "ready" in events
    assert "request" not in events
    assert "connection opened" not in events


# -- 4. the library is quiet --------------------------------------------------------------

LIBRARY_SCRIPT = """
import asyncio
import sys

import tierd

if sys.argv[1] == "configured":
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


async def main() -> None:
    config = {"block_bytes": 4096, "tiers": [{"name": "m", "kind": "memory", "capacity": 8}]}
    async with tierd.open(config) as chain:
        await chain.store([b"k"], [bytes(4096)])
        async with chain.loading([b"k"]) as handle:
            print("loaded", len(handle.keys))


asyncio.run(main())
"""


def run_library_script(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "use_library.py"
    script.write_text(textwrap.dedent(LIBRARY_SCRIPT))
    return subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=DEADLINE_S,
        check=False,
    )


def test_library_prints_nothing_unless_logging_is_configured(tmp_path: Path) -> None:
    done = run_library_script(tmp_path, "unconfigured")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == "loaded 1\n"


def test_library_logs_through_an_application_s_configuration(tmp_path: Path) -> None:
    done = run_library_script(tmp_path, "configured")
    assert done.returncode == 0, done.stderr
    assert "tier opened" in done.stderr
    assert done.stdout == "loaded 1\n"
