"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1, scripts/setup_dynamo)
subscribed to a tierd daemon's KV events scores a prefix that tierd holds only in its disk
tier (issue 36; docs/events.md, mode 2: tierd's publisher as a worker of its own).

The indexer's HTTP server binds 0.0.0.0 with no host option, so the indexer and the daemon
run in a private network namespace (``unshare -rn``) where only loopback exists:
tests/dynamo_driver.py does the work there and prints what it saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kv_events_kit import DRIVER, DYNAMO_PYTHON, unshare_works

ROOT = Path(__file__).resolve().parent.parent
RESULT = "dynamo-driver-result: "
BLOCK_SIZE = 4  # the driver's engine block, in tokens
ON_DISK = 4  # of the chain of 6 over a CPU tier of 2


pytestmark = [
    pytest.mark.skipif(
        not DYNAMO_PYTHON.exists(),
        reason=f"dynamo: {DYNAMO_PYTHON} is missing (scripts/setup_dynamo installs it)",
    ),
    pytest.mark.skipif(
        not unshare_works(),
        reason="dynamo: `unshare -rn` (a private network namespace) does not work here",
    ),
]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the driver: the daemon, the indexer, the chain, the indexer's answers."""
    return _driven(tmp_path_factory.mktemp("dynamo"), timeout_s=180)


def _driven(work: Path, *options: str, timeout_s: float) -> dict[str, Any]:
    """One run of the driver in a private network namespace: what it printed."""
    cmd = ["unshare", "-rn", sys.executable, str(DRIVER), str(DYNAMO_PYTHON), str(work)]
    run = subprocess.run(
        [*cmd, *options], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
    )
    log = work / "indexer.log"
    said = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\nindexer: " + (
        log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
    )
    assert run.returncode == 0, said
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT)]
    assert len(lines) == 1, said
    return dict(json.loads(lines[0][len(RESULT) :]))


def _worker(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["status"] == 200, answer
    return dict(answer["body"]["instances"].get("1", {}))


def test_the_prefix_is_held_only_on_disk(seen: dict[str, Any]) -> None:
    assert seen["blocks_held"] == ["DISK"] * ON_DISK + ["CPU"] * 2
    assert seen["lookup_media"] == seen["blocks_held"]


def test_the_indexer_scores_the_disk_prefix_for_worker_1(seen: dict[str, Any]) -> None:
    for asked in ("query", "query_disk_prefix"):
        mine = _worker(seen[asked])
        assert mine["disk"] >= ON_DISK * BLOCK_SIZE, (asked, mine)  # tokens matched on disk
        assert mine["longest_matched"] >= ON_DISK * BLOCK_SIZE, (asked, mine)
        assert mine["gpu"] == 0, (asked, mine)
        assert seen[asked]["body"]["scores"] == {}  # `scores` counts device blocks only


def test_the_indexer_keeps_the_disk_medium(seen: dict[str, Any]) -> None:
    events = seen["dump"]["body"]["default:default"]["events"]
    tiers = {
        int(block["block_hash"]): event["storage_tier"]
        for event in events
        if event["worker_id"] == 1
        for block in event["event"]["data"].get("stored", {}).get("blocks", [])
    }
    assert [tiers.get(7000 + i) for i in range(ON_DISK)] == ["disk"] * ON_DISK


def test_the_indexer_hashes_tokens_itself(seen: dict[str, Any]) -> None:
    """/query_by_hash takes the indexer's own hashes of the tokens (the dump's
    ``tokens_hash``), not the engine's block hashes the events carry."""
    assert _worker(seen["query_by_hash_tokens_hash"])["disk"] >= ON_DISK * BLOCK_SIZE
    assert _worker(seen["query_by_hash_engine_hash"]) == {}


def test_tokens_never_stored_score_nothing(seen: dict[str, Any]) -> None:
    assert _worker(seen["query_other"]) == {}


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The driver's ``--restarts`` run: one indexer connected throughout, the daemon a
    process restarted by SIGTERM and SIGKILL, its disk kept and then wiped."""
    return _driven(tmp_path_factory.mktemp("dynamo-restarts"), "--restarts", timeout_s=300)


@pytest.mark.parametrize("restart", ["SIGTERM", "SIGKILL", "SIGTERM wiped", "SIGKILL wiped"])
def test_after_a_restart_the_indexer_credits_what_the_node_holds(
    restarted: dict[str, Any], restart: str
) -> None:
    """Issue 59, item 1: the new incarnation's first batches went out before the indexer
    was back, and its sequence started again at 0: the indexer kept crediting a wiped
    disk's blocks and dropped every later batch (blocks stored after the restart were
    never credited). Now batches are numbered past the last incarnation's, and a
    subscriber that comes back gets a snapshot of what the node holds."""
    seen = restarted[restart]
    # kept: the four the CPU tier demoted, at least (SIGKILL may lose the two above)
    assert seen["held"] == 0 if "wiped" in restart else 4 <= seen["held"] <= 6, seen
    assert seen["credited"] == seen["held"] * BLOCK_SIZE, seen
    assert seen["fresh"] == BLOCK_SIZE, seen  # a block stored after the restart
