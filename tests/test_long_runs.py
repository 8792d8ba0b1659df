"""Long commands (``tierd replay``, ``replay --compare``, ``tierd simulate``): as fast as
possible unless ``--speed`` follows the trace clock, a progress bar on stderr when asked
(or on a terminal), Ctrl-C printing the results so far with status 130, and the
comparison drawn on one pair of axes."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tierd.cli import main, progress
from tierd.workload import read_trace, simulate, write_trace
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.plots import write_compare_plot
from tierd.workload.trace import TraceRecord

TIERD = [sys.executable, "-m", "tierd"]
BAR = re.compile(rb"\|\s*(\d+)/(\d+) \[")  # tqdm: " 12%|#    | 720/6001 [00:01<..."
DEADLINE_S = 120.0


def generated_trace(
    tmp_path_factory: pytest.TempPathFactory, name: str, seed: int, conversations: int
) -> Path:
    """A trace file of the generator's ``conversations`` from ``seed``."""
    path = tmp_path_factory.mktemp(name) / "trace.jsonl"
    write_trace(path, generate(GeneratorConfig(seed=seed, conversations=conversations)))
    return path


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 6,000 requests over 17 minutes of trace clock."""
    return generated_trace(tmp_path_factory, "big", seed=5, conversations=2000)


def chain_config(path: Path, capacity: int) -> Path:
    path.write_text(
        f"block_bytes: 4096\ntiers: [{{name: m, kind: memory, capacity: {capacity}}}]\n"
    )
    return path


def interrupt_once_under_way(argv: list[str]) -> tuple[int, str, str]:
    """Run ``tierd ARGV`` (with ``--progress``), send SIGINT once its bar counts a request,
    and return (status, stdout, stderr)."""
    proc = subprocess.Popen(
        [*TIERD, *argv, "--progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not any(int(m[1]) > 0 for m in BAR.finditer(seen)):
            left = deadline - time.monotonic()
            assert left > 0, f"no progress within {DEADLINE_S} s: {seen[-500:]!r}"
            ready, _, _ = select.select([proc.stderr], [], [], left)
            chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
            assert chunk or not ready, f"it ended first: {seen[-500:]!r}"
            seen += chunk
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out.decode(), (seen + err).decode()


# -- Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_during_a_replay_prints_the_partial_table_and_exits_130(
    tmp_path: Path, big_trace: Path
) -> None:
    config = chain_config(tmp_path / "a.yaml", 256)
    # --speed 10 follows the trace clock: its 17 minutes would take 100 s.
    status, out, err = interrupt_once_under_way(
        ["replay", str(big_trace), "--config", str(config), "--speed", "10"]
    )

    assert status == 130
    assert "Traceback" not in err
    lines = out.splitlines()
    mark = re.fullmatch(r"interrupted after ([\d,]+) of ([\d,]+) requests", lines[0])
    assert mark is not None, out
    done, planned = (int(n.replace(",", "")) for n in mark.groups())
    assert 0 < done < planned == len(read_trace(big_trace))
    rows = {line[:16].strip(): line[16:] for line in lines[1:]}
    assert rows["requests"].startswith(f"{done:,} (")
    assert {"hit ratio", "shortfall", "errors", "wrong bytes"} <= rows.keys()
    assert rows["wrong bytes"] == "0"


def test_ctrl_c_during_a_compare_shows_the_runs_so_far_and_exits_130(
    tmp_path: Path, big_trace: Path
) -> None:
    small = chain_config(tmp_path / "small.yaml", 64)
    large = chain_config(tmp_path / "large.yaml", 4096)
    argv = ["replay", str(big_trace), "--compare", str(small), str(large), "--speed", "10"]
    status, out, err = interrupt_once_under_way([*argv, "--json"])

    assert status == 130
    assert "Traceback" not in err
    printed = json.loads(out)
    assert printed["interrupted"] is True
    (run,) = printed["runs"]  # large.yaml was not run
    assert run["config"]["path"] == str(small)
    assert run["interrupted"] is True
    assert 0 < run["requests"] < run["planned_requests"]
    assert run["block_accesses"] > 0


# The single-tier simulation reports (and checks for a stop) every 512 requests; the
# replay engine behind --config checks before each request: Ctrl-C once 64 are done.
@pytest.mark.parametrize(("chain", "chunk"), [(False, 512), (True, 64)])
def test_ctrl_c_during_simulate_prints_the_partial_result(
    tmp_path: Path,
    trace_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    chain: bool,
    chunk: int,
) -> None:
    # simulate runs too fast to catch from outside: the first bar update sends the SIGINT.
    drawn = progress.Bar.__call__
    sent: list[int] = []

    def draw_then_interrupt(self: progress.Bar, done: int, total: int, note: str = "") -> None:
        drawn(self, done, total, note)
        if chunk <= done < total and not sent:  # once: a second Ctrl-C means "stop at once"
            sent.append(done)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(progress.Bar, "__call__", draw_then_interrupt)
    config = ["--config", str(chain_config(tmp_path / "c.yaml", 512))] if chain else []
    status = main(["simulate", str(trace_path), *config, "--progress", "--json"])

    out, err = capsys.readouterr()
    assert status == 130
    assert BAR.search(err.encode())
    result = json.loads(out)
    assert result["interrupted"] is True
    assert result["requests"] == sent[0]  # what was done at the Ctrl-C, then it stopped
    assert sent[0] >= chunk if chain else sent[0] == chunk  # the simulation draws per 512
    assert result["planned_requests"] == len(read_trace(trace_path))
    assert 0 < result["hits"] <= result["block_accesses"]


def test_simulate_stop_ends_the_replay_early(trace_path: Path) -> None:
    trace = read_trace(trace_path)
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2  # after two chunks

    part = simulate(trace, "lru", "10%", stop=stop)
    whole = simulate(trace, "lru", "10%")
    assert (part.requests, part.planned_requests, part.interrupted) == (1024, len(trace), True)
    assert part.block_accesses == sum(len(r.keys) for r in trace.requests[:1024])
    assert part.hits < whole.hits
    assert (whole.requests, whole.interrupted) == (len(trace), False)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generated_trace(tmp_path_factory, "small", seed=3, conversations=600)


# -- pacing and the bar ----------------------------------------------------------------------


def spaced_trace(path: Path, seconds: int) -> Path:
    """Three requests ``seconds`` apart on the trace clock."""
    records = [TraceRecord(i * seconds * 1000, 1024, 8, (3 * i, 3 * i + 1)) for i in range(3)]
    write_trace(path, records)
    return path


@pytest.mark.parametrize(
    ("flags", "speed"), [([], "max"), (["--max-rate"], "max"), (["--speed", "1000"], 1000.0)]
)
def test_a_replay_goes_as_fast_as_it_can_unless_told_a_speed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], speed: Any
) -> None:
    trace = spaced_trace(tmp_path / "t.jsonl", seconds=30)  # a minute of trace clock
    config = chain_config(tmp_path / "c.yaml", 64)
    argv = ["replay", str(trace), "--config", str(config), "--json", *flags]

    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["speed"] == speed
    assert summary["requests"] == summary["planned_requests"] == 3
    assert summary["interrupted"] is False
    assert summary["seconds"] < 30  # the trace clock would take 60 s


def test_replay_help_documents_the_default_pacing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: as fast as the clients go" in text
    assert "--progress, --no-progress" in text


@pytest.mark.parametrize(("flags", "drawn"), [([], False), (["--progress"], True)])
def test_the_bar_is_drawn_on_stderr_only_on_a_terminal_or_when_forced(
    trace_path: Path, flags: list[str], drawn: bool
) -> None:
    done = subprocess.run(
        [*TIERD, "simulate", str(trace_path), *flags],
        capture_output=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 0
    assert bool(BAR.search(done.stderr)) is drawn
    assert not BAR.search(done.stdout)
    assert b"hit ratio" in done.stdout


# -- the comparison plot ---------------------------------------------------------------------


def test_compare_draws_both_configs_on_the_same_axes(tmp_path: Path, trace_path: Path) -> None:
    small = chain_config(tmp_path / "small.yaml", 32)
    large = chain_config(tmp_path / "large.yaml", 2048)
    out = tmp_path / "out"
    argv = ["replay", str(trace_path), "--compare", str(small), str(large), "--out", str(out)]

    assert main([*argv, "--json"]) == 0

    png = (out / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"
    from matplotlib.image import imread

    assert imread(out / "compare.png").shape[0] > 100  # decodes as an image
    runs = json.loads((out / "compare.json").read_text())["runs"]
    series = write_compare_plot(
        {"small.yaml": runs[0], "large.yaml": runs[1]}, tmp_path / "again.png"
    )
    assert series.hit_ratio.keys() == {"small.yaml", "large.yaml"}
    small_line, large_line = series.hit_ratio["small.yaml"], series.hit_ratio["large.yaml"]
    assert small_line and large_line
    assert small_line[-1][0] == large_line[-1][0] == runs[0]["requests"]
    assert small_line[-1][1] == pytest.approx(100 * runs[0]["hit_ratio"])
    assert large_line[-1][1] == pytest.approx(100 * runs[1]["hit_ratio"])
    assert large_line[-1][1] > small_line[-1][1]
    assert series.by_medium == {
        "small.yaml": runs[0]["hit_ratio_by_medium"],
        "large.yaml": runs[1]["hit_ratio_by_medium"],
    }
    assert (out / "0-small" / "hit_ratio.png").exists()
    assert (out / "1-large" / "hit_ratio.png").exists()
