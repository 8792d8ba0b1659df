"""What the command line prints when things go wrong: a closed pipe ends quietly, an
unusable trace is one line naming the file (and line) with status 1, and an unreachable
daemon still gets ``health --json`` its JSON and the example client one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierd.cli import main
from tierd.testing import short_socket_path

ROOT = Path(__file__).resolve().parent.parent
TIERD = [sys.executable, "-m", "tierd"]
GOOD_LINE = '{"timestamp": 0, "input_length": 512, "output_length": 8, "hash_ids": [1, 2]}\n'


def test_trace_generate_into_a_closed_pipe_ends_quietly_with_status_0() -> None:
    argv = [*TIERD, "trace", "generate", "--out", "-", "--conversations", "3000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    head = proc.stdout.read(200)  # `| head -c 200`: far less than the trace (about 1 MB)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert head.startswith(b'{"timestamp": ')
    assert err == b""


# -- unusable traces -------------------------------------------------------------------------


def unusable(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Trace paths that cannot be used, with what the message must say."""
    (tmp_path / "not-utf8.jsonl").write_bytes(GOOD_LINE.encode() + b"\xff\xfe oops\n")
    (tmp_path / "bad-json.jsonl").write_text(GOOD_LINE + GOOD_LINE + "{oops\n")
    (tmp_path / "a-dir").mkdir()
    os.mkfifo(tmp_path / "a-fifo")  # opening it would wait for a writer forever
    return {
        "directory": (tmp_path / "a-dir", f"{tmp_path / 'a-dir'}: is a directory"),
        "fifo": (tmp_path / "a-fifo", f"{tmp_path / 'a-fifo'}: not a regular file"),
        "not utf-8": (tmp_path / "not-utf8.jsonl", f"{tmp_path / 'not-utf8.jsonl'}:2: not UTF-8"),
        "bad json": (tmp_path / "bad-json.jsonl", f"{tmp_path / 'bad-json.jsonl'}:3: not valid"),
    }


@pytest.mark.parametrize("case", ["directory", "fifo", "not utf-8", "bad json"])
@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_an_unusable_trace_is_one_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, command: str
) -> None:
    path, message = unusable(tmp_path)[case]
    config = tmp_path / "chain.yaml"
    config.write_text("block_bytes: 4096\ntiers: [{name: m, kind: memory, capacity: 64}]\n")
    extra = ["--config", str(config)] if command == "replay" else []

    status = main([command, str(path), *extra])

    out, err = capsys.readouterr()
    assert (status, out) == (1, "")
    assert err.splitlines() == [err.strip()]  # one line
    assert err.startswith(f"tierd: error: {message}")


def test_a_missing_trace_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(tmp_path / "nope.jsonl")]) == 2
    assert "trace file not found" in capsys.readouterr().err


# -- no daemon -------------------------------------------------------------------------------


def test_health_json_says_unreachable_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    path = short_socket_path()

    status = main(["health", "--json", "--socket", path])

    out, err = capsys.readouterr()
    assert status == 3
    assert err == ""
    answer = json.loads(out)
    assert answer["ok"] is False
    assert answer["error"] == "unreachable"
    assert answer["socket"] == path
    assert answer["detail"]  # why: no such file, say


def test_client_demo_honours_tierd_socket_and_says_one_line_when_unreachable() -> None:
    path = short_socket_path()
    env = {**os.environ, "TIERD_SOCKET": path}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "client_demo.py"), "load"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 3
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()  # one line, no traceback
    assert line.startswith(f"client_demo: cannot reach tierd at {path}: ")


def test_simulate_takes_the_traces_first_requests_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 61, item 9: ``replay`` had ``--limit`` and ``simulate`` did not."""
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"timestamp": i, "input_length": 16, "output_length": 1, "hash_ids": [i, i + 1]})
        for i in range(10)
    ]
    path.write_text("\n".join(lines) + "\n")
    assert main(["simulate", str(path), "--limit", "4", "--capacity", "100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["requests"], result["unique_blocks"], result["block_accesses"]) == (4, 5, 8)
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        main(["simulate", str(path), "--limit", "0"])
    assert refused.value.code == 2
    assert "--limit: must be at least 1" in capsys.readouterr().err
