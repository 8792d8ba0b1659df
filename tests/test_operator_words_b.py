"""What the docs and the ``tierd`` command tell an operator is what happens, with real
daemons and the ``tierd`` command as child processes:

- "Replays repeat": two ``tierd replay --clients 4`` of one trace against fresh daemons
  give the same figures;
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.test_daemon_lifecycle import Spawn, spawn
from tests.test_operator import tierd
from tierd.testing import daemon_config
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import write_trace

__all__ = ["spawn"]  # the fixture, imported for the tests below

BLOCK = 4096


def small_trace(path: Path, conversations: int = 60) -> Path:
    write_trace(path, generate(GeneratorConfig(seed=5, conversations=conversations)))
    return path


# -- replays repeat --------------------------------------------------------------------------


async def replay_json(daemon_socket: str, trace: Path, *extra: str) -> dict[str, Any]:
    done = await tierd(
        "replay", str(trace), "--socket", daemon_socket, "--json", "--no-progress", *extra
    )
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


async def test_two_replays_with_four_clients_against_fresh_daemons_repeat(
    tmp_path: Path, spawn: Spawn
) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    runs = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        cfg = daemon_config(tmp_path / run, cpu_blocks=48, disk_blocks=200, block_bytes=BLOCK)
        daemon = await spawn(cfg)
        runs.append(await replay_json(daemon.socket_path, trace, "--clients", "4"))
        daemon.proc.terminate()
        assert daemon.proc.wait(timeout=60) == 0

    first, second = runs
    assert first["config"]["clients"] == 4
    assert first["config"]["ordered"] is True
    assert 0 < first["hits"] < first["block_accesses"]
    for figure in ("hits", "hits_by_medium", "loaded_blocks", "stored_blocks", "errors"):
        assert first[figure] == second[figure], figure
