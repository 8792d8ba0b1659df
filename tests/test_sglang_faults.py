"""tierd under SGLang's own code, when things go wrong (issue 60, items 8, 12 and 13):

- a daemon without a pool (a ``kind: memory`` entry tier) serves SGLang's generic calls
  with ``"allocator": "shm"`` (every store used to raise out of the backend);
- nothing the backend raises reaches SGLang, and an error of its own code is no quiet
  miss: counted, logged once at ERROR with its traceback;
- a clear that a stopped daemon did not answer says that the delete may still complete
  (it does, once the daemon resumes).

The engines are tests/sglang_kit/driver.py processes, as in tests/test_sglang.py (whose
daemon config and engine pair this module shares).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from sglang_kit.engines import Engines, missing_reason, tierd_spec
from sglang_kit.shared import PAGES, config, loaded_all, namespace_row, until

REASON = missing_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

GENERIC = {"interface_v1": 0}  # SGLang's generic calls: get/set, a page as a flat tensor
OWN_CODE = "tierd HiCache call failed in tierd's own code"


def memory_entry(tmp_path: Path) -> dict[str, Any]:
    """A daemon whose entry tier is plain memory (no pool an engine could map), over disk."""
    cfg = config(tmp_path)
    cfg["tiers"][0] = {"name": "mem", "kind": "memory", "capacity": 64}
    return cfg


def lines(engines: Engines, name: str, level: str) -> list[str]:
    return [text for lvl, text in engines.stats(name)["tierd_logs"] if lvl == level]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_a_daemon_without_a_pool_serves_sglangs_generic_calls_from_an_shm_pool(
    tmp_path: Path, spawn: Any, pair: Any, layout: str
) -> None:
    """Issue 60, item 8: every generic store from a memfd host pool used to fail with
    ``AttributeError: 'FlatBlock' object has no attribute 'offsets'``, raised into
    SGLang's backup thread: 0 pages stored. A generic page is a copy, not in the memfd:
    it goes through the connection's staging memfd."""
    a, b = pair
    daemon = await spawn(memory_entry(tmp_path))
    sock = daemon.socket_path
    writer = a.open("gen-w", tierd_spec(sock, layout=layout, allocator="shm", extra=GENERIC))
    assert writer["memfd"]  # offered: a daemon without a pool
    reader = b.open("gen-r", tierd_spec(sock, layout=layout, extra=GENERIC))
    errors = {a: writer["sglang_errors"], b: reader["sglang_errors"]}  # each process's so far
    assert a.write("gen-w", seed=100, pages=PAGES)["stored_pages"] == PAGES
    assert loaded_all(b.read("gen-r", seed=100, pages=PAGES), PAGES)
    assert loaded_all(a.read("gen-w", seed=100, pages=PAGES), PAGES)
    # interface_v1 beside it, the memfd handed over: its own namespace, stored too.
    a.open("v1-w", tierd_spec(sock, layout=layout, allocator="shm"))
    assert a.write("v1-w", seed=101, pages=PAGES)["stored_pages"] == PAGES
    assert loaded_all(a.read("v1-w", seed=101, pages=PAGES), PAGES)
    for engines, name in [(a, "gen-w"), (b, "gen-r"), (a, "v1-w")]:
        stats = engines.stats(name)
        assert stats["sglang_errors"] == errors[engines], stats["last_error"]
        assert stats["totals"]["internal_errors"] == 0
        engines.ask("close", name)


PLANTED = {"module_path": "planted", "class_name": "PlantedFault"}


@pytest.mark.parametrize("error", ["TypeError", "ValueError"])
async def test_a_bug_in_the_backend_never_reaches_sglang_and_is_never_a_quiet_miss(
    tmp_path: Path, spawn: Any, pair: Any, error: str
) -> None:
    """Issue 60, item 13: a bug planted in the backend's page jobs (tests/sglang_kit/
    planted.py). A TypeError used to raise into SGLang's threads (logged there at ERROR,
    the backup given up); a ValueError was caught and logged at debug: a miss nobody
    saw. Both are now failed calls, counted as internal errors, and said once at ERROR
    with the traceback however often they come."""
    a, _ = pair
    daemon = await spawn(config(tmp_path))
    name = f"planted-{error}"
    spec = tierd_spec(daemon.socket_path, extra=PLANTED, env={"TIERD_TEST_PLANTED_FAULT": error})
    errors = a.open(name, spec)["sglang_errors"]  # the process's, so far
    assert a.stats(name)["backend"] == "PlantedFault"
    for seed in (110, 111):
        assert a.write(name, seed=seed, pages=8)["stored_pages"] == 0
        assert a.read(name, seed=seed, pages=8)["hit_pages"] == 0
    stats = a.stats(name)
    assert stats["sglang_errors"] == errors, stats["last_error"]
    # The process's lines (its engines share them): this engine's error, once.
    planted = f"error={error}: planted in tierd's page jobs"
    said = [line for line in lines(a, name, "ERROR") if line.startswith(OWN_CODE)]
    assert [line for line in said if planted in line] == [f"{OWN_CODE}: {planted}"], said
    assert "Traceback (most recent call last)" in a.stderr()  # SGLang's handler printed it
    assert stats["totals"]["internal_errors"] >= 4  # two stores, two lookups
    assert stats["totals"]["failed_calls"] >= stats["totals"]["internal_errors"]
    a.ask("close", name)


async def test_a_clear_a_stopped_daemon_did_not_answer_says_it_may_still_complete(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """Issue 60, item 12: a clear timed out on a stopped daemon and said "not cleared:
    tierd still serves the namespace's pages"; once resumed, the daemon deleted them."""
    a, _ = pair
    daemon = await spawn(config(tmp_path))
    sock = daemon.socket_path
    spec = tierd_spec(sock, model="clear-model", extra={"clear_deadline_s": 1.0})
    ns = a.open("stopped", spec)["namespace"]
    # A first clear: the thread that clears has its connection (else a stopped daemon
    # never answers its hello, and no delete is sent: "not cleared" is then the truth).
    a.ask("clear", "stopped")
    assert any(f"cleared: namespace={ns}" in line for line in lines(a, "stopped", "INFO"))
    assert a.write("stopped", seed=120, pages=PAGES)["stored_pages"] == PAGES
    before = len(lines(a, "stopped", "WARNING"))
    daemon.signal(signal.SIGSTOP)
    try:
        a.ask("clear", "stopped")
    finally:
        daemon.signal(signal.SIGCONT)
    said = lines(a, "stopped", "WARNING")[before:]
    clear_lines = [line for line in said if "clear" in line]
    assert len(clear_lines) == 1, said
    assert "may still complete" in clear_lines[0]
    assert "still serves" not in clear_lines[0]

    async def emptied() -> bool:
        row = await namespace_row(sock, ns)
        return sum(row["blocks"].values()) == 0

    await until(emptied, "the delete the stopped daemon was sent completed")
    a.ask("close", "stopped")
