"""tierd under SGLang's own controller on a saturated node (issue 60, items 10 and 9).

Item 10: with busy-loop processes outnumbering the CPUs several times over, SGLang's hit
query (``batch_exists`` on its prefetch thread) was served nothing for pages the daemon
held: the documented 0.1 s lookup deadline passed while the request and its reply waited
for a CPU (the daemon's work on a lookup stays under a millisecond; docs/sglang.md has
the figures). A lookup's deadline now counts the engine's own time: stretched by how many
times over the node's CPUs are asked for, up to ``job_deadline_s``.

Item 9: with the daemon stopped in the middle of a transfer, under load, every call of
the backend returns within its deadline and :data:`LATE_S`.

The busy loops are child processes, each ending by itself after :data:`HOG_S` and killed
by its PID when the test ends. The engines are tests/sglang_kit/driver.py processes, as
in tests/test_sglang.py, whose daemon config and engine pair this module shares.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from sglang_kit.engines import missing_reason, tierd_spec
from sglang_kit.shared import PAGES, config, loaded_all

REASON = missing_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

HOG_S = 240.0  # a busy loop ends by itself after this, whatever becomes of the test
_HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
SEQUENCE = 150  # pages: two of SGLang's hit-query batches (128 + 22)
CASES = 8
# A call on a stopped daemon returns within its deadline and this: the thread's wake-up
# on a loaded node, a page's copy, closing the connection. Measured in 16 runs of the
# test below on a 2-CPU node shared with other test runs: at most 62 ms past the
# deadline in 15, 673 ms once. The report was 2.03 s on 7-15 ms deadlines.
LATE_S = 1.0


@contextmanager
def saturated(per_cpu: int, *pids: int) -> Iterator[None]:
    """``per_cpu`` busy loops for each of (at most) two CPUs, which the processes
    ``pids`` (the daemon, the engines) share with them for the block: the same
    saturation on a node of any size."""
    everywhere = os.sched_getaffinity(0)
    cpus = set(sorted(everywhere)[:2])
    for pid in pids:
        pin(pid, cpus)
    hogs = [
        subprocess.Popen([sys.executable, "-c", _HOG.format(s=HOG_S)])
        for _ in range(per_cpu * len(cpus))
    ]
    try:
        for hog in hogs:
            os.sched_setaffinity(hog.pid, cpus)
        time.sleep(1.0)  # every loop running
        yield
    finally:
        for hog in hogs:
            if hog.poll() is None:
                os.kill(hog.pid, signal.SIGKILL)
            hog.wait()
        for pid in pids:
            pin(pid, everywhere)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (threads it starts later inherit)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def lookups(calls: list[dict[str, Any]]) -> list[str]:
    """The hit queries, as ``found/keys in ms (deadline ms)``."""
    return [
        f"{c.get('found')}/{c['keys']} in {1e3 * (c['returned'] - c['enter']):.0f} ms"
        f" ({1e3 * c.get('deadline_s', 0):.0f} ms)"
        for c in calls
        if c["op"] == "batch_exists"
    ]


async def test_a_saturated_node_is_served_what_the_daemon_holds_at_the_default_deadline(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 60, item 10: 24 busy loops a CPU (two CPUs); each case a new engine (SGLang's own
    controller, default deadlines) stores a 150-page sequence, which the daemon then
    holds, and reads it back at once. At 0.1 s of wall time a hit query was served 0
    pages in 6 of 12 cases at 16 loops a CPU (lookups waited 0.1-0.29 s for a CPU, a
    new connection's hello 0.03-0.16 s more), in 2 or more of these 8 at 24; now every
    case is served all 150."""
    a, _ = pair
    daemon = await spawn(config(tmp_path, cpu_blocks=2048, disk_blocks=2048))
    a.ask("trace")
    cases: list[tuple[int, dict[str, Any] | None]] = []
    with saturated(24, daemon.pid, a.proc.pid):
        for case in range(CASES):
            name = f"busy-{case}"
            a.open(name, tierd_spec(daemon.socket_path, model=f"busy-{case}"))
            stored = a.write(name, seed=300 + case, pages=SEQUENCE)["stored_pages"]
            # A page counts as stored only once the daemon holds it.
            read = a.read(name, seed=300 + case, pages=SEQUENCE) if stored == SEQUENCE else None
            cases.append((stored, read))
            a.ask("close", name)
    calls = a.ask("trace")["calls"]
    held = [read for _, read in cases if read is not None]
    assert len(held) >= CASES // 2, cases  # a store too may miss its deadline on this node
    served = [read["loaded_pages"] for read in held]
    assert all(loaded_all(read, SEQUENCE) for read in held), (served, lookups(calls), short(calls))


def short(calls: list[dict[str, Any]]) -> list[str]:
    """The loads that loaded less than asked, with what failed in them."""
    return [
        f"{sum(c['found'])}/{c['keys']} in {1e3 * took(c):.0f} ms:"
        f" {[step for step in c.get('steps', []) if step[3] != 'ok']}"
        for c in calls
        if c["op"] == "batch_get_v1" and not all(c["found"])
    ]


def took(call: dict[str, Any]) -> float:
    return float(call["returned"] - call["enter"])


def deadline(call: dict[str, Any]) -> float:
    """A traced call's deadline: a hit query's as the backend computed it, a job's."""
    return float(call.get("deadline_s", call["job_deadline_s"]))


def stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


TIGHT = {"lookup_deadline_s": 0.007, "job_deadline_s": 0.015}


async def test_every_call_on_a_daemon_stopped_mid_transfer_under_load_ends_in_time(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 60, item 9: 2 busy loops a CPU (two CPUs); an engine of 7 ms lookups and 15 ms jobs
    reads and writes while the daemon is stopped (SIGSTOP) after the third page of a
    transfer, and reads again while it stays stopped. Every call of the backend (SGLang's
    hit query, its loads and stores) returns within its deadline and :data:`LATE_S`."""
    a, _ = pair
    daemon = await spawn(config(tmp_path))
    sock = daemon.socket_path
    a.open("fill", tierd_spec(sock, model="stop-model"))
    assert a.write("fill", seed=310, pages=PAGES)["stored_pages"] == PAGES
    a.open("tight", tierd_spec(sock, model="stop-model", extra=TIGHT))
    a.ask("trace")
    stops = {"read": 0, "write": 0}
    with saturated(2, daemon.pid, a.proc.pid):
        for attempt in range(30):
            transfer = "read" if stops["read"] <= stops["write"] else "write"
            try:
                seed = 310 if transfer == "read" else 320 + attempt
                a.ask(transfer, "tight", seed=seed, pages=PAGES, stop_daemon=[daemon.pid, 3])
                if stopped(daemon.pid):
                    stops[transfer] += 1
                    a.read("tight", seed=310, pages=PAGES)  # still stopped
            finally:
                daemon.signal(signal.SIGCONT)
            if min(stops.values()) >= 2:
                break
            await asyncio.sleep(0.6)  # the breaker's probe finds the daemon back
    calls = a.ask("trace")["calls"]
    assert min(stops.values()) >= 1, (stops, lookups(calls))
    late = [
        f"{c['op']} {1e3 * took(c):.0f} ms on a {1e3 * deadline(c):.0f} ms deadline:"
        f" {c.get('steps')}"
        for c in calls
        if took(c) > deadline(c) + LATE_S
    ]
    assert not late, late
    a.ask("close", "fill")
    a.ask("close", "tight")
