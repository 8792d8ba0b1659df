"""KV events for the tests of the publishers and the routers: a daemon config that publishes
them, a chain of keys, stores that make events, the engines' and routers' pythons and the
decoder run under them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tierd.client import Client
from tierd.testing import daemon_config

NS = "model-a"
BS = 4  # tokens per engine block


def events_config(tmp_path: Path, **kv: Any) -> dict[str, Any]:
    section = {
        "enabled": True,  # each tenant's own ipc sockets, beside the control socket
        "topic": "kv@node:n1@m",
        "batch_s": 0.001,
        **kv,
    }
    return daemon_config(tmp_path, cpu_blocks=4, disk_blocks=16, kv_events=section)


def description(i: int, parent: int | None = None) -> dict[str, Any]:
    return {
        "hashes": [1000 + i],
        "parent": parent,
        "tokens": [i * 10 + t for t in range(BS)],
        "block_size": BS,
        "lora_name": None,
    }


def described_chain(n: int) -> tuple[list[bytes], list[dict[str, Any]]]:
    keys = [f"k{i}".encode() for i in range(n)]
    descs = [description(i, None if i == 0 else 1000 + i - 1) for i in range(n)]
    return keys, descs


async def put_blocks(client: Client, keys: list[bytes], fill: bytes = b"x") -> None:
    for i in range(0, len(keys), 2):  # the CPU tier holds 4: each store evicts the oldest
        await client.put(keys[i : i + 2], [fill * 4096] * len(keys[i : i + 2]))


ROOT = Path(__file__).resolve().parents[1]
DECODER = ROOT / "tests" / "kv_events_decode.py"
DRIVER = ROOT / "tests" / "dynamo_driver.py"  # Dynamo's router, run by DYNAMO_PYTHON
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
SMG_PYTHON = Path(os.environ.get("TIERD_SMG_PYTHON", ROOT / ".venv-smg" / "bin" / "python"))


def engine_python(path: Path, engine: str, setup: str) -> Path:
    if not path.is_file():
        pytest.skip(f"{engine} is not installed ({path} missing): run scripts/{setup}")
    return path


def decode(python: Path, engine: str, payloads: list[bytes]) -> list[dict[str, Any]]:
    """Each payload as the engine's ``KVEventBatch`` decoder sees it (tests/kv_events_decode.py)."""
    framed = b"".join(len(p).to_bytes(4, "big") + p for p in payloads)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    done = subprocess.run(
        [str(python), str(DECODER), engine],
        input=framed,
        capture_output=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert len(lines) == len(payloads), done.stdout.decode()
    return lines


def unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0
