"""What the docs and the ``tierd`` command tell an operator is what happens, with real
daemons and the ``tierd`` command as child processes:

- "Replays repeat": two ``tierd replay --clients 4`` of one trace against fresh daemons
  give the same figures;
- a key copied from ``tierd events`` into ``tierd inspect`` finds the block, both forms
  (``<namespace id>:<key hex>``, and the key's hex with ``--namespace``);
- ``tierd record status`` of a daemon whose config has no ``trace:`` section says what to
  add and that the daemon must restart; ``record on`` says the same as its error;
- ``tierd simulate`` of a recording keeps its namespaces apart: two models sending the
  same prompts share no block;
- ``simulate --curve --out`` without matplotlib says it is needed and how to install it;
- ``tierd namespaces`` says that a block in two tiers counts as two copies;
- a block size in decimal units (``256kb``: 256,000 bytes) is refused, naming ``256KiB``;
- a replay or a what-if through a chain with a disk tier says, before it starts, how much
  it stores and writes to which disk;
- the README's command list names every ``tierd`` command, and only options they take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import tierd, write_config
from tests.daemon_kit import DaemonProcess, Spawn, child_env
from tierd.cli import build_parser
from tierd.client import Client
from tierd.testing import daemon_config
from tierd.units import format_bytes
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import read_trace, write_trace

BLOCK = 4096
WAIT_S = 60.0  # a safety net for what a test waits on, never a timed assertion


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


# -- inspect takes the key that events prints --------------------------------------------------


async def key_from_events(daemon: DaemonProcess, key: bytes, *extra: str) -> str:
    """Store ``key`` in namespace ``ns`` while ``tierd events --count 1`` follows; the key
    as the command printed it."""
    events = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "tierd", "events", "--socket", daemon.socket_path],
        *["--count", "1", *extra],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env(),
    )
    assert events.stdout is not None and events.stderr is not None
    async with asyncio.timeout(WAIT_S):
        announced = await events.stderr.readline()
        assert b"following events" in announced, announced
        async with await Client.connect(daemon.socket_path, namespace="ns") as client:
            await client.store([key], [bytes(BLOCK)])
        out = (await events.stdout.read()).decode()
        assert await events.wait() == 0
    line = next(line for line in out.splitlines() if line.startswith("stored"))
    return line.rsplit(": ", 1)[1].strip()


@pytest.mark.parametrize("following", [[], ["--namespace", "ns"]])
async def test_inspect_finds_a_key_copied_from_events(
    tmp_path: Path, spawn: Spawn, following: list[str]
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
    daemon = await spawn(cfg)
    printed = await key_from_events(daemon, b"prompt-1", *following)

    found = await tierd("inspect", printed, "--socket", daemon.socket_path, "--namespace", "ns")
    assert found.returncode == 0, found.stderr
    assert "not held" not in found.stdout
    assert "cpu (CPU)" in found.stdout


async def test_inspect_reads_a_long_hex_key_as_hex_and_refuses_an_unknown_namespace(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Issue 61, item 9: a 32-byte key given as its 64 hex digits (too long as text) was
    answered ``bad_key: ... bin of 1 to 56 bytes``; a namespace the daemon never heard of
    was "not held" with exit 0."""
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
    daemon = await spawn(cfg)
    key = bytes(range(32))
    async with await Client.connect(daemon.socket_path, namespace="ns") as client:
        await client.store([key], [bytes(BLOCK)])
    found = await tierd("inspect", key.hex(), "--socket", daemon.socket_path, "--namespace", "ns")
    assert found.returncode == 0, found.stderr
    assert "cpu (CPU)" in found.stdout and "read as hex" in found.stdout
    unknown = await tierd("inspect", "k", "--socket", daemon.socket_path, "--namespace", "nope")
    assert unknown.returncode == 1, unknown
    assert "namespace nope is not known to this daemon" in unknown.stderr
    assert "Traceback" not in unknown.stderr


async def test_inspect_without_a_namespace_says_how_to_name_one(tmp_path: Path) -> None:
    done = await tierd("inspect", "prompt-1", "--socket", str(tmp_path / "none.sock"))
    assert done.returncode == 2
    assert "--namespace NS" in done.stderr
    assert "NSID:HEX" in done.stderr


# -- record: no trace section -------------------------------------------------------------------


async def test_record_status_without_a_trace_section_says_what_to_add(
    tmp_path: Path, spawn: Spawn
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
    assert "trace" not in cfg
    daemon = await spawn(cfg)

    status = await tierd("record", "status", "--socket", daemon.socket_path)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("recording    not set up")
    for words in ("trace:", "directory:", "restart", "docs/sizing.md"):
        assert words in status.stdout, words
    as_json = await tierd("record", "status", "--socket", daemon.socket_path, "--json")
    assert json.loads(as_json.stdout) == {"configured": False, "enabled": False}

    on = await tierd("record", "on", "--socket", daemon.socket_path)
    assert on.returncode == 1
    for words in ("trace:", "directory", "restart"):
        assert words in on.stderr, words


# -- simulate: recorded namespaces ----------------------------------------------------------


def recorded(path: Path, namespaces: list[str]) -> Path:
    """The same prompt (blocks 1, 2, 3) once from each namespace, as tierd record writes."""
    lines = [
        json.dumps(
            {
                "timestamp": number,
                "input_length": 3,
                "output_length": 0,
                "hash_ids": [1, 2, 3],
                "namespace": namespace,
            }
        )
        for number, namespace in enumerate(namespaces)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("curve", [[], ["--curve"]])
async def test_simulate_keeps_recorded_namespaces_apart(tmp_path: Path, curve: list[str]) -> None:
    two_models = recorded(tmp_path / "two.jsonl", ["aa" * 8, "bb" * 8])
    one_model = recorded(tmp_path / "one.jsonl", ["aa" * 8, "aa" * 8])

    apart = await tierd("simulate", str(two_models), "--capacity", "100", "--json", *curve)
    shared = await tierd("simulate", str(one_model), "--capacity", "100", "--json", *curve)
    assert apart.returncode == shared.returncode == 0, apart.stderr + shared.stderr
    ratio = "max_hit_ratio" if curve else "hit_ratio"
    figures = json.loads(apart.stdout)
    assert (figures["unique_blocks"], figures[ratio]) == (6, 0.0)
    figures = json.loads(shared.stdout)
    assert (figures["unique_blocks"], figures[ratio]) == (3, 0.5)


async def test_simulate_refuses_a_namespace_that_is_not_hex(tmp_path: Path) -> None:
    bad = recorded(tmp_path / "bad.jsonl", ["model-a"])
    done = await tierd("simulate", str(bad), "--json")
    assert done.returncode == 1
    assert "bad.jsonl:1" in done.stderr
    assert "namespace" in done.stderr


# -- simulate --curve without matplotlib --------------------------------------------------------

NO_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # import matplotlib now fails, as where it is not installed
from tierd.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("out", ["curve.png", "."])
def test_a_curve_plot_without_matplotlib_says_what_to_install(tmp_path: Path, out: str) -> None:
    trace = small_trace(tmp_path / "t.jsonl", conversations=5)
    argv = ["simulate", str(trace), "--curve", "--out", str(tmp_path / out)]
    done = subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, *argv],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 1
    assert "matplotlib is needed" in done.stderr
    assert "pip install 'tierd[plots]'" in done.stderr


# -- namespaces: copies in several tiers -------------------------------------------------------


async def test_namespaces_says_a_block_in_two_tiers_is_two_copies(
    tmp_path: Path, spawn: Spawn
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=16, block_bytes=BLOCK)
    daemon = await spawn(cfg)
    async with await Client.connect(daemon.socket_path, namespace="ns") as client:
        await client.store([b"prompt-1"], [bytes(BLOCK)])
    flushed = await tierd("flush", "--socket", daemon.socket_path)
    assert flushed.returncode == 0, flushed.stderr

    listed = await tierd("namespaces", "--socket", daemon.socket_path, "--json")
    (row,) = json.loads(listed.stdout)["default"]
    assert row["blocks"] == {"cpu": 1, "disk": 1}  # one block, a copy in each tier
    assert row["bytes"] == 2 * BLOCK
    table = await tierd("namespaces", "--socket", daemon.socket_path)
    header = table.stdout.splitlines()[0].split("  ")
    assert "bytes (copies)" in [cell.strip() for cell in header], table.stdout
    assert "a block in several tiers counts once in each" in table.stdout


# -- sizes: kb is 1000, KiB 1024 -----------------------------------------------------------------


@pytest.mark.parametrize("written", ["256kb", "256 KB", "2MB"])
async def test_a_block_size_in_decimal_units_is_refused_naming_the_binary_one(
    tmp_path: Path, written: str
) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
    cfg["block_bytes"] = written
    checked = await tierd("config", "check", str(write_config(tmp_path, cfg)), "--offline")
    assert checked.returncode == 78, checked.stdout + checked.stderr
    said = checked.stdout + checked.stderr
    number, unit = written.replace(" ", "")[:-2], written.replace(" ", "")[-2].upper()
    assert f"{number}{unit}iB" in said, said
    assert "1000" in said


async def test_capacities_in_decimal_units_stay_allowed(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, cpu_blocks=8, disk_blocks=None, block_bytes=BLOCK)
    cfg["tiers"][0]["capacity"] = "1MB"
    checked = await tierd("config", "check", str(write_config(tmp_path, cfg)), "--offline")
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- disk writes announced ------------------------------------------------------------------------


def chain_file(tmp_path: Path, disk_blocks: int | None) -> Path:
    (tmp_path / "chain").mkdir(exist_ok=True)
    cfg = daemon_config(tmp_path / "chain", cpu_blocks=16, disk_blocks=disk_blocks)
    tiers = {"block_bytes": cfg["block_bytes"], "tiers": cfg["tiers"]}
    return write_config(tmp_path, tiers, name="whatif.yaml")


def notice(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "disk writes" in line]
    assert len(lines) <= 1, stderr
    return lines[0] if lines else ""


@pytest.mark.parametrize("command", ["replay", "simulate"])
async def test_a_what_if_with_a_disk_tier_says_what_it_will_write(
    tmp_path: Path, command: str
) -> None:
    trace = small_trace(tmp_path / "t.jsonl", conversations=20)
    distinct = read_trace(trace).unique_blocks
    config = chain_file(tmp_path, disk_blocks=400)
    done = await tierd(command, str(trace), "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    said = notice(done.stderr)
    assert said.startswith(f"tierd: this run stores {distinct:,} distinct blocks of 4 KiB")
    assert "disk tier 'disk' (a private directory in" in said
    past_the_cpu_tier = format_bytes((distinct - 16) * 4096)
    assert f"expect {past_the_cpu_tier} of disk writes or more" in said
    json.loads(done.stdout)  # stdout is the result alone

    memory_only = chain_file(tmp_path, disk_blocks=None)
    quiet = await tierd(command, str(trace), "--config", str(memory_only), "--json")
    assert quiet.returncode == 0, quiet.stderr
    assert notice(quiet.stderr) == ""


async def test_a_daemon_replay_with_a_disk_tier_says_what_it_will_write(
    tmp_path: Path, spawn: Spawn
) -> None:
    trace = small_trace(tmp_path / "t.jsonl", conversations=20)
    cfg = daemon_config(tmp_path, cpu_blocks=16, disk_blocks=400, block_bytes=BLOCK)
    daemon = await spawn(cfg)
    done = await tierd("replay", str(trace), "--socket", daemon.socket_path, "--limit", "10")
    assert done.returncode == 0, done.stderr
    said = notice(done.stderr)
    assert "distinct blocks of 4 KiB" in said
    assert f"disk tier 'disk' (the daemon's at {daemon.socket_path})" in said


# -- the README's command list ---------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_entries() -> list[str]:
    """The README's command list, one entry per ``tierd ...`` line with its continuations."""
    text = README.read_text()
    block = text.split("## Command line", 1)[1].split("```", 2)[1]
    entries: list[str] = []
    for line in block.splitlines():
        if line.startswith("tierd "):
            entries.append(line)
        elif entries and line.strip().startswith(("[", "--")):
            entries[-1] += " " + line.strip()
    return entries


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    found = {option for action in parser._actions for option in action.option_strings}
    for sub in subparsers(parser).values():
        found |= options_of(sub)
    return found


def test_the_readme_command_list_matches_the_command() -> None:
    commands = subparsers(build_parser())
    entries = readme_entries()
    named: set[str] = set()
    for entry in entries:
        words = re.findall(r"(?:^tierd |\| )([a-z][a-z-]*)", entry)
        here = [word for word in words if word in commands]
        assert here, entry
        named.update(here)
        taken = set().union(*(options_of(commands[word]) for word in here))
        shown = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", entry))
        assert shown <= taken, f"{entry}: not taken: {sorted(shown - taken)}"
    assert set(commands) <= named, f"not in the README: {sorted(set(commands) - named)}"
